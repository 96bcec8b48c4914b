"""The pretrained encoders the benchmark fine-tunes, and what differs between them for the rows.

Each model is an asset of ``examples/assets.py``; the example's ``SentimentClassifier`` loads it with the
sequence-classification class of its ``model_type`` (a new, seeded head). What the rows need to know per
model: the backbone's attribute (``BaseFinetuning`` freezes its embeddings and lower blocks), the modules
that run before the blocks (``AutoFreeze(pre=...)``), LoRA's target projections, and the block count.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MODELS", "ModelSpec"]


@dataclass(frozen=True)
class ModelSpec:
    """One pretrained encoder.

    Attributes:
        asset: the name in ``examples/assets.py``.
        title: how the report and the plots name it.
        backbone: the attribute of the ``*ForSequenceClassification`` model that holds embeddings and encoder.
        blocks: Transformer blocks in the encoder.
        pre: ``AutoFreeze(pre=...)``: attribute paths (from the LightningModule) of everything that runs
            before the blocks, frozen with the embeddings; ``None``: the package's discovery finds them.
        lora_targets: the attention projections LoRA adapts (query and value).
        head_class: the ``transformers`` class the example loads it with (a new classification head).
    """

    asset: str
    title: str
    backbone: str
    blocks: int
    pre: tuple[str, ...] | None
    lora_targets: tuple[str, ...]
    head_class: str = "BertForSequenceClassification"


MODELS: dict[str, ModelSpec] = {
    "minilm-l6": ModelSpec(
        asset="minilm-l6", title="MiniLM-L6", backbone="bert", blocks=6, pre=None, lora_targets=("query", "value")
    ),
    "mpnet-base": ModelSpec(
        asset="mpnet-base",
        title="MPNet-base (12 layers)",
        backbone="mpnet",
        blocks=12,
        # MPNet's encoder computes one relative-position bias (from `encoder.relative_attention_bias`, a
        # trainable embedding registered AFTER the block list) before the blocks and passes it to every
        # block. Left after the stack it would stay trainable, its gradient would flow through every frozen
        # block, and the frozen blocks' outputs (which depend on it) would change as it trains, so cached
        # ones would go stale. AutoFreeze finds it from the call order; it is named here too, with the
        # embeddings, so that the benchmark's split does not depend on that observation.
        pre=("model.mpnet.embeddings", "model.mpnet.encoder.relative_attention_bias"),
        lora_targets=("q", "v"),
        head_class="MPNetForSequenceClassification",
    ),
}
