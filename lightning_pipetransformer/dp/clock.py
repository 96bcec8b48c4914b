"""A clock for a transition's phases (seconds each, in order: the strategy's ``last_transition``)."""

from __future__ import annotations

import time

__all__ = ["PhaseClock"]


class PhaseClock:
    """Seconds spent in each named phase, in order (a transition's breakdown)."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = self.laps.get(name, 0.0) + now - self._last
        self._last = now
