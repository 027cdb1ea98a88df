"""STYLE habit 8: app/, workers/, clients/ (and core/) type-check clean, with no dead names."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_is_clean() -> None:
    out = subprocess.run([sys.executable, "-m", "mypy"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_no_unused_or_undefined_names() -> None:
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "F", "app", "workers", "clients", "core", "tests"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
