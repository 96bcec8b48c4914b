"""Run a multi-process Lightning script in a clean environment, with a free port and a hard timeout."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

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


def launch_ranks(script: Path | str, out: Path, *args: str, timeout: float = 240, cleanup: bool = True) -> subprocess.CompletedProcess:
    """Run ``script --out out *args`` as rank 0 of a multi-process Lightning run; never waits past ``timeout``.

    Rank 0 gets a session of its own (Lightning starts the other ranks from it), so a hang or a
    leftover rank is killed as one process group.
    """
    import pytest

    # A clean environment (no MASTER_*/RANK/PL_GLOBAL_SEED left by Trainers run in this process: the
    # seed would change the sampler's permutation) and a free port.
    proc = subprocess.Popen(
        [sys.executable, str(script), "--out", str(out), *args], env=clean_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        stdout, _ = proc.communicate()
        pytest.fail(f"Multi-process run {Path(script).name} hung for {timeout}s:\n{stdout[-4000:]}")
    except BaseException:  # Ctrl-C (KeyboardInterrupt) or a failure here: its own session is out of the terminal's reach
        kill_session(proc.pid)
        raise
    if cleanup:
        # A rank left over (e.g. still starting when rank 0 failed) would join the next run's
        # rendezvous on a reused port.
        kill_session(proc.pid)
    result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, "")
    result.pid = proc.pid  # type: ignore[attr-defined]
    return result


def kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # rank 0's process group: the ranks it launched too
    except ProcessLookupError:
        pass


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, session id) of ``pid`` from ``/proc/<pid>/stat``; ``None`` when it is gone or a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp session ...
    return None if fields[0] == "Z" else (int(fields[1]), int(fields[3]))


def process_tree(root: int) -> list[int]:
    """Every living process started from ``root`` (its descendants), and every process in a session one of
    them opened (``start_new_session=True``: a launched rank 0 and the ranks it started, also those already
    orphaned and adopted by init). Linux only (``/proc``); elsewhere empty."""
    table = {int(d.name): s for d in Path("/proc").iterdir() if d.name.isdigit() and (s := _stat(int(d.name))) is not None}
    own_session = table.get(root, (0, -1))[1]
    found, todo = set(), [root]
    while todo:
        parent = todo.pop()
        children = [pid for pid, (ppid, _) in table.items() if ppid == parent and pid not in found]
        found.update(children)
        todo += children
    sessions = {table[pid][1] for pid in found} - {own_session}
    found |= {pid for pid, (_, sid) in table.items() if sid in sessions}
    return sorted(found - {root, os.getpid()})


def end_process_tree(root: int | None = None) -> list[int]:
    """SIGKILL everything :func:`process_tree` finds under ``root`` (default: this process); the pids killed.

    tests/conftest.py calls it when a run is interrupted (Ctrl-C): test processes have nothing to save, and
    a rank in a session of its own, which the terminal's SIGINT never reaches, would otherwise run on.
    """
    killed = []
    for pid in process_tree(os.getpid() if root is None else root):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return killed


def is_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, not yet reaped by its parent, counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def fit_recording_errors(trainer, module, train, val, error_file: Path, stage: str = "fit", **fit_kwargs) -> None:
    """``trainer.fit`` (or ``validate``) in a launched rank; an exception is written to ``error_file`` (for the test to read) and re-raised."""
    import time

    start = time.monotonic()
    try:
        if stage == "validate":
            trainer.validate(module, val, verbose=False)
        else:
            trainer.fit(module, train, val, **fit_kwargs)
    except BaseException as error:  # noqa: BLE001 - recorded for the test, then re-raised
        error_file.write_text(f"{time.monotonic() - start:.1f}s {type(error).__name__}: {error}")
        raise
