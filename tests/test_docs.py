"""Generated docs stay true to the code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_page_is_generated_from_the_settings() -> None:
    out = subprocess.run([sys.executable, "scripts/config_docs.py"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == out.stdout, "docs/configuration.md is stale: python scripts/config_docs.py > docs/configuration.md"
    for key in ("`speculative.mode`", "`workers[].urls`", "`limits.drain_timeout_s`", "`SPECGATE_API_KEY`", "`SPECGATE_WORKER_TOKEN`"):
        assert key in page
