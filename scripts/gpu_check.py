"""The first GPU run, in one command (``bash scripts/gpu_check.sh``): does the CUDA path hold?

Prints ``nvidia-smi`` and the versions first (torch and ``torch.version.cuda``, lightning,
transformers, peft, python, the GPU's name and capability), then runs each part in a process of
its own under its own timeout, most important first: a part that hangs is killed and reported
as timed out, and the others still run. The whole run ends within ``BUDGET`` (300 s on the GPU,
nvidia-smi and the probe included), so that a second attempt fits in one 15-minute lease: the
table ends with each part's seconds against its timeout and, for each part that did not pass, the
exact command that runs it again alone (``--only PART``; its table goes to ``gpu_check-PART.md``). Nothing is installed and nothing is fetched: a part whose
modules this Python cannot import is skipped, and its row says which. A part that did not run is
never shown as passed. The table (markdown, dated) goes to ``$OUT/gpu_check.md`` when ``OUT`` is
set (where the device tool brings files back), else to ``outputs/gpu_check.md``, and to stdout,
last; each part's full output goes to ``gpu_check.log`` beside it. ``--list`` shows the parts.

This file imports nothing outside the standard library at the top (the parts are
``gpu_check_trainers.py``, ``gpu_check_timing.py`` and ``gpu_check_ddp.py``), so it reports what it
found even on a Python without torch. ``GPU_CHECK_FAULT="part=fail|hang|crash,..."`` makes parts
misbehave, to test that reporting (``tests/integration/test_gpu_check.py``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]

PASS, FAIL, SKIP, TIMEOUT, ERROR = "pass", "FAIL", "skipped", "TIMED OUT", "ERROR"
#: rows that check nothing themselves: a measurement, and a reference fit other rows compare with
INFO, RAN = "info", "ran"
FAILURES = (FAIL, TIMEOUT, ERROR)
#: what the probe imports and reports; a part names the ones it needs
MODULES = ("torch", "lightning", "transformers", "peft", "torchmetrics", "safetensors", "pytest", "pytest_timeout", "hypothesis")
NVIDIA_SMI_TIMEOUT, PROBE_TIMEOUT = 10.0, 30.0
#: How long a killed part may take to exit (a process inside the driver dies late) before the check goes on without it.
KILL_GRACE = 10.0
#: The whole run, nvidia-smi and the probe included, ends within this many seconds of its start (scaled like the
#: timeouts): a part starts only with at least MIN_PART seconds left, and its timeout is cut so that it ends, a
#: killed part's KILL_GRACE included, by then. Five minutes: one lease is 15 minutes of device time, the machine's
#: start included, so a second attempt (a rerun of what failed, ``--only PART``) fits in it too.
BUDGET = 300.0
MIN_PART = 10.0
#: The versions this check (and the tests it runs) were written and dry-run against. The lent machine
#: has others (torch 2.11 + CUDA 13, transformers 5.17, Python 3.12): a part that fails there while
#: a version differs says so in its row, and an error that reads like an API change is named as one.
WRITTEN_FOR = {"python": "3.11", "torch": "2.13", "lightning": "2.6", "transformers": "5.24", "peft": "0.21"}
#: Errors that usually mean an API moved between versions rather than a bug in the code under test.
API_ERRORS = re.compile(
    r"ImportError|ModuleNotFoundError|AttributeError: module|has no attribute|unexpected keyword argument|"
    r"missing \d+ required positional argument|takes \d+ positional arguments? but"
)


@dataclass(frozen=True)
class Row:
    """One line of the table."""

    part: str
    case: str
    status: str
    detail: str
    seconds: float


@dataclass(frozen=True)
class Part:
    """A part: run as ``gpu_check.py --part NAME`` in a process of its own, killed at ``timeout`` seconds (on the H200)."""

    name: str
    title: str
    what: str
    timeout: float
    entry: str  # "module:function", called as function(accelerator, emit)
    needs: tuple[str, ...] = ("torch", "lightning", "transformers")
    cuda: bool = False  # skipped in a CPU dry run
    gpus: int = 1  # GPUs it needs with --accelerator gpu


#: Most important first: a session that runs out of time still gets these.
PARTS: tuple[Part, ...] = (
    Part("cuda-tests", "1 CUDA tests", "the executor's CUDA tests: per-stage streams, events, record_stream, BERT and Llama on two streams",
         45, "gpu_check:part_cuda_tests", needs=("torch", "pytest", "transformers"), cuda=True),
    Part("trainers", "2 Trainers fp32", "BERT and Llama on the device vs strategy=auto: pipe_len=2 chunks 1/2, cache, both; K=2 engagement",
         55, "gpu_check_trainers:part_trainers"),
    Part("timing", "3 K=2 vs K=1 time", "forward+backward at K=2 on one GPU's two streams against K=1, several M (CUDA events)",
         35, "gpu_check_timing:part_timing", needs=("torch", "transformers"), cuda=True),
    Part("precisions", "4 AMP", "pipe_len=2 chunks=2 cache=True in bf16-mixed and 16-mixed vs strategy=auto",
         40, "gpu_check_trainers:part_precisions"),
    Part("lora", "5 LoRA + checkpointing + cache", "PEFT LoRA + reentrant gradient checkpointing, pipe_len=2 chunks=2 cache=True vs plain",
         30, "gpu_check_trainers:part_lora", needs=("torch", "lightning", "transformers", "peft")),
    Part("compile", "6 model.compile()", "the whole model compiled (aot_eager; GPU_CHECK_COMPILE_BACKEND=inductor), pipe_len=2 chunks=2 vs eager",
         45, "gpu_check_trainers:part_compile"),
    Part("ddp", "7 two GPUs", "devices=2 pipe_len=2 16-mixed, K 2 -> 1 (scripts/gpu_check_ddp.py)",
         150, "gpu_check:part_ddp", cuda=True, gpus=2),
)
BY_NAME = {part.name: part for part in PARTS}
#: The CUDA-only tests (skipped, visibly, without CUDA) and the device-placement tests. Of test_anneal.py only its
#: CUDA test: its other 24 tests are CPU work that CI runs (a few CPU seconds) and prove nothing a GPU adds.
CUDA_TESTS = ("tests/unit/pipe/test_pipeline_cuda.py", "tests/unit/pipe/test_costs.py", "tests/unit/test_virtual_devices.py",
              "tests/unit/freeze/test_non_finite_steps.py",
              "tests/unit/freeze/test_anneal.py::test_blocks_on_several_devices_anneal_each_on_its_own_device")


# ---------------------------------------------------------------------------------- the parts that live here


def part_cuda_tests(accelerator: str, emit: Callable[[Row], None]) -> None:
    """pytest on CUDA_TESTS, in this process; one row per file, emitted as each file ends (a kill keeps the earlier ones)."""
    import pytest

    class Rows:
        def __init__(self) -> None:
            self.file: str | None = None
            self.counts: dict[str, list[str]] = {}
            self.start = time.perf_counter()

        def flush(self) -> None:
            if self.file is None:
                return
            passed, failed, skipped = (self.counts.get(k, []) for k in ("passed", "failed", "skipped"))
            status = FAIL if failed else PASS if passed else SKIP
            detail = f"{len(passed)} passed, {len(failed)} failed, {len(skipped)} skipped"
            if failed:
                detail += ": " + "; ".join(failed[:5])
            reasons = sorted(set(skipped))
            if reasons:
                detail += " (skipped: " + "; ".join(reasons[:3]) + ")"
            emit(Row("1 CUDA tests", self.file, status, detail, time.perf_counter() - self.start))
            self.file, self.counts, self.start = None, {}, time.perf_counter()

        def pytest_runtest_logreport(self, report: Any) -> None:
            file = report.nodeid.split("::")[0]
            if file != self.file:
                self.flush()
                self.file = file
            if report.failed:
                self.counts.setdefault("failed", []).append(f"{report.nodeid.split('::', 1)[1]} ({report.when})")
            elif report.skipped:
                reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
                self.counts.setdefault("skipped", []).append(reason.removeprefix("Skipped: "))
            elif report.when == "call":
                self.counts.setdefault("passed", []).append(report.nodeid)

        def pytest_sessionfinish(self) -> None:
            self.flush()

    code = pytest.main(["-v", "-p", "no:cacheprovider", *CUDA_TESTS], plugins=[Rows()])
    if code not in (0, 1):  # 1: some test failed (its row says so); anything else: pytest itself could not run
        emit(Row("1 CUDA tests", "pytest", ERROR, f"pytest exit code {int(code)}", 0.0))


def part_ddp(accelerator: str, emit: Callable[[Row], None]) -> None:
    """Two processes on two GPUs (scripts/gpu_check_ddp.py): its one-line verdict is the row."""
    out = Path(tempfile.mkdtemp(prefix="gpu_check_ddp_"))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check_ddp.py"), "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True)
    print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
    last = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    ok = proc.returncode == 0 and last.startswith("pass")
    emit(Row("7 two GPUs", "devices=2 pipe_len=2 16-mixed, K 2 -> 1", PASS if ok else FAIL, last, time.perf_counter() - start))


# ---------------------------------------------------------------------------------- a part's own process


def inject_fault(name: str) -> str | None:
    """``GPU_CHECK_FAULT="trainers=hang,lora=fail"``: fail (a failed row), hang (sleep until killed) or crash (raise)."""
    faults = dict(item.split("=", 1) for item in os.environ.get("GPU_CHECK_FAULT", "").split(",") if "=" in item)
    fault = faults.get(name)
    if fault == "hang":
        print(f"[{name}] injected fault: hanging (pid {os.getpid()})", flush=True)
        time.sleep(10**6)
    if fault == "crash":
        raise RuntimeError(f"injected fault: part {name} crashed (GPU_CHECK_FAULT)")
    return fault


def run_part_here(name: str, accelerator: str, rows_path: Path) -> int:
    """The child side: import the part's module, run it, append each row to ``rows_path`` as a JSON line at once."""
    sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]
    part = BY_NAME[name]
    with rows_path.open("a") as rows:
        def emit(row: Any) -> None:
            rows.write(json.dumps(asdict(row)) + "\n")
            rows.flush()
            print(f"[{name}] {row.status}: {row.case} ({row.seconds:.1f} s) {row.detail}", flush=True)

        if inject_fault(name) == "fail":
            emit(Row(part.title, "injected fault", FAIL, "GPU_CHECK_FAULT asked this part to fail", 0.0))
            return 0
        module, function = part.entry.split(":")
        getattr(importlib.import_module(module), function)(accelerator, emit)
    return 0


def distribution_version(name: str, module: Any) -> str:
    """The installed distribution's version (pytest_timeout has no ``__version__``), else the module's."""
    from importlib import metadata

    try:
        return metadata.version(name.replace("_", "-"))
    except metadata.PackageNotFoundError:
        return str(getattr(module, "__version__", "?"))


def probe_here() -> int:
    """The child side of the probe: what imports, which versions, what CUDA sees. One JSON line on stdout."""
    found: dict[str, Any] = {"python": platform.python_version(), "executable": sys.executable, "modules": {}, "errors": {}}
    for name in MODULES:
        try:
            module = importlib.import_module(name)
            found["modules"][name] = distribution_version(name, module)
        except Exception as err:  # noqa: BLE001 - any failure to import is "not importable", and why
            found["errors"][name] = f"{type(err).__name__}: {str(err)[:200]}"
    if "torch" in found["modules"]:
        import torch

        cuda: dict[str, Any] = {"version": torch.version.cuda, "available": torch.cuda.is_available(), "count": 0}
        if cuda["available"]:
            cuda.update(count=torch.cuda.device_count(), name=torch.cuda.get_device_name(0),
                        capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                        cudnn=torch.backends.cudnn.version(), bf16=torch.cuda.is_bf16_supported())
        found["cuda"] = cuda
    print("GPU_CHECK_PROBE " + json.dumps(found), flush=True)
    return 0


# ---------------------------------------------------------------------------------- the driver


@dataclass(frozen=True)
class PartResult:
    """One part's outcome for the parts' table: its worst row, its seconds against its timeout, and how to rerun it."""

    name: str
    status: str
    seconds: float
    timeout: float
    rerun: str = ""


@dataclass
class Run:
    """What one ``gpu_check`` run found, and where it writes."""

    accelerator: str
    out: Path
    log: Path
    budget: float
    started: datetime.datetime
    start: float
    env: dict[str, Any]
    smi: str
    rows: list[Row]
    done: bool = False
    parts: list[PartResult] = field(default_factory=list)
    #: the arguments this run was given (for the header's command line)
    argv: tuple[str, ...] = ()


def killed_tail(text: str, lines: int = 1) -> str:
    """The last non-empty lines of a part's output, on one line, for the table."""
    found = [line.strip() for line in text.splitlines() if line.strip()]
    return " / ".join(found[-lines:])[-300:] if found else "(no output)"


def run_child(cmd: Sequence[str], timeout: float, log: Path, env: dict[str, str] | None = None) -> tuple[int | None, str, float]:
    """Run ``cmd`` in a session of its own, output to ``log``; kill its whole process group at ``timeout``.

    Returns (exit code or None when killed, its output, seconds).
    """
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = None
            try:
                proc.wait(timeout=KILL_GRACE)
            except subprocess.TimeoutExpired:  # stuck in the driver, say: leave it and go on
                out.write(f"\ngpu_check: pid {proc.pid} did not exit within {KILL_GRACE:.0f} s of SIGKILL\n")
    return code, log.read_text(errors="replace"), time.perf_counter() - start


def nvidia_smi() -> tuple[str, Row]:
    """``nvidia-smi``'s own output, or why there is none; and its row (timed out: a row that says so)."""
    start = time.perf_counter()
    status = INFO
    try:
        proc = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT)
        text = (proc.stdout + proc.stderr).rstrip() or f"nvidia-smi: no output (exit code {proc.returncode})"
    except FileNotFoundError:
        text = "nvidia-smi: not found on this machine"
    except subprocess.TimeoutExpired:
        text, status = f"nvidia-smi: TIMED OUT after {NVIDIA_SMI_TIMEOUT:.0f} s", TIMEOUT
    driver = re.search(r"Driver Version:\s*(\S+)", text)
    detail = f"driver {driver.group(1)}" if driver else killed_tail(text)
    return text, Row("0 environment", "nvidia-smi", status, detail, time.perf_counter() - start)


def probe(work: Path, timeout: float = PROBE_TIMEOUT) -> tuple[dict[str, Any], Row]:
    """The probe in a process of its own (importing torch can hang on a broken driver too)."""
    code, text, seconds = run_child([sys.executable, str(Path(__file__)), "--probe"], timeout, work / "probe.log")
    for line in text.splitlines():
        if line.startswith("GPU_CHECK_PROBE "):
            env = json.loads(line.removeprefix("GPU_CHECK_PROBE "))
            missing = ", ".join(f"{k} ({v})" for k, v in env["errors"].items())
            return env, Row("0 environment", "imports and CUDA", INFO, "not importable: " + missing if missing else "all importable", seconds)
    status, why = (TIMEOUT, f"killed after {timeout:.0f} s") if code is None else (ERROR, f"exit code {code}")
    return {}, Row("0 environment", "imports and CUDA", status, f"{why}: {killed_tail(text)}; every part runs unchecked", seconds)


def describe_env(env: dict[str, Any], smi: str) -> list[str]:
    """The version lines printed first and put at the top of the table."""
    if not env:
        return [f"python {platform.python_version()} ({sys.executable}); the probe found nothing (see its row)"]
    mods = env["modules"]
    cuda = env.get("cuda", {})
    driver = re.search(r"Driver Version:\s*(\S+)", smi)
    gpu = (f"{cuda.get('name')}, {cuda.get('count')} GPU(s), capability {cuda.get('capability')}, cuDNN {cuda.get('cudnn')}, "
           f"bf16 {cuda.get('bf16')}" if cuda.get("available") else "no CUDA device visible (torch.cuda.is_available() is False)")
    return [
        f"python {env['python']} ({env['executable']})",
        f"torch {mods.get('torch', 'not importable')}, torch.version.cuda {cuda.get('version')}, driver {driver.group(1) if driver else '-'}",
        f"GPU: {gpu}",
        ", ".join(f"{name} {mods.get(name, 'NOT importable')}" for name in MODULES if name != "torch"),
    ]


def skip_reason(part: Part, accelerator: str, env: dict[str, Any]) -> str | None:
    """Why ``part`` cannot run here, or None. An unknown environment (the probe failed) skips nothing."""
    if part.cuda and accelerator == "cpu":
        return "needs CUDA: not run in a CPU dry run"
    if not env:
        return None
    missing = [name for name in part.needs if name not in env["modules"]]
    if missing:
        return f"{', '.join(missing)} not importable here ({env['errors'][missing[0]]}); nothing is installed by this check"
    cuda = env.get("cuda", {})
    if accelerator == "gpu" and not cuda.get("available"):
        return "no CUDA device visible (torch.cuda.is_available() is False)"
    if accelerator == "gpu" and cuda.get("count", 0) < part.gpus:
        return f"needs {part.gpus} GPUs, {cuda.get('count', 0)} visible"
    return None


def run_part(part: Part, run: Run, timeout: float, work: Path) -> tuple[list[Row], float]:
    """One part in its own process group; its rows, plus one for a kill, a crash or silence, and its seconds."""
    rows_path = work / f"{part.name}.jsonl"
    # The part may plan its own work by these (the timing part does): its timeout, and when (time.time()) it is killed.
    env = dict(os.environ, GPU_CHECK_PART_TIMEOUT=f"{timeout:.0f}", GPU_CHECK_PART_DEADLINE=f"{time.time() + timeout:.1f}",
               PYTHONUNBUFFERED="1")
    if run.accelerator == "cpu":
        # One thread: on a small shared machine OpenMP's spin-waiting made these tiny fits 30x slower.
        env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, str(Path(__file__)), "--part", part.name, "--accelerator", run.accelerator, "--rows", str(rows_path)]
    code, text, seconds = run_child(cmd, timeout, work / f"{part.name}.log", env)
    with run.log.open("a") as log:
        log.write(f"\n===== {part.name} ({part.title}): exit {code}, {seconds:.1f} s of {timeout:.0f} s =====\n{text}")
    rows = [Row(**json.loads(line)) for line in rows_path.read_text().splitlines()] if rows_path.exists() else []
    if code is None:
        rows.append(Row(part.title, "(the part)", TIMEOUT, f"killed after {timeout:.0f} s; last output: {killed_tail(text)}", seconds))
    elif code != 0:
        rows.append(Row(part.title, "(the part)", ERROR, f"exit code {code}: {killed_tail(text, 2)}", seconds))
    elif not rows:
        rows.append(Row(part.title, "(the part)", ERROR, "exited without reporting a row", seconds))
    if any(r.status in FAILURES for r in rows):
        print("\n".join(f"    | {line}" for line in text.splitlines()[-25:]))
    return rows, seconds


def command(run: Run) -> str:
    """The command line this run was started with (as ``bash scripts/gpu_check.sh``)."""
    args = list(run.argv) if run.argv else ["--accelerator", run.accelerator]
    return " ".join(["bash", "scripts/gpu_check.sh", *args])


def rerun_command(run: Run, names: Sequence[str], timeouts: dict[str, float]) -> str:
    """The exact command that runs ``names`` again (with ``timeouts``: a longer one for a part that was killed)."""
    args = ["bash", "scripts/gpu_check.sh", "--only", ",".join(names)]
    if run.accelerator != "gpu":
        args += ["--accelerator", run.accelerator]
    for name in names:
        if name in timeouts:
            args += ["--timeout", f"{name}={timeouts[name]:.0f}"]
    return " ".join(args)


def part_result(run: Run, part: Part, rows: list[Row], seconds: float, timeout: float, planned_timeout: float,
                budget_skip: bool) -> PartResult:
    """A part's worst row and, where it did not pass (failed, killed, crashed, or not started for the budget), its rerun:
    a part killed at its full timeout is rerun with twice that (no more than one run's budget leaves it)."""
    statuses = [r.status for r in rows]
    status = next((s for s in (TIMEOUT, ERROR, FAIL) if s in statuses), None)
    status = status or (PASS if PASS in statuses else SKIP if SKIP in statuses else INFO)
    if status not in FAILURES and not budget_skip:
        return PartResult(part.name, status, seconds, timeout)
    longer = {}
    if status == TIMEOUT and timeout >= planned_timeout:
        most = run.budget - NVIDIA_SMI_TIMEOUT - PROBE_TIMEOUT - KILL_GRACE
        longer[part.name] = min(2 * planned_timeout, most)
    return PartResult(part.name, status, seconds, timeout, rerun_command(run, [part.name], longer))


def reruns(run: Run) -> list[str]:
    """One rerun command per part that did not pass, and one for all of them together when there are several."""
    failed = [p for p in run.parts if p.rerun]
    lines = [p.rerun for p in failed]
    if len(failed) > 1:
        timeouts = {}
        for p in failed:
            found = re.search(rf"--timeout {re.escape(p.name)}=(\d+)", p.rerun)
            if found:
                timeouts[p.name] = float(found.group(1))
        lines.append(rerun_command(run, [p.name for p in failed], timeouts))
    return lines


def render(run: Run) -> str:
    """The markdown report: a dated header with the versions, the table, the parts (with reruns), then nvidia-smi's output."""
    counts = {s: sum(r.status == s for r in run.rows) for s in (PASS, FAIL, SKIP, TIMEOUT, ERROR)}
    elapsed = time.perf_counter() - run.start
    state = "complete" if run.done else "INCOMPLETE (written after each part; this run had not finished)"
    rerun = reruns(run)
    lines = [
        f"# GPU check, {run.started:%Y-%m-%d %H:%M} UTC",
        "",
        f"- `{command(run)}` on {platform.node()}: {elapsed:.0f} s of a {run.budget:.0f} s budget, {state}",
        *(f"- {line}" for line in describe_env(run.env, run.smi)),
        f"- result: {counts[PASS]} pass, {counts[FAIL]} FAIL, {counts[SKIP]} skipped, {counts[TIMEOUT]} timed out, "
        f"{counts[ERROR]} error ({INFO!r} rows are measurements, {RAN!r} rows reference fits: neither is a check)",
        "",
        "| part | case | result | seconds | detail |",
        "| --- | --- | --- | ---: | --- |",
        *(f"| {r.part} | {cell(r.case)} | {bold(r.status)} | {r.seconds:.1f} | {cell(r.detail)} |" for r in run.rows),
        "",
        "Parts (seconds: the part's process, imports and CUDA start included, against its timeout):",
        "",
        "| part name | result | seconds | timeout | rerun |",
        "| --- | --- | ---: | ---: | --- |",
        *(f"| `{p.name}` | {bold(p.status)} | {p.seconds:.1f} | {p.timeout:.0f} | {f'`{p.rerun}`' if p.rerun else '-'} |"
          for p in run.parts),
        "",
        *(["Rerun what did not pass (a rerun of some parts writes its own table, `gpu_check-PART.md`, beside this one):",
           "", "```", *rerun, "```", ""] if rerun else []),
        "nvidia-smi:",
        "",
        "```",
        run.smi,
        "```",
    ]
    return "\n".join(lines) + "\n"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def bold(status: str) -> str:
    return f"**{status}**" if status in FAILURES else status


def write(run: Run) -> None:
    run.out.parent.mkdir(parents=True, exist_ok=True)
    run.out.write_text(render(run))


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="gpu", choices=["gpu", "cpu"], help="cpu: a dry run of the check itself, CUDA parts skipped")
    parser.add_argument("--out", type=Path, help=f"the markdown table (default: {out_dir()}/gpu_check.md; "
                        "with --only naming some of the parts, gpu_check-PART[-PART...].md)")
    parser.add_argument("--only", help="comma-separated part names, run in the order given (a rerun: the table printed at the end "
                        "names the command for each part that did not pass)")
    parser.add_argument("--timeout", action="append", default=[], metavar="PART=SECONDS", help="override one part's timeout")
    parser.add_argument("--timeout-scale", type=float, help="multiply every part's timeout, the probe's and the budget "
                        "(default 1 on gpu, 4 on cpu: a slower machine)")
    parser.add_argument("--budget", type=float, help=f"the whole run ends within this many seconds of its start (default {BUDGET:.0f}, scaled)")
    parser.add_argument("--list", action="store_true", help="print the parts and their timeouts, run nothing")
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def out_dir() -> Path:
    """Where the table goes: ``$OUT`` (the device tool brings it back) when set, else ``outputs/``."""
    return Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "outputs"


def out_path(args: argparse.Namespace, plan: Sequence[tuple[Part, float]]) -> Path:
    """``--out``, else gpu_check.md for the whole check and gpu_check-PART.md for a rerun of some parts (not overwriting it)."""
    if args.out:
        return args.out
    names = [part.name for part, _ in plan]
    return out_dir() / ("gpu_check.md" if set(names) == set(BY_NAME) else f"gpu_check-{'-'.join(names)}.md")


def timeout_scale(args: argparse.Namespace) -> float:
    """The timeouts are the H200's; a CPU dry run (here: 2 shared cores) gets four times as long."""
    return args.timeout_scale or (4.0 if args.accelerator == "cpu" else 1.0)


def planned(args: argparse.Namespace) -> list[tuple[Part, float]]:
    """The parts to run, in order, each with its timeout."""
    names = [n.strip() for n in args.only.split(",")] if args.only else [p.name for p in PARTS]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise SystemExit(f"gpu_check: no part named {', '.join(unknown)}; the parts are {', '.join(BY_NAME)}")
    scale = timeout_scale(args)
    overrides = {k: float(v) for k, v in (item.split("=", 1) for item in args.timeout)}
    return [(BY_NAME[n], overrides.get(n, BY_NAME[n].timeout * scale)) for n in names]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if args.probe:
        return probe_here()
    if args.part:
        return run_part_here(args.part, args.accelerator, args.rows)
    plan = planned(args)
    if args.list:
        for part, timeout in plan:
            print(f"{part.name:<11} {timeout:5.0f} s  {part.title}: {part.what}")
        probe_timeout = PROBE_TIMEOUT * timeout_scale(args)
        one_gpu = sum(t for part, t in plan if part.gpus <= 1) + NVIDIA_SMI_TIMEOUT + probe_timeout
        budget = args.budget or BUDGET * timeout_scale(args)
        print(f"{'one GPU':<11} {one_gpu:5.0f} s  every part listed that runs on one GPU, with nvidia-smi ({NVIDIA_SMI_TIMEOUT:.0f} s) "
              f"and the probe ({probe_timeout:.0f} s); the whole run ends within --budget {budget:.0f} s (a part's timeout is "
              f"cut to what is left, less {KILL_GRACE:.0f} s for a killed process to exit)")
        return 0
    return check(args, plan, tuple(argv) if argv is not None else tuple(sys.argv[1:]))


def check(args: argparse.Namespace, plan: list[tuple[Part, float]], argv: tuple[str, ...] = ()) -> int:
    """Environment first, then each part in order within the overall budget; the table after each part and at the end."""
    budget = args.budget or BUDGET * timeout_scale(args)
    out = out_path(args, plan).resolve()
    run = Run(args.accelerator, out, out.with_suffix(".log"), budget, datetime.datetime.now(datetime.timezone.utc),
              time.perf_counter(), {}, "", [], argv=argv)
    out.parent.mkdir(parents=True, exist_ok=True)
    run.log.write_text("")
    print(f"gpu_check: {run.started:%Y-%m-%d %H:%M} UTC, accelerator {run.accelerator}, budget {budget:.0f} s, table -> {out}", flush=True)
    print("gpu_check: parts (timeout): " + ", ".join(f"{part.name} ({timeout:.0f} s)" for part, timeout in plan), flush=True)
    run.smi, smi_row = nvidia_smi()
    run.rows.append(smi_row)
    print("== nvidia-smi\n" + run.smi, flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = Path(tmp)
        probe_timeout = PROBE_TIMEOUT * timeout_scale(args)  # imports on a slow, shared CPU take longer too
        run.env, env_row = probe(work, min(probe_timeout, max(1.0, budget - (time.perf_counter() - run.start) - KILL_GRACE)))
        run.rows.append(env_row)
        print("== versions\n" + "\n".join(describe_env(run.env, run.smi)) + f"\n== {env_row.status}: {env_row.detail}", flush=True)
        for part, timeout in plan:
            run.rows += part_rows(part, timeout, run, work)
            write(run)
    run.done = True
    write(run)
    text = render(run)
    print("\n" + text.split("\nnvidia-smi:")[0], flush=True)
    print("\n".join(summary(run)))
    print(f"gpu_check: table written to {out}, full output to {run.log}")
    return exit_code(run)


def summary(run: Run) -> list[str]:
    """The last lines of stdout (the device tool returns the tail): the counts, what did not pass, the K=2 / K=1 ratios."""
    counts = ", ".join(f"{sum(r.status == s for r in run.rows)} {s}" for s in (PASS, FAIL, SKIP, TIMEOUT, ERROR))
    lines = [f"gpu_check: {counts} in {time.perf_counter() - run.start:.0f} s (budget {run.budget:.0f} s)"]
    lines += [f"  {r.status}: {r.part} / {r.case} ({r.seconds:.1f} s)" for r in run.rows if r.status in FAILURES]
    lines += [f"  rerun: {line}" for line in reruns(run)]
    ratios = [f"{r.case.split(': ')[0]} {m.group(1)}" for r in run.rows if (m := re.search(r"\): ratio (\d+\.\d+)", r.detail))]
    if ratios:
        lines.append("  K=2 / K=1 forward+backward on ONE GPU (shared SMs: overhead vs overlap, not a multi-GPU speed-up): " + ", ".join(ratios))
    return lines


def part_rows(part: Part, timeout: float, run: Run, work: Path) -> list[Row]:
    """A part's rows: skipped with its reason, skipped for the budget, or run, its timeout cut so that it ends (a killed
    part's grace included) within the budget. Its outcome, with the rerun command where it did not pass, goes to ``run.parts``."""
    reason = skip_reason(part, run.accelerator, run.env)
    left = run.budget - (time.perf_counter() - run.start) - KILL_GRACE
    budget_skip = reason is None and left < MIN_PART
    if budget_skip:
        reason = f"not started: {left + KILL_GRACE:.0f} s of the {run.budget:.0f} s budget left"
    if reason is not None:
        print(f"-- {part.name}: skipped: {reason}", flush=True)
        rows = [Row(part.title, part.what, SKIP, reason, 0.0)]
        run.parts.append(part_result(run, part, rows, 0.0, timeout, timeout, budget_skip))
        return rows
    planned_timeout, timeout = timeout, min(timeout, left)
    print(f"-- {part.name}: running (timeout {timeout:.0f} s): {part.what}", flush=True)
    rows, seconds = run_part(part, run, timeout, work)
    rows = [with_version_note(row, run.env) for row in rows]
    counts = ", ".join(f"{sum(r.status == s for r in rows)} {s}" for s in (PASS, FAIL, SKIP, TIMEOUT, ERROR) if any(r.status == s for r in rows))
    print(f"-- {part.name}: {counts or 'nothing checked'} in {seconds:.0f} s of {timeout:.0f} s", flush=True)
    run.parts.append(part_result(run, part, rows, seconds, timeout, planned_timeout, False))
    return rows


def version_differences(env: dict[str, Any]) -> list[str]:
    """``"torch 2.11 here, written for 2.13"`` for each module whose major.minor differs from :data:`WRITTEN_FOR`."""
    if not env:
        return []
    found = {"python": env.get("python", ""), **env.get("modules", {})}
    differ = []
    for name, written in WRITTEN_FOR.items():
        here = found.get(name)
        if here and ".".join(here.split("+")[0].split(".")[:2]) != written:
            differ.append(f"{name} {here} here, written for {written}")
    return differ


def with_version_note(row: Row, env: dict[str, Any]) -> Row:
    """A failed, crashed or killed row names the versions that differ from those the check was written
    for, and an error that reads like an API change as one: the fix may be a version's, not the code's."""
    if row.status not in FAILURES:
        return row
    differ = version_differences(env)
    if not differ:
        return row
    api = API_ERRORS.search(row.detail)
    kind = f"'{api.group(0)}' looks like an API difference between versions" if api else "may be a version difference"
    return Row(row.part, row.case, row.status, f"{row.detail} [{kind}: {'; '.join(differ)}]", row.seconds)


def exit_code(run: Run) -> int:
    """1 when anything failed, timed out or crashed; 2 when nothing could be checked; else 0."""
    if any(r.status in FAILURES for r in run.rows):
        return 1
    return 0 if any(r.status == PASS for r in run.rows) else 2


if __name__ == "__main__":
    raise SystemExit(main())
