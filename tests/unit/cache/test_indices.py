"""Index keys: the probe that stops a run whose samples change their input between passes."""

from __future__ import annotations

import pytest
import torch

from lightning_pipetransformer.cache.indices import PROBE_EVERY, BatchIndices, InputChanged, probed


def batch(x: torch.Tensor, start: int = 0) -> dict:
    return {"x": x, "y": torch.zeros(len(x), dtype=torch.long), "index": torch.arange(start, start + len(x))}


def raise_it(error: Exception) -> None:
    raise error


def test_about_one_sample_in_probe_every_is_probed_and_always_the_same():
    chosen = [i for i in range(16_000) if probed(i)]
    assert len(chosen) == pytest.approx(16_000 / PROBE_EVERY, rel=0.1)
    assert chosen == [i for i in range(16_000) if probed(i)]
    assert any(probed(i) for i in range(0, 16_000, PROBE_EVERY)) and not all(probed(i) for i in range(0, 16_000, PROBE_EVERY))


@pytest.mark.parametrize("through_host", [True, False])
def test_a_probed_sample_with_another_input_in_a_later_pass_stops(through_host):
    indices = BatchIndices()
    x = torch.randint(0, 50, (64, 8))
    target = next(i for i in range(64) if probed(i))

    def read(values: torch.Tensor, batch_idx: int) -> list[str]:
        b = batch(values)
        if through_host:
            moved = {k: v.clone() for k, v in b.items()}
            indices.remember(b, moved)
            b = moved
        return indices.read(b, "ns-", "train0", batch_idx, raise_it)

    read(x, 0)
    read(x, 0)  # the same inputs again: nothing to say
    other = x.clone()
    other[target, 3] += 1
    with pytest.raises(InputChanged, match=f"sample {target} of the train0 loader"):
        read(other, 0)


def test_an_unprobed_sample_may_change_unnoticed_but_its_neighbours_are_compared():
    indices = BatchIndices()
    x = torch.randint(0, 50, (64, 8))
    indices.read(batch(x), "ns-", "train0", 0, raise_it)
    other = x.clone()
    for i in range(64):
        if not probed(i):
            other[i] += 1
    indices.read(batch(other), "ns-", "train0", 0, raise_it)  # the probed rows are unchanged


def test_a_forward_whose_rows_changed_stops_only_where_an_entry_was_stored():
    """A row that reaches the model with another input stops the run when an entry computed from its old input could be
    served (a masking in training_step); a row that left no entry (a NaN read once is not stored) takes its new input."""
    indices = BatchIndices()
    keys = [f"ns-i{i}-0f3a" for i in range(4)]  # an index key and its blocks' arguments (prefix.with_block_arguments)
    first = torch.arange(32.0).reshape(4, 8)
    assert indices.check_forward(keys, first, 4, recording=True) is None
    changed = first.clone()
    changed[1] += 1
    indices.new_pass()
    stored = {keys[0], keys[2], keys[3]}  # row 1's entry was never stored
    assert indices.check_forward(keys, changed, 4, recording=False, holds=stored.__contains__) is None
    assert indices.check_forward(keys, changed, 4, recording=False, holds=stored.__contains__) is None  # now its input
    masked = changed.clone()
    masked[2] = 0
    error = indices.check_forward(keys, masked, 4, recording=False, holds=stored.__contains__)
    assert isinstance(error, InputChanged) and "sample 2 " in str(error)
