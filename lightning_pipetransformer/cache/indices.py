"""Index keys, batch by batch: the dataset indices a loader gives, checked to name one sample each.

An index key names a sample, so an index seen twice in one batch or in one pass over a loader
means two samples share a key and one would be served the other's activations. The check runs
from the first batch on (cache on or not yet), so a bad index fails in the first step, not at the
first freeze.

The indices are read on the host: :meth:`BatchIndices.remember` takes them from the loader's batch
before it goes to the device, so that :meth:`BatchIndices.read` need not wait for the device copy.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torch import Tensor

from lightning_pipetransformer.cache.keys import index_keys

__all__ = ["BatchIndices"]


class BatchIndices:
    """The keys of the next forward (:attr:`next`) and the indices each loader gave since its pass began."""

    def __init__(self) -> None:
        #: The keys the next forward takes (``None``: the cache will not serve it).
        self.next: list[str] | None = None
        #: Per loader (``f"{stage}{dataloader_idx}"``): the indices of its current pass.
        self._seen: dict[str, set[int]] = {}
        #: The last batch's indices as the loader gave them (host ints), by the device tensor made from them,
        #: its version counter then, and the ints (:meth:`remember`).
        self._host: tuple[weakref.ref[Tensor], int, list[int]] | None = None

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
        self._host = (weakref.ref(moved), moved._version, raw.reshape(-1).tolist())

    def _host_copy(self, raw: Tensor) -> list[int] | None:
        """The host ints :meth:`remember` kept for ``raw``, if ``raw`` is that device tensor and unchanged."""
        if self._host is None:
            return None
        ref, version, values = self._host
        return values if ref() is raw and raw._version == version else None

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
        if isinstance(raw, Tensor) and not (raw.is_floating_point() or raw.is_complex()):
            # The loader's host copy when the batch came through the strategy; else read once (a wait on a GPU).
            host = self._host_copy(raw)
            raw = host if host is not None else raw.reshape(-1).tolist()
        keys = index_keys(raw, namespace)  # says what is wrong with indices that are not ints
        error = self._repeated(list(raw), loader, batch_idx)
        if error is not None:
            refuse(error)
        return keys

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
