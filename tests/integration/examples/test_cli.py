"""The shipped LightningCLI YAML configs run (both strategy forms), in a subprocess with a timeout."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.launch import clean_env

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    "config, expected",
    [
        ("synthetic_by_name.yaml", "pipe length 1"),
        ("synthetic_class_path.yaml", "3 frozen, pipe length 2"),
    ],
)
def test_cli_fit_from_shipped_yaml(config, expected, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "synthetic_cli.py"), "fit", "--config", str(ROOT / "examples" / "configs" / config),
         f"--trainer.default_root_dir={tmp_path}"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=clean_env(),
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert expected in out, out[-4000:]
    assert "AutoFreeze: epoch 2" in out
