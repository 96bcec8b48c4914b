"""A logger that keeps what Lightning sends it, for tests that read the logged metrics."""

from __future__ import annotations

from lightning.pytorch.loggers import Logger


class Recorder(Logger):
    """Every ``log_metrics`` call, as Lightning's tests observe loggers."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.calls.append(dict(metrics))
