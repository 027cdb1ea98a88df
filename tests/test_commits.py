"""Commit subjects under 100 characters, the detail in the body (issue 77): every commit since the rule, as
``git log`` shows it in this clone (skipped where there is no history to read)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SINCE = "f4a5ba2"  # the last commit before the rule


def test_commit_subjects_are_under_100_characters() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("no git history here")
    out = subprocess.run(
        ["git", "log", "--format=%h %s", f"{SINCE}..HEAD"], capture_output=True, text=True, cwd=ROOT
    )
    if out.returncode != 0:
        pytest.skip(f"no history back to {SINCE}: {out.stderr.strip()}")
    long = [line for line in out.stdout.splitlines() if len(line.split(" ", 1)[1]) >= 100]
    assert not long, "subjects of 100 characters or more (put the detail in the body):\n" + "\n".join(long)
