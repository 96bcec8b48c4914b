"""The demo on a busy machine: the threads it picks, the notices it hides, and the reference line that
tells a slow machine from a broken run (examples/machine.py, examples/quiet.py, examples/reference.py)."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.launch import clean_env

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

import machine  # noqa: E402
import quiet  # noqa: E402
import reference  # noqa: E402

# ------------------------------------------------------------------ threads


@pytest.mark.parametrize(
    ("cpus", "cores", "busy", "threads"),
    [(2, 2, 0.1, 2), (2, 2, 1.0, 1), (2, 2, 2.0, 1), (4, 4, 1.6, 2), (16, 8, 0.0, 8), (1, 1, 0.9, 1)],
)
def test_one_thread_per_free_core(cpus: int, cores: int, busy: float, threads: int) -> None:
    """A busy core is left to its work (torch's threads would wait on it at every operation); never more threads
    than physical cores, never none."""
    assert machine.choose_threads(cpus, cores, busy) == threads


def test_machine_prints_what_the_demo_reads() -> None:
    run = [sys.executable, str(EXAMPLES / "machine.py"), "--sample", "0.2"]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    first, chosen, why = proc.stdout.splitlines()
    threads, cpus, busy = first.split()
    assert 1 <= int(threads) <= int(cpus) and 0.0 <= float(busy) <= int(cpus)
    assert chosen.startswith(f"{threads} torch thread") and "OMP_NUM_THREADS" in why
    assert max(len("demo: " + line) for line in (chosen, why)) <= 80
    mine = subprocess.run([*run, "--threads", "3"], capture_output=True, text=True, timeout=60)
    assert mine.stdout.split()[0] == "3" and "set by OMP_NUM_THREADS" in mine.stdout


def test_demo_sets_the_threads_it_measured_and_reports_them() -> None:
    """scripts/demo.sh exports OMP_NUM_THREADS from examples/machine.py (unless set: then that count is reported)
    before the first training run, and hands the measurement to examples/reference.py."""
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    measured = demo.index("examples/machine.py ${OMP_NUM_THREADS:+--threads \"$OMP_NUM_THREADS\"}")
    assert measured < demo.index('export OMP_NUM_THREADS="$threads"') < demo.index("examples/text_classification.py fit")
    assert '--machine "$threads" "$cpus" "$busy"' in demo


# ------------------------------------------------------------------ the reference line

def _readme_rows(speed: float) -> tuple[list[dict], list[dict]]:
    """A demo run with the README's seeded numbers at ``speed`` times its samples/s, and its plain reference."""
    run = reference.README_RUN
    demo = [
        dict(epoch=e, frozen=f, cache_hits=h, metric=a, samples=run.samples_per_epoch, train_s=10.0,
             samples_per_s=speed * run.epoch0_samples_per_s * (1 + e))
        for e, (f, h, a) in enumerate(zip(run.frozen, run.hits, run.accuracy))
    ]  # fmt: skip
    return demo, [dict(epoch=1, frozen="-", samples=384, samples_per_s=speed * run.plain_samples_per_s)]


def _said(lines: list[str]) -> str:
    return " ".join(" ".join(lines).split())


def test_a_slow_machine_reads_apart_from_a_broken_run() -> None:
    demo, base = _readme_rows(speed=1 / 6)
    slow = _said(reference.machine_lines(demo, base, (1, 2, 1.0)))
    assert "1 torch thread(s), 2 CPU(s) of which 1.0 busy with other work" in slow
    assert "plain fine-tuning at 9.5 samples/s, where the README's run (2026-12-03, a quiet 2-core CPU, 2 threads) " \
           "had 57.1" in slow
    assert "6.0x slower than it" in slow and "nothing is broken; only this machine's speed differs" in slow

    demo[2]["cache_hits"] = "0/2500 (0%)"  # a cache that stopped serving: not a matter of speed
    broken = _said(reference.machine_lines(demo, base, (1, 2, 1.0)))
    assert "differs from the README's in what a slow machine cannot change: cache hits" in broken
    assert "nothing is broken" not in broken
    demo[2]["cache_hits"], demo[-1]["metric"] = reference.README_RUN.hits[2], 0.62
    assert "final accuracy 62.0% (README: 81.0%)" in _said(reference.machine_lines(demo, base, None))

    other = _said(reference.machine_lines(demo[:3], base, None))  # --trainer.max_epochs 3: nothing seeded to compare
    assert "not the README's setting" in other and "nothing is broken" not in other
    fast = _said(reference.machine_lines(*_readme_rows(speed=1.0), None))
    assert "about as fast as it" in fast and "nothing is broken" in fast


def test_the_readme_quotes_the_reference_run() -> None:
    """examples/reference.py compares with README_RUN: README.md must state the same run."""
    readme = " ".join(ROOT.joinpath("README.md").read_text().split())
    run = reference.README_RUN
    assert f"The run of {run.date}" in readme and run.machine in readme and f"{run.threads} torch threads" in readme
    assert f"plain fine-tuning measured at {run.plain_samples_per_s} samples/s" in readme
    assert f"(epoch 0 of the demo: {run.epoch0_samples_per_s})" in readme
    assert f"the demo's {run.train_s:.0f} s of training" in readme
    for epoch, (frozen, hits, acc) in enumerate(zip(run.frozen, run.hits, run.accuracy)):
        hit_cell = "-" if hits == "-" else hits
        row = rf"\| {epoch} \| {frozen} \| [\d.]+x \| {re.escape(hit_cell)} \| {100 * acc:.1f}% \|"
        assert re.search(row, readme), (epoch, frozen, hits)


def test_the_reference_says_this_machine_last_and_within_80_columns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    demo, base = _readme_rows(speed=0.5)
    (tmp_path / "demo.json").write_text(__import__("json").dumps({"rows": demo}))
    (tmp_path / "base.json").write_text(__import__("json").dumps({"rows": base}))
    reference.main([str(tmp_path / "demo.json"), str(tmp_path / "base.json"), "--machine", "1", "2", "1.0"])
    printed = capsys.readouterr().out
    assert max(len(line) for line in printed.splitlines()) <= reference.WIDTH
    paragraphs = printed.split("\nreference: ")
    assert "this machine (1 torch thread(s)" in paragraphs[-2] and "nothing is broken" in paragraphs[-1]


# ------------------------------------------------------------------ third-party notices

NOISY = """
import logging, sys, warnings
sys.path.insert(0, sys.argv[1])
import quiet
if quiet.hiding():
    quiet.hide_known_noise()
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning.pytorch.utilities._pytree import _tree_flatten
logging.getLogger("lightning.pytorch").setLevel(logging.INFO)
rank_zero_info("Tip: For seamless cloud logging, try installing [litlogger](https://pypi.org/project/litlogger/)")
rank_zero_info("an ordinary message")
_tree_flatten(1)  # Lightning's helper builds a LeafSpec: torch's FutureWarning
"""


@pytest.mark.parametrize("hide", ["1", "0"])
def test_the_demo_hides_known_third_party_notices_and_shows_them_when_asked(hide: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-W", "default", "-c", NOISY, str(EXAMPLES)], capture_output=True, text=True, timeout=120,
        env=clean_env(PIPETRANSFORMER_HIDE_NOISE=hide),
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "an ordinary message" in out, out
    assert ("litlogger" in out, "LeafSpec" in out) == ((False, False) if hide == "1" else (True, True)), out


def test_a_new_head_is_not_reported_but_anything_else_missing_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """transformers reports the classification head missing from an encoder's checkpoint (it is new): hidden while
    hiding; another missing weight is still said, by a warning of the example's own."""
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    config = BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    BertModel(config).save_pretrained(tmp_path / "encoder")  # no classifier.*: as MiniLM-L6's checkpoint
    monkeypatch.setenv(quiet.ENV, "1")
    with caplog.at_level(logging.WARNING), pytest.warns() as record:
        import warnings

        warnings.warn("marker", UserWarning)  # pytest.warns needs one; the test reads what else came
        quiet.load_pretrained(BertForSequenceClassification, str(tmp_path / "encoder"), num_labels=2)
    assert not [r for r in caplog.records if "LOAD REPORT" in r.getMessage()]
    assert [str(w.message) for w in record] == ["marker"]

    import safetensors.torch as st

    weights = st.load_file(tmp_path / "encoder" / "model.safetensors")
    kept = {k: v for k, v in weights.items() if "pooler" not in k}
    st.save_file(kept, tmp_path / "encoder" / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"weights missing, unexpected or mismatched in the checkpoint: .*pooler"):
        quiet.load_pretrained(BertForSequenceClassification, str(tmp_path / "encoder"), num_labels=2)
