"""``num_draft_tokens: auto`` (issue 8, DESIGN §3.1): per request, γ is chosen each round by
``core.math.draft_length.choose_gamma`` from running estimates of what this request has met:

    α_j        accepted / reached at draft position j, from a prior of α = 0.7 worth 4 rounds
    t_d        the draft's seconds per token (rounds whose draft was not prepared ahead)
    t_v(m)     c·m: the workers' model seconds per scored position (their reported model time)
    RTT        the rest of a round's wall time: link both ways and serialisation, taken as a
               constant per round (payloads grow with γ, but slowly next to the RTT on the
               links where γ matters)
    u          the share of prepared drafts used so far (overlap), from a prior of ½ worth one

Each estimate is an exponential moving average (weight 0.3 on the newest round). The first
round uses γ = 4. With a ``seed`` the output depends on γ, so ``auto`` is off for seeded
requests: they draft DEFAULT_GAMMA tokens every round.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from core.math.draft_length import RoundCosts, choose_gamma

DEFAULT_GAMMA = 4  # the first round's γ, and every round's for a seeded request
MAX_AUTO_GAMMA = 12
_PRIOR_ALPHA, _PRIOR_WEIGHT = 0.7, 4.0
_EMA = 0.3


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - _EMA) * old + _EMA * new


@dataclass
class GammaController:
    overlap: bool = False
    max_gamma: int = MAX_AUTO_GAMMA
    reached: list[float] = field(default_factory=list)  # per draft position: rounds that got there
    accepted: list[float] = field(default_factory=list)  # ... and accepted its token
    draft_s: float | None = None
    model_s_per_position: float | None = None
    network_s: float | None = None
    prepared: int = 0  # drafts prepared during a flight (overlap) ...
    prepared_used: int = 0  # ... and used
    chosen: list[int] = field(default_factory=list)  # γ of each round, for the usage block

    def choose(self) -> int:
        if self.draft_s is None or self.model_s_per_position is None or self.network_s is None:
            gamma = DEFAULT_GAMMA
        else:
            gamma = choose_gamma(self.costs(), self.max_gamma)
        self.chosen.append(gamma)
        return gamma

    def costs(self) -> RoundCosts:
        assert self.draft_s is not None and self.model_s_per_position is not None and self.network_s is not None
        alphas = tuple(
            (self.accepted[j] + _PRIOR_ALPHA * _PRIOR_WEIGHT) / (self.reached[j] + _PRIOR_WEIGHT) for j in range(len(self.reached))
        ) or (_PRIOR_ALPHA,)
        return RoundCosts(
            alphas=alphas, draft_s=self.draft_s, verify_s=(0.0, self.model_s_per_position), rtt_s=self.network_s,
            overlap=self.overlap, prepared_used=(self.prepared_used + 0.5) / (self.prepared + 1),
        )

    def observe(self, drafted: int, accepted: int, draft_s: float, verify_s: float, model_s: float, prepared: int, prepared_used: int) -> None:
        """What one round cost and yielded (a round that drafted nothing teaches only its flight)."""
        for j in range(drafted):
            while len(self.reached) <= j:
                self.reached.append(0.0)
                self.accepted.append(0.0)
            if j > accepted:
                break
            self.reached[j] += 1
            self.accepted[j] += j < accepted
        if drafted and not prepared_used:
            self.draft_s = _ema(self.draft_s, draft_s / drafted)
        self.model_s_per_position = _ema(self.model_s_per_position, model_s / (drafted + 1))
        self.network_s = _ema(self.network_s, max(verify_s - model_s, 0.0))
        self.prepared += prepared
        self.prepared_used += prepared_used
