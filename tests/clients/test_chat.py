"""``specgate chat`` against a real uvicorn gateway (tiny draft, fake workers below it): it
streams the answer, keeps the conversation, reports acceptance and tokens/s after each answer,
and survives an error."""

from __future__ import annotations

import argparse
import io

import pytest

from app.server import create_app
from clients.chat import chat
from clients.cli import build_parser
from core.runners import ModelRunner
from tests.app.fakes import FakeWorkerTransport
from tests.app.helpers import gateway_config, served


@pytest.fixture
def fakes(tiny_runner: ModelRunner) -> FakeWorkerTransport:
    return FakeWorkerTransport(tiny_runner.fingerprint)


def _args(url: str, *extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["chat", "--url", url, "--max-tokens", "8", *extra])


def test_a_conversation_with_statistics(tiny_runner: ModelRunner, fakes: FakeWorkerTransport) -> None:
    app = create_app(gateway_config(), draft_runner=tiny_runner, transport=fakes.transport())
    with served(app) as url:
        out = io.StringIO()
        code = chat(_args(url), stdin=io.StringIO("Hello there\n\nAnd again\n/quit\n"), out=out)
    text = out.getvalue()
    assert code == 0 and "specgate chat with 'test-model'" in text
    summaries = [line for line in text.splitlines() if line.startswith("[acceptance")]
    assert len(summaries) == 2 and all("tok/s" in s and "8 tokens" in s and "B/round" in s for s in summaries)
    second = [req for _, req in fakes.requests][-1]
    assert len(second.tokens) + second.prefix_len > 30  # the second turn carried the first


def test_an_error_is_shown_and_the_chat_goes_on(tiny_runner: ModelRunner, fakes: FakeWorkerTransport) -> None:
    app = create_app(gateway_config(), draft_runner=tiny_runner, transport=fakes.transport())
    with served(app) as url:
        out = io.StringIO()
        code = chat(_args(url, "--mode", "pipeline"), stdin=io.StringIO("Hi\n"), out=out)
    assert code == 0 and "error: speculative.mode" in out.getvalue()


def test_no_gateway_is_a_clear_error() -> None:
    assert chat(_args("http://127.0.0.1:1"), stdin=io.StringIO(""), out=io.StringIO()) == 1
