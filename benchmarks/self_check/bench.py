"""The first-batch self-check's cost, against a training step of the same run.

A BERT-shaped encoder from a config (no download): 6 layers of width 256, batch 16 x 64 tokens,
``pipe_len=2, chunks=2``, CPU. Inside the checked step it times the check itself (the whole
``SelfCheck`` call less the pipeline's own pass in it: the copies of the inputs, the plain run of
the stack without a graph, the comparison) and sets it against the median of the later training
steps (forward, backward, optimizer). Both are measured in the same process, back to back, so a
busy machine slows both alike. Prints one JSON line per repeat and the medians.

    python -m benchmarks.self_check [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import lightning.pytorch as pl
import torch
import transformers as T
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipetransformer import PipeTransformerStrategy
from lightning_pipetransformer.stack import self_check

STEPS, BATCH, SEQ = 6, 16, 64


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = T.BertConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=6, num_attention_heads=4,
                              intermediate_size=1024, max_position_embeddings=SEQ, num_labels=2)
        self.model = T.BertForSequenceClassification(config)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.model(input_ids=x).logits, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StepTimes(Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *_):
        self._start = time.perf_counter()

    def on_train_batch_end(self, *_):
        self.times.append(time.perf_counter() - self._start)


CHECK: dict[str, float] = {}


def _timed_check(call):
    def timed(self, runner, stack_call):
        inner_run = runner.run
        spent = {"runner": 0.0}

        def run(c):
            start = time.perf_counter()
            try:
                return inner_run(c)
            finally:
                spent["runner"] += time.perf_counter() - start

        runner.run = run
        start = time.perf_counter()
        try:
            return call(self, runner, stack_call)
        finally:
            del runner.run
            CHECK["check_s"] = time.perf_counter() - start - spent["runner"]
            CHECK["runner_s"] = spent["runner"]

    return timed


def run() -> list[float]:
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randint(0, 1000, (STEPS * BATCH, SEQ), generator=g), torch.randint(0, 2, (STEPS * BATCH,), generator=g)), batch_size=BATCH)
    times = StepTimes()
    pl.Trainer(accelerator="cpu", devices=1, strategy=PipeTransformerStrategy(pipe_len=2, chunks=2), max_epochs=1,
               callbacks=[times], logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
               num_sanity_val_steps=0).fit(Model(), data)
    return times.times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    self_check.SelfCheck.__call__ = _timed_check(self_check.SelfCheck.__call__)
    rows = []
    for repeat in range(args.repeats):
        times = run()
        row = {"repeat": repeat, **CHECK, "training_step_s": statistics.median(times[1:])}
        row["check_over_step"] = row["check_s"] / row["training_step_s"]
        rows.append(row)
        print(json.dumps(row))
    print(json.dumps({"median_check_over_step": statistics.median(r["check_over_step"] for r in rows), "median_check_s": statistics.median(r["check_s"] for r in rows)}))


if __name__ == "__main__":
    main()
