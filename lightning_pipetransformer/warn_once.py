"""Say a thing once: the one "warn once" state of the package.

A performance feature that stands aside must say so (never silent), but a per-batch reason said on
every batch drowns the log. Each owner (a store, a pipeline, an interception) holds one
:class:`WarnOnce` and names its reasons; the same reason is said once per owner, another reason is
said on its own.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable


def _warn(message: str, stacklevel: int) -> None:
    warnings.warn(message, stacklevel=stacklevel + 1)


class WarnOnce:
    """Emit each reason's message the first time it is given, never again.

    ``emit`` receives ``(message, stacklevel)``; by default :func:`warnings.warn` points at the
    caller of :meth:`__call__`'s caller (the user-facing call that hit the reason).
    """

    def __init__(self, emit: Callable[[str, int], None] = _warn) -> None:
        self._emit = emit
        self._said: set[Hashable] = set()

    def __call__(self, reason: Hashable, message: str, stacklevel: int = 2) -> bool:
        """Say ``message`` unless ``reason`` was said already; True when it was said now."""
        if reason in self._said:
            return False
        self._said.add(reason)
        self._emit(message, stacklevel + 1)
        return True
