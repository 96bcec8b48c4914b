"""``AutoFreeze(rule="plasticity")`` (issue 41) through Lightning: it waits for the warm-up to end, freezes the
leading blocks that moved least once two points agree, keeps the most-moved block training, and decides the same
under the pipeline strategy with the cache."""

from __future__ import annotations

import pytest
import torch

from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy
from tests.helpers.models import TextClassifier, loader, text_dataset
from tests.helpers.trainers import cpu_trainer

STEPS = 16  # 2 epochs of 8 batches


class SplitRates(TextClassifier):
    """Blocks 0 and 1 never move (rate 0), block 2 moves at the full rate, block 3 at 0.3 of it: the rule's profile
    is known in advance. The head's group comes first: its rate is the one AutoFreeze reads. ``warmup`` steps of
    linear warm-up, then linear decay to 0 over the run (``warmup=0``: a constant rate)."""

    def __init__(self, warmup: int) -> None:
        super().__init__(num_layers=4, lr=0.05)
        self.warmup = warmup

    def configure_optimizers(self):
        layers = self.model.bert.encoder.layer
        in_blocks = {id(p) for block in layers for p in block.parameters()}
        still = [p for block in layers[:2] for p in block.parameters()] + list(self.model.bert.embeddings.parameters())
        head = [p for p in self.parameters() if id(p) not in in_blocks and all(p is not q for q in still)]
        groups = [
            {"params": head, "lr": self.lr},
            {"params": list(layers[2].parameters()), "lr": self.lr},
            {"params": list(layers[3].parameters()), "lr": 0.3 * self.lr},
            {"params": still, "lr": 0.0},
        ]
        optimizer = torch.optim.SGD(groups, lr=self.lr, momentum=0.9)
        w = self.warmup

        def factor(step: int) -> float:
            if not w:
                return 1.0
            return (step + 1) / (w + 1) if step < w else (STEPS - step) / (STEPS - w)

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def fit(warmup: int, strategy=None) -> AutoFreeze:
    freeze = AutoFreeze(rule="plasticity", freeze_interval=2)
    trainer = cpu_trainer(strategy=strategy or "auto", callbacks=[freeze], max_epochs=2)
    trainer.fit(SplitRates(warmup), loader(text_dataset(32), 4))
    return freeze


@pytest.mark.parametrize("warmup, first_freeze", [
    # Points at steps 2, 4, 6, ...; the rate of step s: (s + 1) / 6 up to step 4, 1 at step 5, then (16 - s) / 11.
    # At a point, the coming step's rate against the last step's: 0.5 > 0.33 (step 2: rising), 0.83 > 0.67 (4:
    # rising), 0.91 < 1 (6: past the peak, read: candidate 2), 0.73 < 0.82 (8: read again, 2 agrees): blocks 0-1
    # freeze at step 8.
    (5, 8),
    # A constant rate: step 2 is read, step 4 agrees.
    (0, 4),
])  # fmt: skip
def test_the_least_moved_blocks_freeze_after_the_warm_up(warmup, first_freeze):
    freeze = fit(warmup)
    # Blocks 0 and 1 did not move: they freeze. Block 2 moved most: it and block 3 above it keep training, though
    # block 3 moved less than 2/3 of block 2.
    assert freeze.step_history == [(first_freeze, 2)]
    assert freeze.num_frozen == 2 and freeze.rule == "plasticity" and freeze.freeze_interval == 2
    rule = freeze.freeze_rule
    assert rule.statistics.reference[:2] == [None, None]  # type: ignore[attr-defined]  # the frozen blocks' copies are gone


def test_the_rule_decides_the_same_under_the_pipeline_with_the_cache():
    cached = fit(5, PipeTransformerStrategy(cache=True, cache_memory=10**8))
    assert cached.step_history == fit(5).step_history == [(8, 2)]
