"""Fine-tune a pretrained BERT (MiniLM-L6) on Rotten Tomatoes sentiment with AutoFreeze.

A LightningCLI program::

    python examples/assets.py fetch                                        # once: weights + data
    python examples/text_classification.py fit --config examples/configs/text_minilm.yaml
    python examples/text_classification.py fit --config examples/configs/text_minilm.yaml \\
        --data.train_size 1500 --data.val_size 1000 --trainer.max_epochs 3
    python examples/text_classification.py fit --config examples/configs/text_minilm_pipetransformer.yaml   # the demo

The YAML picks the strategy (``trainer.strategy``), the AutoFreeze callback and the timeline
(``lightning_pipetransformer.PipeTransformerTimeline``);
the LightningModule below is plain Lightning and knows nothing about freezing, pipelines or
caching. The data (``rotten_tomatoes.py``) is read and tokenized by Hugging Face ``datasets``.
``model.pretrained`` (a local folder with a BERT checkpoint and its tokenizer; default: the
MiniLM-L6 asset) also sets ``data.tokenizer``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

# No model hub is reachable: transformers and datasets must never try one (read when they are imported).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
if not __package__:  # a script, or imported by its plain name: the siblings by theirs (see examples/__init__.py)
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # assets, rotten_tomatoes

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.cli import LightningCLI  # noqa: E402
from torch.optim.lr_scheduler import LambdaLR  # noqa: E402
from torchmetrics.classification import MulticlassAccuracy  # noqa: E402

import lightning_pipetransformer  # noqa: E402,F401  (importing registers strategy="pipetransformer")

if __package__:  # imported as examples.text_classification (the benchmarks)
    from .quiet import hide_known_noise, hiding, load_pretrained
    from .rotten_tomatoes import Batch, RottenTomatoesDataModule
else:
    from quiet import hide_known_noise, hiding, load_pretrained  # noqa: E402
    from rotten_tomatoes import Batch, RottenTomatoesDataModule  # noqa: E402

__all__ = ["SEQUENCE_CLASSIFIERS", "SentimentClassifier", "TextCLI", "layerwise_lr_groups", "main", "sequence_classifier_class"]

NO_DECAY = ("bias", "LayerNorm.weight", "LayerNorm.bias")


class SentimentClassifier(pl.LightningModule):
    """A pretrained encoder with a new classification head (``BertForSequenceClassification``, or the
    class of the checkpoint's ``model_type``: see :data:`SEQUENCE_CLASSIFIERS`), with accuracy and AdamW.

    Args:
        pretrained: a local folder with a BERT-family checkpoint (``config.json`` +
            ``model.safetensors``). ``None``: the MiniLM-L6 asset (fetched on first use).
        num_labels: classes.
        lr: peak learning rate of AdamW.
        weight_decay: AdamW weight decay (not on biases and LayerNorm).
        warmup_ratio: share of the optimizer steps with a linear warm-up; then linear decay to 0.
        fused: use fused AdamW (``None``: where this torch build supports it).
        llrd: layer-wise learning-rate decay (e.g. 0.8): the classifier, the pooler and the top block
            train at ``lr``, each block below at ``llrd`` times the one above, the embeddings at
            ``lr * llrd ** L`` (Zhang et al., 2021, "Revisiting few-sample BERT fine-tuning"). ``None``:
            one learning rate. See :func:`layerwise_lr_groups`.
    """

    def __init__(
        self,
        pretrained: str | None = None,
        num_labels: int = 2,
        lr: float = 5e-5,
        weight_decay: float = 0.01,
        warmup_ratio: float = 0.1,
        fused: bool | None = None,
        llrd: float | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        path = pretrained or _asset_path("minilm-l6")
        # The head is new, so transformers reports it missing from the checkpoint: quiet.py hides that report
        # where the demo asks it to (and still says anything else missing).
        self.model = load_pretrained(sequence_classifier_class(path), path, num_labels=num_labels, local_files_only=True)
        self.train_acc = MulticlassAccuracy(num_classes=num_labels, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=num_labels, average="micro")

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def on_fit_start(self) -> None:
        # transformers 5 returns models from from_pretrained in eval mode (dropout off), and
        # Lightning keeps modules' modes as it finds them: switch training on explicitly.
        # (AutoFreeze puts the frozen blocks back in eval mode at each epoch start.)
        self.model.train()

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        logits = self(batch["input_ids"], batch["attention_mask"])
        loss = torch.nn.functional.cross_entropy(logits, batch["labels"])
        n = batch["labels"].shape[0]
        self.train_acc(logits.detach(), batch["labels"])
        self.log("train/loss", loss, prog_bar=True, batch_size=n)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True, batch_size=n)
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        logits = self(batch["input_ids"], batch["attention_mask"])
        n = batch["labels"].shape[0]
        self.val_acc(logits, batch["labels"])
        self.log("val/loss", torch.nn.functional.cross_entropy(logits, batch["labels"]), batch_size=n, sync_dist=True)
        self.log("val/acc", self.val_acc, prog_bar=True, batch_size=n)

    def param_groups(self) -> list[dict[str, Any]]:
        """AdamW's parameter groups over the trainable parameters: no weight decay on biases and
        LayerNorm; with ``llrd``, one group per depth and decay setting, each with its own ``lr``
        (LambdaLR scales every group's own lr by the same factor, so the ratios hold all run)."""
        hp = self.hparams
        named = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        if hp.get("llrd") is not None:
            return layerwise_lr_groups(self.model, named, hp.lr, hp.llrd, hp.weight_decay)
        return [
            {"params": [p for n, p in named if not n.endswith(NO_DECAY)], "weight_decay": hp.weight_decay},
            {"params": [p for n, p in named if n.endswith(NO_DECAY)], "weight_decay": 0.0},
        ]

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        optimizer = _adamw(self.param_groups(), hp.lr, hp.fused)
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        warmup = int(hp.warmup_ratio * total)

        def linear(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            return max(0.0, (total - step) / max(total - warmup, 1))

        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": LambdaLR(optimizer, linear), "interval": "step"}}


def layerwise_lr_groups(
    model: torch.nn.Module, named: list[tuple[str, torch.nn.Parameter]], lr: float, decay: float, weight_decay: float
) -> list[dict[str, Any]]:
    """Layer-wise learning-rate decay, as parameter groups for any model whose block stack the package finds.

    The recipe (docs/autofreeze.md): with ``L`` blocks, block ``i`` (0 = the lowest) trains at
    ``lr * decay ** (L - 1 - i)``, what runs before the stack (the embeddings) at ``lr * decay ** L``
    and what runs after it (pooler, classifier) at ``lr``. It needs no package code beyond
    :func:`lightning_pipetransformer.find_block_stack`: the groups are built once, every parameter
    stays in the optimizer, and AutoFreeze freezes blocks inside their groups as usual (frozen
    parameters get no gradient, so the optimizer skips them). Groups are keyed by (depth, decay or
    not); only parameters in ``named`` (the trainable ones) are placed.
    """
    from lightning_pipetransformer import find_block_stack

    if not 0.0 < decay <= 1.0:
        raise ValueError(f"llrd must be in (0, 1] (1 is no decay), got {decay!r}.")
    stack = find_block_stack(model)
    depth_of: dict[int, int] = {}  # how many blocks above: 0 for the top block and everything after the stack
    num_blocks = len(stack.blocks)
    for i, block in enumerate(stack.blocks):
        depth_of.update({id(p): num_blocks - 1 - i for p in block.parameters()})
    for _, module in stack.pre:
        depth_of.update({id(p): num_blocks for p in module.parameters()})
    depth_of.update({id(p): num_blocks for _, p in stack.pre_params})
    groups: dict[tuple[int, bool], dict[str, Any]] = {}
    for name, p in named:
        depth, decays = depth_of.get(id(p), 0), not name.endswith(NO_DECAY)
        group = groups.setdefault((depth, decays), {
            "params": [], "weight_decay": weight_decay if decays else 0.0, "lr": lr * decay**depth, "depth": depth,
        })  # fmt: skip
        group["params"].append(p)
    return [groups[k] for k in sorted(groups, key=lambda k: (-k[0], not k[1]))]


def _adamw(groups: list[dict[str, Any]], lr: float, fused: bool | None) -> torch.optim.Optimizer:
    """AdamW, fused where supported: on a 2-core CPU 13 ms per step against 83 ms (foreach)."""
    if fused is False:
        return torch.optim.AdamW(groups, lr=lr)
    try:
        return torch.optim.AdamW(groups, lr=lr, fused=True)
    except (RuntimeError, ValueError):
        if fused:
            raise
        return torch.optim.AdamW(groups, lr=lr)


#: The classes this module loads, by the checkpoint's ``config.json`` ``model_type``: listed, so that a
#: checkpoint of another family fails with a clear message instead of loading into the wrong class.
SEQUENCE_CLASSIFIERS = {"bert": "BertForSequenceClassification", "mpnet": "MPNetForSequenceClassification"}


def sequence_classifier_class(path: str | Path) -> Any:
    """The ``transformers`` class that adds a classification head to the checkpoint in ``path``."""
    import json

    import transformers

    config = Path(path) / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    if model_type not in SEQUENCE_CLASSIFIERS:
        raise ValueError(
            f"{config}: model_type {model_type!r} is not one this example loads ({', '.join(SEQUENCE_CLASSIFIERS)}); "
            "add its *ForSequenceClassification class to SEQUENCE_CLASSIFIERS in examples/text_classification.py."
        )
    return getattr(transformers, SEQUENCE_CLASSIFIERS[model_type])


def _asset_path(name: str) -> str:
    if __package__:
        from .assets import fetch
    else:
        from assets import fetch

    return str(fetch(name))


class TextCLI(LightningCLI):
    """LightningCLI with the tokenizer following the model's checkpoint folder."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.link_arguments("model.pretrained", "data.tokenizer")


def main(args: list[str] | None = None) -> None:
    """Run the command line (``fit``, ``validate``, ... ``--config examples/configs/text_minilm.yaml``).

    With ``PIPETRANSFORMER_HIDE_NOISE=1`` (scripts/demo.sh sets it) known third-party notices are hidden
    (examples/quiet.py)."""
    if hiding():
        hide_known_noise()
    TextCLI(SentimentClassifier, RottenTomatoesDataModule, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
