"""No host synchronisation in a steady-state step of the strategy's own code (issue 31).

On CPU nothing synchronises, so the rule is checked by what would: every call that makes the
host wait for a GPU tensor (``.item()``, ``.tolist()``, ``.cpu()``, ``bool()``/``int()``/``float()``
of a tensor, ``nonzero``, ``.numpy()``), and every tensor made from host data, counted by a
``TorchFunctionMode`` around the strategy's per-batch hook (the progress bar) and the pipeline's
pass (the runner, the executor and the blocks), from the third step on. ``torch.tensor(v)`` of host
data without a device is no sync (it stays on the CPU); with ``device=`` it is a copy to the GPU.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from lightning_pipetransformer import PipeTransformerStrategy, runners
from tests.helpers.lightning_models import Classifier, data_for
from tests.helpers.trainers import cpu_trainer

SYNCING = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.nonzero, torch.nonzero,
    torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
}


class SyncCounter(TorchFunctionMode):
    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNCING:
            self.seen.append(getattr(func, "__name__", str(func)))
        elif func is torch.tensor and (kwargs or {}).get("device") is not None:
            # Host data placed on the module's device (Lightning's logging of a Python number): a
            # synchronising copy from pageable memory on a GPU. A CPU tensor (no device) is none.
            self.seen.append("tensor(device=...)")
        return func(*args, **(kwargs or {}))


def test_a_steady_state_pipelined_step_makes_the_host_wait_for_nothing(monkeypatch):
    seen: list[str] = []
    steps = {"n": 0}
    strategy = PipeTransformerStrategy(pipe_len=2, chunks=2)

    def counted(method):
        def wrapper(*args, **kwargs):
            if steps["n"] < 2:
                return method(*args, **kwargs)
            with SyncCounter(seen):
                return method(*args, **kwargs)
        return wrapper

    run = runners.ReturnTo.run
    counted_passes = []

    def counted_run(self, call):
        counted_passes.append(steps["n"] >= 2)
        return counted(run)(self, call)

    monkeypatch.setattr(runners.ReturnTo, "run", counted_run)
    batch_start = strategy.on_train_batch_start

    def on_train_batch_start(batch, batch_idx):
        steps["n"] = batch_idx
        return counted(batch_start)(batch, batch_idx)

    strategy.on_train_batch_start = on_train_batch_start
    trainer = cpu_trainer(strategy, max_epochs=1)
    trainer.fit(Classifier("bert"), data_for("bert", n=48))
    assert trainer.global_step == 6 and sum(counted_passes) == 4  # the pipeline ran the steps counted
    assert seen == [], seen
