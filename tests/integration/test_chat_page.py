"""The chat page at ``/`` in a real headless Chromium (Debian's, driven by Playwright) against a
real gateway and worker on 127.0.0.1: type a message, see the answer stream in, coloured by
where each piece came from (accepted draft tokens vs the target's), with live statistics.
The screenshot goes to ``test-output/chat_page.png``."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from playwright.sync_api import sync_playwright

from core.config import parse_config
from tests.integration.gateways import SharedDraft, gateway_in_process

pytestmark = pytest.mark.integration

OUTPUT = Path(__file__).resolve().parents[2] / "test-output"
# what this machine's closed network needs (no background connections, no sandbox as root)
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def gateway_url(builtin_workers: list[str], shared_draft: SharedDraft) -> Iterator[str]:
    with ExitStack() as stack:
        worker = builtin_workers[0]
        config = parse_config(
            {
                "model": "specgate-page",
                "draft": {"model": "builtin-draft", "threads": 1},
                "workers": [{"url": worker}],
            }
        )
        yield gateway_in_process(stack, config, shared_draft)


def test_a_message_streams_in_with_both_colours(gateway_url: str) -> None:
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is missing: `make test` installs it (apt-get install chromium)"
    OUTPUT.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 700})
            page.goto(f"{gateway_url}/")
            assert page.title() == "specgate chat"
            page.select_option("#mode", "exact")
            page.fill("#input", "Tell me three things about the sea.")
            page.click("#send")
            answer = page.locator(".message.assistant")
            page.wait_for_selector(".message.assistant span", timeout=60_000)
            early = len(answer.inner_text())
            page.wait_for_function("!document.getElementById('send').disabled", timeout=120_000)
            text = answer.inner_text()
            assert len(text) > early > 0  # it arrived piece by piece, not at once
            assert page.locator(".message.assistant span.draft").count() > 0  # accepted draft tokens
            assert page.locator(".message.assistant span.target").count() > 0  # recovered / bonus tokens
            assert page.locator(".message.error").count() == 0
            assert page.inner_text("#acceptance").endswith("%") and page.inner_text("#speed") != "–"
            assert int(page.inner_text("#bytes").replace(",", "")) > 0
            page.screenshot(path=str(OUTPUT / "chat_page.png"))
        finally:
            browser.close()
    assert (OUTPUT / "chat_page.png").stat().st_size > 10_000
