"""A test that starts processes the ways the suite does, then waits: the target of the Ctrl-C test.

tests/integration/test_first_contact.py runs it through scripts/test.sh and sends SIGINT, as a
terminal's Ctrl-C does. Not collected otherwise (not a ``test_*.py`` file); each process it
starts appends its pid to ``$PIPETRANSFORMER_INTERRUPT_PIDS``:

* a ``multiprocessing`` (spawn) worker, as ``torch.multiprocessing.spawn`` starts gloo workers;
* a rank launched in a session of its own (:func:`tests.helpers.launch.launch_ranks`), which
  starts another rank, as Lightning's launcher does: the terminal's SIGINT reaches neither.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

from tests.helpers.launch import launch_ranks

ENV = "PIPETRANSFORMER_INTERRUPT_PIDS"
RANK0 = """
import os, subprocess, sys, time
pids = os.environ["{env}"]
subprocess.Popen([sys.executable, "-c", "import os, time; open({pids!r}, 'a').write(f'{{os.getpid()}}\\\\n'); time.sleep(120)"])
open(pids, "a").write(f"{{os.getpid()}}\\n")
time.sleep(120)
"""


def _sleep(pids: str) -> None:
    with open(pids, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(120)


def test_starts_processes_and_waits(tmp_path: Path) -> None:
    pids = os.environ[ENV]
    worker = multiprocessing.get_context("spawn").Process(target=_sleep, args=(pids,))
    worker.start()
    script = tmp_path / "rank0.py"
    script.write_text(RANK0.format(env=ENV, pids=pids))
    launch_ranks(script, tmp_path / "out", timeout=120)  # blocks here until interrupted
