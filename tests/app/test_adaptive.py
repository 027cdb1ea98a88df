"""num_draft_tokens: auto — the running estimates of app.adaptive, the engine choosing γ with
them, and the API: auto on unseeded requests, a fixed γ for seeded ones."""

from __future__ import annotations

import asyncio

import pytest

from app.adaptive import DEFAULT_GAMMA, GammaController
from app.engine import GenerationRequest, SpecOptions
from core.math.draft_length import choose_gamma
from core.math.sampling import SamplingParams
from core.names import Mode, Reconstruction
from tests.app.conftest import Gateway
from tests.app.fakes import MarkovRunner, make_engine, random_table
from tests.app.helpers import assert_error


def _feed(controller: GammaController, rounds: int, accepted: int, rtt_s: float) -> None:
    for _ in range(rounds):
        gamma = controller.choose()
        controller.observe(gamma, min(accepted, gamma), draft_s=0.006 * gamma, verify_s=rtt_s + 0.004 * (gamma + 1),
                           model_s=0.004 * (gamma + 1), prepared=0, prepared_used=0)


def test_the_first_round_is_the_default_then_the_analytic_choice() -> None:
    controller = GammaController()
    assert controller.choose() == DEFAULT_GAMMA
    controller.observe(4, 2, draft_s=0.024, verify_s=0.060, model_s=0.020, prepared=0, prepared_used=0)
    costs = controller.costs()
    assert costs.draft_s == pytest.approx(0.006) and costs.verify_s == (0.0, pytest.approx(0.004)) and costs.rtt_s == pytest.approx(0.040)
    assert costs.alphas[:3] == (pytest.approx((1 + 2.8) / 5), pytest.approx((1 + 2.8) / 5), pytest.approx(2.8 / 5))
    assert controller.choose() == choose_gamma(costs, controller.max_gamma)


def test_the_choice_follows_the_link_and_the_acceptance() -> None:
    near, far, poor = GammaController(), GammaController(), GammaController()
    _feed(near, 12, accepted=3, rtt_s=0.0)
    _feed(far, 12, accepted=12, rtt_s=0.100)
    _feed(poor, 12, accepted=0, rtt_s=0.0)
    assert poor.chosen[-1] == 1
    assert far.chosen[-1] > near.chosen[-1] >= poor.chosen[-1]


V = 6
DRAFT = MarkovRunner(random_table(V, 100), name="draft")
TARGET = MarkovRunner(random_table(V, 200), name="t0")


def test_the_engine_chooses_gamma_unless_the_request_is_seeded() -> None:
    engine = make_engine(DRAFT, [(TARGET, 1.0)])
    spec = SpecOptions(Mode.AGGREGATE, DEFAULT_GAMMA, None, Reconstruction.RENORMALIZE, auto_gamma=True)

    async def rounds(seeded: bool) -> list[tuple[int | None, int]]:
        req = GenerationRequest("r", [3, 1], 40, SamplingParams(), 7, 0, spec, seeded=seeded)
        return [(r.gamma, r.drafted) async for r in engine.generate(req)]

    auto = asyncio.run(rounds(seeded=False))
    assert all(g is not None and 1 <= g <= 12 and d <= g for g, d in auto) and auto[0][0] == DEFAULT_GAMMA
    fixed = asyncio.run(rounds(seeded=True))
    assert all(g is None and d <= DEFAULT_GAMMA for g, d in fixed)


async def test_auto_through_the_api(gateway: Gateway) -> None:
    async with gateway(speculative={"mode": "aggregate", "num_draft_tokens": "auto"}) as client:
        body = {"model": "test-model", "prompt": "hi", "max_tokens": 12}
        spec = (await client.post("/v1/completions", json=body)).json()["usage"]["speculative"]
        assert spec["num_draft_tokens"] == "auto" and spec["gamma_auto"] is True and spec["gamma_chosen_mean"] >= 1
        seeded = (await client.post("/v1/completions", json={**body, "seed": 3})).json()["usage"]["speculative"]
        assert seeded["gamma_auto"] is False and seeded["gamma_chosen_mean"] == DEFAULT_GAMMA
        for bad in (0, 33, "sometimes"):
            resp = await client.post("/v1/completions", json={**body, "speculative": {"num_draft_tokens": bad}})
            assert_error(resp, 400, contains="num_draft_tokens")
