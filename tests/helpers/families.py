"""Tiny models of every Transformer family the strategy must handle, built from configs (no downloads).

Each family is a builder returning a ``transformers`` model with 4 blocks, dropout 0 and its
default ``use_cache`` (the strategy must turn the key-value cache off for fit itself), plus how to
feed it: ``"lm"`` (a causal LM trained on its own tokens), ``"cls"`` (sequence classification),
``"image"`` or ``"audio"`` (classification of float inputs, :attr:`Family.inputs`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
import transformers as T
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB, SEQ, BATCH, LABELS = 40, 10, 6, 3
STEPS = 3  # batches per epoch of family_data's default size
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
              max_position_embeddings=64)
DROPOUTS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "attention_dropout", "hidden_dropout", "resid_pdrop",
            "embd_pdrop", "attn_pdrop", "dropout", "embedding_dropout", "mlp_dropout", "seq_classif_dropout",
            "classifier_dropout", "drop_path_rate", "pooler_dropout", "activation_dropout", "final_dropout",
            "feat_proj_dropout")


@dataclass(frozen=True)
class Family:
    name: str
    build: Callable[..., nn.Module]  # build(untie=False): untie=True unties tied input/output embeddings
    task: str  # "lm", "cls", "image" or "audio"
    #: Why ``cache=True`` is refused for this family (words the error contains, and the reason for the docs).
    cache_refused: tuple[str, str] | None = None
    #: Why ``cache=True`` stands aside (exact, warned, nothing served): words of the warning.
    cache_stands_aside: str | None = None
    #: Why every training forward is observed (the model asks transformers to record per-layer outputs each
    #: time): the pipeline runs each pass as one micro-batch and the cache stands aside, exact and warned.
    observed: str | None = None
    #: Float inputs (image, audio): the keyword the model takes them by and one sample's shape.
    inputs: tuple[str, tuple[int, ...]] | None = None


def _model(model_cls: type, config_cls: type, **kwargs: object) -> Callable[..., nn.Module]:
    def build(untie: bool = False) -> nn.Module:
        config = config_cls(**kwargs)
        for name in DROPOUTS:
            if isinstance(getattr(config, name, None), float):
                setattr(config, name, 0.0)
        if untie:
            config.tie_word_embeddings = False
        return model_cls(config)

    return build


IMAGE = ("pixel_values", (1, 16, 16))


FAMILIES = {
    f.name: f
    for f in [
        Family("bert", _model(T.BertForSequenceClassification, T.BertConfig, **COMMON, num_labels=LABELS), "cls"),
        Family("roberta", _model(T.RobertaForSequenceClassification, T.RobertaConfig, **COMMON, num_labels=LABELS, pad_token_id=1), "cls"),
        Family("distilbert", _model(T.DistilBertForSequenceClassification, T.DistilBertConfig, vocab_size=VOCAB, dim=32, n_layers=4,
                                    n_heads=2, hidden_dim=64, max_position_embeddings=64, num_labels=LABELS), "cls"),
        Family("vit", _model(T.ViTForImageClassification, T.ViTConfig, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                             intermediate_size=64, image_size=16, patch_size=4, num_channels=1, num_labels=LABELS), "image", inputs=IMAGE),
        Family("deit", _model(T.DeiTForImageClassification, T.DeiTConfig, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                              intermediate_size=64, image_size=16, patch_size=4, num_channels=1, num_labels=LABELS), "image", inputs=IMAGE),
        Family("llama", _model(T.LlamaForCausalLM, T.LlamaConfig, **COMMON, num_key_value_heads=1), "lm"),
        Family("qwen2", _model(T.Qwen2ForCausalLM, T.Qwen2Config, **COMMON, num_key_value_heads=1, use_sliding_window=True,
                               sliding_window=4, max_window_layers=2), "lm"),
        Family("gemma2", _model(T.Gemma2ForCausalLM, T.Gemma2Config, **COMMON, num_key_value_heads=1, head_dim=16,
                                sliding_window=4), "lm"),
        Family("mistral", _model(T.MistralForCausalLM, T.MistralConfig, **COMMON, num_key_value_heads=1, sliding_window=4), "lm"),
        Family("phi3", _model(T.Phi3ForCausalLM, T.Phi3Config, **COMMON, num_key_value_heads=1, pad_token_id=0), "lm"),
        Family("gemma3", _model(T.Gemma3ForCausalLM, T.Gemma3TextConfig, **COMMON, num_key_value_heads=1, head_dim=16,
                                sliding_window=4), "lm"),
        Family("opt", _model(T.OPTForCausalLM, T.OPTConfig, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4,
                             num_attention_heads=2, ffn_dim=64, max_position_embeddings=64, word_embed_proj_dim=32), "lm"),
        Family("gpt2", _model(T.GPT2LMHeadModel, T.GPT2Config, vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=2, n_positions=64,
                              bos_token_id=0, eos_token_id=0), "lm"),
        Family("modernbert", _model(T.ModernBertForSequenceClassification, T.ModernBertConfig, **COMMON, num_labels=LABELS,
                                    global_attn_every_n_layers=2, local_attention=4, pad_token_id=0, bos_token_id=1,
                                    eos_token_id=2, cls_token_id=1, sep_token_id=2), "cls"),
        Family("bloom", _model(T.BloomForCausalLM, T.BloomConfig, vocab_size=VOCAB, hidden_size=32, n_layer=4, n_head=2), "lm"),
        Family("swin", _model(T.SwinForImageClassification, T.SwinConfig, image_size=16, patch_size=1, num_channels=1, embed_dim=8,
                              depths=[1, 1, 1, 1], num_heads=[1, 1, 2, 2], window_size=2, num_labels=LABELS), "image", inputs=IMAGE),
        # Its shared relative-position embeddings are read (not called) before the layers and handed to every
        # block: found from the first block's arguments, they freeze with the embeddings. The weight itself is a
        # block argument shared by all samples, which a cache entry cannot hold: the cache stands aside, warned.
        Family("deberta-v2", _model(T.DebertaV2ForSequenceClassification, T.DebertaV2Config, **COMMON, num_labels=LABELS,
                                    relative_attention=True, position_buckets=8, max_relative_positions=16), "cls",
               cache_stands_aside=r"block \d's argument rel_embeddings is a tensor of shape"),
        # transformers 5 registers the classifier before the backbone: it runs after the stack, and keeps training.
        Family("xlm-roberta", _model(T.XLMRobertaForSequenceClassification, T.XLMRobertaConfig, **COMMON, num_labels=LABELS,
                                     pad_token_id=1), "cls"),
        # The relative attention bias is computed once before the layers (registered after them) and passed to each.
        Family("mpnet", _model(T.MPNetForSequenceClassification, T.MPNetConfig, **COMMON, num_labels=LABELS), "cls"),
        Family("mixtral", _model(T.MixtralForCausalLM, T.MixtralConfig, **COMMON, num_key_value_heads=1, num_local_experts=2,
                                 num_experts_per_tok=1, output_router_logits=False), "lm"),
        Family("whisper-encoder", _model(T.WhisperForAudioClassification, T.WhisperConfig, vocab_size=VOCAB, d_model=32,
                                         encoder_layers=4, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=4,
                                         max_source_positions=8, num_labels=LABELS), "audio", inputs=("input_features", (4, 16))),
        Family("wav2vec2", _model(T.Wav2Vec2ForSequenceClassification, T.Wav2Vec2Config, **COMMON, num_labels=LABELS, layerdrop=0.0,
                                  mask_time_prob=0.0, conv_dim=(8, 8), conv_kernel=(10, 3), conv_stride=(5, 2),
                                  num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2, feat_extract_norm="layer",
                                  classifier_proj_size=16), "audio", inputs=("input_values", (400,)),
               observed="Wav2Vec2ForSequenceClassification asks for the hidden states on every forward (transformers' "
                        "`filter_output_hidden_states`, then drops them), so its output recorders observe every block run"),
    ]
}


class FamilyModule(pl.LightningModule):
    """A LightningModule around one family's model; SGD with momentum (frozen vs active differences show)."""

    def __init__(self, family: str, seed: int = 0, untie: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.family = FAMILIES[family]
        self.model = self.family.build(untie=untie)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.family.inputs is not None:
            return self.model(**{self.family.inputs[0]: x}).logits
        return self.model(input_ids=x, attention_mask=mask).logits

    def loss(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, mask, y = batch
        logits = self(x, mask)
        if self.family.task == "lm":  # next-token prediction on the sequence itself
            return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        return nn.functional.cross_entropy(logits, y)

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def family_data(family: str, n: int = STEPS * BATCH, seed: int = 0) -> DataLoader:
    """``(inputs, attention_mask, labels)`` batches; text padded at the end of every other sample."""
    g = torch.Generator().manual_seed(seed)
    inputs = FAMILIES[family].inputs
    if inputs is not None:
        x = torch.randn(n, *inputs[1], generator=g)
        mask = torch.ones(n, 1)
    else:
        x = torch.randint(3, VOCAB, (n, SEQ), generator=g)
        mask = torch.ones(n, SEQ, dtype=torch.long)
        mask[::2, -3:] = 0
    y = torch.randint(0, LABELS, (n,), generator=g)
    return DataLoader(TensorDataset(x, mask, y), batch_size=BATCH, shuffle=False)
