"""Model configuration flags a pipelined or cached stack cannot honour, checked before training.

Hugging Face models carry ``config.output_hidden_states`` / ``output_attentions`` (every layer's
output, which one pipeline call or a cache hit does not produce: refused, with what to change)
and ``config.use_cache`` (a key-value cache object shared by a pass's micro-batches would be
updated once per micro-batch: turned off for the fit and restored after).
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["check_layer_outputs", "turn_off_kv_cache"]


def check_layer_outputs(module: nn.Module) -> None:
    """Per-layer outputs cannot come out of one pipeline call (or a cache): refuse them up front."""
    for name, sub in module.named_modules():
        config = getattr(sub, "config", None)
        asked = [flag for flag in ("output_hidden_states", "output_attentions") if getattr(config, flag, False)]
        if asked:
            raise ValueError(
                f"{name or type(module).__name__}.config.{asked[0]}=True asks for every layer's output, which a "
                "pipelined or cached block stack does not produce. Set it to False, or use pipe_len=1, chunks=1, "
                "cache=False."
            )


def turn_off_kv_cache(module: nn.Module) -> list[Any]:
    """Set ``use_cache=False`` on every config that has it on; returns those configs (to restore them)."""
    configs = {id(c): c for m in module.modules() if getattr(c := getattr(m, "config", None), "use_cache", None) is True}
    for config in configs.values():
        config.use_cache = False
    return list(configs.values())
