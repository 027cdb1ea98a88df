"""The pipeline target's stage failures (docs/design.md §3.7) over fake stages (httpx.MockTransport
stands in for the stage workers below the gateway): which stage a failure names, failover to
a stage's replica, the sessions of the old chain starting again, and replicas that could not
stand in for their stage. The real thing (a stage process killed mid-stream) is in
tests/integration/test_pipeline_real.py."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import numpy as np
import pytest

from app.targets.channel import Channel, Expected
from app.targets.pipeline import PipelineTarget, Segment, StageDown, StageShort
from core.protocol import (
    BINARY_CONTENT_TYPE,
    ErrorBody,
    InfoResponse,
    StageRequest,
    StageResponse,
    decode,
    encode,
)

V = 8
LAYERS = {"s1": [0, 2], "s2": [2, 4], "s2b": [2, 4], "s3": [4, 6], "odd": [2, 5]}
SEGMENT = Segment(0, [1, 2, 3], None, None, 0)
SAMPLING: dict[str, Any] = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "k": None}


class Stages:
    """Fake stage workers by host: ``/v1/info`` with their layers; the first stage answers a
    forward as the whole chain would (``down``: hosts the chain cannot reach)."""

    def __init__(self) -> None:
        self.down: set[str] = set()
        self.forwards: list[tuple[str, StageRequest]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host in self.down:
            raise httpx.ConnectError("refused", request=request)
        if request.url.path == "/v1/info":
            info = InfoResponse(1, ["pipeline"], "m", V, "fp", [0], 64, "transformers", LAYERS[host], 6)
            return httpx.Response(
                200, content=encode(info, V)[0], headers={"content-type": BINARY_CONTENT_TYPE}
            )
        if request.method == "DELETE":
            return httpx.Response(204)
        req = decode(StageRequest, request.content, BINARY_CONTENT_TYPE)
        self.forwards.append((host, req))
        for url in req.next or []:
            if httpx.URL(url).host in self.down:  # the stage before it reports it, by URL
                body = ErrorBody(
                    f"the next stage {url} is unreachable",
                    "server_error",
                    param=url,
                    code="stage_unreachable",
                )
                return httpx.Response(
                    502, content=body.to_json(), headers={"content-type": "application/json"}
                )
        rows = len(req.tokens) - req.score_from
        resp = StageResponse(
            held=len(req.tokens),
            probs=np.full((rows, V), 1 / V, np.float32),
            tail_mass=np.zeros(rows, np.float32),
        )
        return httpx.Response(200, content=encode(resp, V)[0], headers={"content-type": BINARY_CONTENT_TYPE})


def _target(stages: Stages, chain: list[list[str]]) -> PipelineTarget:
    channel = Channel("pipe", httpx.AsyncClient(transport=httpx.MockTransport(stages)), httpx.Timeout(5.0))
    return PipelineTarget(
        "pipe",
        [[f"http://{host}:1" for host in hosts] for hosts in chain],
        1.0,
        channel,
        Expected("fp", V),
        3,
    )


def test_a_stage_that_cannot_be_reached_is_named_and_its_replica_takes_over() -> None:
    stages = Stages()
    target = _target(stages, [["s1"], ["s2", "s2b"], ["s3"]])

    async def run() -> None:
        assert (await target.check_all())["ready"]
        await target.forward("r", SEGMENT, SAMPLING)  # session r starts on s1 → s2 → s3
        stages.down.add("s2")
        with pytest.raises(StageDown) as failure:
            await target.forward("x", SEGMENT, SAMPLING)
        assert failure.value.stage == 1 and "s2" in str(failure.value)
        assert target.fail_over(1) and [r.url for r in target.replicas] == [
            "http://s1:1",
            "http://s2b:1",
            "http://s3:1",
        ]
        with pytest.raises(StageShort):  # a session of the old chain starts again from zero
            await target.forward("r", SEGMENT, SAMPLING)
        target.restart("r")
        await target.forward("r", SEGMENT, SAMPLING)
        host, req = stages.forwards[-1]
        assert (
            host == "s1"
            and req.next == ["http://s2b:1", "http://s3:1"]
            and req.session_id == "r~1"
            and req.seq == 0
        )
        assert not target.fail_over(1)  # its only replica: no third to move to
        entry = await target.check_all()  # the probe: s2 still down, s2b stays in use
        assert entry["ready"] and [
            (r["url"], r["active"], r["ready"]) for r in entry["replicas"] if r["stage"] == 2
        ] == [
            ("http://s2:1", False, False),
            ("http://s2b:1", True, True),
        ]

    asyncio.run(run())


def test_without_a_replica_the_failure_ends_the_request_naming_the_stage() -> None:
    stages = Stages()
    target = _target(stages, [["s1"], ["s2"], ["s3"]])

    async def run() -> None:
        assert (await target.check_all())["ready"]
        stages.down.add("s3")
        with pytest.raises(StageDown) as failure:
            await target.forward("x", SEGMENT, SAMPLING)
        assert failure.value.stage == 2 and not target.fail_over(2)
        stages.down = {"s1"}
        with pytest.raises(StageDown) as failure:
            await target.forward("y", SEGMENT, SAMPLING)
        assert failure.value.stage == 0 and "stage 1 (http://s1:1)" in str(failure.value)

    asyncio.run(run())


def test_a_stage_down_at_start_up_moves_to_its_replica_and_a_replica_of_other_layers_is_fatal() -> None:
    stages = Stages()
    stages.down.add("s2")
    entry = asyncio.run(_target(stages, [["s1"], ["s2", "s2b"], ["s3"]]).check_all())
    assert entry["ready"] and [r["url"] for r in entry["replicas"] if r["active"]] == [
        "http://s1:1",
        "http://s2b:1",
        "http://s3:1",
    ]
    entry = asyncio.run(_target(Stages(), [["s1"], ["s2", "odd"], ["s3"]]).check_all())
    assert (
        entry["fatal"] and "stage 2's replica http://odd:1 cannot stand in for http://s2:1" in entry["error"]
    )
