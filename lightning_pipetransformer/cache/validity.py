"""When may a cached activation be reused: the frozen prefix's fingerprint and a determinism check.

An activation stored at boundary F is the output of ``pre`` + ``blocks[:F]`` for one input. It
may be returned only to a caller running *the same function*: same boundary, same weights and
buffers bit for bit, same module configuration, same dtypes, device type and torch version
(kernels differ in the last bits between them). :func:`prefix_fingerprint` hashes all of that
into 32 hex digits; the store keeps one directory per fingerprint and checks it again in every
file it reads, so an entry from another boundary, model or configuration is never returned.

Hashing weights: CPU tensors go through BLAKE2b over their bytes (~1 GB/s); tensors on an
accelerator are hashed on the device (:func:`~lightning_pipetransformer.cache.keys.tensor_digest`), so only 16 bytes per
tensor cross to the host. Either way the fingerprint takes one pass over the frozen weights per
boundary move, which is nothing next to an epoch.

A cache is only correct if the prefix is a pure, per-sample function of its input:
:func:`nondeterministic_reasons` lists what breaks that (a module in train mode with dropout
or stochastic depth, BatchNorm in train mode, a frozen parameter that still requires grad).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from lightning_pipetransformer.cache.code_identity import class_code_lines, interpreter
from lightning_pipetransformer.cache.keys import tensor_digest
from lightning_pipetransformer.stack.discovery import BlockStack

__all__ = [
    "FORMAT_VERSION",
    "NondeterministicPrefixError",
    "check_deterministic",
    "config_lines",
    "nondeterministic_reasons",
    "prefix_fingerprint",
    "prefix_modules",
    "private_state",
    "stochastic_reasons",
    "stochastic_when_training",
    "trainable_names",
]

# Bump when the meaning of a fingerprint or of a cache file changes: old directories then miss.
# 2: every file carries a CRC-32 of each tensor (files of version 1 have none).
# 3: the fingerprint leaves out the modules' training flags.
# 4: the fingerprint covers the prefix's code (its classes' code objects, their packages' versions) and the interpreter.
# 5: and the modules' private plain attributes (PEFT's _disable_adapters, _active_adapter).
FORMAT_VERSION = 5

#: ``nn.Module``'s own attributes (hooks, parameters, flags of its bookkeeping): not what a module computes.
_MODULE_OWN = frozenset(vars(nn.Module()))

# Attribute names of stochastic-depth / dropout probabilities held as plain floats
# (Hugging Face attention's ``dropout`` float, timm's DropPath ``drop_prob``).
_PROB_WORDS = ("drop", "dropout")


class NondeterministicPrefixError(RuntimeError):
    """The frozen prefix is not a pure function of its input, so its output cannot be cached."""


def prefix_modules(stack: BlockStack, num_frozen: int, include_pre: bool = True) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` pairs whose composition produces the activation at boundary ``num_frozen``."""
    if not 0 <= num_frozen <= len(stack):
        raise ValueError(f"num_frozen must be in 0..{len(stack)}, got {num_frozen}.")
    modules = list(stack.pre) if include_pre else []
    # Modules outside the prefix whose output still enters it (run before the stack and after it):
    # a cached boundary is stale once they train, whatever the keys name.
    modules += [(path, module) for path, module in stack.feeds if (path, module) not in modules]
    modules += [(f"{stack.path}.{i}", block) for i, block in enumerate(stack.blocks[:num_frozen])]
    return modules


def _is_plain(value: object) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_is_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def config_lines(name: str, module: nn.Module) -> Iterable[str]:
    """Plain attributes of every submodule: hyper-parameters that weights do not show (heads, eps)."""
    for sub_name, sub in module.named_modules(prefix=name):
        # Only plain values: the repr of an arbitrary object may hold its address, which
        # differs between processes and would stop them from sharing the cache.
        # Not the training flag: where it changes the output (dropout, batch statistics) the prefix is refused in train
        # mode, and elsewhere (a rotary embedding) it does not; validation must find training's entries.
        # Private ones too (not nn.Module's own): PEFT switches its adapters off with _disable_adapters.
        plain = {k: v for k, v in vars(sub).items() if k != "training" and k not in _MODULE_OWN and _is_plain(v)}
        yield f"{sub_name}:{type(sub).__module__}.{type(sub).__qualname__}:{sorted(plain.items())!r}"
        config = getattr(sub, "config", None)
        if config is not None and hasattr(config, "to_json_string"):
            # The attention implementation (eager / sdpa) changes results and is a private field.
            attn = getattr(config, "_attn_implementation", None)
            settings = config.to_dict()
            # Generation settings do not change what a forward computes; the strategy turns
            # use_cache off for fit only, and validate/predict after fit must find the same entries.
            settings.pop("use_cache", None)
            yield f"{sub_name}.config:{attn}:{json.dumps(settings, sort_keys=True, default=str)}"


def private_state(module: nn.Module) -> tuple[str, ...]:
    """The names of ``module``'s own private plain attributes (not ``nn.Module``'s), which :func:`config_lines` covers:
    flags such as PEFT's ``_disable_adapters`` that a library flips to compute otherwise with the same weights."""
    return tuple(k for k, v in vars(module).items() if k.startswith("_") and k not in _MODULE_OWN and _is_plain(v))


def _digest(tensor: Tensor) -> bytes:
    t = tensor.detach()
    if t.device.type != "cpu":
        return tensor_digest(t)
    data = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(memoryview(data), digest_size=16).digest()


def prefix_fingerprint(
    stack: BlockStack,
    num_frozen: int,
    include_pre: bool = True,
    *,
    extra: str = "",
) -> str:
    """32 hex digits identifying the function ``input -> activation at boundary num_frozen``.

    Covers: the boundary, whether ``pre`` is included, every frozen module's class, plain
    attributes and (if it has one) its Hugging Face config, the code of every class among them
    and the version of its package (:func:`~lightning_pipetransformer.cache.code_identity.class_code_lines`),
    every parameter and buffer (name, dtype, shape, device type, bits), the ``pre_params``, the
    torch and Python versions and :data:`FORMAT_VERSION`. ``extra`` is anything else the caller knows changes the prefix's
    output (e.g. an autocast dtype): different ``extra``, different fingerprint.
    """
    h = hashlib.blake2b(digest_size=16)

    def feed(text: str) -> None:
        h.update(text.encode())
        h.update(b"\n")

    feed(f"pipetransformer-cache v{FORMAT_VERSION} torch {torch.__version__} {interpreter()}")
    feed(f"boundary={num_frozen} include_pre={include_pre} stack={stack.path} extra={extra}")
    tensors: list[tuple[str, Tensor]] = []
    modules = prefix_modules(stack, num_frozen, include_pre)
    for line in class_code_lines(module for _, module in modules):
        feed(line)
    for name, module in modules:
        for line in config_lines(name, module):
            feed(line)
        tensors += [(f"{name}.{n}", p) for n, p in module.named_parameters(recurse=True)]
        # Non-persistent buffers (position ids) change outputs too.
        tensors += [(f"{name}.{n}", b) for n, b in module.named_buffers(recurse=True)]
    if include_pre:
        tensors += list(stack.pre_params)
    seen: set[int] = set()
    for name, tensor in tensors:
        if id(tensor) in seen:  # tied weights: hash once, position still recorded by name
            feed(f"{name}: tied")
            continue
        seen.add(id(tensor))
        feed(f"{name}: {tensor.dtype} {tuple(tensor.shape)} {tensor.device.type} {_digest(tensor).hex()}")
    return h.hexdigest()


def stochastic_when_training(name: str, module: nn.Module) -> str | None:
    """Why ``module`` itself (not its children) computes something else in train mode, or ``None``:
    dropout with ``p > 0``, BatchNorm (batch statistics), a float ``*drop*`` probability above 0."""
    if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
        return f"{name} ({type(module).__name__}, p={module.p}) is in train mode"
    if isinstance(module, nn.modules.batchnorm._NormBase):
        return f"{name} ({type(module).__name__}) is in train mode (batch statistics)"
    for attr, value in vars(module).items():
        if isinstance(value, float) and not isinstance(value, bool) and value > 0 and any(w in attr.lower() for w in _PROB_WORDS):
            return f"{name} ({type(module).__name__}, {attr}={value}) is in train mode"
    return None


def nondeterministic_reasons(modules: Sequence[tuple[str, nn.Module]]) -> list[str]:
    """Why ``modules`` (e.g. :func:`prefix_modules`) are not a pure per-sample function; empty if none found.

    Detects: dropout layers (``p > 0``) and float ``*drop*`` attributes (Hugging Face attention
    dropout, timm DropPath) on a module in train mode; BatchNorm in train mode (its output
    depends on the rest of the batch and it updates running statistics); a parameter that still
    requires grad (it will change, and stale activations would be returned). A custom
    stochastic op this cannot see is the caller's responsibility: keep the prefix in eval mode.
    """
    reasons = stochastic_reasons(modules)
    for name, module in modules:
        trainable = [n for n, p in module.named_parameters(prefix=name) if p.requires_grad]
        if trainable:
            reasons.append(f"{trainable[0]} still requires grad ({len(trainable)} parameter(s) not frozen)")
    return reasons


def stochastic_reasons(modules: Sequence[tuple[str, nn.Module]]) -> list[str]:
    """The modules of ``modules`` in train mode whose output is then random or batch-dependent, in words."""
    reasons: list[str] = []
    for name, module in modules:
        for sub_name, sub in module.named_modules(prefix=name):
            reason = stochastic_when_training(sub_name, sub) if sub.training else None
            if reason is not None:
                reasons.append(reason)
    return reasons


def trainable_names(modules: Sequence[tuple[str, nn.Module]], tensors: Sequence[tuple[str, Tensor]] = ()) -> list[str]:
    """The parameters of ``modules`` (and the loose ``tensors``) that require grad: they train, so the prefix's output
    changes at every optimizer step and there is nothing to cache while they do."""
    names = [n for name, module in modules for n, p in module.named_parameters(prefix=name) if p.requires_grad]
    return names + [name for name, tensor in tensors if tensor.requires_grad]


def check_deterministic(modules: Sequence[tuple[str, nn.Module]], *, trainable_too: bool = True) -> None:
    """Raise :class:`NondeterministicPrefixError` naming what to fix if the prefix cannot be cached.

    ``trainable_too=False``: only modules that are random in train mode; a trainable parameter is the
    caller's to handle (the cache stands aside while one trains)."""
    reasons = nondeterministic_reasons(modules) if trainable_too else stochastic_reasons(modules)
    if reasons:
        listed = "; ".join(reasons[:5]) + (f"; and {len(reasons) - 5} more" if len(reasons) > 5 else "")
        raise NondeterministicPrefixError(
            f"The frozen prefix is not deterministic, so its activations cannot be cached: {listed}. Ways out: "
            "PipeTransformerStrategy(cache_frozen_eval=True) keeps the frozen prefix in eval mode under the cache (no "
            "dropout in the frozen part: a change from a plain run, in which frozen modules left in train mode keep "
            "their dropout); or put the frozen modules in eval mode yourself (module.eval() where you freeze them; "
            "AutoFreeze does); or set their dropout to 0; or turn the cache off (cache=False)."
        )
