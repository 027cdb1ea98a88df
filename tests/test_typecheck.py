"""STYLE habit 8: app/, workers/, clients/ (and core/) type-check clean, with no dead names; every Python file
in one format (``ruff format``) and clean under the lint rules of pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_mypy_is_clean() -> None:
    out = _run("mypy", timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr


def test_lint_rules_hold() -> None:
    """pyflakes, the line length, the import order, bugbear, pyupgrade: pyproject.toml [tool.ruff.lint]."""
    out = _run("ruff", "check", "--no-cache", ".")
    assert out.returncode == 0, out.stdout + out.stderr


def test_code_is_formatted() -> None:
    out = _run("ruff", "format", "--check", "--no-cache", ".")
    assert out.returncode == 0, "run `.venv/bin/ruff format .`:\n" + out.stdout + out.stderr
