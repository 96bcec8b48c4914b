"""Third-party notices the demo hides because it cannot fix them, and the switch that shows them again.

A newcomer reads every line between ``bash scripts/demo.sh`` and the timeline's table; these say
nothing about the run, and come from code this project does not own:

* Lightning's tip to install ``litlogger`` (logged by every Trainer that has a logger);
* torch's ``FutureWarning`` that ``LeafSpec`` is deprecated, raised from Lightning's own pytree
  helper (``lightning/pytorch/utilities/_pytree.py``) on the first batch;
* transformers' load report listing the classification head as missing from the checkpoint: it is
  new, and fine-tuning trains it. Anything else missing or unexpected is still said
  (:func:`load_pretrained`).

setuptools' editable-install banner is hidden by ``scripts/setup.sh`` under the same switch.
``PIPETRANSFORMER_HIDE_NOISE=1`` (what ``scripts/demo.sh`` sets unless it is set already) hides
them; ``PIPETRANSFORMER_HIDE_NOISE=0 bash scripts/demo.sh`` shows them.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from typing import Any

__all__ = ["ENV", "NEW_HEAD", "hide_known_noise", "hiding", "load_pretrained"]

#: The switch: "1" hides the notices below, anything else (or unset) shows them.
ENV = "PIPETRANSFORMER_HIDE_NOISE"
#: The weights a sequence classifier adds to a pretrained encoder: missing from the checkpoint by design.
NEW_HEAD = re.compile(r"^(classifier|score|pre_classifier)\.")
_LEAFSPEC = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
_LOAD_REPORT_LOGGER = "transformers.modeling_utils"


def hiding() -> bool:
    """Whether the known notices are to be hidden (``PIPETRANSFORMER_HIDE_NOISE=1``)."""
    return os.environ.get(ENV, "0").strip() == "1"


class _DropLitLoggerTip(logging.Filter):
    """Drops Lightning's litlogger tip; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in record.getMessage()


def hide_known_noise() -> None:
    """Hide Lightning's litlogger tip and the LeafSpec ``FutureWarning`` in this process (idempotent)."""
    tip = logging.getLogger("lightning.pytorch.utilities.rank_zero")  # where rank_zero_info's records are created
    if not any(isinstance(f, _DropLitLoggerTip) for f in tip.filters):
        tip.addFilter(_DropLitLoggerTip())
    warnings.filterwarnings("ignore", message=_LEAFSPEC, category=FutureWarning)


def load_pretrained(model_cls: Any, path: str, **kwargs: Any) -> Any:
    """``model_cls.from_pretrained(path, **kwargs)``; while hiding, without transformers' load report for a new
    classification head: the report is silenced for the load and anything else it would list (another missing
    weight, an unexpected or mismatched one) is warned here instead."""
    if not hiding():
        return model_cls.from_pretrained(path, **kwargs)
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = model_cls.from_pretrained(path, output_loading_info=True, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    unexpected = [k for k in info.get("missing_keys", ()) if not NEW_HEAD.match(k)]
    unexpected += list(info.get("unexpected_keys", ())) + [str(k) for k in info.get("mismatched_keys", ())]
    if unexpected:
        listed = ", ".join(unexpected[:8])
        warnings.warn(f"{path}: weights missing, unexpected or mismatched in the checkpoint: {listed}", stacklevel=2)
    return model
