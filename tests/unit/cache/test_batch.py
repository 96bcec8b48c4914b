"""One served batch (cache/batch.py): hits from the store, misses held at an earlier boundary advanced
through the blocks in between, the rest through the frozen prefix; the result equals computing every row."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipetransformer.cache.batch import CachedBatch, merge_rows
from lightning_pipetransformer.cache.store import ActivationStore

FP = "0123456789abcdef0123456789abcdef"


class Scale(nn.Module):
    """A block that counts the rows it runs."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor
        self.rows: list[int] = []

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.rows.append(hidden.shape[0])
        return hidden * self.factor + mask


def prefix_of(blocks):
    def prefix(hidden, calls):
        for block, (args, kwargs) in zip(blocks, calls, strict=True):
            hidden = block(hidden, *args, **kwargs)
        return hidden

    return prefix


def test_hits_earlier_boundary_and_misses_each_run_only_what_they_need(tmp_path):
    blocks = [Scale(2.0), Scale(3.0)]
    hidden = torch.arange(8.0).reshape(4, 2)
    mask = torch.full((4, 2), 0.5)
    calls = [((mask,), {}), ((mask,), {})]
    expected = prefix_of(blocks)(hidden, calls)
    for block in blocks:
        block.rows.clear()
    keys = ["k0", "k1", "k2", "k3"]
    current = ActivationStore(tmp_path, FP, 2, 10**6)
    current.store(["k0", "k2"], expected[[0, 2]])  # hits
    older = ActivationStore(tmp_path, FP, 1, 10**6)
    older.store(["k1"], blocks[0](hidden[1:2], mask[1:2]))  # held at boundary 1: runs block 1 only
    blocks[0].rows.clear()
    asked: list[list[str]] = []

    def from_older(missed):
        asked.append(list(missed))
        hit, held = older.lookup(missed)
        return [(1, hit, held)] if bool(hit.any()) else []

    served = CachedBatch(
        current, keys, rows=lambda m: hidden[m], calls=calls, extras={"t.b2": torch.zeros(4, 1)}, blocks=blocks,
        prefix=prefix_of(blocks), older=from_older, sample_shape=(2,), dtype=torch.float32, time_prefix=True,
    )
    torch.testing.assert_close(served.boundary(), expected)
    assert served.hit_mask.tolist() == [True, False, True, False]
    assert asked == [["k1", "k3"]]  # only the misses are asked of earlier boundaries
    assert blocks[0].rows == [1] and blocks[1].rows == [1, 1]  # k3 from the input; k1 through block 1 only
    assert served.served == 3 and served.computed_shape == (2,)
    assert served.prefix_time is not None and served.prefix_time[1] == 1  # timed: the one row the prefix ran (k3)
    hit, _ = current.lookup(keys)
    assert hit.all()  # both computed rows were stored at the current boundary


def test_a_batch_that_all_hits_runs_nothing(tmp_path):
    blocks = [Scale(2.0)]
    store = ActivationStore(tmp_path, FP, 1, 10**6)
    store.store(["a", "b"], torch.ones(2, 3))
    served = CachedBatch(
        store, ["a", "b"], rows=lambda m: pytest.fail("no row may run"), calls=[((torch.zeros(2, 3),), {})], extras={},
        blocks=blocks, prefix=prefix_of(blocks),
    )
    torch.testing.assert_close(served.boundary(), torch.ones(2, 3))
    assert blocks[0].rows == [] and served.served == 2 and served.prefix_time is None


def test_merge_rows():
    hit = torch.tensor([True, False, True, False])
    hits = torch.tensor([[1.0], [3.0]])
    computed = torch.tensor([[2.0], [4.0]])
    assert merge_rows(hit, hits, computed).flatten().tolist() == [1.0, 2.0, 3.0, 4.0]
    assert merge_rows(torch.zeros(2, dtype=torch.bool), torch.empty(0, 1), computed) is computed
    with pytest.raises(ValueError):
        merge_rows(hit, hits, computed[:1])


