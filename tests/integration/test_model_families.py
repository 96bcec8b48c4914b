"""Every model family engages the pipeline and the cache, equal to plain training, or is refused loudly.

Per family (tiny models from configs, 4 blocks): ``pipe_len=2, chunks=2`` equals a plain Trainer
and every block runs once per micro-batch; ``cache=True`` with 3 of 4 blocks frozen equals
``cache=False`` and serves the frozen blocks from the store (they do not run once cached), or
raises the documented refusal. The supported-models table in docs/user-guide.md states the same.
"""

from __future__ import annotations

import contextlib

import pytest

from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy
from lightning_pipetransformer.cache.store import CacheConfigError
from tests.helpers.block_runs import ForwardRunsPerEpoch
from tests.helpers.compare import assert_same_weights
from tests.helpers.families import BATCH, FAMILIES, STEPS, FamilyModule, family_data
from tests.helpers.trainers import cpu_trainer

EPOCHS = 3

_plain: dict[str, FamilyModule] = {}


def plain(family):
    if family not in _plain:
        module = FamilyModule(family)
        cpu_trainer("auto", max_epochs=EPOCHS).fit(module, family_data(family))
        _plain[family] = module
    return _plain[family]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_pipeline_equals_plain_training_and_runs_every_block_per_micro_batch(family):
    module = FamilyModule(family)
    runs = ForwardRunsPerEpoch(module)
    fit = cpu_trainer(PipeTransformerStrategy(pipe_len=2, chunks=2), [runs], max_epochs=EPOCHS)
    observed = FAMILIES[family].observed
    with pytest.warns(UserWarning, match="observes the blocks") if observed else contextlib.nullcontext():
        fit.fit(module, family_data(family))
    assert_same_weights(module, plain(family))
    blocks = len(runs.blocks)
    if observed:  # exact, and said: every pass runs whole (the probe, then one run per step)
        assert runs.epochs == [[1 + STEPS] * blocks] + [[STEPS] * blocks] * (EPOCHS - 1)
        return
    # Epoch 0: one run per block without a graph on the first batch (learning what blocks return), then
    # 2 micro-batches per step; later epochs: 2 per step. A bypassed pipeline would give 1 per step.
    assert runs.epochs == [[1 + 2 * STEPS] * blocks] + [[2 * STEPS] * blocks] * (EPOCHS - 1)
    # After fit the blocks have their own class again, and a key-value cache turned off for fit is back on.
    assert not any("_pipetransformer_base" in vars(type(b)) for b in runs.blocks)
    if FAMILIES[family].task == "lm":
        assert module.model.config.use_cache is True


def fit_cached(family, cache, untie=False):
    module = FamilyModule(family, untie=untie)
    runs = ForwardRunsPerEpoch(module)
    strategy = PipeTransformerStrategy(cache=cache, cache_memory=10**8)
    fit = cpu_trainer(strategy, [AutoFreeze(schedule={1: 3}), runs], max_epochs=EPOCHS)
    fit.fit(module, family_data(family))
    return module, runs, strategy


def tied(family):
    """Whether the family ties its input embeddings to its output head (they then keep training by default)."""
    model = FAMILIES[family].build()
    head = model.get_output_embeddings()
    return head is not None and head.weight is model.get_input_embeddings().weight


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cache_equals_cache_off_and_serves_the_frozen_blocks(family):
    refused = FAMILIES[family].cache_refused
    if refused is not None:
        with pytest.raises(CacheConfigError, match=refused[0]):
            fit_cached(family, True)
        return
    # Tied embeddings keep training by default and the cache stands aside (test_tied_embeddings_...): untied, it serves.
    untie = tied(family)
    off, _, _ = fit_cached(family, False, untie)
    aside = FAMILIES[family].cache_stands_aside or ("observes the blocks" if FAMILIES[family].observed else None)
    with pytest.warns(UserWarning, match=aside) if aside else contextlib.nullcontext():
        on, runs, strategy = fit_cached(family, True, untie)
    assert_same_weights(on, off)
    # What runs before the stack (by call order, whatever the registration order) froze; nothing after it did.
    stack = strategy.stack
    assert stack.pre and not stack.provisional
    assert not any(p.requires_grad for _, m in stack.pre for p in m.parameters())
    assert all(p.requires_grad for _, m in stack.post for p in m.parameters())
    stats = strategy.cache_stats
    if aside:
        assert stats["autocache/hits"] == 0 and stats["autocache/batches_bypassed"] == 2 * STEPS
        assert runs.epochs[2] == [STEPS] * 4  # every block runs: nothing is served
        return
    # Epoch 1 computes and stores every sample at boundary 3; epoch 2 is served from the store:
    # blocks 0-2 run only for the one-off check of the first hits (one batch), block 3 every step.
    assert stats["autocache/hits"] == STEPS * BATCH and stats["autocache/misses"] == STEPS * BATCH
    assert runs.epochs[2][:3] == [1, 1, 1] and runs.epochs[2][3] == STEPS
