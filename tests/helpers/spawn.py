"""Run a function in a few gloo processes, with a hard deadline (a hung collective fails the test, never hangs it)."""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers.launch import free_port

TIMEOUT = timedelta(seconds=20)  # each collective's: a missing peer ends in an error within it


def spawn_gloo(fn: Callable[[int, int], None], nprocs: int, deadline: float = 180.0) -> None:
    """Run ``fn(rank, world)`` in ``nprocs`` gloo processes; fail (and kill them) past ``deadline`` s."""
    port = free_port()
    context = mp.spawn(_entry, args=(fn, nprocs, port), nprocs=nprocs, join=False)
    end = time.monotonic() + deadline
    while not context.join(timeout=1):
        if time.monotonic() > end:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail(f"{fn.__name__} did not finish within {deadline} s")


def _entry(rank: int, fn: Callable[[int, int], None], world: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        fn(rank, world)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()
