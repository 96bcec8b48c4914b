"""Index keys, batch by batch: the dataset indices a loader gives, checked to name one sample each.

An index key names a sample, so an index seen twice in one batch or in one pass over a loader
means two samples share a key and one would be served the other's activations. The check runs
from the first batch on (cache on or not yet), so a bad index fails in the first step, not at the
first freeze.

The indices are read on the host: :meth:`BatchIndices.remember` takes them from the loader's batch
before it goes to the device, so that :meth:`BatchIndices.read` need not wait for the device copy.

An index names a sample, not its input: a random augmentation or masking in the Dataset or the
collate function gives the same index another input every epoch, and an index key would serve the
activations of its first view. So a fixed subset of the samples (about one in
:data:`PROBE_EVERY`, chosen by a hash of the index, the same every pass) is probed: a digest of its
batch entries (every per-sample tensor but ``index``), taken from the loader's host batch (no wait
for a device), compared with the digest of its first pass. A sample whose input changed stops the
run before its stale activation can be served, naming the augmentation (:class:`InputChanged`).
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_pipetransformer.cache.keys import content_keys, index_keys

__all__ = ["FORWARD_PROBES", "PROBE_EVERY", "BatchIndices", "InputChanged", "probed"]

#: About one sample in this many has its input's digest compared between passes (two per batch of 32).
PROBE_EVERY = 16
#: The first forwards of every pass whose rows are compared as the model receives them with what they were when stored
#: (a masking in training_step, which the loader's batch does not show): one read of the device's digests each.
FORWARD_PROBES = 4


class InputChanged(ValueError):
    """``cache_key='index'``: a sample's input differs from its first pass (augmentation or random masking)."""


def probed(index: int) -> bool:
    """Whether sample ``index`` is probed (the same samples every pass; a multiplicative hash, not ``index % n``,
    so that indices with a stride do not all fall in or out)."""
    return (index * 0x9E3779B97F4A7C15) % 2**64 * PROBE_EVERY < 2**64  # the product's top bits: well mixed


def _row_digest(batch: dict[str, Any], row: int, size: int) -> tuple[tuple[tuple[int, ...], ...], bytes]:
    """Row ``row`` of every per-sample tensor of ``batch`` but ``index`` (host or device): its shapes, and 16 bytes over
    its bits. Compared only between rows of the same shapes: with padding to each batch's longest sample a sample's row
    changes length with its batch-mates, which the key sees (the attention mask is hashed in) and a probe must not."""
    h = hashlib.blake2b(digest_size=16)
    shapes: list[tuple[int, ...]] = []
    for name in sorted(k for k in batch if k != "index"):
        value = batch[name]
        if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == size:
            shapes.append(tuple(value.shape[1:]))
            sample = value[row].detach().cpu().contiguous().reshape(-1)
            h.update(f"{name}|{sample.dtype}".encode())
            h.update(sample.view(torch.uint8).numpy().tobytes())
    return tuple(shapes), h.digest()


class BatchIndices:
    """The keys of the next forward (:attr:`next`) and the indices each loader gave since its pass began."""

    def __init__(self) -> None:
        #: The keys the next forward takes (``None``: the cache will not serve it).
        self.next: list[str] | None = None
        #: Per loader (``f"{stage}{dataloader_idx}"``): the indices of its current pass.
        self._seen: dict[str, set[int]] = {}
        #: The last batch's indices as the loader gave them (host ints), by the device tensor made from them,
        #: its version counter then, the ints and the probed samples' digests from the host batch (:meth:`remember`).
        self._host: tuple[weakref.ref[Tensor], int, list[int], dict[int, tuple[tuple[tuple[int, ...], ...], bytes]]] | None = None
        #: Per loader: the digest of each probed sample's input at its first pass, per shape of its row.
        self._first: dict[str, dict[tuple[int, tuple[tuple[int, ...], ...]], bytes]] = {}
        #: Forwards left in this pass whose rows are compared as the model receives them (:meth:`check_forward`), and each
        #: key's content key when its entry was stored (the key holds the mask's hash: padding-invariant).
        self.forward_probes = FORWARD_PROBES
        self._first_forward: dict[str, str] = {}

    def new_pass(self) -> None:
        """A pass over a loader begins: its first :data:`FORWARD_PROBES` forwards probe again."""
        self.forward_probes = FORWARD_PROBES

    def check_forward(
        self, keys: list[str], source: Any, batch: int, recording: bool, holds: Callable[[str], bool] | None = None
    ) -> InputChanged | None:
        """A forward's rows as the model receives them (``source``: the embeddings' recorded inputs or the stack's
        input) against what they were when their entries were stored: ``None``, or the error naming a masking or
        augmentation applied after the loader (in ``training_step`` or the model), which :meth:`read`'s probe of the
        loader's batch cannot see.

        ``recording``: the current store is filling (its entries are stored in this pass): every forward's content keys
        are kept (one read of 16 bytes per row, where the store copies the new entries to the host anyway). Else only
        the first :data:`FORWARD_PROBES` forwards of a pass are compared, before anything of theirs is served.
        ``holds(key)``: whether the store has an entry for ``key``. A key whose earlier input left none (a NaN read once is
        not stored) has nothing stale to serve: its new input is kept instead of refused."""
        if not recording and self.forward_probes <= 0:
            return None
        self.forward_probes -= 0 if recording else 1
        try:
            content = content_keys(source, batch_size=batch)
        except TypeError:
            return None  # what cannot be hashed cannot be probed: the loader's probe still runs
        for key, now in zip(keys, content):
            before = self._first_forward.setdefault(key, now)
            if before != now and holds is not None and not holds(key):
                self._first_forward[key] = now
            elif before != now:
                return InputChanged(
                    f"cache_key='index': sample {key.rsplit('-', 1)[0].rsplit('i', 1)[-1]} reached the model with another "
                    "input than when its entry was stored: a random masking or augmentation in training_step or in the "
                    "model? Index keys name the sample, not its input: its first view's activations would be served "
                    "instead. Use cache_key='content' (exact: a changed input misses), or make the input the same every "
                    "epoch."
                )
        return None

    def remember(self, before: Any, after: Any) -> None:
        """The indices of a batch the loader gave (``before``, on the host) by the device copy ``after`` holds.

        Reading them from the device copy would make the host wait for the GPU in every step;
        the loader's tensor is host memory, read without a wait. :meth:`read` uses them only for
        that very device tensor, unmodified since (its version counter).
        """
        self._host = None
        raw = before.get("index") if isinstance(before, dict) else None
        moved = after.get("index") if isinstance(after, dict) else None
        if not (isinstance(raw, Tensor) and isinstance(moved, Tensor)) or raw.device.type != "cpu":
            return
        if raw.is_floating_point() or raw.is_complex() or raw.shape != moved.shape:
            return  # read() says what is wrong with them
        if moved.is_inference():
            return  # validate/test/predict under inference_mode: no version counter to tell a change
        values = raw.reshape(-1).tolist()
        digests = {i: _row_digest(before, row, len(values)) for row, i in enumerate(values) if isinstance(i, int) and probed(i)}
        self._host = (weakref.ref(moved), moved._version, values, digests)

    def _host_copy(self, raw: Tensor) -> tuple[list[int], dict[int, tuple[tuple[tuple[int, ...], ...], bytes]]] | None:
        """The host ints and probe digests :meth:`remember` kept for ``raw``, if ``raw`` is that device tensor, unchanged."""
        if self._host is None:
            return None
        ref, version, values, digests = self._host
        return (values, digests) if ref() is raw and raw._version == version else None

    def read(
        self, batch: Any, namespace: str, loader: str, batch_idx: int | None, refuse: Callable[[Exception], None],
    ) -> list[str]:
        """The keys of ``batch["index"]`` under ``namespace``; a repeated index goes to ``refuse``.

        ``batch_idx``: the batch's position in the loader's current pass (0 starts a new pass).
        """
        if not isinstance(batch, dict) or "index" not in batch:
            raise ValueError(
                "cache_key='index' needs dict batches with an 'index' entry (the dataset index of each sample); "
                f"got a {type(batch).__name__} batch. Add the index in your Dataset/collate_fn, or use cache_key='content'."
            )
        raw = batch["index"]
        digests: dict[int, tuple[tuple[tuple[int, ...], ...], bytes]] | None = None
        if isinstance(raw, Tensor) and not (raw.is_floating_point() or raw.is_complex()):
            # The loader's host copy when the batch came through the strategy; else read once (a wait on a GPU).
            host = self._host_copy(raw)
            raw, digests = host if host is not None else (raw.reshape(-1).tolist(), None)
        keys = index_keys(raw, namespace)  # says what is wrong with indices that are not ints
        error = self._repeated(list(raw), loader, batch_idx)
        if digests is None:  # no host copy: the probed rows of the batch as the forward gets it (read with the indices)
            digests = {i: _row_digest(batch, row, len(raw)) for row, i in enumerate(raw) if probed(i)}
        error = error or self._changed(digests, loader)
        if error is not None:
            refuse(error)
        return keys

    def _changed(self, digests: dict[int, tuple[tuple[tuple[int, ...], ...], bytes]], loader: str) -> InputChanged | None:
        """The error for a probed sample whose input differs from its first pass over ``loader``."""
        first = self._first.setdefault(loader, {})
        for index, (shapes, digest) in digests.items():
            before = first.setdefault((index, shapes), digest)
            if before != digest:
                return InputChanged(
                    f"cache_key='index': sample {index} of the {loader} loader came with another input than in an earlier "
                    "pass (a random augmentation or masking in the Dataset or collate_fn?). Index keys name the sample, "
                    "not its input: its first view's activations would be served instead. Use cache_key='content' "
                    "(exact: a changed input misses and is computed), or make the input the same every epoch."
                )
        return None

    def _repeated(self, indices: list[int], loader: str, batch_idx: int | None) -> ValueError | None:
        """The error for an index repeated in the batch, or already seen in this pass over ``loader``.

        The pass's indices are kept as a set of ints (reset when ``batch_idx == 0``): validation
        may run several times per training epoch, each run a new pass. Without ``batch_idx`` only
        the batch is checked.
        """
        fix = (
            "Index keys must name one sample each: put each sample's own position in the Dataset in 'index' "
            "(not, e.g., i % n), or use cache_key='content' (also when the sampler repeats samples on purpose: "
            "sampling with replacement, weighted sampling)."
        )
        unique = set(indices)
        if len(unique) != len(indices):
            repeated = sorted({i for i in indices if indices.count(i) > 1})
            return ValueError(
                f"cache_key='index': batch {batch_idx} of the {loader} loader holds dataset index(es) "
                f"{repeated[:5]} more than once. {fix}"
            )
        if batch_idx is None:
            return None
        seen = self._seen.setdefault(loader, set())
        if batch_idx == 0:
            seen.clear()
        again = seen & unique
        if again:
            return ValueError(
                f"cache_key='index': batch {batch_idx} of the {loader} loader holds dataset index(es) "
                f"{sorted(again)[:5]}, already seen earlier in this pass over the loader. {fix}"
            )
        seen |= unique
        return None
