"""The exact law of a run of the real code, by enumerating every random draw it makes.

Every random number of specgate is a uniform of ``core.math.random`` (``uniform``, ``uniforms``, and on a
device ``philox_uniforms`` of ``stream_key``'s keys), and every uniform is consumed by one of four functions:
``accepts`` (u < a), ``count_accepts`` (leading u_j < a_j), ``sample_index`` and ``sample_rows`` (inverse
CDF). ``ExactDraws`` stands in for the eight:

- a uniform becomes a **tag**, a float that names its key (seed, choice, position, purpose,
  worker, lane) — the same key gives the same tag, as the same key gives the same number;
- a tag holds the interval of U[0, 1) its number may still lie in (at first all of it);
- a test ``u < a`` or an inverse-CDF draw splits that interval; each piece is one branch, whose
  probability is the piece's length over the interval's.

``law(run)`` runs ``run`` once per sequence of branches (depth first, replaying the choices
already made), so every outcome comes with its exact probability, through the very code that
serves requests: the draft's sampling, the gateway's walk, the workers' samples. A number read
twice is cut twice (a stream shared by two purposes shows in the law). A tag is not a float32
value, so a uniform converted to float32 (or rounded any other way) is no longer a tag and raises
at its draw. What it cannot see: a uniform compared by hand (``u < a`` outside ``accepts``) takes
the branch of the tag's value, not both — keep every comparison in ``core.math.random``.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

import core.math.random as random_module
from core.math.random import Purpose

T = TypeVar("T", bound=Hashable)

Key = tuple[int, int, int, int, int, int]  # seed, choice, position, purpose, worker, lane
Decision = tuple[int, int]  # (tag, how many decisions on that tag came before)


@dataclass
class _Run:
    """One execution: the branches it was told to take, the new ones it met, its probability."""

    script: dict[Decision, int]
    intervals: dict[int, tuple[float, float]] = field(default_factory=dict)
    cuts: dict[int, int] = field(default_factory=dict)
    new: list[tuple[Decision, int]] = field(default_factory=list)
    probability: float = 1.0


class ExactDraws:
    """Usage: ``with ExactDraws() as draws: law = draws.law(lambda: run_once())``."""

    MAX_RUNS = 200_000  # a run with more branches than this is not a closed form but a hang

    def __init__(self) -> None:
        self._tags: dict[Key, int] = {}
        self._values: dict[float, int] = {}
        # (seed, choice, purpose, worker) -> its stand-in key
        self._streams: dict[tuple[int, int, int, int], int] = {}
        self._stream_of: list[tuple[int, int, int, int]] = []
        self._run: _Run | None = None
        self.runs = 0

    # ----------------------------------------------------------------- the law

    def law(self, run: Callable[[], T]) -> dict[T, float]:
        """Every outcome of ``run`` with its exact probability."""
        out: dict[T, float] = defaultdict(float)
        stack: list[dict[Decision, int]] = [{}]
        while stack:
            script = stack.pop()
            self._run = current = _Run(script)
            try:
                outcome = run()
            finally:
                self._run = None
            self.runs += 1
            if self.runs > self.MAX_RUNS:
                raise RuntimeError(f"more than {self.MAX_RUNS} branches: shrink the case")
            out[outcome] += current.probability
            taken: dict[Decision, int] = {}
            for decision, options in current.new:
                stack.extend({**script, **taken, decision: option} for option in range(1, options))
                taken[decision] = 0
        return dict(out)

    # ----------------------------------------------------------------- the stand-ins

    def _tag(
        self, seed: int, choice: int, position: int, purpose: Purpose, worker: int = 0, lane: int = 0
    ) -> float:
        key = (seed, choice, position, int(purpose), worker, lane)
        if key not in self._tags:
            self._tags[key] = len(self._tags)
            self._values[self._value(self._tags[key])] = self._tags[key]
        return self._value(self._tags[key])

    @staticmethod
    def _value(tag: int) -> float:
        return (tag + 0.5) / 2**24 + 2**-40  # distinct, in (0, 1), exact in float64 and not in float32

    def uniform(
        self, seed: int, choice: int, position: int, purpose: Purpose, worker: int = 0, lane: int = 0
    ) -> float:
        return self._tag(seed, choice, position, purpose, worker, lane)

    def uniforms(
        self, seed: int, choice: int, positions: list[int], purpose: Purpose, worker: int = 0, lane: int = 0
    ) -> torch.Tensor:
        return torch.tensor(
            [self._tag(seed, choice, p, purpose, worker, lane) for p in positions], dtype=torch.float64
        )

    def stream_key(self, seed: int, choice: int, purpose: Purpose, worker: int = 0) -> tuple[int, int]:
        """A key that names its stream (Philox's would not say whose it is): ``philox_uniforms`` reads the
        stream back from it."""
        stream = (seed, choice, int(purpose), worker)
        if stream not in self._streams:
            self._streams[stream] = len(self._streams)
            self._stream_of.append(stream)
        return self._streams[stream], 0

    def philox_uniforms(
        self, keys: torch.Tensor, positions: torch.Tensor, lanes: torch.Tensor | None = None
    ) -> torch.Tensor:
        lane_list = lanes.tolist() if lanes is not None else [0] * len(positions)
        tags = [
            self._tag(
                *self._stream_of[k0][:2],
                position,
                Purpose(self._stream_of[k0][2]),
                self._stream_of[k0][3],
                lane,
            )
            for (k0, _), position, lane in zip(keys.tolist(), positions.tolist(), lane_list)
        ]
        return torch.tensor(tags, dtype=torch.float64, device=positions.device)

    def accepts(self, u: float, probability: float) -> bool:
        a = float(probability)
        return bool(self._cut(u, [(True, None, a), (False, a, None)]))

    def count_accepts(self, u: torch.Tensor, probabilities: torch.Tensor) -> torch.Tensor:
        count = 0
        while count < len(u) and self.accepts(float(u[count]), float(probabilities[count])):
            count += 1
        return torch.tensor(count)

    def sample_index(self, probs: torch.Tensor, u: float) -> int:
        cdf = torch.cumsum(probs.double(), dim=0)
        total = float(cdf[-1])
        if not total > 0:
            raise ValueError("cannot sample from a distribution with no mass")
        bounds = [0.0, *(float(c) / total for c in cdf)]
        return int(self._cut(u, [(i, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]))

    def sample_rows(self, probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(probs.shape[0], dtype=torch.long)
        for row in range(probs.shape[0]):
            if float(probs[row].double().sum()) > 0:
                out[row] = self.sample_index(probs[row], float(u[row]))
        return out

    def _cut(self, u: float, pieces: list[tuple[Any, float | None, float | None]]) -> Any:
        """The branch taken among ``pieces`` (value, from, to) of U[0, 1) for the tag ``u``."""
        run = self._run
        assert run is not None, "a draw outside ExactDraws.law"
        tag = self._values.get(float(u))
        if tag is None:
            raise AssertionError(
                f"{u!r} is not a uniform of core.math.random: a draw escaped the enumeration"
            )
        lo, hi = run.intervals.get(tag, (0.0, 1.0))
        options = []
        for value, start, end in pieces:
            a, b = max(lo, start if start is not None else lo), min(hi, end if end is not None else hi)
            if b > a:
                options.append((value, a, b))
        decision = (tag, run.cuts.get(tag, 0))
        run.cuts[tag] = decision[1] + 1
        if len(options) == 1:
            choice = 0
        elif decision in run.script:
            choice = run.script[decision]
        else:
            choice = 0
            run.new.append((decision, len(options)))
        value, a, b = options[choice]
        run.probability *= (b - a) / (hi - lo)
        run.intervals[tag] = (a, b)
        return value

    # ----------------------------------------------------------------- installing

    def __enter__(self) -> ExactDraws:
        self._patches = list(_patches(self))
        for module, name, _, new in self._patches:
            setattr(module, name, new)
        return self

    def __exit__(self, *exc: object) -> None:
        for module, name, old, _ in self._patches:
            setattr(module, name, old)


_STAND_INS = (
    "uniform",
    "uniforms",
    "stream_key",
    "philox_uniforms",
    "accepts",
    "count_accepts",
    "sample_index",
    "sample_rows",
)


_HOLDERS: tuple[int, list[tuple[Any, str, Any, str]]] = (-1, [])  # (len(sys.modules), the holders found then)


def _patches(draws: ExactDraws) -> Iterator[tuple[Any, str, Any, Any]]:
    """(module, name, original, stand-in) for every project module that holds one of the six; the scan of
    every module's names is kept while no module is imported and each holder still holds its function (a
    matrix enters ExactDraws once a cell: thousands of times)."""
    global _HOLDERS
    if _HOLDERS[0] != len(sys.modules) or any(
        vars(module).get(attr) is not value for module, attr, value, _ in _HOLDERS[1]
    ):
        # one pass over each module's names
        originals = {id(getattr(random_module, name)): name for name in _STAND_INS}
        holders = []
        for module in list(sys.modules.values()):
            if module is None or not getattr(module, "__name__", "").startswith(
                ("app", "core", "workers", "clients", "tests")
            ):
                continue
            holders += [
                (module, attr, value, originals[id(value)])
                for attr, value in list(vars(module).items())
                if id(value) in originals
            ]
        _HOLDERS = (len(sys.modules), holders)
    for module, attr, value, name in _HOLDERS[1]:
        yield module, attr, value, getattr(draws, name)


@contextmanager
def exact_draws() -> Iterator[ExactDraws]:
    with ExactDraws() as draws:
        yield draws


def prefix_distance(
    law: dict[tuple[int, ...], float],  # outcome (the tokens checked) → its exact probability
    # [V] float64: the target after a prefix of generated tokens
    p_next: Callable[[tuple[int, ...]], torch.Tensor],
    eos: int,
    vocab_size: int,
) -> float:
    """How far the checked tokens' law, each outcome followed by the target's conditionals, is
    from the target's own law of sequences: the largest |C(s) − P(s)| over the prefixes s that
    decide it — every proper prefix of an outcome and each of its V one-token extensions. (Past
    those no outcome goes on, so C(s·x) = C(s) p(x | s) = P(s·x) by induction: equal there, equal
    at every length, without enumerating Vᴸ sequences.) A sequence ends at EOS."""

    def target(s: tuple[int, ...], start: int = 0) -> float:  # P(s[start:] | s[:start])
        mass = 1.0
        for i in range(start, len(s)):
            if i and s[i - 1] == eos:
                return 0.0
            mass *= float(p_next(s[:i])[s[i]])
        return mass

    internal = {t[:i] for t in law for i in range(len(t))}
    checks = internal | {(*s, x) for s in internal if not (s and s[-1] == eos) for x in range(vocab_size)}
    worst = 0.0
    for s in checks:
        reached = sum(
            mass * (1.0 if t[: len(s)] == s else target(s, len(t)) if s[: len(t)] == t else 0.0)
            for t, mass in law.items()
        )
        worst = max(worst, abs(reached - target(s)))
    return worst
