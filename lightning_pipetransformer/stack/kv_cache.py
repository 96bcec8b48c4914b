"""Whether a Hugging Face model really builds a key-value cache when ``config.use_cache`` is on.

The strategy turns ``use_cache`` off for every config while fitting (harmless where it does
nothing) but says so only where it matters, so the notice never shows for a model that has no such
cache: decoders (GPT-2, Llama), encoder-decoders (BART, T5) and BERT-family models configured as
decoders build one; a BERT-family encoder ignores the flag (its forward reads ``use_cache`` only
``if self.config.is_decoder``). That gate is read from the model's own forward, so a new family
needs no list here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from lightning_pipetransformer.stack.model_flags import turn_off_kv_cache

__all__ = ["builds_kv_cache", "off_while_fitting"]


def off_while_fitting(module: nn.Module, announce: Callable[[str], None]) -> list[Any]:
    """``use_cache=False`` while fitting (micro-batches would share one key-value cache); returns the configs to
    restore at teardown. Said only for a model that builds such a cache (a decoder), never for an encoder that ignores
    the flag."""
    configs = turn_off_kv_cache(module)
    if any(builds_kv_cache(module, config) for config in configs):
        announce(
            "PipeTransformer: the model's key-value cache for generation (config.use_cache) is off while fitting,\n"
            "  since micro-batches would share it; it is restored after fit. (Not AutoCache, the strategy's cache=,\n"
            "  which stores the frozen blocks' outputs.)"
        )
    return configs


def builds_kv_cache(module: nn.Module, config: Any) -> bool:
    """Whether ``config.use_cache=True`` gives ``module`` (a model holding ``config``) a key-value cache."""
    if getattr(config, "is_decoder", False) or getattr(config, "is_encoder_decoder", False):
        return True
    owners = [m for m in module.modules() if getattr(m, "config", None) is config]
    return not any(_gated_on_is_decoder(type(m).forward) for m in owners)


def _gated_on_is_decoder(forward: Any) -> bool:
    """Whether a forward reads ``use_cache`` only for decoders (``if self.config.is_decoder:`` before it)."""
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):  # no source (compiled, dynamic): assume the cache exists, and say so
        return False
    gate = source.find("self.config.is_decoder")
    return gate != -1 and "use_cache" in source[gate:]
