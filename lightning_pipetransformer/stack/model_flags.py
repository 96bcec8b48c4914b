"""Model configuration flags a pipelined or cached stack cannot honour, checked before training.

Hugging Face models carry flags that change how their loop runs the blocks. Per-layer outputs
(``output_hidden_states``, ``output_attentions``, ``output_router_logits``) are recorded by hooks
on the blocks and need no flag check: those hooks are observers (:mod:`~.observers`), and passes
they observe run each block once on the whole batch. Refused here, with what to change:

- ``use_weighted_layer_sum`` (Wav2Vec2-style audio heads): reads every layer's output through a
  path that is not the recorded one on every model, so it is refused rather than trusted;
- layer drop (``layerdrop``, ``encoder_layerdrop``, ``decoder_layerdrop`` > 0 while fitting): the
  model's loop skips blocks at random, which a runner of the whole stack cannot reproduce;
- AltUp streams (Gemma3n's ``altup_num_inputs`` > 1): the hidden state is ``[streams, batch, ...]``,
  its first dimension is not the batch that micro-batches and cache rows cut.

``config.use_cache`` (a key-value cache object shared by a pass's micro-batches would be updated
once per micro-batch) is turned off for the fit and restored after.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["check_model_flags", "turn_off_kv_cache"]

_LAYER_DROP = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")
_WAY_OUT = "or use pipe_len=1, chunks=1, cache=False"


def _configs(module: nn.Module) -> list[tuple[str, Any]]:
    """Every ``config`` in the module tree (each object once) with the name of its owner."""
    seen: dict[int, tuple[str, Any]] = {}
    for name, sub in module.named_modules():
        config = getattr(sub, "config", None)
        if config is not None and not isinstance(config, (int, float, str, bool)) and id(config) not in seen:
            seen[id(config)] = (name or type(module).__name__, config)
        for text in ("text_config", "audio_config", "vision_config"):
            inner = getattr(config, text, None)
            if inner is not None and id(inner) not in seen:
                seen[id(inner)] = (f"{name or type(module).__name__}.config", inner)
    return list(seen.values())


def check_model_flags(module: nn.Module, fitting: bool) -> None:
    """Refuse, before training, what a pipelined or cached stack cannot run as the model's own loop does."""
    for owner, config in _configs(module):
        if getattr(config, "use_weighted_layer_sum", False) is True:
            raise ValueError(
                f"{owner}.config.use_weighted_layer_sum=True: the head sums every layer's output with learnt weights, "
                "which strategy='pipetransformer' does not support with a pipeline or the activation cache. Set "
                f"use_weighted_layer_sum=False (the head then reads the last layer), {_WAY_OUT}."
            )
        if fitting:
            for flag in _LAYER_DROP:
                value = getattr(config, flag, None)
                if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                    raise ValueError(
                        f"{owner}.config.{flag}={value}: layer drop makes the model's loop skip blocks at random while "
                        "training, which a pipeline or the activation cache (they run the whole stack) cannot reproduce. "
                        f"Set config.{flag}=0 before fit, {_WAY_OUT}."
                    )
        streams = getattr(config, "altup_num_inputs", None)
        if isinstance(streams, int) and streams > 1:
            raise ValueError(
                f"{owner}.config.altup_num_inputs={streams}: the model's hidden state is [{streams} AltUp streams, batch, ...], "
                "so its first dimension is not the batch that micro-batches and cache rows are cut along. "
                f"Use pipe_len=1, chunks=1, cache=False for this model."
            )


def turn_off_kv_cache(module: nn.Module) -> list[Any]:
    """Set ``use_cache=False`` on every config that has it on; returns those configs (to restore them)."""
    configs = {id(c): c for m in module.modules() if getattr(c := getattr(m, "config", None), "use_cache", None) is True}
    for config in configs.values():
        config.use_cache = False
    return list(configs.values())
