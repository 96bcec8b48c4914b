"""``cache="auto"``: keep the cache at a boundary only while a lookup costs less device time than the frozen prefix.

Both sides are measured as device time (:class:`~lightning_pipetransformer.devices.timing.DeviceSpan`:
CUDA events on the current stream, the host clock off CUDA), because on a GPU the host clock sees
only launches: the prefix's kernels and the lookup's ``non_blocking`` copy to the device run after
the host has moved on. The prefix is timed on the misses it runs, the lookup on a batch whose every
row hit; the events are read once, when the decision is taken (the one wait), by the first such
batch after the prefix was timed.

Nothing is timed with ``cache=True`` or ``False``, nor at a boundary once decided: a boundary that
opens is measured again (its prefix is longer). The last prefix timed is kept over a boundary move,
as the host-clock measure was, so a boundary whose misses are all advanced from an earlier
boundary's entries still decides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_pipetransformer.devices.timing import DeviceSpan

__all__ = ["AutoDecision", "Verdict"]


@dataclass(frozen=True)
class Verdict:
    """What ``cache="auto"`` decided at a boundary, with the device seconds per sample it compared."""

    keep: bool
    lookup: float
    prefix: float

    def describe(self) -> str:
        return f"a lookup takes {self.lookup * 1e3:.3f} ms per sample, the frozen prefix {self.prefix * 1e3:.3f} ms (device time)"


class AutoDecision:
    """Whether the cache pays at the current boundary, measured while ``cache="auto"`` has still to decide.

    ``measuring`` is the only question the step path asks: no span is made when it is false.
    """

    def __init__(self, auto: bool) -> None:
        self.auto = auto
        self.decided = not auto
        #: The prefix's last timed run while measuring: its span and how many rows it ran.
        self._prefix: tuple[DeviceSpan, int] | None = None

    @property
    def measuring(self) -> bool:
        return self.auto and not self.decided

    def reopen(self) -> None:
        """A new boundary opens: measured again there."""
        self.decided = not self.auto

    def span(self, device: torch.device) -> DeviceSpan | None:
        """A span to time a region on ``device`` with, while measuring; ``None`` (nothing timed) otherwise."""
        return DeviceSpan(device) if self.measuring else None

    def prefix_ran(self, timed: tuple[DeviceSpan, int] | None) -> None:
        """The frozen prefix ran ``rows`` rows in ``span`` (unread: read only when the decision is taken)."""
        if timed is not None and self.measuring:
            self._prefix = timed

    def decide(self, lookup: DeviceSpan | None, batch: int) -> Verdict | None:
        """The verdict from ``lookup`` (a batch of ``batch`` rows that all hit) and the prefix's last timed run;
        ``None`` while one of them is missing. Reads both spans (waits for the lookup's end), once per boundary."""
        if lookup is None or self._prefix is None or not self.measuring:
            return None
        span, rows = self._prefix
        prefix = span.seconds() / max(1, rows)
        per_sample = lookup.seconds() / max(1, batch)
        self.decided = True
        return Verdict(keep=per_sample < prefix, lookup=per_sample, prefix=prefix)
