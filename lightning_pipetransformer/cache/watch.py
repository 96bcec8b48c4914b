"""Whether the frozen prefix is still what the store's entries were computed from, watched on the host.

An entry at boundary F is the output of ``pre`` + ``blocks[:F]`` as they were when it was stored.
Freezing is not a promise that they stay so: a callback unfreezes a block (``requires_grad_(True)``,
Lightning's ``BaseFinetuning.unfreeze_and_add_param_group``), edits frozen weights in place (weight
surgery, ``load_state_dict`` of a prefix), swaps in other weights for validation (Lightning's
``EMAWeightAveraging``/SWA), puts a frozen module back in train mode, or hooks it. So the cache does
not assume: :class:`PrefixWatch` compares what computes the prefix now with what computed the
entries, and the cache serves only while they match.

- **Every forward the cache would serve** (host only: nothing waits for a device): each module of
  the prefix (identity, training flag where it has dropout or batch statistics, the forward hooks on
  it other than this package's and :func:`~lightning_pipetransformer.stack.observers.sees_block_runs`
  counters), each parameter (identity, ``requires_grad``, version counter, storage address) and each
  buffer (identity, version counter, storage address: an in-place write such as a BatchNorm's running statistics
  edited by a callback; DDP's buffer broadcast writes below autograd and moves no counter). Measured on the 12-layer
  model: docs/cache.md, "Validity by observation".
- **At the start of every pass over a loader** (``full=True``: a training epoch, training resumed
  after validation, each validation, test or predict run): the prefix's fingerprint as well (every
  weight's bits, :func:`~lightning_pipetransformer.cache.validity.prefix_fingerprint`). It sees the
  writes that version counters do not: ``param.data.copy_(...)``, which is how Lightning's weight
  averaging swaps weights in and out at validation.

Where the cheap walk moved but the fingerprint, ``requires_grad`` and the modes are as they were
(``load_state_dict`` of the same weights, a swap back after validation), nothing changed and the
watch takes the new walk as its reference. Otherwise :meth:`PrefixWatch.changed` says what changed,
in words, and keeps saying it until the model is back as it was or the watch is armed anew.
What the cache then does (stand aside for the pass, move the boundary) is the caller's decision.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.modules import module as torch_module

from lightning_pipetransformer.cache.keys import tensor_digest
from lightning_pipetransformer.cache.validity import (
    config_lines,
    private_state,
    stochastic_reasons,
    stochastic_when_training,
    trainable_names,
)
from lightning_pipetransformer.stack.observers import keeps_values

__all__ = ["PrefixChange", "PrefixWatch"]

_FORWARD_HOOKS = ("_forward_pre_hooks", "_forward_hooks")
_GLOBAL_FORWARD_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks")
#: How many names a reason lists before "and N more".
_LISTED = 3


@dataclass(frozen=True)
class PrefixChange:
    """What changed in the prefix since its entries were computed, in words."""

    reasons: tuple[str, ...]
    #: Only modes and hooks differ (a frozen module put in train mode, a hook put on it): the entries are still those of
    #: the weights as they are, and serve again once the modes and hooks are back; the store is kept meanwhile.
    transient: bool = False

    def describe(self) -> str:
        return "; ".join(self.reasons)


def _hooks(module: nn.Module) -> tuple[int, ...]:
    """Ids of the forward hooks on ``module`` that may change what it computes."""
    return tuple(id(hook) for name in _FORWARD_HOOKS for hook in getattr(module, name).values() if not keeps_values(hook))


def _global_hooks() -> tuple[int, ...]:
    return tuple(id(hook) for name in _GLOBAL_FORWARD_HOOKS for hook in getattr(torch_module, name).values() if not keeps_values(hook))


def _version(tensor: Tensor) -> int:
    """The version counter (bumped by in-place ops); inference tensors have none (-1)."""
    return -1 if tensor.is_inference() else tensor._version


def _bits(tensor: Tensor) -> int | bytes:
    """A checksum of a tensor's bits: CRC-32 on the host (twice BLAKE2b's speed; a change, not an attack, is what it
    must see), the device hash elsewhere (16 bytes cross to the host, not the tensor)."""
    t = tensor.detach()
    if t.device.type == "meta":
        return 0
    if t.device.type != "cpu":
        return tensor_digest(t)
    return zlib.crc32(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))


def _frozen_copy(value: object) -> object:
    """A plain value as it is now (a list the module changes in place later must not change the walk taken now)."""
    return tuple(_frozen_copy(v) for v in value) if isinstance(value, (list, tuple)) else value


def _listed(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_LISTED])
    return shown + (f" and {len(names) - _LISTED} more" if len(names) > _LISTED else "")


class PrefixWatch:
    """The prefix's modules, parameters and buffers as they were when the current store opened."""

    def __init__(self) -> None:
        self._modules: list[tuple[str, nn.Module]] = []
        self._tensors: list[tuple[str, Tensor]] = []
        #: The prefix's content when armed: a digest of its modules' configuration, and each tensor's checksum by name.
        self._content: tuple[bytes, dict[str, int | bytes]] = (b"", {})
        self.trainable: frozenset[str] = frozenset()
        self._trainable_ids: set[int] = set()
        #: The reference walk (``None``: not armed) and what it was made of, by id.
        self._walk: tuple | None = None
        #: The last walk judged, and the verdict on it: kept until the walk moves or a full check judges again
        #: (a change that only the weights' bits show stays a change for the rest of the pass).
        self._seen: tuple | None = None
        self._verdict: PrefixChange | None = None
        self._names: dict[int, str] = {}
        self._hooks: dict[int, tuple[int, ...]] = {}
        self._global: tuple[int, ...] = ()
        #: Modules whose training flag changes what they compute (dropout, batch statistics): only theirs is watched.
        self._sensitive: set[int] = set()
        #: ``id(module) -> names`` of its private plain attributes when armed (PEFT's ``_disable_adapters``), read in
        #: every walk; any other attribute is compared at pass starts with the configuration.
        self._private: dict[int, tuple[str, ...]] = {}
        #: How many times :meth:`changed` read the weights' checksums (pass starts, and a cheap walk that moved).
        self.content_reads = 0

    @property
    def armed(self) -> bool:
        return self._walk is not None

    def arm(self, modules: Sequence[tuple[str, nn.Module]], tensors: Sequence[tuple[str, Tensor]] = ()) -> None:
        """Take the prefix as it is now as the reference (one pass over its weights, as at a pass start).

        ``modules``: :func:`~lightning_pipetransformer.cache.validity.prefix_modules` of the store's boundary;
        ``tensors``: loose parameters before the stack (``pre_params``).
        """
        self._modules, self._tensors = list(modules), list(tensors)
        # What trains when armed (a store that opens while the embeddings train serves nothing until they freeze): its
        # values change every step by design, so only its requires_grad is watched.
        self.trainable = frozenset(trainable_names(self._modules, self._tensors))
        self._trainable_ids = {id(p) for _, m in self._modules for p in m.parameters() if p.requires_grad}
        self._trainable_ids |= {id(t) for _, t in self._tensors if t.requires_grad}
        self._content = self._read_content()
        self._sensitive = {
            id(sub) for name, root in self._modules for sub_name, sub in root.named_modules(prefix=name)
            if stochastic_when_training(sub_name, sub) is not None
        }  # fmt: skip
        self._names = self._structure()
        self._hooks = {id(sub): _hooks(sub) for _, root in self._modules for sub in root.modules()}
        self._private = {id(sub): names for _, root in self._modules for sub in root.modules() if (names := private_state(sub))}
        self._global = _global_hooks()
        self._walk = self._seen = self._take()
        self._verdict = None

    def disarm(self) -> None:
        self._walk = self._seen = self._verdict = None
        self._modules, self._tensors, self._content = [], [], (b"", {})

    def changed(self, full: bool = False) -> PrefixChange | None:
        """What changed since :meth:`arm` (``None``: nothing, the entries may be served).

        ``full``: compare the weights' bits too (at a pass start); otherwise they are read only when the
        cheap walk moved.
        """
        if self._walk is None:
            return None
        walk = self._take()
        if walk == self._seen and not full:
            return self._verdict
        self._seen, self._verdict = walk, self._judge(walk)
        return self._verdict

    def _judge(self, walk: tuple) -> PrefixChange | None:
        reasons, lasting = self._structural_reasons()
        if reasons:
            return PrefixChange(tuple(reasons), transient=not lasting)
        self.content_reads += 1
        config, bits = self._read_content()
        if config == self._content[0] and bits == self._content[1]:
            self._walk = walk  # the same function as the entries' (same bits, grads, modes, hooks): the new reference
            return None
        if config != self._content[0]:
            return PrefixChange(("a frozen module's configuration changed (an attribute such as eps, or its config)",))
        changed = [name for name, value in bits.items() if self._content[1].get(name) != value]
        return PrefixChange((self._value_reason(walk, changed),))

    def _read_content(self) -> tuple[bytes, dict[str, int | bytes]]:
        config = hashlib.blake2b(digest_size=16)
        for name, module in self._modules:
            for line in config_lines(name, module):
                config.update(line.encode())
        bits: dict[str, int | bytes] = {}
        seen: set[int] = set()
        for name, module in self._modules:
            for tname, tensor in [*module.named_parameters(prefix=name), *module.named_buffers(prefix=name)]:
                if id(tensor) not in seen and id(tensor) not in self._trainable_ids:
                    seen.add(id(tensor))
                    bits[tname] = _bits(tensor)
        for name, tensor in self._tensors:
            if id(tensor) not in seen and id(tensor) not in self._trainable_ids:
                seen.add(id(tensor))
                bits[name] = _bits(tensor)
        return config.digest(), bits

    # ------------------------------------------------------------------ the walk

    def _take(self) -> tuple:
        """Everything the cheap check compares, as plain Python values (no device read)."""
        items: list[tuple] = [_global_hooks()]
        seen: set[int] = set()
        for _, root in self._modules:
            for sub in root.modules():
                if id(sub) in seen:
                    continue
                seen.add(id(sub))
                private = self._private.get(id(sub))
                state = tuple(_frozen_copy(sub.__dict__.get(k)) for k in private) if private else None
                items.append((id(sub), sub.training if id(sub) in self._sensitive else None, _hooks(sub), state))
                for param in sub._parameters.values():
                    if param is not None and id(param) in self._trainable_ids:
                        items.append((id(param), param.requires_grad))
                    elif param is not None:
                        items.append((id(param), param.requires_grad, _version(param), param.data_ptr()))
                for buffer in sub._buffers.values():
                    if buffer is not None:
                        items.append((id(buffer), _version(buffer), buffer.data_ptr()))
        for _, tensor in self._tensors:
            trains = id(tensor) in self._trainable_ids
            items.append((id(tensor), tensor.requires_grad) if trains else (id(tensor), tensor.requires_grad, _version(tensor), tensor.data_ptr()))
        return tuple(items)

    def _structure(self) -> dict[int, str]:
        """``id -> name`` of every module, parameter and buffer of the prefix now."""
        names: dict[int, str] = {}
        for name, root in self._modules:
            for sub_name, sub in root.named_modules(prefix=name):
                names.setdefault(id(sub), sub_name)
                for pname, param in sub._parameters.items():
                    if param is not None:
                        names.setdefault(id(param), f"{sub_name}.{pname}")
                for bname, buffer in sub._buffers.items():
                    if buffer is not None:
                        names.setdefault(id(buffer), f"{sub_name}.{bname}")
        for name, tensor in self._tensors:
            names.setdefault(id(tensor), name)
        return names

    def _structural_reasons(self) -> tuple[list[str], bool]:
        """Changes that make the entries stale whatever the weights' bits, and whether one of them lasts (a thaw, a
        freeze, another object) rather than a mode or a hook that may come back as it was."""
        reasons: list[str] = []
        trainable = trainable_names(self._modules, self._tensors)
        thawed = [n for n in trainable if n not in self.trainable]
        if thawed:
            reasons.append(f"{_listed(thawed)} require(s) grad again (unfrozen)")
        frozen = sorted(self.trainable - set(trainable))
        if frozen:
            reasons.append(f"{_listed(frozen)} frozen since")
        stochastic = stochastic_reasons(self._modules)
        if stochastic:
            reasons.append(_listed(stochastic))
        replaced = [name for key, name in self._structure().items() if key not in self._names]
        if replaced:
            reasons.append(f"{_listed(replaced)} replaced or added (another module, parameter or buffer object)")
        lasting = bool(reasons) and bool(thawed or frozen or replaced)
        hooked = [
            sub_name for name, root in self._modules for sub_name, sub in root.named_modules(prefix=name)
            if self._hooks.get(id(sub), ()) != _hooks(sub)
        ]  # fmt: skip
        if hooked:
            reasons.append(f"the forward hooks on {_listed(hooked)} changed")
        if self._global != _global_hooks():
            reasons.append("the global module forward hooks changed")
        return reasons, lasting

    def _value_reason(self, walk: tuple, changed: list[str]) -> str:
        """The weights' bits differ from the entries': name them, and whether a version counter saw the write."""
        assert self._walk is not None
        before = {item[0]: item for item in self._walk[1:]}
        seen = any(before.get(item[0]) != item for item in walk[1:] if item[0] in self._names)
        how = (
            "written in place (a weight edit, load_state_dict or a weight swap)" if seen
            else "written where no version counter sees it (param.data.copy_, as Lightning's EMA/SWA weight averaging swaps "
            "weights in and out)"
        )
        return f"the values of {_listed(changed)} differ from those the entries were computed with, {how}"
