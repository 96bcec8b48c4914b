"""``nn.TransformerEncoder`` with torch's default ``enable_nested_tensor=True`` and a padded batch (issue 45).

The encoder turns the batch into a nested tensor when its first layer is in eval mode: in the model
as written, in validation only. Freezing put layer 0 alone in eval mode, so the encoder handed a
nested tensor to the training layer 1 (an AssertionError at the first frozen step under AutoFreeze
alone; under the strategy the pipeline then failed on the nested tensor at the first validation).

The reference is the user's plain Trainer freezing by hand (``requires_grad`` off at the same epoch):
weights and every epoch's validation loss must equal it, and beside that the runs must show what
happened: the blocks frozen, training on dense tensors, validation on nested ones (zeros at the
padded positions, as the plain run), the pipeline's micro-batches and the cache's hits in training.
"""

from __future__ import annotations

import pytest
from lightning.pytorch.callbacks import Callback

from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy
from lightning_pipetransformer.stack.observers import sees_block_runs
from tests.helpers.block_runs import ForwardBackwardRunsPerEpoch
from tests.helpers.compare import assert_state_close
from tests.helpers.lightning_models import Classifier, data_for
from tests.helpers.trainers import cpu_trainer

KIND, EPOCHS, STEPS = "torch-nested", 3, 3  # data_for: 24 samples, batches of 8


class FreezeByHand(Callback):
    """What a user writes: at epoch 1 the embedding and layer 0 stop training (their modules keep their mode)."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            for module in (pl_module.model.embed, pl_module.model.encoder.layers[0]):
                for p in module.parameters():
                    p.requires_grad_(False)
                    p.grad = None


class Watch(Callback):
    """Each epoch's validation loss, and what layer 1 received: ``inputs[(training, nested)]`` counts its runs."""

    def __init__(self, module):
        self.val_losses: list[float] = []
        self.inputs: dict[tuple[bool, bool], int] = {}
        layer = module.model.encoder.layers[1]
        layer.register_forward_pre_hook(sees_block_runs(lambda m, args: self._saw(m.training, args[0].is_nested)))

    def _saw(self, training, nested):
        self.inputs[(training, nested)] = self.inputs.get((training, nested), 0) + 1

    def on_validation_end(self, trainer, pl_module):
        self.val_losses.append(float(trainer.callback_metrics["val_loss"]))


def fit(strategy, freeze, *callbacks):
    module = Classifier(KIND)
    watch = Watch(module)
    cpu_trainer(strategy, [freeze, watch, *callbacks], max_epochs=EPOCHS).fit(module, data_for(KIND), data_for(KIND))
    return module, watch


_plain: list = []


def plain():
    if not _plain:
        _plain.extend(fit("auto", FreezeByHand()))
    return _plain


def assert_equals_plain(module, watch):
    reference, seen = plain()
    assert seen.inputs[(False, True)] == EPOCHS * STEPS  # the reference validates on nested tensors
    assert_state_close(module.state_dict(), reference.state_dict(), rtol=1e-4, atol=1e-5)
    assert watch.val_losses == pytest.approx(seen.val_losses, rel=1e-5)
    # Training ran dense, validation nested (every validation batch), as in the plain run.
    assert set(watch.inputs) == {(True, False), (False, True)}, watch.inputs
    assert watch.inputs[(False, True)] == EPOCHS * STEPS
    frozen = [module.model.embed, module.model.encoder.layers[0]]
    assert not any(p.requires_grad for m in frozen for p in m.parameters())
    assert not module.model.encoder.layers[0].training and module.model.encoder.layers[1].training
    assert module.model.encoder.use_nested_tensor  # the encoder is the user's again after fit


def test_autofreeze_alone_equals_freezing_by_hand():
    """Was an AssertionError at the first frozen step: MultiheadAttention got a nested tensor while training."""
    freeze = AutoFreeze(schedule={1: 1})
    module, watch = fit("auto", freeze)
    assert freeze.num_frozen == 1
    assert_equals_plain(module, watch)


@pytest.mark.parametrize("pipe_len", [1, 2])
@pytest.mark.parametrize("cache", [False, True])
def test_the_strategy_equals_freezing_by_hand(pipe_len, cache, tmp_path):
    """Was "NestedTensorImpl doesn't support sizes" at the first validation: the pipeline split a nested tensor."""
    runs = ForwardBackwardRunsPerEpoch()
    strategy = PipeTransformerStrategy(pipe_len=pipe_len, chunks=2, cache=cache, cache_dir=str(tmp_path))
    module, watch = fit(strategy, AutoFreeze(schedule={1: 1}), runs)
    assert_equals_plain(module, watch)
    assert strategy.plan.num_frozen == 1 and strategy.plan.pipe_len == pipe_len
    # Per epoch and block, training and validation: the first step's probe (1), 2 micro-batches per training
    # step (the pipeline engaged), the 3 validation batches run whole, as the model calls the blocks (nested).
    # With the cache, frozen block 0 runs for the misses of epoch 1 (whole batches), then only for the
    # one-off check of the first hits; frozen blocks never run backward.
    train, val = 2 * STEPS, STEPS
    frozen = [STEPS + val, 1 + val] if cache else [train + val, train + val]
    assert runs.forward == [[1 + train + val] * 4] + [[f] + [train + val] * 3 for f in frozen], runs.forward
    assert runs.backward == [[train] * 4] + [[0] + [train] * 3] * 2, runs.backward
    if cache:
        stats = strategy.cache_stats
        assert stats["autocache/misses"] == 24 and stats["autocache/hits"] == 24, stats
