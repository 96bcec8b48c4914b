"""Tests of the text example on a tiny synthetic corpus, a tiny BERT and a tokenizer built offline."""

from __future__ import annotations

import csv
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.launch import clean_env

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

import rotten_tomatoes as rt  # noqa: E402

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


# ------------------------------------------------------------------ the csv-module reader the datasets-based one replaced
# (examples/rotten_tomatoes.py before issue 15, verbatim in what it does): the split a run sees must not change.


def _reference_reviews(path: Path) -> list[tuple[str, int, str]]:
    seen: set[str] = set()
    out = []
    with path.open(encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            if row["category"] == "plot":
                continue
            text = (row["text"] or "").strip()
            if not text or text in seen:
                continue
            seen.add(text)
            out.append((text, {"rotten": 0, "fresh": 1}[row["category"]], row["movie_name"] or ""))
    return out


def _reference_split(reviews: list[tuple[str, int, str]], val_fraction: float, seed: int, train_size: int | None, val_size: int | None) -> tuple[list, list]:
    movies = sorted({r[2] for r in reviews})
    random.Random(seed).shuffle(movies)
    per_movie: dict[str, int] = {}
    for r in reviews:
        per_movie[r[2]] = per_movie.get(r[2], 0) + 1
    target, count, val_movies = val_fraction * len(reviews), 0, set()
    for movie in movies:
        if count >= target:
            break
        val_movies.add(movie)
        count += per_movie[movie]
    train = [r for r in reviews if r[2] not in val_movies]
    val = [r for r in reviews if r[2] in val_movies]

    def sub(rs: list, size: int | None, s: int) -> list:
        return rs if size is None or size >= len(rs) else random.Random(s).sample(rs, size)

    return sub(train, train_size, seed), sub(val, val_size, seed + 1)


def test_reading_drops_plot_empty_and_duplicates_and_labels_right(tiny_assets: tuple[Path, Path], tmp_path: Path) -> None:
    _, corpus = tiny_assets
    reviews = rt.read_reviews(corpus, tmp_path / "hf")
    assert len(reviews) == 12 * 6
    assert not any("plot of" in r.text for r in reviews)
    assert len({r.text for r in reviews}) == len(reviews)
    for r in reviews:
        assert r.label == (1 if r.text.startswith("good") else 0)
    assert [(r.text, r.label, r.movie) for r in reviews] == _reference_reviews(corpus)


def test_datasets_reads_every_text_as_a_string(tmp_path: Path) -> None:
    """load_dataset's CSV reader (pandas) would turn "NA", "null" or "nan" into missing values and
    numbers into ints: the module reads every column as a string, like the csv module did."""
    path = tmp_path / "odd.csv"
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(rt.COLUMNS)
        for text, movie in (("NA", "1917"), ("null", "nan"), ("  spaced  ", "None"), ("", "x"), ("2", "x")):
            w.writerow(["fresh", text, movie, ""])
    assert [(r.text, r.movie) for r in rt.read_reviews(path, tmp_path / "hf")] == [("NA", "1917"), ("null", "nan"), ("spaced", "None"), ("2", "x")]
    assert [(t, m) for t, _, m in _reference_reviews(path)] == [("NA", "1917"), ("null", "nan"), ("spaced", "None"), ("2", "x")]


def test_split_is_by_movie_and_seeded(tiny_assets: tuple[Path, Path], tmp_path: Path) -> None:
    _, corpus = tiny_assets
    movies = [r.movie for r in rt.read_reviews(corpus, tmp_path / "hf")]
    train, val = rt.split_by_movie(movies, val_fraction=0.3, seed=0)
    assert {movies[i] for i in train}.isdisjoint({movies[i] for i in val})
    assert sorted(train + val) == list(range(len(movies)))
    assert 0.25 <= len(val) / len(movies) <= 0.4
    assert rt.split_by_movie(movies, 0.3, seed=0) == (train, val)
    assert rt.split_by_movie(movies, 0.3, seed=1) != (train, val)


@pytest.mark.parametrize(("val_fraction", "seed", "train_size", "val_size"), [(0.3, 0, 20, 8), (0.4, 0, None, None), (0.25, 3, 30, 5)])
def test_datamodule_sides_equal_the_csv_reference(
    tiny_assets: tuple[Path, Path], tmp_path: Path, val_fraction: float, seed: int, train_size: int | None, val_size: int | None
) -> None:
    """The datasets-based module gives the split of the csv-module code it replaced: the same snippets,
    labels and order on each side; ``index`` is the position in the side, ``labels`` the label."""
    model_dir, corpus = tiny_assets
    dm = rt.RottenTomatoesDataModule(
        tokenizer=str(model_dir), csv_path=str(corpus), train_size=train_size, val_size=val_size, val_fraction=val_fraction,
        split_seed=seed, max_length=16, datasets_cache_dir=str(tmp_path / "hf"),
    )  # fmt: skip
    dm.setup("fit")
    ref_train, ref_val = _reference_split(_reference_reviews(corpus), val_fraction, seed, train_size, val_size)
    tokenizer = rt.load_tokenizer(str(model_dir))
    for side, ref in ((dm.train_set, ref_train), (dm.val_set, ref_val)):
        assert side is not None and len(side) == len(ref)
        assert side.labels.tolist() == [label for _, label, _ in ref]
        assert torch.equal(side.index, torch.arange(len(ref)))
        enc = tokenizer([t for t, _, _ in ref], padding="max_length", truncation=True, max_length=16, return_tensors="pt")
        assert torch.equal(side.input_ids, enc["input_ids"]) and torch.equal(side.attention_mask, enc["attention_mask"])
        batch = side.__getitems__([3, 0, 2])
        assert batch["index"].tolist() == [3, 0, 2] and torch.equal(batch["input_ids"], enc["input_ids"][[3, 0, 2]])


def test_tokenization_is_cached_on_disk_and_reused(tiny_assets: tuple[Path, Path], tmp_path: Path) -> None:
    """prepare_data tokenizes into datasets' cache (under datasets_cache_dir, nothing in the user's home);
    a second data module with the same settings, in setup, loads those files instead of tokenizing."""
    model_dir, corpus = tiny_assets
    cache = tmp_path / "hf"
    kwargs = {"tokenizer": str(model_dir), "csv_path": str(corpus), "train_size": 20, "val_size": 8, "val_fraction": 0.3, "max_length": 16}
    first = rt.RottenTomatoesDataModule(**kwargs, datasets_cache_dir=str(cache))
    first.prepare_data()
    sides = first.encode_sides()
    assert sides.cached and Path(sides.folder).is_relative_to(cache)
    files = sorted(cache.rglob("cache-*.arrow"))
    assert len(files) == 2  # one per side
    assert {Path(f["filename"]) for s in (sides.train, sides.val) for f in s.cache_files} == set(files)
    stamps = {f: f.stat().st_mtime_ns for f in files}

    second = rt.RottenTomatoesDataModule(**kwargs, datasets_cache_dir=str(cache))
    assert second.encode_sides().cached
    second.setup("fit")
    assert second.train_set is not None
    assert {Path(f["filename"]) for f in second.train_set.data.cache_files} <= set(files)
    assert {f: f.stat().st_mtime_ns for f in sorted(cache.rglob("cache-*.arrow"))} == stamps  # read, not rewritten

    # Another max_length is another tokenization: new files, the old ones kept.
    other = rt.RottenTomatoesDataModule(**{**kwargs, "max_length": 12}, datasets_cache_dir=str(cache))
    assert not other.encode_sides().cached
    assert len(list(cache.rglob("cache-*.arrow"))) == 4


def test_datasets_runs_offline() -> None:
    """Importing the example module sets HF_DATASETS_OFFLINE before datasets is imported (unless set)."""
    code = (
        "import os, sys; [os.environ.pop(k, None) for k in ('HF_DATASETS_OFFLINE', 'HF_HUB_OFFLINE')]; sys.path.insert(0, sys.argv[1]); "
        "import rotten_tomatoes, datasets; print(datasets.config.HF_HUB_OFFLINE)"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(EXAMPLES)], capture_output=True, text=True, timeout=120, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "True"


def test_bad_csv_says_what_is_wrong(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("category,review\nfresh,nice\n")
    with pytest.raises(ValueError, match="lacks the column"):
        rt.read_reviews(bad, tmp_path / "hf")
    with pytest.raises(FileNotFoundError, match="assets.py fetch"):
        rt.read_reviews(tmp_path / "missing.csv", tmp_path / "hf")
    unknown = tmp_path / "unknown.csv"
    unknown.write_text("category,text,movie_name\nfresh,nice,a\nmeh,so so,b\n")
    with pytest.raises(ValueError, match="unknown category 'meh'"):
        rt.read_reviews(unknown, tmp_path / "hf")


def test_length_buckets_give_each_snippet_the_same_input_every_epoch(tiny_assets: tuple[Path, Path], tmp_path: Path) -> None:
    """bucket_tokens: each batch holds snippets of one padded length, so a snippet's trimmed row is the
    same whatever its batch-mates (AutoCache's keys need that); every snippet comes once per epoch."""
    model_dir, corpus = tiny_assets
    dm = rt.RottenTomatoesDataModule(
        tokenizer=str(model_dir), csv_path=str(corpus), val_fraction=0.3, max_length=16, batch_size=4, bucket_tokens=4,
        datasets_cache_dir=str(tmp_path / "hf"),
    )  # fmt: skip
    dm.setup("fit")
    assert dm.train_set is not None
    lengths = dm.train_set.lengths
    rows: list[dict[int, torch.Tensor]] = []
    orders = []
    torch.manual_seed(0)
    for _ in range(2):  # two epochs
        seen: dict[int, torch.Tensor] = {}
        order = []
        for batch in dm.train_dataloader():
            width = batch["input_ids"].shape[1]
            assert width % 4 == 0 or width == 16
            for i, row in zip(batch["index"].tolist(), batch["input_ids"]):
                assert width == min(16, -(-int(lengths[i]) // 4) * 4)  # its own padded length
                seen[i] = row
                order.append(i)
        assert sorted(seen) == list(range(len(dm.train_set)))
        rows.append(seen)
        orders.append(order)
    assert all(torch.equal(rows[0][i], rows[1][i]) for i in rows[0])
    assert orders[0] != orders[1]  # reshuffled each epoch
    val_order = [i for b in dm.val_dataloader() for i in b["index"].tolist()]
    assert val_order == [i for b in dm.val_dataloader() for i in b["index"].tolist()]  # fixed batches
    with pytest.raises(ValueError, match="bucket_tokens"):
        rt.RottenTomatoesDataModule(trim_padding=False, bucket_tokens=8)


def test_the_shipped_yamls_list_the_timeline_before_autofreeze() -> None:
    """An epoch-level freeze (re-plan, cache advance) runs in AutoFreeze's on_train_epoch_start: the
    timeline must start the epoch's clock first (tests/integration/test_timeline.py: it warns otherwise)."""
    for config in sorted((EXAMPLES / "configs").glob("*.yaml")):
        paths = [cb["class_path"] for cb in yaml.safe_load(config.read_text())["trainer"].get("callbacks") or []]
        if any(p.endswith("Timeline") for p in paths) and any(p.endswith("AutoFreeze") for p in paths):
            assert paths.index("lightning_pipetransformer.PipeTransformerTimeline") < paths.index("lightning_pipetransformer.AutoFreeze"), config.name


def test_datamodule_batches_and_module_logits(tiny_assets: tuple[Path, Path], tmp_path: Path) -> None:
    from text_classification import SentimentClassifier

    model_dir, corpus = tiny_assets
    dm = rt.RottenTomatoesDataModule(
        tokenizer=str(model_dir), csv_path=str(corpus), train_size=20, val_size=8,
        val_fraction=0.3, max_length=16, batch_size=8, datasets_cache_dir=str(tmp_path / "hf"),
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


def test_layerwise_lr_decay_groups(tiny_assets: tuple[Path, Path]) -> None:
    """``SentimentClassifier(llrd=...)``: top block and head at lr, each block below times llrd, the
    embeddings times llrd**L; every trainable parameter in one group; LambdaLR keeps the ratios."""
    from text_classification import SentimentClassifier

    model_dir, _ = tiny_assets
    plain = SentimentClassifier(pretrained=str(model_dir), lr=1e-3).param_groups()
    assert [g["weight_decay"] for g in plain] == [0.01, 0.0] and "lr" not in plain[0]  # unchanged without llrd

    module = SentimentClassifier(pretrained=str(model_dir), lr=1e-3, llrd=0.5)  # 3 blocks
    groups = module.param_groups()
    placed = [id(p) for g in groups for p in g["params"]]
    assert sorted(placed) == sorted(id(p) for p in module.parameters()) and len(placed) == len(set(placed))
    lr_of = {id(p): g["lr"] for g in groups for p in g["params"]}
    decay_of = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    bert = module.model.bert
    expected = {
        bert.embeddings.word_embeddings.weight: 1e-3 * 0.5**3,
        bert.encoder.layer[0].attention.self.query.weight: 1e-3 * 0.5**2,
        bert.encoder.layer[1].output.dense.weight: 1e-3 * 0.5,
        bert.encoder.layer[2].output.dense.weight: 1e-3,
        bert.pooler.dense.weight: 1e-3,
        module.model.classifier.weight: 1e-3,
    }
    for param, lr in expected.items():
        assert lr_of[id(param)] == pytest.approx(lr)
    assert decay_of[id(bert.encoder.layer[0].output.LayerNorm.weight)] == 0.0
    assert decay_of[id(bert.encoder.layer[0].output.dense.weight)] == 0.01

    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.1 * (s + 1))
    for _ in range(3):
        optimizer.step()
        sched.step()
    for g in optimizer.param_groups:
        assert g["lr"] == pytest.approx(0.4 * 1e-3 * 0.5 ** g["depth"])
    # Only trainable parameters are placed (BaseFinetuning's frozen ones are not).
    for p in bert.embeddings.parameters():
        p.requires_grad_(False)
    assert not any(g["depth"] == 3 for g in module.param_groups())
    with pytest.raises(ValueError, match="llrd"):
        SentimentClassifier(pretrained=str(model_dir), llrd=1.5).param_groups()


@pytest.mark.parametrize(
    ("config_name", "strategy"),
    [("text_minilm.yaml", "auto"), ("text_minilm.yaml", "pipetransformer"), ("text_minilm_pipetransformer.yaml", None)],
)
def test_cli_fit_with_autofreeze_and_timeline(tiny_assets: tuple[Path, Path], tmp_path: Path, config_name: str, strategy: str | None) -> None:
    """The shipped YAMLs, with their paths pointed at the tiny assets, run `fit` end to end. In
    text_minilm.yaml switching to PipeTransformer is the one line ``trainer.strategy: pipetransformer``;
    the demo's YAML (strategy None: as shipped) runs it with AutoCache and length buckets, and the
    cache serves every lookup once the boundary it stored at is in place."""
    model_dir, corpus = tiny_assets
    config = yaml.safe_load((EXAMPLES / "configs" / config_name).read_text())
    config["model"]["pretrained"] = str(model_dir)
    config["data"].update(
        csv_path=str(corpus), train_size=32, val_size=16, val_fraction=0.3, max_length=16, batch_size=8,
        datasets_cache_dir=str(tmp_path / "hf"),
    )  # fmt: skip
    trainer = config["trainer"]
    if strategy is not None:
        trainer["strategy"] = strategy
    trainer.update(max_epochs=3, default_root_dir=str(tmp_path / "out"), enable_progress_bar=False, enable_model_summary=False)
    trainer["logger"]["init_args"]["save_dir"] = str(tmp_path / "out")
    timeline = next(cb for cb in trainer["callbacks"] if cb["class_path"].endswith("Timeline"))
    timeline["init_args"].update(dirpath=str(tmp_path))
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(config))

    # An empty asset cache: reaching for the real assets would fail loudly instead of downloading. The demo's
    # YAML runs as scripts/demo.sh runs it, known third-party notices hidden (examples/quiet.py); the others show them.
    hide = {"PIPETRANSFORMER_HIDE_NOISE": "1"} if strategy is None else {}
    env = clean_env(PIPETRANSFORMER_ASSETS=str(tmp_path / "no-assets"), HF_HUB_OFFLINE="1", HOME=str(tmp_path / "home"), **hide)
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "text_classification.py"), "fit", "--config", str(cfg_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    printed = (proc.stdout + proc.stderr).splitlines()
    noise = [line for line in printed if "litlogger" in line or "LeafSpec" in line]
    assert bool(noise) == (not hide), noise  # hidden under the switch, shown without it
    if hide:  # what the demo prints: every line fits 120 columns, the timeline's summary comes last
        # (but Lightning's warning that these 4 tiny batches are fewer than log_every_n_steps: the demo has 51)
        shown = [line for line in printed if "log_every_n_steps" not in line]
        assert max(len(line) for line in shown) <= 120, max(shown, key=len)
        assert [line for line in proc.stdout.splitlines() if line.strip()][-1].startswith("written: "), proc.stdout[-800:]
    assert "Timeline is listed after" not in proc.stdout + proc.stderr  # the epoch-start freeze is timed
    assert "PipeTransformer timeline" in proc.stdout and "speed: samples/s over epoch 0's" in proc.stdout
    rows = json.loads((tmp_path / "timeline.json").read_text())["rows"]
    assert [r["epoch"] for r in rows] == [0, 1, 2]
    frozen = [int(r["frozen"].split("/")[0]) for r in rows]
    assert frozen[0] == 0 and frozen == sorted(frozen) and rows[0]["frozen"].endswith("/3")
    if strategy == "auto":
        assert all(r["pipe_len"] == "-" and r["replicas"] == "-" for r in rows)  # no plan to read
    else:
        assert all(r["pipe_len"].isdigit() and r["replicas"] == "1" for r in rows)
    assert all(r["metric"] is not None and 0.0 <= r["metric"] <= 1.0 for r in rows)
    assert rows[0]["speed_vs_epoch0"] == 1.0
    assert all(r["speed_vs_epoch0"] == pytest.approx(r["samples_per_s"] / rows[0]["samples_per_s"]) for r in rows)
    if strategy is not None:
        # The JSON carries the cache's bytes per epoch; text_minilm.yaml does not cache (cache=False by default).
        assert all(r["cache_mem_bytes"] is None and r["cache_disk_bytes"] is None for r in rows)
    else:
        assert rows[0]["cache_hits"] == "-" and rows[1]["cache_hit_count"] == 0 < rows[1]["cache_lookups"]  # epoch 1 stores
        lookups = rows[2]["cache_lookups"]
        assert frozen[1] > 0 and rows[2]["cache_hits"] == f"{lookups}/{lookups} (100%)"  # then serves every lookup
        assert all(r["cache_mem_bytes"] > 0 for r in rows[1:])
    assert (tmp_path / "timeline.png").stat().st_size > 1000
    assert not (tmp_path / "no-assets").exists()
    # Nothing of Hugging Face's in the home directory (matplotlib keeps its font list there).
    assert not [p for p in (tmp_path / "home").rglob("*") if p.is_file() and "matplotlib" not in p.parts]
    assert list((tmp_path / "hf").rglob("cache-*.arrow"))  # the tokenized sides, where the config says


def test_the_baseline_yaml_is_the_demos_setting_without_freezing() -> None:
    """The demo's plain fine-tuning reference trains on the same batches: same model and data sections,
    strategy auto, no AutoFreeze (else its speed would not be plain fine-tuning's)."""
    demo = yaml.safe_load((EXAMPLES / "configs" / "text_minilm_pipetransformer.yaml").read_text())
    base = yaml.safe_load((EXAMPLES / "configs" / "text_minilm_baseline.yaml").read_text())
    assert base["model"] == demo["model"] and base["data"] == demo["data"] and base["seed_everything"] == demo["seed_everything"]
    assert base["trainer"]["strategy"] == "auto" and base["trainer"]["precision"] == demo["trainer"]["precision"]
    assert [cb["class_path"] for cb in base["trainer"]["callbacks"]] == ["lightning_pipetransformer.PipeTransformerTimeline"]


def test_baseline_run_and_the_reference_lines(tiny_assets: tuple[Path, Path], tmp_path: Path) -> None:
    """The baseline YAML runs (two short epochs, no validation); examples/reference.py compares a demo's
    rows with its last epoch and quotes the committed benchmark with its date."""
    model_dir, corpus = tiny_assets
    config = yaml.safe_load((EXAMPLES / "configs" / "text_minilm_baseline.yaml").read_text())
    config["model"]["pretrained"] = str(model_dir)
    config["data"].update(csv_path=str(corpus), train_size=32, val_size=16, val_fraction=0.3, max_length=16, batch_size=8,
                          datasets_cache_dir=str(tmp_path / "hf"))  # fmt: skip
    config["trainer"].update(default_root_dir=str(tmp_path / "out"))
    config["trainer"]["callbacks"][0]["init_args"]["dirpath"] = str(tmp_path / "base")
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    env = clean_env(PIPETRANSFORMER_ASSETS=str(tmp_path / "no-assets"), HF_HUB_OFFLINE="1", HOME=str(tmp_path / "home"))
    proc = subprocess.run([sys.executable, str(EXAMPLES / "text_classification.py"), "fit", "--config", str(cfg_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    base = json.loads((tmp_path / "base" / "timeline.json").read_text())["rows"]
    assert [r["epoch"] for r in base] == [0, 1] and all(r["frozen"] == "-" and r["samples"] == 32 for r in base)

    import reference

    demo = [dict(base[0], epoch=0, samples_per_s=base[1]["samples_per_s"]), dict(base[1], epoch=1, samples_per_s=2 * base[1]["samples_per_s"])]
    lines = reference.measured_lines(demo, base)
    # The samples it measured, and no count of batches (the rows do not hold one: "12 batches" was wrong for a smaller --data.train_size).
    assert "measured just now over 32 samples: " in lines[0] and not re.search(r"\d+ batches", lines[0]), lines[0]
    assert "per epoch: 0: 1.00x, 1: 2.00x" in lines[1]
    bench = reference.benchmark_lines()[0]
    assert "(docs/benchmarks_25_3seeds.md, 2026-12-02; 3,000 snippets, 5 epochs" in bench
    assert "full fine-tuning 399 s" in bench and "198 s (2.02x less)" in bench and "(-0.89 points)" in bench


def test_the_reference_lines_fit_80_columns_and_keep_every_word(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """examples/reference.py prints after the demo's 80-column table: its statements wrap at 80 too,
    without splitting a date or a path, and say the same as the unwrapped lines."""
    import reference

    row = dict(epoch=0, frozen="0/6", samples=1500, samples_per_s=50.0, train_s=30.0)
    demo, base = tmp_path / "demo.json", tmp_path / "base.json"
    demo.write_text(json.dumps({"rows": [row, dict(row, epoch=1, samples_per_s=100.0, train_s=15.0)]}))
    base.write_text(json.dumps({"rows": [dict(row, frozen="-", samples=384, samples_per_s=40.0)]}))
    reference.main([str(demo), str(base)])
    printed = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in printed) <= reference.WIDTH, printed
    statements = reference.measured_lines(json.loads(demo.read_text())["rows"], json.loads(base.read_text())["rows"])
    statements += reference.benchmark_lines()
    statements += reference.machine_lines(json.loads(demo.read_text())["rows"], json.loads(base.read_text())["rows"], None)
    words = " ".join(" ".join(printed).split())
    assert words.count("reference:") == len(statements) + 1  # one paragraph per statement, the speed's meaning first
    assert all(" ".join(s.split()) in words for s in statements)
    assert any("2026-12-02;" in line for line in printed)  # the date is not split at its hyphens
    assert "per epoch: 0: 1.25x, 1: 2.50x" in words
