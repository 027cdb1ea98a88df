"""Fixtures of the gateway's HTTP tests: fake workers and a started gateway app."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from app.server import create_app
from core.runners import ModelRunner
from tests.app.fakes import FakeWorkerTransport
from tests.app.helpers import gateway_config

Gateway = Callable[..., Any]


@pytest.fixture
def fakes(tiny_runner: ModelRunner) -> FakeWorkerTransport:
    return FakeWorkerTransport(tiny_runner.fingerprint)


@pytest.fixture
def gateway(tiny_runner: ModelRunner, fakes: FakeWorkerTransport) -> Gateway:
    """``async with gateway(**config) as client``: a started gateway app (in-process) and its
    client; ``transport=`` replaces the fake workers."""

    @asynccontextmanager
    async def start(
        transport: httpx.AsyncBaseTransport | None = None, **overrides: Any
    ) -> AsyncIterator[httpx.AsyncClient]:
        app = create_app(
            gateway_config(**overrides), draft_runner=tiny_runner, transport=transport or fakes.transport()
        )
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://gateway", timeout=30
            ) as client:
                yield client

    return start


@pytest.fixture
async def client(gateway: Gateway) -> AsyncIterator[httpx.AsyncClient]:
    async with gateway() as c:
        yield c
