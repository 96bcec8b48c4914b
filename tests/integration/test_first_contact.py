"""What a newcomer meets first: the use_cache notice, the strategy's CLI help, ``timeout`` as a
timedelta, where the cache's folders go (and that empty ones do not stay behind), and what an
ordinary run prints: every line fits 120 columns, and the timeline's summary comes last."""

from __future__ import annotations

import inspect
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy, PipeTransformerTimeline
from tests.helpers.families import FamilyModule, family_data
from tests.helpers.launch import clean_env, is_alive


@pytest.mark.parametrize(("family", "said"), [("bert", False), ("llama", True)])
def test_the_notice_only_where_a_kv_cache_exists(family: str, said: bool, caplog) -> None:
    module = FamilyModule(family)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=PipeTransformerStrategy(pipe_len=2), max_epochs=1, limit_train_batches=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    with caplog.at_level(logging.INFO):
        trainer.fit(module, family_data(family))
    notices = [r.getMessage() for r in caplog.records if "config.use_cache" in r.getMessage()]
    assert bool(notices) == said, notices
    if said:
        assert "Not AutoCache" in notices[0]
    assert module.model.config.use_cache is True  # restored after fit either way


# ------------------------------------------------------------------------------------------ LightningCLI help

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
HIDDEN = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin")


def _help_entries(text: str, prefix: str) -> dict[str, str]:
    """``{argument: its description}`` from argparse's help (the words before ``(type: ...``)."""
    entries: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        match = re.match(rf"  --{re.escape(prefix)}\.(\w+)\b", line)
        if match:
            current = match.group(1)
            entries[current] = ""
            line = line[match.end():]
            line = re.sub(r"^\s*\S+", "", line)  # the metavar
        elif current is None or not line.startswith(" " * 10):
            current = None if not line.startswith(" ") else current
            continue
        entries[current] += " " + line.strip()
    return {k: " ".join(v.split()) for k, v in entries.items()}


def test_cli_help_describes_every_strategy_argument_and_hides_lightnings() -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "synthetic_cli.py"), "fit", "--trainer.strategy.help", "lightning_pipetransformer.PipeTransformerStrategy"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "100"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    entries = _help_entries(proc.stdout, "trainer.strategy")
    params = [p.name for p in inspect.signature(PipeTransformerStrategy.__init__).parameters.values()
              if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD]  # fmt: skip
    assert set(entries) == set(params), (sorted(entries), params)
    undescribed = [name for name in params if len(entries[name].split("(type:")[0].split()) < 4]
    assert not undescribed, f"no description in --trainer.strategy.help: {undescribed}\n{proc.stdout[-3000:]}"
    assert not [h for h in HIDDEN if f"--trainer.strategy.{h}" in proc.stdout]
    assert "timedelta" in entries["timeout"] and "4 GiB" in entries["cache_memory"]


def test_lightnings_arguments_still_work_and_unknown_ones_are_named() -> None:
    strategy = PipeTransformerStrategy(parallel_devices=[torch.device("cpu")])
    assert strategy.parallel_devices == [torch.device("cpu")]
    with pytest.raises(TypeError, match=r"unexpected argument\(s\) \['pipe_length'\].*pipe_len"):
        PipeTransformerStrategy(pipe_length=2)


# ------------------------------------------------------------------------------------------ timeout

@pytest.mark.parametrize(("given", "seconds"), [(timedelta(minutes=5), 300.0), (90, 90.0), (12.5, 12.5), ("60", 60.0)])
def test_timeout_takes_a_timedelta_or_seconds(given, seconds) -> None:
    strategy = PipeTransformerStrategy(timeout=given)
    assert strategy.config.timeout == seconds
    assert strategy._timeout == timedelta(seconds=seconds)  # what the process groups get


def test_the_command_line_takes_a_timedelta_too() -> None:
    """LightningCLI (jsonargparse) reads ``--trainer.strategy.timeout 0:05:00`` as a timedelta, which the strategy takes."""
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser()
    parser.add_class_arguments(PipeTransformerStrategy, "strategy")
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
    for given, seconds in (("0:05:00", 300.0), ("90", 90.0)):
        strategy = instantiate(parser.parse_args(["--strategy.timeout", given])).strategy
        assert strategy.config.timeout == seconds and strategy._timeout == timedelta(seconds=seconds), given


@pytest.mark.parametrize("bad", [0, -1, timedelta(0), True, "soon", float("inf")])
def test_a_bad_timeout_is_refused_with_what_to_pass(bad) -> None:
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds or a datetime.timedelta"):
        PipeTransformerStrategy(timeout=bad)


# ------------------------------------------------------------------------------------------ the cache's folders

class StoreFolder(Callback):
    """The current store's folder at each epoch end (it exists while the fit runs)."""

    def __init__(self) -> None:
        self.seen: list[Path] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        store = trainer.strategy.autocache.store
        if store is not None:
            assert store.directory.is_dir()
            self.seen.append(Path(store.directory))


def _cached_fit(tmp_path: Path, **strategy_kwargs) -> tuple[pl.Trainer, StoreFolder]:
    folders = StoreFolder()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=PipeTransformerStrategy(cache=True, **strategy_kwargs), max_epochs=3,
        callbacks=[AutoFreeze(schedule={1: 1, 2: 2}), folders], default_root_dir=str(tmp_path / "run"), logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(FamilyModule("bert"), family_data("bert"))
    return trainer, folders


def test_the_default_cache_dir_is_under_the_runs_root_and_empty_folders_go(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # where a script would start: nothing may be left here
    trainer, folders = _cached_fit(tmp_path)
    root = tmp_path / "run" / "pipetransformer_cache"
    assert folders.seen and all(f.parent == root for f in folders.seen)  # under default_root_dir while fitting
    assert trainer.strategy.cache_stats["autocache/hits"] > 0  # the cache engaged (entries in memory)
    assert not root.exists(), list(root.rglob("*"))  # every entry was in memory: the empty folders are gone
    assert not (tmp_path / "pipetransformer_cache").exists()


def test_folders_with_entries_stay_and_a_given_cache_dir_is_kept(tmp_path) -> None:
    # cache_memory=0: every entry on disk, so the store's folder holds files and stays.
    _, folders = _cached_fit(tmp_path, cache_memory=0)
    assert folders.seen[-1].is_dir() and any(folders.seen[-1].iterdir())
    # A cache_dir of one's own: the empty store folder inside goes, the folder itself stays.
    mine = tmp_path / "mine"
    _, folders = _cached_fit(tmp_path / "second", cache_dir=str(mine))
    assert all(f.parent == mine for f in folders.seen) and mine.is_dir() and not any(mine.iterdir())


# ------------------------------------------------------------------------------------------ what an ordinary run prints

#: The widest line a newcomer's terminal shows without wrapping mid-word (the package wraps its messages at 100).
WIDEST = 120
#: Lightning's own notices, not the package's (the demo hides them: examples/quiet.py).
THIRD_PARTY = ("litlogger", "LeafSpec")


def _short_fit(
    tmp_path: Path, family: str, strategy: PipeTransformerStrategy | str, progress: Callback | None = None
) -> pl.Trainer:
    """Three epochs with AutoFreeze (1, then 2 blocks) and the timeline listed first, as the demo runs them."""
    timeline = PipeTransformerTimeline(dirpath=str(tmp_path), save_plot=False)
    callbacks: list[Callback] = [timeline, AutoFreeze(schedule={1: 1, 2: 2})]
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_epochs=3, callbacks=callbacks + ([progress] if progress else []),
        default_root_dir=str(tmp_path), logger=False, enable_checkpointing=False, enable_progress_bar=progress is not None,
        enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(FamilyModule(family), family_data(family), family_data(family, seed=1))
    return trainer


@pytest.mark.parametrize(
    ("family", "strategy"),
    [("bert", "cache"), ("llama", "pipe_len=2"), ("bert", "auto")],
    ids=["bert-cache", "llama-pipeline", "bert-plain-trainer"],
)
def test_every_line_a_short_fit_prints_fits_120_columns(tmp_path: Path, family: str, strategy: str, caplog, capsys) -> None:
    """The block-stack line (some 300 columns with the model's head, dropout and metrics listed), the
    self-check line (some 210), the use_cache notice of a decoder: each is wrapped or shortened, and
    the full lists are at DEBUG on the package's logger."""
    chosen = {
        "cache": PipeTransformerStrategy(cache=True), "pipe_len=2": PipeTransformerStrategy(pipe_len=2), "auto": "auto",
    }[strategy]  # fmt: skip
    with caplog.at_level(logging.DEBUG), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _short_fit(tmp_path, family, chosen)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    lines = [line for message in said + [str(w.message) for w in caught] for line in message.splitlines()]
    lines += capsys.readouterr().out.splitlines()
    ours = [line for line in lines if not any(name in line for name in THIRD_PARTY)]
    assert any(line.startswith("AutoFreeze: block stack") for line in ours) and "PipeTransformer timeline" in ours
    if strategy == "cache":
        assert any("self-check passed" in line for line in ours)  # the line that was 210 columns is there, wrapped
    widest = max(ours, key=len)
    assert len(widest) <= WIDEST, f"{len(widest)} columns: {widest}"
    # Nothing is lost: the stack's full description is on the package's logger at DEBUG.
    debug = [r.getMessage() for r in caplog.records if r.name == "lightning_pipetransformer" and r.levelno == logging.DEBUG]
    assert any("by registration order until the first training forward" in m for m in debug), debug


def test_the_timelines_summary_is_the_last_thing_a_fit_prints(tmp_path: Path, capsys) -> None:
    """Lightning's RichProgressBar stops its live display in ``teardown``, after ``on_fit_end`` where
    the timeline prints: its last frame (the metrics column wrapped) came after the summary. The
    timeline stops it first, so the table and summary close the run's output."""
    pytest.importorskip("rich")
    from lightning.pytorch.callbacks import RichProgressBar

    _short_fit(tmp_path, "bert", PipeTransformerStrategy(cache=True), progress=RichProgressBar())
    out = capsys.readouterr().out
    assert "Epoch 2/2" in out  # the bar was drawn
    after_table = out[out.index("PipeTransformer timeline"):]
    printed = [line for line in after_table.splitlines() if line.strip()]
    assert printed[-1] == f"written: {tmp_path / 'timeline.json'}", printed[-6:]
    assert "Epoch" not in after_table, after_table[-1500:]


# ------------------------------------------------------------------------------------------ Ctrl-C on the test command

ROOT = EXAMPLES.parent


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc (Linux)")
def test_ctrl_c_on_the_test_command_ends_every_process_it_started(tmp_path: Path) -> None:
    """scripts/test.sh runs a test that starts a spawn worker and a rank in a session of its own (which starts
    another); SIGINT to the command's process group, as a terminal's Ctrl-C sends it, ends all of them within
    seconds. Before, the ranks in their own session (which the terminal's SIGINT never reaches) ran on."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "test.sh", repo / "scripts" / "test.sh")
    (repo / "scripts" / "setup.sh").write_text("exit 0\n")  # .venv set up already (setup.sh has tests of its own)
    shutil.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")
    (repo / "tests").symlink_to(ROOT / "tests")
    python = repo / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # this interpreter, as .venv's
    python.chmod(0o755)
    pids = tmp_path / "pids"
    env = clean_env(PIPETRANSFORMER_INTERRUPT_PIDS=str(pids), PYTHONPATH=str(ROOT))
    command = ["bash", "scripts/test.sh", "-q", "-p", "no:cacheprovider", "tests/helpers/interrupt_target.py"]
    proc = subprocess.Popen(
        command, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    started: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while len(started) < 3:  # the spawn worker, rank 0 and the rank it started
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the target did not start its processes: {started}\n{proc.communicate()[0][-3000:]}")
            time.sleep(0.5)
            started = [int(x) for x in pids.read_text().split()] if pids.exists() else []
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals its foreground process group
        interrupted = time.monotonic()
        out, _ = proc.communicate(timeout=60)
        while any(is_alive(p) for p in started) and time.monotonic() - interrupted < 5:
            time.sleep(0.1)
        survivors = [p for p in started if is_alive(p)]
        assert not survivors, f"still running {time.monotonic() - interrupted:.1f} s after Ctrl-C: {survivors}\n{out[-2000:]}"
        assert proc.returncode != 0 and "KeyboardInterrupt" in out, out[-2000:]
    finally:
        for pid in [proc.pid, *started]:
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)
