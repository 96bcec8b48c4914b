"""An advance holds a bounded amount of host memory in its part-filled groups (issue 40 item 6).

Entries are grouped by shape for their block calls; with many shapes (one per padded length) and a
few entries each, every group stayed part-filled and the whole boundary sat on the host until the
end. The bytes held are measured from outside: an entry counts from its ``read`` to the ``store`` of
its group at the next boundary.
"""

from __future__ import annotations

import pytest
import torch

from lightning_pipetransformer.cache.advance import advance_store
from lightning_pipetransformer.cache.arguments import pack_block_inputs
from lightning_pipetransformer.cache.store import ActivationStore

SHAPES, PER_SHAPE, WIDTH = 40, 3, 16


def _run(hidden: torch.Tensor, calls) -> torch.Tensor:
    """Blocks F..F'-1: each entry's own arithmetic (its block input included), whatever its group."""
    ((mask, _none), kwargs), = calls
    assert kwargs == {"is_causal": False}
    return hidden * 2 + mask[..., None]


def _fill(src: ActivationStore) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``SHAPES`` lengths with ``PER_SHAPE`` entries each; returns every key's (activation, mask)."""
    g = torch.Generator().manual_seed(0)
    made = {}
    for length in range(1, SHAPES + 1):
        keys = [f"l{length}-{i}" for i in range(PER_SHAPE)]
        hidden = torch.randn(PER_SHAPE, length, WIDTH, generator=g)
        mask = torch.randn(PER_SHAPE, length, generator=g)
        src.store(keys, hidden, pack_block_inputs([((mask, None), {"is_causal": False})], 1, PER_SHAPE))
        made.update({k: (hidden[i], mask[i]) for i, k in enumerate(keys)})
    return made


class HeldBytes:
    """Bytes of entries read from ``src`` and not yet stored into ``dst``: what the advance holds."""

    def __init__(self, src: ActivationStore, dst: ActivationStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sizes: dict[str, int] = {}
        self.now = self.peak = 0
        read, store = src.read, dst.store

        def counted_read(key):
            entry = read(key)
            if entry is not None:
                self.sizes[key] = entry.hidden.nbytes + sum(t.nbytes for t in entry.extras.values())
                self.now += self.sizes[key]
                self.peak = max(self.peak, self.now)
            return entry

        def counted_store(keys, *args, **kwargs):
            self.now -= sum(self.sizes.pop(k) for k in keys)
            return store(keys, *args, **kwargs)

        monkeypatch.setattr(src, "read", counted_read)
        monkeypatch.setattr(dst, "store", counted_store)


@pytest.mark.parametrize("late", [False, True], ids=["cpu", "late-copies"])
@pytest.mark.parametrize("budget", [0, 10**7], ids=["disk", "memory"])
def test_many_shapes_with_a_few_entries_each_stay_under_the_cap(tmp_path, monkeypatch, request, late, budget):
    if late:
        request.getfixturevalue("async_gpu")  # every copy to the host runs late (tests/unit/cache/async_copies.py)
    src = ActivationStore(tmp_path, "a" * 32, 1, memory_budget=budget)
    made = _fill(src)
    dst = ActivationStore(tmp_path, "b" * 32, 2, memory_budget=budget)
    one_entry = max(h.nbytes + m.nbytes for h, m in made.values()) + 64  # the packed block inputs' markers
    cap = 5 * one_entry
    held = HeldBytes(src, dst, monkeypatch)
    assert advance_store(src, dst, _run, batch_size=32, max_held_bytes=cap) == SHAPES * PER_SHAPE
    # Before: every entry at once (no group of 32 ever filled): SHAPES * PER_SHAPE entries held. Now the
    # groups stay under the cap, plus the entry just read (its size is known once it is read).
    assert 0 < held.peak <= cap + one_entry, (held.peak, cap)
    assert held.now == 0
    if budget == 0:  # every entry written when the advance returns (the other ranks read them after a barrier)
        assert dst.stats().files_on_disk == SHAPES * PER_SHAPE
    # Each advanced entry equals its own entry recomputed through the blocks, whichever group it went in.
    keys = list(made)
    for key in keys:
        hidden, mask = made[key]
        hit, got = dst.lookup([key])
        assert hit.all(), key
        assert torch.equal(got[0], _run(hidden[None], [((mask[None], None), {"is_causal": False})])[0])
    assert src.stats().entries_in_memory == 0  # released as they were advanced


def test_an_entry_larger_than_the_cap_is_advanced_alone(tmp_path, monkeypatch):
    src = ActivationStore(tmp_path, "a" * 32, 1, memory_budget=0)
    made = _fill(src)
    dst = ActivationStore(tmp_path, "b" * 32, 2, memory_budget=0)
    held = HeldBytes(src, dst, monkeypatch)
    biggest = max(held_bytes for held_bytes in (h.nbytes + m.nbytes for h, m in made.values()))
    assert advance_store(src, dst, _run, max_held_bytes=0) == len(made)
    assert held.peak <= 2 * (biggest + 64)  # one entry at a time, and the one just read


def test_max_held_bytes_is_checked(tmp_path):
    src = ActivationStore(tmp_path, "a" * 32, 1, memory_budget=0)
    dst = ActivationStore(tmp_path, "b" * 32, 2, memory_budget=0)
    with pytest.raises(ValueError, match="max_held_bytes"):
        advance_store(src, dst, _run, max_held_bytes=-1)
