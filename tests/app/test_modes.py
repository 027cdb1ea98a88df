"""The one registry of modes (core.modes) and what derives from it: every served mode has a
gateway strategy, every field a mode takes is a field of the request's ``speculative`` object,
and the lists of config, protocol and service are the registry's."""

from __future__ import annotations

from app.engine.strategies import STRATEGIES
from app.schemas import SpeculativeParams
from core import config
from core.modes import MODES, modes_where, target_problem, verify_modes
from core.names import Mode


def test_every_served_mode_names_a_strategy_and_nothing_else_is_one() -> None:
    """A tree is a draft shape: its rows are verified by its payload's strategy (``SpecOptions.verifier``)."""
    assert set(STRATEGIES) == {spec.strategy for spec in MODES.values()} - {None}
    assert MODES[Mode.TREE].strategy is None and {Mode.AGGREGATE, Mode.EXACT} <= set(STRATEGIES)
    assert set(MODES) == set(Mode)


def test_the_fields_a_mode_takes_are_request_fields() -> None:
    for spec in MODES.values():
        assert "mode" in spec.fields and spec.fields <= set(SpeculativeParams.model_fields), spec.mode


def test_config_and_protocol_take_their_lists_from_the_registry() -> None:
    # the start-up check is the requests' one
    assert config.target_problem is target_problem
    # pipeline's stages speak /v1/stage/forward
    assert verify_modes() == [m for m in MODES if m is not Mode.PIPELINE]
    assert modes_where("openai_logprobs") == [Mode.AUTOREGRESSIVE, Mode.AGGREGATE]
    assert modes_where("one_worker") == [Mode.SPLIT, Mode.PIPELINE]
    assert modes_where("pipelines") == [Mode.AUTOREGRESSIVE, Mode.AGGREGATE, Mode.TREE, Mode.PIPELINE]
