"""Tests of the text example on a tiny synthetic corpus, a tiny BERT and a tokenizer built offline."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

import rotten_tomatoes as rt  # noqa: E402
from launch import clean_env

WORDS = "good bad great awful fun boring movie film the a plot story acting".split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _write_corpus(path: Path, movies: int = 12, per_movie: int = 6) -> None:
    """A CSV with the real file's columns: fresh/rotten reviews, plot rows, a duplicate, an empty text."""
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(rt.COLUMNS)
        for m in range(movies):
            movie = f"movie {m}"
            w.writerow(["plot", f"the plot of {movie} is a story", movie, True])
            for i in range(per_movie):
                fresh = (m + i) % 2 == 0
                word = WORDS[(i + m) % 6]
                text = f"{'good great fun' if fresh else 'bad awful boring'} {word} movie {m} {i}"
                w.writerow(["fresh" if fresh else "rotten", text, movie, i % 2 == 0])
        w.writerow(["fresh", "good great fun good movie 0 0", "movie 0", False])  # duplicate text: dropped
        w.writerow(["rotten", "", "movie 1", False])  # empty text: dropped


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a folder with a 3-block BERT + its tokenizer, a corpus CSV)."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    root = tmp_path_factory.mktemp("tiny")
    vocab = SPECIAL + WORDS + [str(i) for i in range(20)]
    tokenizer = BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)})
    model_dir = root / "tiny-bert"
    tokenizer.save_pretrained(model_dir)
    config = BertConfig(
        vocab_size=len(vocab), hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(model_dir)
    corpus = root / "corpus.csv"
    _write_corpus(corpus)
    return model_dir, corpus


def test_reading_drops_plot_empty_and_duplicates_and_labels_right(tiny_assets: tuple[Path, Path]) -> None:
    _, corpus = tiny_assets
    reviews = rt.read_reviews(corpus)
    assert len(reviews) == 12 * 6
    assert not any("plot of" in r.text for r in reviews)
    assert len({r.text for r in reviews}) == len(reviews)
    for r in reviews:
        assert r.label == (1 if r.text.startswith("good") else 0)


def test_split_is_by_movie_and_seeded(tiny_assets: tuple[Path, Path]) -> None:
    _, corpus = tiny_assets
    reviews = rt.read_reviews(corpus)
    train, val = rt.split_by_movie(reviews, val_fraction=0.3, seed=0)
    assert {r.movie for r in train}.isdisjoint({r.movie for r in val})
    assert len(train) + len(val) == len(reviews)
    assert 0.25 <= len(val) / len(reviews) <= 0.4
    assert rt.split_by_movie(reviews, 0.3, seed=0) == (train, val)
    assert rt.split_by_movie(reviews, 0.3, seed=1) != (train, val)


def test_bad_csv_says_what_is_wrong(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("category,review\nfresh,nice\n")
    with pytest.raises(ValueError, match="lacks the column"):
        rt.read_reviews(bad)
    with pytest.raises(FileNotFoundError, match="assets.py fetch"):
        rt.read_reviews(tmp_path / "missing.csv")


def test_datamodule_batches_and_module_logits(tiny_assets: tuple[Path, Path]) -> None:
    from text_classification import SentimentClassifier

    model_dir, corpus = tiny_assets
    dm = rt.RottenTomatoesDataModule(
        tokenizer=str(model_dir), csv_path=str(corpus), train_size=20, val_size=8,
        val_fraction=0.3, max_length=16, batch_size=8,
    )  # fmt: skip
    dm.setup("fit")
    assert dm.train_set is not None and dm.val_set is not None
    assert len(dm.train_set) == 20 and len(dm.val_set) == 8
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "attention_mask", "labels", "index"}
    assert batch["input_ids"].shape[0] == 8
    assert batch["input_ids"].shape[1] == int(batch["attention_mask"].sum(1).max()) <= 16  # trimmed
    assert batch["input_ids"][:, 0].eq(2).all()  # [CLS] first: the tokenizer is ours

    module = SentimentClassifier(pretrained=str(model_dir))
    module.on_fit_start()
    assert module.model.training  # transformers 5 loads in eval mode; the module switches back
    logits = module(batch["input_ids"], batch["attention_mask"])
    assert logits.shape == (8, 2)


@pytest.mark.parametrize("strategy", ["auto", "pipetransformer"])
def test_cli_fit_with_autofreeze_and_timeline(tiny_assets: tuple[Path, Path], tmp_path: Path, strategy: str) -> None:
    """The shipped YAML, with its paths pointed at the tiny assets, runs `fit` end to end; switching
    to PipeTransformer is the one line ``trainer.strategy: pipetransformer``."""
    if strategy == "pipetransformer":
        from lightning.pytorch.strategies import StrategyRegistry

        import lightning_pipetransformer  # noqa: F401  (registers the strategy if it exists)

        if "pipetransformer" not in StrategyRegistry:
            pytest.skip("strategy='pipetransformer' is not registered yet")
    model_dir, corpus = tiny_assets
    config = yaml.safe_load((EXAMPLES / "configs" / "text_minilm.yaml").read_text())
    config["model"]["pretrained"] = str(model_dir)
    config["data"].update(csv_path=str(corpus), train_size=32, val_size=16, val_fraction=0.3, max_length=16, batch_size=8)
    trainer = config["trainer"]
    trainer.update(strategy=strategy, max_epochs=3, default_root_dir=str(tmp_path / "out"), enable_progress_bar=False, enable_model_summary=False)
    trainer["logger"]["init_args"]["save_dir"] = str(tmp_path / "out")
    timeline = next(cb for cb in trainer["callbacks"] if cb["class_path"].endswith("Timeline"))
    timeline["init_args"].update(plot_path=str(tmp_path / "timeline.png"), json_path=str(tmp_path / "timeline.json"))
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(config))

    # An empty asset cache: reaching for the real assets would fail loudly instead of downloading.
    env = clean_env(PIPETRANSFORMER_ASSETS=str(tmp_path / "no-assets"), HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "text_classification.py"), "fit", "--config", str(cfg_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PipeTransformer timeline" in proc.stdout
    rows = json.loads((tmp_path / "timeline.json").read_text())
    assert [r["epoch"] for r in rows] == [0, 1, 2]
    frozen = [int(r["frozen"].split("/")[0]) for r in rows]
    assert frozen[0] == 0 and frozen == sorted(frozen) and rows[0]["frozen"].endswith("/3")
    if strategy == "auto":
        assert all(r["pipe_len"] == "-" and r["replicas"] == "-" for r in rows)  # no plan to read
    else:
        assert all(r["pipe_len"].isdigit() and r["replicas"] == "1" for r in rows)
    assert all(r["metric"] is not None and 0.0 <= r["metric"] <= 1.0 for r in rows)
    # The JSON carries the cache's bytes per epoch; neither strategy here caches (cache=False by default).
    assert all(r["cache_mem_bytes"] is None and r["cache_disk_bytes"] is None for r in rows)
    assert (tmp_path / "timeline.png").stat().st_size > 1000
    assert not (tmp_path / "no-assets").exists()
