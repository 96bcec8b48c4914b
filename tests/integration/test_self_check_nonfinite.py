"""The first-batch self-check does not blame the cache for a NaN in the data (issue 40, item 2).

A training step that skips a non-finite loss trains on through a NaN image without a cache. With
the cache, the self-check after each freeze compared the cached pass with the plain loop, NaN with
NaN, and stopped the run with ``SelfCheckError`` naming the activation cache. Non-finite values
at the same places on both sides are now equal; each run below equals the same run without a
cache, and the cache served it (hits counted, the self-check ran and passed).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.cached_fits import assert_same_run, cached, fit, stats_of
from tests.helpers.lightning_models import Classifier, IndexedSamples, _images, inputs_and_labels

NAN_SAMPLE = 3  # in the first batch of every epoch: the batch a self-check runs on


class SkipsNonFinite(Classifier):
    """Skips a step whose loss is not finite (a NaN image in the batch), as a user's training_step may."""

    def training_step(self, batch, batch_idx):
        x, y = inputs_and_labels(batch)
        loss = torch.nn.functional.cross_entropy(self(x), y)
        if not torch.isfinite(loss):
            return None
        return loss


def loaders(key: str) -> dict[str, DataLoader]:
    """Training images with one NaN feature in one sample; validation images without (dict batches for index keys)."""
    x, y = _images(24, 0)
    x[NAN_SAMPLE, 0, 2, 5] = float("nan")
    samples = IndexedSamples if key == "index" else TensorDataset
    return {"train": DataLoader(samples(x, y), batch_size=8), "val": DataLoader(samples(*_images(16, 7)), batch_size=8)}


@pytest.mark.parametrize("key", ["content", "index"])
def test_nan_in_one_training_sample_equals_cache_off(tmp_path, key, caplog):
    caplog.set_level(logging.INFO, logger="lightning.pytorch")
    run = fit("vit", cached(tmp_path, cache_key=key), module=SkipsNonFinite("vit"), **loaders(key))
    plain = fit("vit", "auto", module=SkipsNonFinite("vit"), **loaders(key))
    assert_same_run(run, plain)
    stats = stats_of(run[1])
    # Engaged: at boundary 3 (epochs 2-3; epoch 2 from boundary 1's entries, advanced on read) every
    # training and validation lookup hit but the NaN sample's.
    assert stats["autocache/boundary"] == 3 and stats["autocache/hits"] == 2 * (24 + 16 - 1)
    assert stats["autocache/nonfinite"] >= 1  # the NaN sample's activation, never stored
    passed = [r.message for r in caplog.records if "self-check passed: the activation cache" in r.message]
    # The check after the first freeze ran on the epoch's first batch, which holds the NaN sample.
    assert passed, "the self-check never ran: nothing was compared"
