"""Faults across ranks: SIGTERM held while state moves, naming a dead peer, and raising together.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist


class PeerFailedError(RuntimeError):
    """Another rank failed at the point every rank was at: this one stops too, naming that rank's error."""


@contextlib.contextmanager
def signals_held(signums: Sequence[int] = (signal.SIGTERM,)) -> Iterator[None]:
    """Hold ``signums`` while every rank is inside the same collectives (a transition), then deliver them.

    Lightning's SIGTERM handler broadcasts over the world group at once; arriving while the other
    ranks wait in a transition's collectives, it would pair with none of them and every rank would
    hang until the collective timeout. Held, it runs right after the transition, where it works
    as it does in the middle of an epoch: every rank stops at the next step (with a checkpoint if
    an ``OnExceptionCheckpoint`` is among the callbacks). Main thread only (Python's rule for
    signal handlers); elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[tuple[int, Any]] = []
    previous = {signum: signal.getsignal(signum) for signum in signums}
    for signum in signums:
        signal.signal(signum, lambda s, frame: received.append((s, frame)))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum, frame in received:
            handler = previous[signum]
            if callable(handler):
                handler(signum, frame)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), signum)


def peer_processes(group: Any) -> list[tuple[str, int]]:
    """``(host, pid)`` of every rank of ``group``, by rank (collective)."""
    mine = (socket.gethostname(), os.getpid())
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return [tuple(p) for p in everyone]  # type: ignore[misc]


def dead_peers(peers: Sequence[tuple[str, int]]) -> list[int]:
    """The ranks on this host whose process is gone (ranks on other hosts cannot be checked from here)."""
    host = socket.gethostname()
    gone = []
    for rank, (their_host, pid) in enumerate(peers):
        if their_host != host or pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            gone.append(rank)
            continue
        except PermissionError:
            continue  # alive, someone else's
        if _is_zombie(pid):  # exited, not yet reaped by its parent (rank 0's launcher)
            gone.append(rank)
    return gone


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def raise_together(error: BaseException | None, group: Any, where: str) -> None:
    """Every rank of ``group`` calls this at the same point; if any of them failed, all raise now.

    A verdict that only one rank reaches (AutoCache's first-hit check, a repeated dataset index)
    would otherwise leave the others waiting in the next collective (DDP's all-reduce, a barrier)
    until its timeout, half an hour by default. One flag per step goes over ``group`` (gloo, on
    the CPU); only when it is set, the errors' texts follow. The failed rank raises its own error,
    the others a :class:`PeerFailedError` that quotes it.
    """
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if int(flag) == 0:
        return
    reports: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, None if error is None else f"{type(error).__name__}: {error}", group=group)
    if error is not None:
        raise error
    rank, report = next((r, m) for r, m in enumerate(reports) if m is not None)
    raise PeerFailedError(f"Rank {rank} failed in {where}, so every rank stops here: {report}")
