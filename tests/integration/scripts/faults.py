"""Faults across ranks on 2 (or 4) CPU processes (gloo); run by tests/integration/distributed/test_faults.py.

A tiny BERT with 4 blocks, ``pipe_len=2`` on 2 processes: epoch 0 is one pipeline replica (rank 1 a
shadow rank), the freeze {1: 2} makes the planner compress K 2 -> 1 at epoch 1's start, where rank 1
joins. ``--devices 4`` runs the same at ``pipe_len=4`` (K 4 -> 2: two replicas, two shadow ranks).

``--stop`` says what goes wrong:

- ``sigterm``: rank 0 sends SIGTERM to every rank's process at once in the middle of epoch 1, as
  SLURM and Kubernetes preempt a job (each rank gets it from outside, not from Lightning's launcher);
- ``sigterm-validation``: the same, in epoch 1's validation (rank 0 at its first batch);
- ``sigterm-transition``: the same, inside epoch 1's transition (rank 0 right before it sends the
  joining replica its weights: the others wait in collectives);
- ``fault``: ``--fault-rank`` raises a ``RuntimeError`` at ``--fault-where`` (its step, its backward, the
  optimizer's step after the backward, inside the transition, validation, a callback, the end of
  training; or ``kill``: a SIGKILL; ``kill-at-end``: a SIGKILL at the end of training, nothing posted).

``--peer-waits store``: at the fault point the other ranks' main threads make a new process group,
whose store rendezvous waits for the failed rank (as an NCCL communicator's set-up does).
``--slow-on-exception S``: the failed rank's callbacks' ``on_exception`` take ``S`` seconds (a large
checkpoint written on exception) before Lightning calls the strategy's.

``--hold`` models NCCL's rule "a collective with a dead peer never returns": the failed rank keeps its
process (and its gloo sockets) open after its fit ended, so a peer waiting in a collective for it is
not told by a closed connection. Every rank writes its pid, its error (``error<rank>``, with the
seconds its fit ran) and, when the fit ends, its final weights (``rank<rank>.pt``) to ``--out``.
"""

import argparse
import errno
import faulthandler
import os
import signal
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for tests.helpers

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, OnExceptionCheckpoint
from torch.utils.data import DataLoader

from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy
from lightning_pipetransformer.dp.replicas import Elastic
from tests.helpers.launch import fit_recording_errors
from tests.helpers.models import TextClassifier, text_dataset

NUM_SAMPLES = 32
FAULT_BATCH = 2
OUT = Path(".")


class InjectedFault(RuntimeError):
    pass


def fault(text: str) -> InjectedFault:
    """The fault to raise, its time noted in ``--out`` for the test's wall-clock bound."""
    (OUT / "faulted").write_text(str(time.time()))
    return InjectedFault(text)


def signal_every_rank(out: Path, world: int) -> None:
    """SIGTERM to every rank's process, as a scheduler does (the launcher does not forward it)."""
    (out / "signalled").write_text(str(time.time()))
    for rank in range(world):
        os.kill(int((out / f"pid{rank}").read_text()), signal.SIGTERM)


class Faults(Callback):
    """Mid-epoch signals, and faults in a callback (on any rank, idle or not)."""

    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.args, self.out = args, out

    def _at_fault_point(self, trainer: pl.Trainer, batch_idx: int) -> bool:
        return trainer.current_epoch == self.args.fault_epoch and batch_idx == FAULT_BATCH

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if not self._at_fault_point(trainer, batch_idx):
            return
        if self.args.stop == "sigterm" and trainer.global_rank == 0:
            signal_every_rank(self.out, trainer.world_size)
        if self.args.stop == "fault" and self.args.fault_where == "callback" and trainer.global_rank == self.args.fault_rank:
            raise fault(f"injected fault in a callback on rank {trainer.global_rank}")
        if self.args.peer_waits == "store" and trainer.global_rank != self.args.fault_rank:
            # Every rank's store rendezvous for it; the failed rank never comes: blocked in the store's get.
            torch.distributed.new_group(backend="gloo")
        if self.args.stop == "fault" and self.args.fault_where == "kill" and trainer.global_rank == self.args.fault_rank:
            fault("SIGKILL")
            os.kill(os.getpid(), signal.SIGKILL)  # no exception, no clean-up: the process is gone

    def on_train_end(self, trainer, pl_module):
        # The end of the fit: the other ranks go on to their teardown (no collective waits for this one).
        if self.args.stop == "fault" and self.args.fault_where == "teardown" and trainer.global_rank == self.args.fault_rank:
            raise fault(f"injected fault at the end of training on rank {trainer.global_rank}")
        if self.args.stop == "fault" and self.args.fault_where == "kill-at-end" and trainer.global_rank == self.args.fault_rank:
            fault("SIGKILL at the end")
            os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer does: nothing posted, no exception

    def on_exception(self, trainer, pl_module, exception):
        if self.args.slow_on_exception and trainer.global_rank == self.args.fault_rank:
            time.sleep(self.args.slow_on_exception)  # a large checkpoint, before the strategy's own hook


class StepStates(Callback):
    """Rank 0's weights after every optimizer step (what a checkpoint at that step must hold)."""

    def __init__(self) -> None:
        self.states: dict[int, dict] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == 0:
            self.states[trainer.global_step] = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


class Module(TextClassifier):
    """The faults that happen inside the model's own work: its step, its backward, its validation."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(num_layers=4)
        self.args = args

    def _fails_here(self, where: str, batch_idx: int) -> bool:
        trainer = self.trainer
        return (
            self.args.stop == "fault" and self.args.fault_where == where and trainer.global_rank == self.args.fault_rank
            and trainer.current_epoch == self.args.fault_epoch and batch_idx == FAULT_BATCH
        )  # fmt: skip

    def training_step(self, batch, batch_idx):
        if self._fails_here("step", batch_idx):
            raise fault(f"injected fault in training_step on rank {self.trainer.global_rank}")
        loss = super().training_step(batch, batch_idx)
        if self._fails_here("backward", batch_idx):
            loss = FailingBackward.apply(loss)
        return loss

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        # After the backward (DDP's all-reduce done on every rank), inside the optimizer's step.
        def closure():
            loss = optimizer_closure()
            if self._fails_here("optimizer", batch_idx):
                raise fault(f"injected fault in the optimizer step on rank {self.trainer.global_rank}")
            return loss

        optimizer.step(closure=closure)

    def validation_step(self, batch, batch_idx):
        trainer = self.trainer
        if self.args.stop == "sigterm-validation" and trainer.global_rank == 0 and trainer.current_epoch == self.args.fault_epoch:
            if batch_idx == 0:
                signal_every_rank(OUT, trainer.world_size)
        if self.args.stop == "fault" and self.args.fault_where == "validation" and self.trainer.global_rank == self.args.fault_rank:
            if self.trainer.current_epoch == self.args.fault_epoch and batch_idx == 0:
                raise fault(f"injected fault in validation_step on rank {self.trainer.global_rank}")
        return super().validation_step(batch, batch_idx)


class FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise fault("injected fault in backward")


def break_the_transition(args: argparse.Namespace, out: Path) -> None:
    """``sigterm-transition`` and ``fault --fault-where transition``: rank 0 (or the fault rank) inside
    epoch 1's transition, right before the weights go to the joining replica."""
    send_weights = Elastic.send_weights

    def send(self, *a, **k):
        if args.stop == "sigterm-transition" and self.global_rank == 0 and not getattr(self, "_signalled", False):
            self._signalled = True
            time.sleep(1.0)  # the other ranks reach their collectives first
            signal_every_rank(out, self.world_size)
        if args.stop == "fault" and args.fault_where == "transition" and self.global_rank == args.fault_rank:
            raise fault(f"injected fault inside the transition on rank {self.global_rank}")
        return send_weights(self, *a, **k)

    Elastic.send_weights = send


class DiskFails(Callback):
    """From the end of epoch 1 (between the two freezes) this rank's cache disk refuses every new
    directory and file, as a filesystem remounted read-only does (chmod would not stop root)."""

    def __init__(self, root: Path) -> None:
        self.root, self.failing, self.refused = str(root), False, 0
        real_mkdir, real_open = Path.mkdir, os.open

        def refuse(path) -> None:
            if self.failing and str(path).startswith(self.root):
                self.refused += 1
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

        def mkdir(path, *a, **k):
            refuse(path)
            return real_mkdir(path, *a, **k)

        def open_(path, flags, *a, **k):
            if flags & os.O_CREAT:
                refuse(path)
            return real_open(path, flags, *a, **k)

        Path.mkdir, os.open = mkdir, open_

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            self.failing = True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--stop", default="none", choices=["none", "sigterm", "sigterm-transition", "sigterm-validation", "fault"])
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--fault-where", default="step", choices=["step", "backward", "optimizer", "transition", "validation", "callback", "teardown", "kill",
                                                           "kill-at-end"])
    parser.add_argument("--peer-waits", default="collective", choices=["collective", "store"])
    parser.add_argument("--slow-on-exception", type=float, default=0.0)
    parser.add_argument("--fault-epoch", type=int, default=1)
    parser.add_argument("--hold", action="store_true", help="the failed rank keeps its process open (NCCL's dead peer)")
    parser.add_argument("--cache", action="store_true", help="AutoCache on, the freezes {1: 1, 2: 2}")
    parser.add_argument("--disk-fail-rank", default=None,
                        help="this rank's cache disk fails after epoch 1 ('all': every rank's; -1: none, with the same freezes)")
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    global OUT
    out = OUT = Path(args.out)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    (out / f"pid{rank}").write_text(str(os.getpid()))
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # a hang's stacks, for whoever debugs one
    break_the_transition(args, out)
    strategy = PipeTransformerStrategy(
        pipe_len=args.devices, frozen_cost=0.0, process_group_backend="gloo", timeout=args.timeout,
        cache=args.cache, cache_dir=str(out / "cache"),
    )
    states = StepStates()
    disk = DiskFails(out / "cache") if args.disk_fail_rank in ("all", str(rank)) else None
    schedule = {1: 1, 2: 2} if args.cache or args.disk_fail_rank is not None else {1: 2}
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy, max_epochs=3,
        callbacks=[AutoFreeze(schedule=schedule), Faults(args, out), states, *([disk] if disk else []),
                   OnExceptionCheckpoint(dirpath=out / "ckpt", filename="on_exception")],
        logger=False, enable_checkpointing=True, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=out,
    )
    train = DataLoader(text_dataset(NUM_SAMPLES), batch_size=4, shuffle=False)
    val = DataLoader(text_dataset(8, seed=1), batch_size=4, shuffle=False)
    caught: list = []
    warnings.showwarning = lambda message, *a, **k: caught.append(str(message))  # noqa: ARG005
    try:
        fit_recording_errors(trainer, Module(args), train, val, out / f"error{rank}", ckpt_path=args.ckpt)
    except BaseException:
        if args.hold and rank == args.fault_rank and not isinstance(sys.exc_info()[1], SystemExit):
            time.sleep(600)  # the process (and its sockets) stays: a peer is told nothing
        raise
    final = {
        "state": trainer.lightning_module.state_dict(), "global_step": trainer.global_step, "states": states.states,
        "cache_stats": strategy.cache_stats, "warnings": caught, "refused": disk.refused if disk else 0,
    }
    torch.save(final, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
