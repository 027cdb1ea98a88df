"""``num_draft_tokens: auto`` (docs/design.md §3.1): γ chosen each round from this request's running
acceptance and costs (docs/modes.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from core.math.draft_length import RoundCosts, choose_gamma

DEFAULT_GAMMA = 4  # the first rounds' γ, and every round's for a seeded request
MAX_AUTO_GAMMA = 12
PROBE_EVERY = 4  # every PROBE_EVERY-th round drafts one token more (or fewer) than chosen
_PRIOR_ALPHA, _PRIOR_WEIGHT = 0.7, 4.0
_EMA = 0.3
_LINE_EMA = 0.1  # the verify line keeps a longer memory: it needs several m to fit


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - _EMA) * old + _EMA * new


@dataclass
class VerifyLine:
    """t_v(m) = v₀ + v₁·m by least squares over decayed sums of (m, t)."""

    weight: float = 0.0
    m: float = 0.0
    mm: float = 0.0
    t: float = 0.0
    mt: float = 0.0

    def add(self, m: int, seconds: float) -> None:
        keep = 1 - _LINE_EMA if self.weight else 1.0
        self.weight, self.m, self.mm = keep * self.weight + 1, keep * self.m + m, keep * self.mm + m * m
        self.t, self.mt = keep * self.t + seconds, keep * self.mt + m * seconds

    def coefficients(self) -> tuple[float, float] | None:
        """(v₀, v₁); None before the first round."""
        if not self.weight:
            return None
        mean_m, mean_t = self.m / self.weight, self.t / self.weight
        spread = self.mm / self.weight - mean_m**2
        if spread > 0.05:
            slope = (self.mt / self.weight - mean_m * mean_t) / spread
            if slope > 0 and mean_t - slope * mean_m >= 0:
                return mean_t - slope * mean_m, slope
        per_position = mean_t / (mean_m + 1)  # one m so far (or a fit that makes no sense): v₀ = v₁
        return per_position, per_position


@dataclass
class GammaController:
    overlap: bool = False
    max_gamma: int = MAX_AUTO_GAMMA
    # the first rounds' γ (the request's num_draft_tokens: DEFAULT_GAMMA with auto)
    start: int = DEFAULT_GAMMA
    reached: list[float] = field(default_factory=list)  # per draft position: rounds that got there
    accepted: list[float] = field(default_factory=list)  # ... and accepted its token
    draft_s: float | None = None
    verify: VerifyLine = field(default_factory=VerifyLine)
    network_s: float | None = None
    prepared: int = 0  # drafts prepared during a flight (overlap) ...
    prepared_used: int = 0  # ... and used
    observed: int = 0  # rounds seen
    chosen: list[int] = field(default_factory=list)  # γ of each round, for the usage block

    def choose(self) -> int:
        if self.draft_s is None:  # set from the second round on, with the line and the RTT
            gamma = self.start
        else:
            gamma = choose_gamma(self.costs(), self.max_gamma)
            if len(self.chosen) % PROBE_EVERY == PROBE_EVERY - 1:
                gamma = gamma + 1 if gamma < self.max_gamma else gamma - 1
        self.chosen.append(gamma)
        return gamma

    def costs(self) -> RoundCosts:
        line = self.verify.coefficients()
        assert self.draft_s is not None and line is not None and self.network_s is not None
        alphas = tuple(
            (self.accepted[j] + _PRIOR_ALPHA * _PRIOR_WEIGHT) / (self.reached[j] + _PRIOR_WEIGHT)
            for j in range(len(self.reached))
        ) or (_PRIOR_ALPHA,)
        return RoundCosts(
            alphas=alphas,
            draft_s=self.draft_s,
            verify_s=line,
            rtt_s=self.network_s,
            overlap=self.overlap,
            prepared_used=(self.prepared_used + 0.5) / (self.prepared + 1),
        )

    def observe(
        self,
        drafted: int,
        accepted: int,
        draft_s: float,
        verify_s: float,
        model_s: float,
        prepared: int,
        prepared_used: int,
    ) -> None:
        """What one round cost and yielded (a round that drafted nothing teaches only its flight)."""
        self.observed += 1
        for j in range(drafted):
            while len(self.reached) <= j:
                self.reached.append(0.0)
                self.accepted.append(0.0)
            if j > accepted:
                break
            self.reached[j] += 1
            self.accepted[j] += j < accepted
        self.network_s = _ema(self.network_s, max(verify_s - model_s, 0.0))
        self.prepared += prepared
        self.prepared_used += prepared_used
        if self.observed == 1:
            return  # the prompt's prefill: neither the draft's nor the workers' cost per token
        if drafted and not prepared_used:
            self.draft_s = _ema(self.draft_s, draft_s / drafted)
        self.verify.add(drafted + 1, model_s)
