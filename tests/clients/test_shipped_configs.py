"""The files in ``config/``: each loads, names models that resolve here, and overrides no
default of the code with another value (issue 33: config/pipeline.yaml shipped the schedule
12/6/4 after the code's default had moved to the faster 10/5/3). What a config may choose is
its purpose — the mode, ``k`` and its reconstruction; every other speculative setting it
writes must be the value the code would pick anyway (written out for the reader)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from core.config import PipelineParams, SpeculativeConfig, TreeParams, load_config
from core.math.shapes import SegmentSchedule
from core.names import Mode
from core.runners import resolve_model

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "config").glob("*.yaml"))
CHOSEN = {"mode", "k", "reconstruction"}  # a config's purpose: free to differ from the defaults


def test_there_are_shipped_configs() -> None:
    assert {p.name for p in SHIPPED} >= {
        "builtin.yaml",
        "one-worker.yaml",
        "federated.yaml",
        "pipeline.yaml",
        "engine.yaml",
    }


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_a_shipped_config_loads_and_its_models_resolve(path: Path) -> None:
    config = load_config(str(path))
    resolve_model(config.draft.model)
    for worker in config.workers:
        for model in [worker.model, *(s.model for s in worker.pipeline or [])]:
            if model is not None:
                resolve_model(model)


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_a_shipped_config_overrides_no_default(path: Path) -> None:
    written = (yaml.safe_load(path.read_text()) or {}).get("speculative") or {}
    config = load_config(str(path)).speculative
    default = SpeculativeConfig(mode=config.mode)
    for key in set(written) - CHOSEN:
        value = getattr(config, key)
        if isinstance(value, PipelineParams):
            assert value.schedule() == SegmentSchedule(), (
                f"{path.name}: pipeline {value} is not the default schedule {SegmentSchedule()}"
            )
        elif isinstance(value, TreeParams):
            pytest.fail(f"{path.name}: a tree shape {value} overrides the default by temperature")
        elif key == "draft_top_k" and config.mode is Mode.EXACT:
            assert value == 32, f"{path.name}: exact's draft_top_k {value} is not its default 32"
        else:
            assert value == getattr(default, key), (
                f"{path.name}: speculative.{key} = {value!r}, the default is {getattr(default, key)!r}"
            )


def test_a_config_written_for_another_checkout_names_only_what_differs_from_the_defaults() -> None:
    """``specgate bench … --baseline``: the earlier checkout's gateway reads our config; a setting added since
    (``draft.forward``) stops it (pydantic forbids extra keys), so the file names only what differs from the
    defaults, and reads back the same."""
    from core.config import builtin_config, dump_config, parse_config

    config = builtin_config()
    changed = yaml.safe_load(dump_config(config, changed_only=True))
    assert "forward" in yaml.safe_load(dump_config(config))["draft"] and "forward" not in changed.get(
        "draft", {}
    )
    assert parse_config(changed) == config


@pytest.mark.parametrize("weight", [float("inf"), float("nan"), -1.0])
def test_a_workers_weight_must_be_a_finite_number_at_least_0(weight: float) -> None:
    """w / Σw must be a number: an infinite weight made it NaN (the old split path failed on it; the worker's
    draw would not have)."""
    from core.config import parse_config
    from core.errors import ConfigError

    with pytest.raises(ConfigError, match="workers.0.weight"):
        parse_config({"workers": [{"url": "http://127.0.0.1:1", "weight": weight}]})
    with pytest.raises(ConfigError, match="weights must not all be 0"):
        parse_config({"workers": [{"url": "http://127.0.0.1:1", "weight": 0.0}]})
