"""AutoCache's logged counters: a short set under ``autocache/``, the rest under ``autocache_diagnostics/``,
every one described, and counters that agree with each other.

The case that once disagreed: after a second boundary move every lookup is answered by the earlier
boundary's entries, advanced on read (a lazy advance). The store counted those as hits
(``hit_rate`` 1.0) while ``batches_served`` counted only the new store's own hits (0).
"""

from __future__ import annotations

import re
from pathlib import Path

import lightning.pytorch as pl

from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy
from lightning_pipetransformer.report import CACHE_DIAGNOSTICS, CACHE_METRICS
from tests.helpers.families import FamilyModule, family_data
from tests.helpers.loggers import Recorder

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def test_lazy_advance_counts_as_served_and_the_logged_metrics_are_split() -> None:
    recorder = Recorder()
    strategy = PipeTransformerStrategy(cache=True, cache_memory=10**8)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_epochs=3, callbacks=[AutoFreeze(schedule={1: 1, 2: 2})],
        logger=recorder, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(FamilyModule("bert"), family_data("bert"))
    stats = {k.split("/", 1)[1]: v for k, v in strategy.cache_stats.items()}
    # Epoch 2 (boundary 2): every lookup answered by boundary 1's entries, advanced on read.
    assert stats["boundary"] == 2 and stats["misses"] == 0 and stats["hits"] > 0 and stats["advanced"] == stats["hits"]
    assert stats["hit_rate"] == 1.0 and stats["served_fraction"] == 1.0 and stats["batches_served"] > 0

    logged = {k for call in recorder.calls for k in call if k.startswith("autocache")}
    shown = {k.split("/", 1)[1] for k in logged if k.startswith("autocache/")}
    diagnostics = {k.split("/", 1)[1] for k in logged if k.startswith("autocache_diagnostics/")}
    # The short set (period_hit_rate only from the second report at one boundary on: each boundary here lasts one epoch).
    assert shown == set(CACHE_METRICS) - {"period_hit_rate"}, shown
    assert diagnostics and diagnostics <= set(CACHE_DIAGNOSTICS), diagnostics - set(CACHE_DIAGNOSTICS)
    assert set(stats) <= set(CACHE_METRICS) | set(CACHE_DIAGNOSTICS), "a counter without a description"
    last = next(call for call in reversed(recorder.calls) if "autocache/hits" in call)
    assert last["autocache/hits"] == stats["hits"] and last["autocache_diagnostics/batches_served"] == stats["batches_served"]


def test_every_logged_name_is_documented_in_the_user_guide() -> None:
    guide = (DOCS / "user-guide.md").read_text()
    missing = [f"autocache/{n}" for n in CACHE_METRICS if f"`autocache/{n}`" not in guide]
    missing += [n for n in CACHE_DIAGNOSTICS if f"`{n}`" not in guide]
    missing += [n for n in ("pt/frozen", "pt/pipe", "pt/replicas", "pt/cache_hit_rate") if f"`{n}`" not in guide]
    assert not missing, f"docs/user-guide.md does not describe: {missing}"


def test_docs_and_messages_name_each_counter_as_the_loggers_get_it() -> None:
    """A diagnostic is logged as ``autocache_diagnostics/NAME``: a page or a warning that sends the reader
    to ``autocache/NAME`` for one sends them to a metric their logger never received."""
    texts = [*DOCS.glob("*.md"), ROOT / "README.md", *(ROOT / "lightning_pipetransformer").rglob("*.py")]
    wrong = []
    for path in texts:
        text = path.read_text()
        # In the package only names in prose (after "in " or "("): the code builds cache_stats keys, which keep "autocache/".
        pattern = r"autocache/(\w+)" if path.suffix == ".md" else r"(?:\bin |\()`?autocache/(\w+)"
        wrong += [f"{path.relative_to(ROOT)}: autocache/{name}" for name in re.findall(pattern, text) if name not in CACHE_METRICS]
    assert not wrong, f"logged as autocache_diagnostics/..., not autocache/...: {wrong}"
