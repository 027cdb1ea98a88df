"""Generated docs stay true to the code."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_page_is_generated_from_the_settings() -> None:
    out = subprocess.run(
        [sys.executable, "scripts/config_docs.py"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == out.stdout, (
        "docs/configuration.md is stale: python scripts/config_docs.py > docs/configuration.md"
    )
    for key in (
        "`speculative.mode`",
        "`workers[].urls`",
        "`limits.drain_timeout_s`",
        "`SPECGATE_API_KEY`",
        "`SPECGATE_WORKER_TOKEN`",
    ):
        assert key in page


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub writes it: lower case, punctuation dropped but hyphens and underscores,
    spaces as hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip()).lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        slug = _slug(line.lstrip("#"))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def test_every_link_in_the_readme_and_docs_resolves() -> None:
    """Each relative link names a file of the repository, and each #anchor a heading of its page: the docs
    stand alone."""
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists() or ROOT not in [linked, *linked.parents]:
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file in the repository)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
