"""Choosing the draft length γ (docs/design.md §3.1, issue 8): the γ that maximises the analytic throughput
E(γ) / T(γ) of a round, with E(γ) = Σ_{i=0}^{γ} Π_{j<i} α_j tokens (α_j the acceptance at draft position j)
and T(γ) its time from sending one round to sending the next (``RoundCosts.round_s``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoundCosts:
    """What one request has measured so far; every time in seconds, every size in bytes."""

    alphas: tuple[float, ...]  # α_j per draft position; positions past the last reuse it
    draft_s: float  # t_d: the draft's time per token
    verify_s: tuple[float, float]  # (v₀, v₁): t_v(m) = v₀ + v₁·m
    rtt_s: float = 0.0
    up_bytes: tuple[float, float] = (0.0, 0.0)  # (u₀, u₁): bytes up = u₀ + u₁·γ
    down_bytes: tuple[float, float] = (0.0, 0.0)  # (d₀, d₁): bytes down = d₀ + d₁·(γ + 1)
    up_bits_per_s: float | None = None  # None = unlimited
    down_bits_per_s: float | None = None
    overlap: bool = False  # DSD: the next draft is prepared during the flight
    # u: the share of prepared drafts used (every token accepted, its first the bonus)
    prepared_used: float = 0.0

    def alpha(self, j: int) -> float:
        return self.alphas[min(j, len(self.alphas) - 1)] if self.alphas else 0.0

    def flight_s(self, gamma: float) -> float:
        """Send to verdict: the link both ways and the workers' scoring."""
        up = self.up_bytes[0] + self.up_bytes[1] * gamma
        down = self.down_bytes[0] + self.down_bytes[1] * (gamma + 1)
        wire = 8 * up / self.up_bits_per_s if self.up_bits_per_s else 0.0
        wire += 8 * down / self.down_bits_per_s if self.down_bits_per_s else 0.0
        return self.rtt_s + wire + self.verify_s[0] + self.verify_s[1] * (gamma + 1)

    def round_s(self, gamma: float) -> float:
        """T(γ) = γ·t_d + flight(γ); overlapped, u·max(flight(γ), (γ + 1)·t_d) + (1 − u)·(flight(γ) +
        γ·t_d)."""
        flight, drafting = self.flight_s(gamma), gamma * self.draft_s
        if not self.overlap:
            return drafting + flight
        used = self.prepared_used
        return used * max(flight, (gamma + 1) * self.draft_s) + (1 - used) * (flight + drafting)


def choose_gamma(costs: RoundCosts, max_gamma: int) -> int:
    """The γ in [1, max_gamma] of the highest throughput (ties to the shorter draft), in one pass: E(γ) grows
    by Π_{j<γ} α_j from E(γ − 1)."""
    best, best_rate = 1, -1.0
    tokens, reach = 1.0, 1.0
    for gamma in range(1, max_gamma + 1):
        reach *= costs.alpha(gamma - 1)
        tokens += reach
        rate = tokens / costs.round_s(gamma)
        if rate > best_rate * (1 + 1e-12):
            best, best_rate = gamma, rate
    return best
