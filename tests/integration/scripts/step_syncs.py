"""The collectives and host reads of steady-state training steps on 2 CPU processes (gloo); run by
tests/integration/distributed/test_step_syncs.py.

Two replicas (pipe length 1, DDP) of a tiny BERT train one epoch of 4 batches. From the end of
batch 1 to the end of the last, every ``torch.distributed`` call made through Python (DDP's own
all-reduces run in its C++ reducer and are not seen) and every ``Tensor.item()`` is recorded with
the file that made it; each rank writes them to ``--out/syncs<rank>.json``.
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for tests.helpers

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_pipetransformer import PipeTransformerStrategy
from tests.helpers.launch import fit_recording_errors
from tests.helpers.models import TextClassifier, loader, text_dataset

COLLECTIVES = ("all_reduce", "broadcast", "barrier", "all_gather", "all_gather_object", "broadcast_object_list", "reduce")


class Recorder(pl.Callback):
    """Records, from ``on_train_batch_end`` of batch 1 to that of the last batch, what ``calls`` names."""

    def __init__(self) -> None:
        self.on = False
        self.seen: list[list] = []
        self.steps = 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.on:
            self.steps += 1
        self.on = 1 <= batch_idx < trainer.num_training_batches - 1

    def record(self, what: str, group) -> None:
        if not self.on:
            return
        caller = sys._getframe(2).f_code.co_filename
        where = caller.split("site-packages/")[-1] if "site-packages/" in caller else caller.split("lightning_pipetransformer/")[-1]
        self.seen.append([what, where, group is None or group is dist.group.WORLD])


def instrument(recorder: Recorder) -> None:
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def wrapper(*args, _name=name, _original=original, **kwargs):
            recorder.record(_name, kwargs.get("group"))
            return _original(*args, **kwargs)

        setattr(dist, name, wrapper)
    item = torch.Tensor.item

    def counted_item(self):
        recorder.record("item", None)
        return item(self)

    torch.Tensor.item = counted_item


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    (out / f"pid{rank}").write_text(str(os.getpid()))
    torch.set_num_threads(1)
    recorder = Recorder()
    instrument(recorder)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=PipeTransformerStrategy(process_group_backend="gloo", timeout=120), max_epochs=1,
        callbacks=[recorder], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )
    fit_recording_errors(trainer, TextClassifier(num_layers=4), loader(text_dataset(64)), None, out / f"error{rank}")
    (out / f"syncs{rank}.json").write_text(json.dumps({"steps": recorder.steps, "seen": recorder.seen}))


if __name__ == "__main__":
    main()
