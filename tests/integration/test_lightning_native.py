"""One process with nothing to pipeline is plain Lightning; several behave like DDP (issue #15).

Each test compares with what Lightning's own single-device strategy (``strategy="auto"``) does.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from lightning.pytorch.trainer.connectors import accelerator_connector
from lightning.pytorch.tuner import Tuner
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy
from lightning_pipetransformer.stack.discovery import BlockStackError
from tests.helpers.lightning_models import Classifier, data_for
from tests.helpers.loggers import Recorder
from tests.helpers.trainers import cpu_trainer


class Linear(pl.LightningModule):
    """Lightning's BoringModel: one Linear layer, no stack of blocks."""

    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(8, 2)
        self.batch_size = batch_size
        self.inference_modes: list[bool] = []

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).square().mean()

    def validation_step(self, batch, batch_idx):
        self.inference_modes.append(torch.is_inference_mode_enabled())
        self.log("val_loss", self.layer(batch[0]).square().mean())

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(32, 8, generator=torch.Generator().manual_seed(0))), batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 8)), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_one_device_has_no_launcher_no_process_group_and_is_not_distributed():
    trainer = cpu_trainer(PipeTransformerStrategy(), max_epochs=1)
    assert trainer.strategy.launcher is None and not trainer._accelerator_connector.is_distributed
    module = Classifier("bert")
    trainer.fit(module, data_for("bert"), data_for("bert", n=8))
    assert not torch.distributed.is_initialized()


def test_usable_in_a_notebook(monkeypatch):
    monkeypatch.setattr(accelerator_connector, "_IS_INTERACTIVE", True)
    cpu_trainer("pipetransformer", max_epochs=1)  # no subprocess launcher for one device: accepted
    with pytest.raises(Exception, match="interactive"):
        cpu_trainer("ddp", max_epochs=1)  # what a DDP-family strategy gets (the check this one used to fail)


def test_validation_honours_inference_mode():
    modes = {}
    for strategy in ("auto", PipeTransformerStrategy()):
        module = Linear()
        trainer = cpu_trainer(strategy, max_epochs=1)
        trainer.fit(module)  # validation inside fit: Lightning uses no_grad there
        trainer.validate(module, verbose=False)  # trainer.validate: inference_mode=True, the default
        modes[str(strategy)] = module.inference_modes
    assert modes["auto"] == [False, False, True, True]
    assert len({str(m) for m in modes.values()}) == 1


def test_batch_size_finder_works_and_finds_what_auto_finds():
    found = {}
    for strategy in ("auto", PipeTransformerStrategy()):
        module = Linear(batch_size=2)
        trainer = cpu_trainer(strategy, max_epochs=1)
        found[str(strategy)] = Tuner(trainer).scale_batch_size(module, mode="power", max_trials=3, steps_per_trial=1)
    assert list(found.values()) == [8, 8]  # 2 -> 4 -> 8 in three trials, under both


def dropout_classifier() -> Classifier:
    module = Classifier("bert")
    for m in module.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.2
    return module


@pytest.mark.parametrize("strategy", [PipeTransformerStrategy, lambda: PipeTransformerStrategy(pipe_len=2)])
def test_the_same_seed_gives_the_run_auto_gives(strategy):
    # Dropout draws: no re-seeding at fit start, and the first pass's probe restores the random state.
    states = []
    for each in ("auto", strategy()):
        pl.seed_everything(7)
        module = dropout_classifier()
        cpu_trainer(each, max_epochs=2).fit(module, data_for("bert"))
        states.append(module.state_dict())
    for key in states[0]:
        torch.testing.assert_close(states[1][key], states[0][key], rtol=0, atol=0, msg=key)


def test_a_model_without_a_block_stack_trains_as_under_auto():
    trained = []
    for strategy in ("auto", PipeTransformerStrategy()):
        module = Linear()
        with pytest.warns(UserWarning, match="no stack of repeated blocks") if strategy != "auto" else _nothing():
            cpu_trainer(strategy, max_epochs=1).fit(module)
        trained.append(module.layer.weight.detach().clone())
    torch.testing.assert_close(trained[1], trained[0], rtol=0, atol=0)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize(
    "strategy, words",
    [
        (lambda: PipeTransformerStrategy(pipe_len=2), "pipe_len=2 needs a block stack"),
        (lambda: PipeTransformerStrategy(cache=True), "cache=True needs a block stack"),
        (lambda: PipeTransformerStrategy(layers="nothing.here"), "layers='nothing.here'"),
    ],
)
def test_asking_for_a_pipeline_or_a_cache_without_a_block_stack_is_refused(strategy, words):
    with pytest.raises(BlockStackError, match=words) as error:
        cpu_trainer(strategy(), max_epochs=1).fit(Linear())
    assert "layers=" in str(error.value) or "configure_block_stack" in str(error.value)


def test_autofreeze_without_a_block_stack_is_refused_before_training():
    with pytest.raises(BlockStackError, match="configure_block_stack"):
        cpu_trainer(PipeTransformerStrategy(), max_epochs=1, callbacks=[AutoFreeze()]).fit(Linear())


class WithTest(Classifier):
    def test_step(self, batch, batch_idx):
        self.log("test_loss", nn.functional.cross_entropy(self(batch[0]), batch[1]))


def test_validate_test_predict_log_what_auto_logs():
    logged = {}
    for strategy in ("auto", PipeTransformerStrategy(pipe_len=2, chunks=2)):
        recorder = Recorder()
        module = WithTest("bert")
        trainer = cpu_trainer(strategy, max_epochs=1, logger=recorder)
        trainer.validate(module, data_for("bert", n=8), verbose=False)
        trainer.test(module, data_for("bert", n=8), verbose=False)
        trainer.predict(module, data_for("bert", n=8))
        logged[str(strategy)] = [sorted(call) for call in recorder.calls]
    assert logged["auto"] and len(set(map(str, logged.values()))) == 1


def test_fit_logs_the_plan_and_shows_it_in_the_progress_bar():
    recorder = Recorder()
    trainer = cpu_trainer(
        PipeTransformerStrategy(pipe_len=2, chunks=2), max_epochs=2, logger=recorder, log_every_n_steps=1, callbacks=[AutoFreeze(schedule={1: 2})],
    )
    module = Classifier("bert")
    shown = []
    log = module.log

    def recording_log(name, value, *args, **kwargs):
        if name.startswith("pt/"):
            shown.append(value)
        return log(name, value, *args, **kwargs)

    module.log = recording_log
    trainer.fit(module, data_for("bert"))
    # No host sync per step: through `LightningModule.log` a Python number would be copied to the
    # module's device (torch.tensor(v, device=cuda)) and read back by the bar. The values go straight
    # into the bar's dictionary as host numbers instead: nothing is logged for them.
    assert shown == [], shown[:4]
    bar = trainer.progress_bar_metrics
    assert bar["pt/frozen"] == 2 and bar["pt/pipe"] == 2
    assert type(bar["pt/frozen"]) is int and type(bar["pt/pipe"]) is int  # counts shown as counts: "2", not "2.000"
    assert Tqdm.format_num(bar["pt/frozen"]) == "2"  # as the default (TQDM) bar renders it
    assert "pt/replicas" not in bar and "pt/cache_hit_rate" not in bar  # one process, no cache: nothing to show
    assert not any(k.startswith("pt/") for call in recorder.calls for k in call)  # the bar only
    frozen = [call["pipetransformer/num_frozen"] for call in recorder.calls if "pipetransformer/num_frozen" in call]
    assert frozen == [0.0, 2.0]  # at set-up and at the freeze


def test_the_rich_progress_bar_shows_counts_as_integers_too():
    """RichProgressBar formats every non-string value with ".3f": it gets the counts as strings."""
    rich = RichProgressBar()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=PipeTransformerStrategy(pipe_len=2), max_epochs=2, logger=False,
        callbacks=[AutoFreeze(schedule={1: 2}), rich], enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(Classifier("bert"), data_for("bert"))
    bar = rich.get_metrics(trainer, trainer.lightning_module)
    assert bar["pt/frozen"] == "2" and bar["pt/pipe"] == "2", bar


def test_one_process_in_a_cluster_environment_asks_it_nothing(monkeypatch):
    # One task of a SLURM job (detected), with none of SLURM's rank variables: rank 0 of 1, as under
    # the single-device strategy (which never asks the cluster environment).
    from lightning.fabric.plugins.environments import SLURMEnvironment

    monkeypatch.setattr(SLURMEnvironment, "detect", staticmethod(lambda: True))
    for name in ("SLURM_NODEID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    trainer = cpu_trainer(PipeTransformerStrategy(), max_epochs=1)
    assert (trainer.global_rank, trainer.local_rank, trainer.node_rank, trainer.world_size) == (0, 0, 0, 1)
    module = Linear()
    trainer.fit(module)
    assert module.inference_modes  # it trained and validated


def test_the_trainer_lets_the_strategy_see_an_exception():
    seen = []

    class Failing(Linear):
        def on_fit_start(self):
            raise RuntimeError("boom")

    class Watching(PipeTransformerStrategy):
        def on_exception(self, exception):
            seen.append(exception)
            super().on_exception(exception)

    with pytest.raises(RuntimeError, match="boom"):
        cpu_trainer(Watching(), max_epochs=1).fit(Failing())
    assert len(seen) == 1
