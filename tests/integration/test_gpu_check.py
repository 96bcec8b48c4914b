"""The GPU check, without a GPU: its CPU dry run, its reporting of faults, and the checks it makes on CUDA.

``bash scripts/gpu_check.sh --accelerator cpu`` runs once (module fixture) with the real
``trainers`` part, the CUDA-only parts (skipped: they must say so, never "pass") and three parts
made to misbehave through ``GPU_CHECK_FAULT``: one hangs (killed at its timeout, reported as timed
out, its process gone), one fails, one crashes. The engagement checks that only CUDA exercises
(a stream per stage) and the timing part's code run here on made-up records and a tiny stack.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers.launch import clean_env

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402
import gpu_check_timing as timing  # noqa: E402
import gpu_check_trainers as trainers  # noqa: E402
import torch  # noqa: E402

FAULTS = "precisions=hang,compile=fail,lora=crash"
HANG_TIMEOUT = 4


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check_out")
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--accelerator", "cpu",
         "--only", "cuda-tests,trainers,timing,precisions,lora,compile,ddp", "--timeout", f"precisions={HANG_TIMEOUT}"],
        capture_output=True, text=True, timeout=400, cwd=ROOT,
        env=clean_env(OUT=str(out), PYTHON=sys.executable, GPU_CHECK_FAULT=FAULTS),
    )
    table = (out / "gpu_check.md").read_text() if (out / "gpu_check.md").exists() else ""
    return SimpleNamespace(proc=proc, out=out, table=table, rows=rows_of(table), stdout=proc.stdout)


def rows_of(table: str, header: str = "| part | case | result | seconds | detail |") -> list[dict[str, str]]:
    """The rows of the table under ``header`` as dicts keyed by its columns, escaped pipes restored."""
    lines = table.splitlines()
    if header not in lines:
        return []
    keys = [c.strip() for c in header.strip("|").split("|")]
    rows = []
    for line in lines[lines.index(header) + 2:]:
        if not line.startswith("| "):
            break
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        rows.append(dict(zip(keys, cells)))
    return rows


PARTS_HEADER = "| part name | result | seconds | timeout | rerun |"


def of_part(rows: list[dict[str, str]], prefix: str) -> list[dict[str, str]]:
    return [r for r in rows if r["part"].startswith(prefix)]


def test_the_dry_run_writes_a_dated_table_where_the_device_tool_brings_files_back(dry_run):
    assert dry_run.table, dry_run.stdout[-3000:] + dry_run.proc.stderr[-3000:]
    assert re.match(r"# GPU check, \d{4}-\d{2}-\d{2} \d{2}:\d{2} UTC", dry_run.table)
    assert "complete" in dry_run.table.splitlines()[2] and "INCOMPLETE" not in dry_run.table
    assert (dry_run.out / "gpu_check.log").read_text().count("=====") >= 4  # every part's output, in the log
    # The table is also the end of stdout (the device tool returns only the tail).
    assert "| part | case | result | seconds | detail |" in dry_run.stdout.split("== versions")[1]


def test_nvidia_smi_and_the_versions_come_before_any_part(dry_run):
    out = dry_run.stdout
    first_part = out.index("-- cuda-tests")
    assert out.index("== nvidia-smi") < out.index("== versions") < first_part
    versions = out[out.index("== versions"):first_part]
    for name in ("python 3.", "torch 2.", "torch.version.cuda", "GPU: ", "lightning 2.", "transformers ", "peft "):
        assert name in versions, versions


def test_cuda_parts_are_skipped_and_say_why_never_passed(dry_run):
    for prefix in ("1 CUDA tests", "3 K=2 vs K=1 time", "7 two GPUs"):
        rows = of_part(dry_run.rows, prefix)
        assert [r["result"] for r in rows] == ["skipped"], rows
        assert "needs CUDA" in rows[0]["detail"]
    assert "0 environment" in dry_run.rows[0]["part"] and dry_run.rows[0]["result"] == "info"


def test_the_real_part_passes_and_reads_the_pipeline_while_k_is_2(dry_run):
    rows = of_part(dry_run.rows, "2 Trainers fp32")
    checked = [r for r in rows if r["result"] != "ran"]
    assert len(checked) == 8 and all(r["result"] == "pass" for r in checked), rows
    piped = [r for r in checked if "pipe_len=2" in r["case"]]
    assert len(piped) == 6
    for row in piped:
        assert re.search(r"epoch 0: plan F=0 K=2 M=[12] \(2, 2\), runs per block \[(7|13), \1, \1, \1\]", row["detail"]), row
        if "cache" not in row["case"]:  # epoch 1: two blocks frozen, still K=2
            assert re.search(r"epoch 1: plan F=2 K=2 M=[12] \(3, 1\), runs per block \[(6|12), \1, \1, \1\]", row["detail"]), row
        assert "streams not checked (CPU)" in row["detail"]


def test_a_hung_part_is_killed_and_reported_as_timed_out_and_the_rest_still_run(dry_run):
    rows = of_part(dry_run.rows, "4 AMP")
    assert [r["result"] for r in rows] == ["**TIMED OUT**"], rows
    assert f"killed after {HANG_TIMEOUT} s" in rows[0]["detail"] and "injected fault: hanging" in rows[0]["detail"]
    pid = int(re.search(r"hanging \(pid (\d+)\)", dry_run.stdout + (dry_run.out / "gpu_check.log").read_text()).group(1))
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert of_part(dry_run.rows, "6 model.compile()"), "the part after the hung one did not run"


def test_a_failed_and_a_crashed_part_are_shown_as_such(dry_run):
    assert [r["result"] for r in of_part(dry_run.rows, "6 model.compile()")] == ["**FAIL**"]
    crashed = of_part(dry_run.rows, "5 LoRA")
    assert [r["result"] for r in crashed] == ["**ERROR**"] and "injected fault: part lora crashed" in crashed[0]["detail"]
    assert "1 FAIL, " in dry_run.table and "1 timed out, 1 error" in dry_run.table
    assert dry_run.proc.returncode == 1


def test_every_row_says_its_result_with_its_number(dry_run):
    """pass / FAIL / skipped / TIMED OUT / ERROR (or info, ran: not checks) and its seconds; a compared fit also the
    difference it found and the limit it was held to."""
    assert dry_run.rows
    for row in dry_run.rows:
        assert row["result"].strip("*") in ("pass", "FAIL", "skipped", "TIMED OUT", "ERROR", "info", "ran"), row
        assert re.fullmatch(r"\d+\.\d", row["seconds"]), row
    compared = [r for r in dry_run.rows if r["result"] == "pass"]  # the trainers part's (the others are made to misbehave here)
    assert len(compared) == 8, compared
    for row in compared:
        assert re.search(r"max \|w - w_auto\| \d\.\d\de[-+]\d\d \(limit rtol [\d.e-]+, atol [\d.e-]+\)", row["detail"]), row


def test_the_parts_table_gives_each_parts_seconds_and_the_exact_rerun_of_what_did_not_pass(dry_run):
    parts = {r["part name"].strip("`"): r for r in rows_of(dry_run.table, PARTS_HEADER)}
    assert list(parts) == list(gpu_check.BY_NAME), parts
    assert [parts[n]["result"] for n in ("cuda-tests", "trainers", "precisions", "lora", "compile")] == [
        "skipped", "pass", "**TIMED OUT**", "**ERROR**", "**FAIL**"]
    assert float(parts["trainers"]["seconds"]) > 0 and parts["trainers"]["timeout"] == f"{55 * 4}"  # the CPU run's timeouts are 4x
    assert parts["trainers"]["rerun"] == "-"
    # Killed at its full timeout: rerun with twice as long; failed or crashed: rerun as it was.
    assert parts["precisions"]["rerun"] == f"`bash scripts/gpu_check.sh --only precisions --accelerator cpu --timeout precisions={2 * HANG_TIMEOUT}`"
    assert parts["lora"]["rerun"] == "`bash scripts/gpu_check.sh --only lora --accelerator cpu`"
    assert parts["compile"]["rerun"] == "`bash scripts/gpu_check.sh --only compile --accelerator cpu`"
    together = f"bash scripts/gpu_check.sh --only precisions,lora,compile --accelerator cpu --timeout precisions={2 * HANG_TIMEOUT}"
    assert together in dry_run.table
    # ... and in the last lines of stdout, which is what the device tool returns.
    assert f"  rerun: {together}" in dry_run.stdout.splitlines()[-6:], dry_run.stdout[-1000:]


def test_the_printed_rerun_runs_that_part_alone_into_a_table_of_its_own(dry_run):
    """The rerun line, run as printed: only that part runs, its table goes beside the full run's, which stays."""
    first = (dry_run.out / "gpu_check.md").read_text()
    line = next(r["rerun"].strip("`") for r in rows_of(dry_run.table, PARTS_HEADER) if r["part name"] == "`lora`")
    argv = line.split()
    assert argv[:2] == ["bash", "scripts/gpu_check.sh"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=clean_env(OUT=str(dry_run.out), PYTHON=sys.executable, GPU_CHECK_FAULT="lora=fail"))
    rerun = (dry_run.out / "gpu_check-lora.md").read_text()
    assert (dry_run.out / "gpu_check.md").read_text() == first
    assert "`bash scripts/gpu_check.sh --only lora --accelerator cpu`" in rerun.splitlines()[2]
    assert {r["part"] for r in rows_of(rerun)} == {"0 environment", gpu_check.BY_NAME["lora"].title}
    assert [r["part name"] for r in rows_of(rerun, PARTS_HEADER)] == ["`lora`"]
    assert proc.returncode == 1  # the injected failure, shown as one


def test_the_cuda_test_part_shows_a_file_whose_tests_all_skipped_as_skipped(tmp_path):
    """The part itself, run here: the CUDA file's tests all skip on CPU, and its row must say so."""
    rows_path = tmp_path / "rows.jsonl"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--part", "cuda-tests", "--accelerator", "cpu", "--rows", str(rows_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=clean_env(OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["case"]: r for r in map(json.loads, rows_path.read_text().splitlines())}
    assert list(rows) == [test.split("::")[0] for test in gpu_check.CUDA_TESTS]  # one row per file
    cuda = rows["tests/unit/pipe/test_pipeline_cuda.py"]
    assert cuda["status"] == "skipped" and cuda["detail"].startswith("0 passed, 0 failed") and "needs a CUDA device" in cuda["detail"]
    assert rows["tests/unit/test_virtual_devices.py"]["status"] == "pass"


# ---------------------------------------------------------------------------------- the driver's rules


def test_a_missing_module_or_gpu_skips_the_part_and_names_it():
    part = gpu_check.BY_NAME["lora"]
    env = {"modules": {"torch": "2", "lightning": "2", "transformers": "5"}, "errors": {"peft": "ModuleNotFoundError: No module named 'peft'"},
           "cuda": {"available": True, "count": 1}}
    reason = gpu_check.skip_reason(part, "gpu", env)
    assert "peft not importable here (ModuleNotFoundError" in reason and "nothing is installed" in reason
    env["modules"]["peft"] = "0.17"
    assert gpu_check.skip_reason(part, "gpu", env) is None
    assert gpu_check.skip_reason(gpu_check.BY_NAME["ddp"], "gpu", env) == "needs 2 GPUs, 1 visible"
    env["cuda"] = {"available": False, "count": 0}
    assert "no CUDA device visible" in gpu_check.skip_reason(part, "gpu", env)


def test_no_part_starts_once_the_budget_is_spent(tmp_path):
    run = gpu_check.Run("cpu", tmp_path / "t.md", tmp_path / "t.log", 450.0, None, time.perf_counter() - 445, {}, "", [])
    rows = gpu_check.part_rows(gpu_check.BY_NAME["trainers"], 80.0, run, tmp_path)
    assert [r.status for r in rows] == ["skipped"] and "budget" in rows[0].detail
    # A part the budget left out is one to rerun, by name.
    assert run.parts[-1].rerun == "bash scripts/gpu_check.sh --only trainers --accelerator cpu"


def test_a_part_is_cut_to_end_within_the_budget_a_killed_ones_grace_included(tmp_path, monkeypatch):
    """250 s into a 300 s run, a part with a 55 s timeout gets 300 - 250 - KILL_GRACE: even killed and slow to die it ends by 300."""
    monkeypatch.setenv("GPU_CHECK_FAULT", "trainers=fail")  # the part's process reports one row and exits at once
    run = gpu_check.Run("gpu", tmp_path / "t.md", tmp_path / "t.log", 300.0, None, time.perf_counter() - 250, {}, "", [])
    gpu_check.part_rows(gpu_check.BY_NAME["trainers"], 55.0, run, tmp_path)
    assert abs(run.parts[-1].timeout - (50 - gpu_check.KILL_GRACE)) < 1, run.parts[-1]


def test_the_whole_check_ends_within_five_minutes_on_one_gpu_and_the_script_installs_nothing():
    """Issue 40 item 10: nvidia-smi, the probe and every one-GPU part's timeout, and a killed part's grace, within 300 s,
    so that a second attempt (a rerun of what failed) fits in a 15-minute lease with the machine's start."""
    one_gpu = sum(p.timeout for p in gpu_check.PARTS if p.gpus <= 1) + gpu_check.NVIDIA_SMI_TIMEOUT + gpu_check.PROBE_TIMEOUT
    assert one_gpu + gpu_check.KILL_GRACE <= gpu_check.BUDGET <= 5 * 60
    listed = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--list"], capture_output=True, text=True,
                            timeout=60, cwd=ROOT, env=clean_env()).stdout
    assert re.search(rf"^one GPU +{one_gpu:.0f} s .*--budget 300 s", listed, re.M), listed
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    assert not re.search(r"\bpip\b|\bvenv\b|curl|wget", script), "the check must not install or fetch anything"


def test_only_failures_are_bold_and_pipes_do_not_break_the_table(tmp_path):
    run = gpu_check.Run("cpu", tmp_path / "t.md", tmp_path / "t.log", 450.0, gpu_check.datetime.datetime(2026, 1, 2, 3, 4),
                        time.perf_counter(), {}, "nvidia-smi: not found", [])
    run.rows = [gpu_check.Row("p", "a", gpu_check.SKIP, "not run", 0.0), gpu_check.Row("p", "b", gpu_check.FAIL, "|w - v| 1", 0.0)]
    rows = rows_of(gpu_check.render(run))
    assert [r["result"] for r in rows] == ["skipped", "**FAIL**"] and rows[1]["detail"] == "|w - v| 1"


# ---------------------------------------------------------------------------------- engagement, on made-up epochs


def plan(k: int, m: int, partition=(2, 2), frozen: int = 0) -> SimpleNamespace:
    return SimpleNamespace(pipe_len=k, chunks=m, partition=partition, num_frozen=frozen)


def epoch(runs, plan_, streams=None, caller=()) -> trainers.Epoch:
    return trainers.Epoch(runs=list(runs), streams=[Counter(s) for s in (streams or [{}] * len(runs))], caller=set(caller), plan=plan_)


def test_the_pipeline_is_read_while_k_is_2_not_in_the_plain_loop_of_the_last_epoch():
    steps = trainers.STEPS
    ok, text = trainers.pipeline_engaged(epoch([1 + 2 * steps] * 4, plan(2, 2)), 2, probe=1)
    assert ok and "streams not checked (CPU)" in text
    # The last epoch's plan (K=1): every block ran once per micro-batch, but that is the plain loop's count too.
    ok, text = trainers.pipeline_engaged(epoch([2 * steps] * 4, plan(1, 2, (4,), 3)), 2, probe=0)
    assert not ok and "not K=2" in text
    ok, _ = trainers.pipeline_engaged(epoch([1 + steps] * 4, plan(2, 2)), 2, probe=1)  # one micro-batch per step: not split
    assert not ok


def test_each_stage_must_run_on_a_stream_of_its_own_not_the_loops():
    per_block = 2 * trainers.STEPS
    loop, s1, s2 = 100, 201, 202
    good = [{s1: per_block, loop: 1}] * 2 + [{s2: per_block, loop: 1}] * 2
    ok, text = trainers.pipeline_engaged(epoch([per_block + 1] * 4, plan(2, 2), good, [loop]), 2, probe=1)
    assert ok and "stage 0 on {'s1'" in text and "stage 1 on {'s2'" in text, text
    one_stream = [{s1: per_block, loop: 1}] * 4
    assert not trainers.pipeline_engaged(epoch([per_block + 1] * 4, plan(2, 2), one_stream, [loop]), 2, probe=1)[0]
    on_the_loop = [{loop: per_block + 1}] * 2 + [{s2: per_block, loop: 1}] * 2
    assert not trainers.pipeline_engaged(epoch([per_block + 1] * 4, plan(2, 2), on_the_loop, [loop]), 2, probe=1)[0]


def test_the_cache_must_serve_its_frozen_blocks():
    steps = trainers.STEPS
    served = epoch([1, 1, 1, 2 * steps], plan(1, 2, (4,), 3))
    assert trainers.cache_served(served, {"autocache/hits": 96})[0]
    assert not trainers.cache_served(served, {"autocache/hits": 0})[0]
    assert not trainers.cache_served(epoch([steps, steps, steps, 2 * steps], plan(1, 2, (4,), 3)), {"autocache/hits": 96})[0]


# ---------------------------------------------------------------------------------- the timing part's code, on a tiny stack


def test_the_timing_part_runs_its_code_and_reports_ratios_as_measurements(monkeypatch, one_thread):
    deadline = time.time() + 20
    monkeypatch.setenv("GPU_CHECK_PART_DEADLINE", f"{deadline:.1f}")
    rows: list[gpu_check.Row] = []
    shape = timing.Shape(layers=4, hidden=32, heads=2, batch=8, seq=8, chunks=(1, 2), warmup=1, rounds=3, min_rounds=2)
    timing.part_timing("cpu", rows.append, shape)
    assert "ONE GPU: both stages share its SMs" in rows[0].detail
    checks = [r for r in rows if r.status != gpu_check.INFO]
    assert [r.status for r in checks] == [gpu_check.PASS] * 2, checks  # float32 and bfloat16
    ratios = [r for r in rows if "K=2 / K=1" in r.case]
    assert len(ratios) == 4 and all(r.status == gpu_check.INFO and re.search(r"ratio \d+\.\d{3}", r.detail) for r in ratios)
    # The last lines of stdout carry the ratios too (the device tool returns only the tail).
    run = gpu_check.Run("cpu", None, None, 450.0, None, time.perf_counter(), {}, "", rows)
    last = gpu_check.summary(run)[-1]
    assert "ONE GPU" in last and all(f"{dtype} M={m} " in last for dtype in ("float32", "bfloat16") for m in (1, 2)), last
    assert time.time() < deadline  # it shares out the time left and ends before the driver would kill it


def test_the_timing_part_catches_a_k2_that_computes_something_else(one_thread):
    shape = timing.Shape(layers=2, hidden=16, heads=2, batch=4, seq=4, chunks=(2,))
    blocks = timing.build_blocks(shape, torch.device("cpu"), torch.float32)
    found = timing.variants(blocks, shape, torch.device("cpu"))
    hidden, mask = timing.batch_inputs(shape, torch.device("cpu"), torch.float32)
    assert timing.same_results(blocks, found, hidden, mask, torch.float32)[0]
    right = found["K=2 M=2"]
    found["K=2 M=2"] = lambda h, m: right(h, m) * 1.001
    assert not timing.same_results(blocks, found, hidden, mask, torch.float32)[0]


# ---------------------------------------------------------------------------------- the docs and the lent machine's versions


def test_the_docs_table_lists_the_script_parts_files_and_timeouts():
    """docs/gpu_check.md's table says what the script runs: part 1's files exactly, every part's timeout."""
    docs = (ROOT / "docs" / "gpu_check.md").read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| \d `([a-z-]+)` \|.*$", docs, re.M)}
    assert set(rows) == set(gpu_check.BY_NAME), sorted(rows)
    for part in gpu_check.PARTS:
        assert f"| {part.timeout:.0f} s |" in rows[part.name], part.name
    named = set(re.findall(r"`(tests/[^`]+\.py(?:::\w+)?)`", rows["cuda-tests"]))
    assert named == set(gpu_check.CUDA_TESTS), named ^ set(gpu_check.CUDA_TESTS)
    assert "aot_eager" in rows["compile"]


def test_a_failure_on_other_versions_says_so_and_names_an_api_error():
    lent = {"python": "3.12.3", "modules": {"torch": "2.11.0+cu130", "lightning": "2.6.1", "transformers": "5.17.0"}}
    failed = gpu_check.Row("2 Trainers fp32", "bert", gpu_check.FAIL, "TypeError: forward() got an unexpected keyword argument 'x'", 1.0)
    note = gpu_check.with_version_note(failed, lent).detail
    assert "looks like an API difference" in note and "torch 2.11.0+cu130 here, written for 2.13" in note
    assert "transformers 5.17.0 here" in note and "lightning" not in note  # 2.6 = 2.6
    plain = gpu_check.with_version_note(gpu_check.Row("p", "c", gpu_check.FAIL, "|w - v| 0.3", 1.0), lent).detail
    assert "may be a version difference" in plain
    passed = gpu_check.Row("p", "c", gpu_check.PASS, "ok", 1.0)
    assert gpu_check.with_version_note(passed, lent) is passed
    same = {"python": "3.11.7", "modules": {"torch": "2.13.0", "transformers": "5.24.0"}}
    assert gpu_check.with_version_note(failed, same) is failed  # nothing differs: no note
