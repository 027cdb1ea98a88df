"""num_draft_tokens: auto — the running estimates of app.adaptive, the engine choosing γ with
them, and the API: auto on unseeded requests, a fixed γ for seeded ones."""

from __future__ import annotations

import asyncio
import itertools
from contextlib import aclosing
from dataclasses import replace

import pytest
import torch

from app.adaptive import DEFAULT_GAMMA, GammaController, VerifyLine
from app.engine import GenerationRequest, SpecOptions
from app.engine import loop as loop_module
from app.engine.session import Session
from core.math.draft_length import RoundCosts, choose_gamma
from core.math.sampling import SamplingParams, apply_sampling, normalised
from core.names import Mode, Reconstruction
from tests.app.conftest import Gateway
from tests.app.fakes import MarkovRunner, make_engine, random_table
from tests.app.helpers import assert_error
from tests.draws import ExactDraws, prefix_distance


def _feed(
    controller: GammaController,
    rounds: int,
    accepted: int,
    rtt_s: float,
    draft_s: float = 0.006,
    verify: tuple[float, float] = (0.0, 0.004),
) -> None:
    for _ in range(rounds):
        gamma = controller.choose()
        model_s = verify[0] + verify[1] * (gamma + 1)
        controller.observe(
            gamma,
            min(accepted, gamma),
            draft_s=draft_s * gamma,
            verify_s=rtt_s + model_s,
            model_s=model_s,
            prepared=0,
            prepared_used=0,
        )


def test_the_first_rounds_use_the_default_then_the_analytic_choice() -> None:
    controller = GammaController()
    assert controller.choose() == DEFAULT_GAMMA
    # the prompt's prefill
    controller.observe(4, 2, draft_s=0.500, verify_s=0.900, model_s=0.850, prepared=0, prepared_used=0)
    assert (
        controller.draft_s is None
        and controller.verify.coefficients() is None
        and controller.network_s == pytest.approx(0.050)
    )
    assert controller.choose() == DEFAULT_GAMMA
    controller.observe(4, 2, draft_s=0.024, verify_s=0.060, model_s=0.020, prepared=0, prepared_used=0)
    costs = controller.costs()
    assert costs.draft_s == pytest.approx(0.006) and costs.rtt_s == pytest.approx(0.7 * 0.050 + 0.3 * 0.040)
    assert costs.verify_s == (pytest.approx(0.020 / 6), pytest.approx(0.020 / 6))  # one m so far: v₀ = v₁
    assert costs.alphas[:3] == (
        pytest.approx((2 + 2.8) / 6),
        pytest.approx((2 + 2.8) / 6),
        pytest.approx(2.8 / 6),
    )
    assert controller.choose() == choose_gamma(costs, controller.max_gamma)


def test_the_verify_line_is_a_least_squares_fit() -> None:
    line = VerifyLine()
    assert line.coefficients() is None
    for m in [3, 3, 4, 5, 3, 6, 4]:
        line.add(m, 0.040 + 0.017 * m)
    v0, v1 = line.coefficients() or (0.0, 0.0)
    assert v0 == pytest.approx(0.040) and v1 == pytest.approx(0.017)
    flat = VerifyLine()
    for _ in range(5):
        flat.add(5, 0.120)
    assert flat.coefficients() == (pytest.approx(0.020), pytest.approx(0.020))


def test_every_fourth_round_probes_one_more_token() -> None:
    controller = GammaController()
    _feed(controller, 6, accepted=2, rtt_s=0.050)
    best = choose_gamma(controller.costs(), controller.max_gamma)
    assert best < controller.max_gamma
    probes = [controller.choose() for _ in range(8)]  # no observations in between: the estimates stand still
    assert [g - best for g in probes] == [1 if (6 + i) % 4 == 3 else 0 for i in range(8)]


def test_the_choice_follows_the_link_and_the_acceptance() -> None:
    near, far, poor = GammaController(), GammaController(), GammaController()
    _feed(near, 12, accepted=3, rtt_s=0.0)
    _feed(far, 12, accepted=12, rtt_s=0.100)
    _feed(poor, 12, accepted=0, rtt_s=0.0)
    choice = {
        name: choose_gamma(c.costs(), c.max_gamma)
        for name, c in (("near", near), ("far", far), ("poor", poor))
    }
    assert choice["poor"] == 1
    assert choice["far"] > choice["near"] >= choice["poor"]


def test_a_fixed_cost_per_call_is_not_charged_to_every_position() -> None:
    """llama.cpp-like costs measured here (t_d 30 ms, t_v = 40 ms + 17 ms·m, 100 ms RTT): the fitted
    line makes the choice of the true costs; a line through the origin would draft less."""
    controller = GammaController()
    _feed(controller, 24, accepted=3, rtt_s=0.100, draft_s=0.030, verify=(0.040, 0.017))
    fitted = replace(controller.costs(), alphas=(0.7,))  # the built-in pair's α
    assert fitted.verify_s == (pytest.approx(0.040), pytest.approx(0.017))
    true = RoundCosts(alphas=(0.7,), draft_s=0.030, verify_s=(0.040, 0.017), rtt_s=0.100)
    # fitted at γ = 1
    through_origin = RoundCosts(alphas=(0.7,), draft_s=0.030, verify_s=(0.0, 0.040 / 2 + 0.017), rtt_s=0.100)
    assert choose_gamma(fitted, 12) == choose_gamma(true, 12) > choose_gamma(through_origin, 12)


V = 6
DRAFT = MarkovRunner(random_table(V, 100), name="draft")
TARGET = MarkovRunner(random_table(V, 200), name="t0")


def test_the_engine_chooses_gamma_unless_the_request_is_seeded() -> None:
    engine = make_engine(DRAFT, [(TARGET, 1.0)])
    spec = SpecOptions(
        mode=Mode.AGGREGATE,
        num_draft_tokens=DEFAULT_GAMMA,
        k=None,
        reconstruction=Reconstruction.RENORMALIZE,
        auto_gamma=True,
    )

    async def rounds(seeded: bool) -> list[tuple[int | None, int]]:
        req = GenerationRequest(
            request_id="r",
            prompt=[3, 1],
            max_tokens=40,
            params=SamplingParams(),
            seed=7,
            choice=0,
            spec=spec,
            seeded=seeded,
        )
        return [(r.drafting.gamma, r.drafted) async for r in engine.generate(req)]

    auto = asyncio.run(rounds(seeded=False))
    assert all(g is not None and 1 <= g <= 12 and d <= g for g, d in auto) and auto[0][0] == DEFAULT_GAMMA
    fixed = asyncio.run(rounds(seeded=True))
    assert all(g is None and d <= DEFAULT_GAMMA for g, d in fixed)


async def test_auto_through_the_api(gateway: Gateway) -> None:
    async with gateway(speculative={"mode": "aggregate", "num_draft_tokens": "auto"}) as client:
        body = {"model": "test-model", "prompt": "hi", "max_tokens": 12}
        spec = (await client.post("/v1/completions", json=body)).json()["usage"]["speculative"]
        assert (
            spec["num_draft_tokens"] == "auto"
            and spec["gamma_auto"] is True
            and spec["gamma_chosen_mean"] >= 1
        )
        seeded = (await client.post("/v1/completions", json={**body, "seed": 3})).json()["usage"][
            "speculative"
        ]
        assert seeded["gamma_auto"] is False and seeded["gamma_chosen_mean"] == DEFAULT_GAMMA
        for bad in (0, 33, "sometimes"):
            resp = await client.post(
                "/v1/completions", json={**body, "speculative": {"num_draft_tokens": bad}}
            )
            assert_error(resp, 400, contains="num_draft_tokens")


# ----------------------------------------------------------------------------- a round's own draws (issue 46)

_EOS = 3
_DRAFT = MarkovRunner(
    torch.log(
        torch.tensor(
            [[0.6, 0.3, 0.05, 0.05], [0.1, 0.1, 0.7, 0.1], [0.1, 0.05, 0.05, 0.8], [0.5, 0.2, 0.2, 0.1]]
        )
    ),
    eos_ids=[_EOS],
    name="d",
)
_TARGET = MarkovRunner(
    torch.log(
        torch.tensor([[0.3, 0.5, 0.1, 0.1], [0.2, 0.2, 0.5, 0.1], [0.3, 0.1, 0.1, 0.5], [0.4, 0.3, 0.2, 0.1]])
    ),
    eos_ids=[_EOS],
    name="t",
)
_TOP2 = SamplingParams(temperature=1.0, top_k=2)  # two branches per draw: the law in a few thousand runs


class _LengthWatcher:
    """A controller that chooses by the last draft's length alone, as the real one does in part
    (its draft time and its verify line's m): γ 4, then 1 after a draft EOS cut short, else 2."""

    def __init__(self, overlap: bool = False, start: int = 4) -> None:
        self.last: int | None = None

    def choose(self) -> int:
        return 4 if self.last is None else 1 if self.last < 4 else 2

    def observe(self, drafted: int, *rest: object) -> None:
        self.last = drafted


def _two_rounds_distance(monkeypatch: pytest.MonkeyPatch) -> float:
    """The exact law (every draw enumerated) of two unseeded auto rounds, against the target."""
    monkeypatch.setattr(loop_module, "GammaController", _LengthWatcher)
    engine = make_engine(_DRAFT, [(_TARGET, 1.0)], eos_ids=[_EOS])
    spec = SpecOptions(
        mode=Mode.AGGREGATE,
        num_draft_tokens=DEFAULT_GAMMA,
        k=None,
        reconstruction=Reconstruction.RENORMALIZE,
        auto_gamma=True,
    )
    loop, count = asyncio.new_event_loop(), itertools.count()

    async def once() -> tuple[int, ...]:
        req = GenerationRequest(
            request_id=f"a{next(count)}",
            prompt=[1, 0],
            max_tokens=16,
            params=_TOP2,
            seed=11,
            choice=0,
            spec=spec,
        )
        tokens, rounds = list[int](), 0
        async with aclosing(engine.generate(req)) as results:
            async for result in results:
                tokens, rounds = tokens + result.tokens, rounds + 1
                if rounds == 2 or result.finish_reason:
                    break
        return tuple(tokens)

    try:
        with ExactDraws() as draws:
            law = draws.law(lambda: loop.run_until_complete(once()))
    finally:
        loop.close()

    def p_next(prefix: tuple[int, ...]) -> torch.Tensor:
        last = prefix[-1] if prefix else 0
        return normalised(apply_sampling(_TARGET.table[last][None].float(), _TOP2))[0]

    return prefix_distance(law, p_next, _EOS, 4)


def test_auto_rounds_draw_their_own_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """γ that follows the last draft's length sees whether the draft drew EOS at a position the
    round left undecided; keyed by position alone, the next round would draw that number again
    (1.6e-3 off the target at T = 1 on the matrix's pair, 4.2e-4 here). Each auto round draws from
    its own seed: the law is the target's, exactly."""
    assert _two_rounds_distance(monkeypatch) < 1e-12


def test_negative_control_auto_rounds_keyed_by_position_alone_are_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(Session, "keyed", lambda self, ahead=0: self.req)
    assert _two_rounds_distance(monkeypatch) > 1e-4
