"""``specgate bench load --gateways``: the config of the gateway it adds beside ``serve``'s (the run itself is
a benchmark: docs/scaling.md has its figures)."""

from __future__ import annotations

import pytest

from clients.bench.load import concurrency_levels, gateway_beside
from core.config import load_config, parse_config
from core.names import TargetType

READY = {
    "workers": [
        {"name": "w0", "weight": 0.5, "replicas": [{"url": "http://127.0.0.1:8101", "ready": True}]},
        {
            "name": "w1",
            "weight": 0.5,
            "replicas": [
                {"url": "http://127.0.0.1:8102", "ready": True},
                {"url": "http://127.0.0.1:8103", "ready": True},
            ],
        },
    ]
}


def test_another_gateway_takes_the_running_workers_by_url() -> None:
    served = load_config(None)  # the built-in config: two local workers serve starts
    config = gateway_beside(served, READY, draft_threads=1)
    assert [(w.name, w.urls, w.weight, w.model, w.port) for w in config.workers] == [
        ("w0", ["http://127.0.0.1:8101"], 0.5, None, None),
        ("w1", ["http://127.0.0.1:8102", "http://127.0.0.1:8103"], 0.5, None, None),
    ]
    assert (
        config.draft.threads == 1
        and config.draft.model == served.draft.model
        and config.speculative == served.speculative
    )
    assert config.port != served.port and config.limits == served.limits


def test_an_engine_keeps_the_model_it_serves_and_a_pipeline_is_refused() -> None:
    engine = parse_config(
        {"workers": [{"name": "w0", "type": "openai-logprobs", "url": "http://vllm:8000", "model": "m"}]}
    )
    config = gateway_beside(
        engine, {"workers": [{"name": "w0", "weight": 1.0, "replicas": [{"url": "http://vllm:8000"}]}]}, 2
    )
    assert config.workers[0].type is TargetType.OPENAI_LOGPROBS and config.workers[0].model == "m"
    pipeline = parse_config({"workers": [{"pipeline": ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]}]})
    with pytest.raises(SystemExit, match="not a pipeline"):
        gateway_beside(pipeline, {"workers": []}, 1)
    assert concurrency_levels("1,2") == [1, 2]
