"""Workers found by DNS, end to end: a real DNS server on loopback (tests/dns.py) names real
workers on 127.0.0.2 and 127.0.0.3, one port, as a headless Service names its pods; the records
change while seeded requests run. An address that appears joins once its /health and /v1/info
pass; one where nothing answers never joins; one that disappears takes no new sessions while
the session it holds finishes there; no answer changes. The gateway runs in this process under a real uvicorn
(tests/integration/gateways.py)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from clients.procs import WorkerProcess, free_port
from core.config import parse_config
from tests.dns import LoopbackDNS
from tests.integration.gateways import SharedDraft, gateway_in_process

pytestmark = pytest.mark.integration

NAME = "workers.specgate.test"
BODY = {
    "model": "specgate",
    "messages": [{"role": "user", "content": "Name three rivers."}],
    "max_tokens": 16,
    "seed": 5,
    "temperature": 0.8,
}


def _replicas(url: str) -> dict[str, dict[str, Any]]:
    [entry] = httpx.get(f"{url}/health/ready", timeout=10).json()["workers"]
    return {r["url"]: r for r in entry["replicas"]}


def _wait(what: Callable[[], bool], timeout_s: float = 30.0) -> float:
    started = time.monotonic()
    while not what():
        assert time.monotonic() - started < timeout_s, "discovery did not react"
        time.sleep(0.05)
    return time.monotonic() - started


def _chat(url: str, max_tokens: int = 16) -> str:
    resp = httpx.post(f"{url}/v1/chat/completions", json=BODY | {"max_tokens": max_tokens}, timeout=120)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["message"]["content"])


def _counter(url: str, name: str) -> float:
    found = re.search(
        rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+]+)$",
        httpx.get(f"{url}/metrics", timeout=10).text,
        re.MULTILINE,
    )
    return float(found.group(1)) if found else 0.0


def test_replicas_follow_the_dns_records_while_requests_run(shared_draft: SharedDraft) -> None:
    port = free_port()
    with LoopbackDNS() as dns, ExitStack() as stack:
        a = stack.enter_context(WorkerProcess("builtin", "llama.cpp", port=port, threads=1, host="127.0.0.2"))
        b = stack.enter_context(WorkerProcess("builtin", "llama.cpp", port=port, threads=1, host="127.0.0.3"))
        dns.set(NAME, ["127.0.0.2"])
        config = parse_config(
            {
                "draft": {"model": "builtin-draft", "threads": 1},
                "speculative": {"mode": "exact", "num_draft_tokens": 4, "draft_top_k": 32},
                "workers": [{"name": "w", "url": f"http://{NAME}:{port}", "discovery_interval_s": 0.2}],
                "discovery": {"dns_servers": [dns.server]},
            }
        )
        gateway = gateway_in_process(stack, config, shared_draft)
        assert set(_replicas(gateway)) == {a}
        reference, reference_long = _chat(gateway), _chat(gateway, 64)

        with ThreadPoolExecutor(8) as pool:
            long = pool.submit(_chat, gateway, 64)  # a session on a that outlives a's record
            _wait(lambda: _counter(a, "specgate:sessions") >= 1)
            dns.set(NAME, ["127.0.0.2", "127.0.0.3", "127.0.0.4"])  # nothing answers on .4
            joined_s = _wait(lambda: _replicas(gateway).get(b, {}).get("ready", False))
            dns.set(NAME, ["127.0.0.3"])
            left_s = _wait(
                lambda: _replicas(gateway).get(a, {}).get("leaving", False) or a not in _replicas(gateway)
            )
            futures = [pool.submit(_chat, gateway) for _ in range(4)]
            busiest_a = 0.0
            while not all(f.done() for f in futures):  # new sessions go to b: a holds only the long one
                busiest_a = max(busiest_a, _counter(a, "specgate:sessions"))
                time.sleep(0.05)
            texts = [f.result() for f in futures]
            long_text = long.result()
        print(
            f"discovery: an address joined {joined_s:.2f} s and left {left_s:.2f} s after its "
            "record changed (interval 0.2 s)"
        )

        assert texts == [reference] * 4  # seeded: the same text on either replica
        assert long_text == reference_long  # it finished on a, as it would have anywhere
        assert busiest_a <= 1
        assert f"http://127.0.0.4:{port}" not in _replicas(gateway)
        _wait(lambda: set(_replicas(gateway)) == {b})  # a left the list once its session ended
        metrics = httpx.get(f"{gateway}/metrics", timeout=10).text
        assert 'specgate:worker_replicas{state="up",worker="w"} 1.0' in metrics
        # the long session finished where it began
        assert _counter(gateway, "specgate:worker_failovers_total") == 0.0
        assert _counter(a, "specgate:sessions") == 0.0 and _counter(b, "specgate:sessions") == 0.0
