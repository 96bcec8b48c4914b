"""One fit with AutoFreeze and a validation loader, for tests that compare a run with the cache against one without."""

from __future__ import annotations

import pytest
from lightning.pytorch.callbacks import Callback

from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy
from tests.helpers.compare import assert_state_close
from tests.helpers.lightning_models import Classifier, data_for
from tests.helpers.trainers import cpu_trainer

SCHEDULE = {1: 1, 2: 3}  # 4 blocks: boundary 1 at epoch 1, advanced to 3 at epoch 2
RTOL, ATOL = 1e-4, 1e-5


class ValLosses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_validation_end(self, trainer, pl_module):
        self.losses.append(float(trainer.callback_metrics["val_loss"]))


def fit(kind, strategy, *, train=None, val=None, freeze=None, max_epochs=4, module=None, callbacks=(), ckpt_path=None, **kwargs):
    """``(module, trainer, val losses per epoch)`` of one fit with AutoFreeze (``SCHEDULE`` by default)."""
    module = module or Classifier(kind)
    losses = ValLosses()
    freeze = freeze or AutoFreeze(schedule=SCHEDULE)
    trainer = cpu_trainer(strategy, [freeze, losses, *callbacks], max_epochs=max_epochs, **kwargs)
    trainer.fit(module, train or data_for(kind), val or data_for(kind, n=16, seed=7), ckpt_path=ckpt_path)
    return module, trainer, losses.losses


def cached(tmp_path, name="cache", **kwargs) -> PipeTransformerStrategy:
    """The strategy with the cache on (unless ``cache=False`` is passed), in its own folder under ``tmp_path``."""
    kwargs.setdefault("cache", True)
    return PipeTransformerStrategy(cache_dir=str(tmp_path / name), **kwargs)


def assert_same_run(a, b, rtol=RTOL, atol=ATOL, losses_rel=1e-5):
    """Same weights (allclose) and the same validation losses, epoch by epoch, of two :func:`fit` results."""
    (module_a, _, losses_a), (module_b, _, losses_b) = a, b
    assert_state_close(module_a.state_dict(), module_b.state_dict(), rtol=rtol, atol=atol)
    assert len(losses_a) == len(losses_b) > 0
    assert losses_a == pytest.approx(losses_b, rel=losses_rel, abs=losses_rel / 10)


def stats_of(trainer) -> dict[str, float]:
    """The cache's counters of a fit (there must be a cache)."""
    stats = trainer.strategy.cache_stats
    assert stats is not None
    return stats
