"""AutoDP on 4 CPU processes (gloo): pipe length 4 -> 2 -> 1 as blocks freeze; run by tests/integration/distributed/test_autodp.py.

Lightning re-launches this script once per extra rank (same arguments). Tiny BERT (or ``--arch llama``, a Llama-style decoder) with 4 blocks,
``frozen_cost=0`` and the schedule {1: 2, 2: 3} make the planner compress K 4 -> 2 -> 1, so the
active replicas grow 1 -> 2 -> 4. Each rank writes what it saw and its final state to ``--out``.

Modes: ``train`` (3 epochs), ``first`` (2 epochs, last.ckpt), ``resume`` (from ``--ckpt`` to 3
epochs), ``kill`` (rank 2 dies in the middle of epoch 1; the others must exit with an error).
"""

import argparse
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for tests.helpers

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint
from torch.utils.data import DataLoader

from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy
from lightning_pipetransformer.devices import VirtualDevices
from lightning_pipetransformer.dp.idle import is_idle_batch
from lightning_pipetransformer.stack.interception import interception_stats
from tests.helpers.launch import fit_recording_errors
from tests.helpers.models import TextClassifier, text_dataset

SCHEDULE = {1: 2, 2: 3}
NUM_SAMPLES = 32


class Record(Callback):
    """Per epoch: plan, activity, real and placeholder batches and their sizes."""

    def __init__(self, kill_rank: int | None = None) -> None:
        self.epochs: dict[int, dict] = {}
        self.kill_rank = kill_rank

    def on_train_epoch_start(self, trainer, pl_module):
        self._record(trainer)

    def _record(self, trainer):
        """This epoch's record (made at the epoch start, or at the first batch when resuming mid-epoch)."""
        if trainer.current_epoch not in self.epochs:
            plan = trainer.strategy.plan
            self.epochs[trainer.current_epoch] = {
                "pipe_len": plan.pipe_len, "replicas": plan.num_replicas, "active": trainer.strategy.is_active,
                "num_frozen": plan.num_frozen, "batch_sizes": [], "idle_batches": 0,
            }
        return self.epochs[trainer.current_epoch]

    def on_train_epoch_end(self, trainer, pl_module):
        stats = interception_stats(trainer.strategy.stack.container)
        # Passes the installed pipeline ran so far (cumulative; the first one is the model's own on idle ranks).
        self._record(trainer)["pipelined_passes"] = stats.deferred if stats is not None else 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        record = self._record(trainer)
        if is_idle_batch(batch):
            record["idle_batches"] += 1
        else:
            record["batch_sizes"].append(int(batch[0].shape[0]))
        if self.kill_rank == trainer.global_rank and trainer.current_epoch == 1 and batch_idx == 1:
            os._exit(17)  # a crash: no exception, no clean-up, the peers are left waiting


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--policy", default="global")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--mode", default="train", choices=["train", "first", "resume", "kill", "sigterm"])
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--arch", default="bert", choices=["bert", "llama"])
    parser.add_argument("--virtual", action="store_true", help="devices cpu:0..cpu:3 that remember what is where")
    args = parser.parse_args()
    out = Path(args.out)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    (out / f"pid{rank}").write_text(str(os.getpid()))

    record = Record(kill_rank=2 if args.mode == "kill" else None)
    callbacks = [AutoFreeze(schedule=SCHEDULE), record]
    if args.mode == "first":
        callbacks.append(ModelCheckpoint(dirpath=out / "ckpt", save_last=True, save_top_k=0))
    if args.mode == "sigterm":  # the checkpoint a preempted job leaves (as in the middle of an epoch)
        callbacks.append(OnExceptionCheckpoint(dirpath=out / "ckpt", filename="on_exception"))
    module = TextClassifier(num_layers=4, arch=args.arch)
    # --virtual: four distinct (virtual) devices; placement, optimizer state and every collective are
    # checked as a multi-GPU run would check them (VirtualDevices raises where CUDA/NCCL would fail).
    devices = [torch.device("cpu", i) for i in range(4)] if args.virtual else None
    strategy = PipeTransformerStrategy(
        pipe_len=4, frozen_cost=0.0, process_group_backend="gloo", timeout=args.timeout, batch_policy=args.policy,
        parallel_devices=devices,
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_epochs=2 if args.mode == "first" else 3,
        callbacks=callbacks, logger=False, enable_checkpointing=args.mode in ("first", "sigterm"), enable_progress_bar=False,
        default_root_dir=out,
        enable_model_summary=False, num_sanity_val_steps=1,
    )
    train = DataLoader(text_dataset(NUM_SAMPLES), batch_size=args.batch_size, shuffle=False)
    val = DataLoader(text_dataset(16, seed=1), batch_size=4, shuffle=False)
    if args.mode == "sigterm":
        signal_rank_zero_inside_the_transition(trainer, strategy, epoch=1)
    with VirtualDevices() if args.virtual else contextlib.nullcontext():
        fit_recording_errors(trainer, module, train, val, out / f"error{rank}", ckpt_path=args.ckpt)
        final = final_record(trainer, module, record)
        if args.virtual:
            final["validate_k4"] = validate_on_virtual_devices(module, val, devices, args.timeout, out / f"error_validate{rank}")
    torch.save(final, out / f"rank{trainer.global_rank}.pt")


def validate_on_virtual_devices(module, val, devices, timeout, error_file):
    """``validate`` with a fresh strategy at K=4: one replica over cpu:0..3, three shadow ranks holding
    their blocks on the CPU. The weights' sync must send through each rank's own device on the
    replicas' group: every tensor of a broadcast outside the (gloo) control group is checked as
    NCCL would check it."""
    import torch.distributed as dist

    from lightning_pipetransformer import devices as dev

    strategy = PipeTransformerStrategy(pipe_len=4, process_group_backend="gloo", timeout=timeout, parallel_devices=devices)
    # What may carry the weights: broadcasts (Lightning's own sync uses the coalesced one) and point-to-point.
    names = ("broadcast", "_broadcast_coalesced", "send", "recv", "isend", "irecv")
    originals = {name: getattr(dist, name) for name in names}

    def checking(name):
        def call(*args, **kwargs):
            group = kwargs.get("group", next((a for a in args if isinstance(a, dist.ProcessGroup)), None))
            if group is None or group is not strategy.control_group:
                for tensor in [a for a in args if isinstance(a, torch.Tensor)] + [t for a in args if isinstance(a, list) for t in a]:
                    dev.check_collective(tensor, f"dist.{name} before validate")
            return originals[name](*args, **kwargs)

        return call

    for name in names:
        setattr(dist, name, checking(name))
    try:
        trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False, enable_progress_bar=False,
                             enable_model_summary=False)
        fit_recording_errors(trainer, module, None, val, error_file, stage="validate")
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)
    return float(trainer.callback_metrics["val_loss"])


def signal_rank_zero_inside_the_transition(trainer: pl.Trainer, strategy: PipeTransformerStrategy, epoch: int) -> None:
    """SIGTERM to global rank 0 inside ``epoch``'s transition, right before it sends the joining
    replica its state: the others already wait for it inside collectives (the joining rank in its
    receives, the idle ones in the loader's barrier), where their own signal handlers cannot run.
    A preemption at the worst moment."""
    from lightning_pipetransformer.dp.replicas import Elastic

    send_weights = Elastic.send_weights  # this worker process only: its strategy's Elastic is made at setup

    def signal_then_send(self, *args, **kwargs):
        if trainer.global_rank == 0 and trainer.current_epoch == epoch and not getattr(strategy, "_signalled", False):
            strategy._signalled = True
            time.sleep(2.0)  # let the other ranks reach their collectives first
            (Path(trainer.default_root_dir) / "signalled").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGTERM)
        return send_weights(self, *args, **kwargs)

    Elastic.send_weights = signal_then_send


def final_record(trainer: pl.Trainer, module: pl.LightningModule, record: Callback) -> dict:
    """What a rank ends with: weights, SGD momentum, trainable names, what it saw per epoch, counters."""
    optimizer = trainer.strategy.optimizers[0]
    momentum = {name: optimizer.state[p]["momentum_buffer"] for name, p in module.named_parameters() if p in optimizer.state}
    return {
        "state": module.state_dict(), "momentum": momentum, "epochs": record.epochs,
        "trainable": sorted(name for name, p in module.named_parameters() if p.requires_grad),
        "global_step": trainer.global_step, "val_loss": float(trainer.callback_metrics.get("val_loss", float("nan"))),
    }


if __name__ == "__main__":
    main()
