"""What the package prints fits a terminal: messages wrapped to :data:`WIDTH` columns, long lists of names shortened.

A message logged in one line of 200 or 300 columns wraps mid-word in a newcomer's terminal and
buries the one thing it says among module names. Messages an ordinary run prints go through
:func:`wrap` (each line wrapped, continuation lines indented, words never split, so a path or a
module name stays whole) and name lists through :func:`names` (the first few, then how many more);
the full lists go to this package's logger at DEBUG (``logging.getLogger("lightning_pipetransformer")``).
Pure Python: any floor of the package may use it.
"""

from __future__ import annotations

import logging
import textwrap
from collections.abc import Sequence

__all__ = ["WIDTH", "debug_log", "names", "wrap"]

#: The widest line a message is wrapped to: 100 columns leave room for a logger's or a warning's prefix
#: within the 120 columns of a common terminal.
WIDTH = 100

#: Where the full lists behind a shortened message go (at DEBUG; silent unless someone asks for DEBUG).
debug_log = logging.getLogger("lightning_pipetransformer")


def wrap(message: str, width: int = WIDTH, indent: str = "  ") -> str:
    """``message`` with each of its lines wrapped to ``width`` columns and continuation lines indented.

    Lines the message already breaks stay broken there (a table or a list keeps its shape); a word
    longer than ``width`` (a path) is left whole on a line of its own rather than split.
    """
    out: list[str] = []
    for line in message.split("\n"):
        if len(line) <= width:
            out.append(line)
            continue
        lead = line[: len(line) - len(line.lstrip())]
        out += textwrap.wrap(
            line, width, initial_indent="", subsequent_indent=lead + indent, break_long_words=False, break_on_hyphens=False,
        )  # fmt: skip
    return "\n".join(out)


def names(items: Sequence[str], limit: int = 3, empty: str = "nothing") -> str:
    """``a, b, c`` for up to ``limit`` items, else the first ``limit - 1`` and how many more (``a, b and 4 more``)."""
    items = list(items)
    if not items:
        return empty
    if len(items) <= limit:
        return ", ".join(items)
    shown = max(1, limit - 1)
    return f"{', '.join(items[:shown])} and {len(items) - shown} more"
