"""scripts/setup.sh skips pip when .venv was set up for this pyproject.toml, and installs the extras asked for.

Run on a copy of the script in a scratch folder whose ``.venv/bin/python`` stands in for the real
one: ``-m pip`` calls are recorded instead of run, everything else goes to this interpreter with
stand-in ``torch`` and ``lightning`` modules (importing the real ones would take most of the test)
and stand-in installed distributions: the package, whose metadata lists its extras'
requirements, and ``transformers`` (what the demo's extras installed).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    import packaging

    (tmp_path / "scripts").mkdir()
    for script in ("setup.sh", "missing_requirements.py"):
        shutil.copy(ROOT / "scripts" / script, tmp_path / "scripts" / script)
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    stubs = tmp_path / "stubs"
    for name in ("torch", "lightning"):
        (stubs / name).mkdir(parents=True)
        (stubs / name / "__init__.py").write_text("__version__ = 'stand-in'\n")
    shutil.copytree(Path(packaging.__file__).parent, stubs / "packaging")  # the helper parses requirements with it
    _dist(stubs, "lightning-pipetransformer", "0.1", [
        "torch>=2.4", "lightning>=2.6,<2.7", 'transformers>=5; extra == "examples"', 'pytest>=8; extra == "dev"',
        'lightning-pipetransformer[examples]; extra == "dev"', 'matplotlib>=3.7; extra == "plot"',
    ])  # fmt: skip
    _dist(stubs, "transformers", "5.1", [])
    python = bin_dir / "python"
    python.write_text(
        "#!/usr/bin/env bash\n"
        f'if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then shift 2; echo "$*" >> "{tmp_path}/pip.log"; exit 0; fi\n'
        f'PYTHONPATH="{stubs}" exec "{sys.executable}" -S "$@"\n'
    )
    python.chmod(0o755)
    return tmp_path


def _dist(stubs: Path, name: str, version: str, requires: list[str]) -> None:
    """An installed distribution as importlib.metadata sees it: a dist-info folder with its METADATA."""
    info = stubs / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
    (info / "METADATA").write_text("\n".join(lines) + "\n")


def setup(repo: Path, *extras: str) -> list[str]:
    """Run setup.sh; return the pip commands it ran."""
    log = repo / "pip.log"
    log.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PIPETRANSFORMER_REINSTALL"}
    proc = subprocess.run(["bash", "scripts/setup.sh", *extras], cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return log.read_text().splitlines() if log.exists() else []


def test_installs_once_then_skips_until_pyproject_changes(repo: Path) -> None:
    first = setup(repo, "examples,cli,plot")
    assert first[-1] == "install -q -e .[examples,cli,plot]"  # only what the demo needs: no pytest, mypy, ruff
    assert setup(repo, "examples,cli,plot") == []  # set up for this pyproject.toml: pip is not run
    # The tests' extras were never installed: only what they lack is, not the package again (its -e install
    # rebuilds it and re-resolves everything) and not what the demo installed (transformers).
    assert setup(repo) == ["install -q pytest>=8"]
    assert setup(repo) == [] and setup(repo, "examples,cli,plot") == []  # dev includes the demo's extras
    (repo / "pyproject.toml").write_text("[project]\nname = 'x'\nversion = '2'\n")
    assert setup(repo, "examples,cli,plot")[-1] == "install -q -e .[examples,cli,plot]"  # changed: again
    assert setup(repo) != []  # the dev stamp was for the old pyproject.toml


def test_a_failed_install_leaves_no_stamp(repo: Path) -> None:
    python = repo / ".venv" / "bin" / "python"
    python.write_text(python.read_text().replace("exit 0; fi", "exit 1; fi"))
    proc = subprocess.run(["bash", "scripts/setup.sh"], cwd=repo, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and not (repo / ".venv" / ".pipetransformer-setup").exists()


def test_the_skip_says_so_in_80_columns(repo: Path) -> None:
    setup(repo, "examples,cli,plot")
    (repo / "pip.log").unlink()
    env = {k: v for k, v in os.environ.items() if k != "PIPETRANSFORMER_REINSTALL"}
    proc = subprocess.run(["bash", "scripts/setup.sh", "examples,cli,plot"], cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and not (repo / "pip.log").exists(), proc.stdout + proc.stderr  # skipped
    lines = proc.stdout.splitlines()
    assert "pip not run" in lines[0] and "PIPETRANSFORMER_REINSTALL=1" in proc.stdout
    assert max(len(line) for line in lines) <= 80, lines


def test_the_demo_installs_its_extras_only_and_the_tests_theirs() -> None:
    """demo.sh asks setup.sh for the demo's extras (no pytest, mypy, ruff); test.sh for the default, dev."""
    calls = {name: [line.split() for line in (ROOT / "scripts" / name).read_text().splitlines() if "scripts/setup.sh" in line
                    and not line.lstrip().startswith("#")] for name in ("demo.sh", "test.sh")}  # fmt: skip
    assert calls["demo.sh"] == [["bash", "scripts/setup.sh", "examples,cli,plot"]], calls
    assert calls["test.sh"] == [["bash", "scripts/setup.sh"]], calls


def test_extras_already_there_are_stamped_without_pip(repo: Path) -> None:
    """Asking for extras whose requirements are all installed (plot's matplotlib here) runs no pip at all."""
    assert setup(repo, "examples")[-1] == "install -q -e .[examples]"
    _dist(repo / "stubs", "matplotlib", "3.9", [])
    assert setup(repo, "plot") == []
    assert "plot" in {line.split()[-1] for line in (repo / ".venv" / ".pipetransformer-setup").read_text().splitlines()}


def test_the_package_missing_means_a_full_install(repo: Path) -> None:
    """A stamp for this pyproject.toml but no package installed (removed by hand): the helper says so and the
    full install runs, not a partial one."""
    setup(repo, "examples")
    shutil.rmtree(next((repo / "stubs").glob("lightning_pipetransformer-*.dist-info")))
    assert setup(repo)[-1] == "install -q -e .[dev]"
