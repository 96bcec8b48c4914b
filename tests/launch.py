"""Run a multi-process Lightning script in a clean environment, with a free port and a hard timeout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

# Lightning (and torch.distributed) set these in the pytest process when a test runs a
# Trainer there; a child that inherits them takes itself for a launched rank and waits forever.
_DIST_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
              "LOCAL_WORLD_SIZE", "PL_GLOBAL_SEED", "PL_TRAINER_GPUS", "TORCHELASTIC_RUN_ID")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS and not k.startswith("PL_")}
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"}, **extra)
    return env


def run_script(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=clean_env(), capture_output=True, text=True, timeout=timeout)
