"""One round as a strategy sees it (docs/design.md §3): the calls, the mixture of the answers, the draws, the
logprobs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Unpack

import numpy as np
import torch

from app.engine.spec import GenerationRequest, TokenLogprob
from app.targets.channel import Traffic
from app.targets.failures import WorkerError
from app.targets.pool import TargetSet
from core.math.aggregation import aggregate, merge_top_logprobs, mixed_logprob, reconstruct
from core.math.random import Purpose, uniforms
from core.math.sampling import normalised
from core.math.tree import TokenTree
from core.names import Mode, Reconstruction
from core.protocol import AskFields, VerifyRequest, VerifyResponse
from core.transform import LogitsTransform


@dataclass
class Round:
    """What a strategy sees of the round in progress."""

    targets: TargetSet
    # [N]: as configured, each target transformed as it would be alone (docs/design.md §3.9)
    weights: torch.Tensor
    vocab_size: int
    req: GenerationRequest
    session_id: str
    sequence: list[int]  # agreed tokens so far (prompt + generated)
    agreed: list[int]  # per worker: tokens of ``sequence`` it holds
    draft: TokenTree  # a chain, or a tree in ``tree`` mode
    traffic: Traffic
    path: list[int] | None = None  # the previous round's accepted tree path, the first call's ``path`` (v1.1)
    # the request's masks (grammar, min_tokens), the gateway's own matcher (not the draft's): ``allowed``
    transformer: LogitsTransform | None = None
    model_s: float = 0.0  # per call the slowest worker's model seconds, summed (the round's latency)
    busy_s: float = 0.0  # every worker's model seconds, summed over workers and calls (the targets' cost)
    responses: list[VerifyResponse] = field(default_factory=list)  # of the last call
    calls_s: float = 0.0  # seconds waiting on the workers' answers, every call of the round
    # those seconds by part, each call's slowest worker (Traffic.seconds)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def positions(self) -> list[int]:
        """Absolute index of the token decided at each depth of the walk (γ+1 for a chain)."""
        start = len(self.sequence)
        return list(range(start, start + self.draft.max_depth() + 1))

    def allowed(self) -> torch.Tensor | None:  # [rows, V] bool
        """The ids each scored row (the root's, then each node's) may emit; None when nothing is masked."""
        if self.transformer is None or not self.transformer.masks_any:
            return None
        ids = self.draft.ids()
        paths = [[], *([ids[n] for n in self.draft.path_to(node)] for node in range(len(self.draft)))]
        return self.transformer.masks(self.sequence, paths)

    async def call(self, **ask: Unpack[AskFields]) -> list[VerifyResponse]:
        """Every worker at once; after it, each holds ``sequence`` + draft (a tree's rows too).
        The first call carries the previous tree's accepted path, which ends the agreed prefix."""
        path, self.path = self.path, None
        self.responses = await self._all(
            self.sequence,
            lambda n: (self.sequence[: self.agreed[n]], self.sequence[self.agreed[n] :], self.draft.ids()),
            # protocol v1.1
            parents=None if self.draft.is_chain else self.draft.parents.numpy().astype(np.int32),
            path=np.array(path, dtype=np.int32) if path else None,
            **ask,
        )
        self.agreed[:] = [len(self.sequence)] * len(self.agreed)
        return self.responses

    async def score(self, position: int, token: int, drafted: list[int] | None = None) -> float:
        """log p(token) at ``position`` of sequence + ``drafted`` under the mixture: one short call per worker
        that re-reads the token before it; each then holds sequence + drafted up to ``position``."""
        held = [*self.sequence, *(self.draft.ids() if drafted is None else drafted)][:position]
        responses = await self._all(
            held,
            lambda n: (held[:-1], held[-1:], []),
            mode=Mode.AUTOREGRESSIVE.value,
            score_ids=np.array([token], dtype=np.int64),
        )
        return mixed_logprob([float(array(resp.score_logprobs)[0]) for resp in responses], self.weights)

    async def _all(
        self,
        agreed: list[int],
        lists: Callable[[int], tuple[list[int], list[int], list[int]]],
        parents: np.ndarray | None = None,
        path: np.ndarray | None = None,
        **ask: Unpack[AskFields],
    ) -> list[VerifyResponse]:
        """One call per worker n (prefix, tokens, draft: ``lists(n)``); its wall time, where the slowest
        worker's call spent it, the model seconds and the bytes count in the round."""
        req = self.req
        requests = [
            VerifyRequest.after(
                self.session_id,
                *lists(n),
                **req.sampling_wire(),
                seed=req.seed,
                choice=req.choice,
                worker=n,
                seeded=req.seeded,
                parents=parents,
                path=path,
                **ask,
            )
            for n in range(len(self.targets.workers))
        ]
        started = time.perf_counter()
        results = await all_workers(self.targets, requests, agreed)
        self.calls_s += time.perf_counter() - started
        slowest = max((traffic.seconds for _, traffic in results), key=lambda parts: sum(parts.values()))
        for name, seconds in slowest.items():
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.model_s += max(resp.model_ms for resp, _ in results) / 1e3
        self.busy_s += sum(resp.model_ms for resp, _ in results) / 1e3
        for _, traffic in results:
            self.traffic.add(traffic)
        return [resp for resp, _ in results]


def round_uniforms(rnd: Round) -> tuple[torch.Tensor, torch.Tensor]:
    """r_j for the accept tests; the residual draw at each draft position, the bonus draw last."""
    req, positions = rnd.req, rnd.positions
    accept = uniforms(req.seed, req.choice, positions[:-1], Purpose.ACCEPT)
    final = torch.cat(
        [
            uniforms(req.seed, req.choice, positions[:-1], Purpose.RESIDUAL),
            uniforms(req.seed, req.choice, positions[-1:], Purpose.BONUS),
        ]
    )
    return accept, final


def lanes(rnd: Round) -> tuple[torch.Tensor, torch.Tensor]:
    """The walk's draws: r per depth and lane ``[D, W]`` (lane 0 is the chain's stream), the recovered / bonus
    draw ``[D+1]``."""
    accept, final = round_uniforms(rnd)
    width = rnd.draft.max_width()
    if width <= 1:
        return accept[:, None], final
    req, positions = rnd.req, rnd.positions[:-1]
    others = [
        uniforms(req.seed, req.choice, positions, Purpose.ACCEPT, lane=lane) for lane in range(1, width)
    ]
    return torch.stack([accept, *others], dim=1), final


def mixture(
    responses: list[VerifyResponse],
    vocab_size: int,
    weights: torch.Tensor,
    method: Reconstruction = Reconstruction.RENORMALIZE,
    normalise: bool = True,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """p̂ = Σ w_n p̂_n: ``[γ+1, V]`` float64 (``weights``: ``[N]``). Whole rows are ``normalised`` unless
    greedy compares them as sent; ``allowed`` (``[rows, V]``): where ``residual`` reconstruction spreads the
    tail."""
    dists = []
    for resp in responses:
        probs = torch.tensor(array(resp.probs), dtype=torch.float64)
        if resp.ids is None:
            dists.append(normalised(probs) if normalise else probs)
        else:
            ids = torch.from_numpy(np.array(resp.ids, dtype=np.int64))
            dists.append(
                reconstruct(ids, probs, vocab_size, method, torch.tensor(array(resp.tail_mass)), allowed)
            )
    return aggregate(torch.stack(dists), weights)


def token_logprobs(
    target: torch.Tensor,  # [m, V]: the distribution each token was decided by
    tokens: list[int],  # [m]
    top_n: int | None,
) -> list[TokenLogprob]:
    out = []
    for row, token in zip(target, tokens):
        logs = torch.log(row.double().clamp(min=1e-45))
        top = torch.topk(row, top_n).indices.tolist() if top_n else []
        out.append(TokenLogprob(token, float(logs[token]), [(int(t), float(logs[t])) for t in top]))
    return out


async def all_workers(
    pool: TargetSet, requests: list[VerifyRequest], agreed: list[int]
) -> list[tuple[VerifyResponse, Traffic]]:
    """One call per worker, at once; one failure cancels the others."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(w.verify(r, agreed)) for w, r in zip(pool.workers, requests)]
    except BaseExceptionGroup as failures:
        # the first WorkerError (what the client is told), else the first failure
        raise (failures.subgroup(WorkerError) or failures).exceptions[0] from None
    return [t.result() for t in tasks]


def row_ids(resp: VerifyResponse, row: int, vocab_size: int) -> torch.Tensor:
    """The ids of one position's probabilities (all of V when sent in full)."""
    if resp.ids is None:
        return torch.arange(vocab_size)
    return torch.from_numpy(np.array(resp.ids[row], dtype=np.int64))


def array(value: np.ndarray | None) -> np.ndarray:
    assert value is not None  # the pool checked the response carries it
    return value


def worker_logprobs(
    rnd: Round, tokens: list[int], values: list[float], rows: list[int] | None = None
) -> list[TokenLogprob]:
    """The emitted tokens with the mixture's logprobs ``values`` and the workers' merged top-n at ``rows``
    (default: the chain's positions)."""
    n, weights = rnd.req.top_logprobs, rnd.weights
    tops = [(array(r.top_ids), array(r.top_logprobs)) for r in rnd.responses] if n else []
    rows = list(range(len(tokens))) if rows is None else rows
    return [
        TokenLogprob(t, v, merge_top_logprobs(tops, j, n or 0, weights))
        for j, t, v in zip(rows, tokens, values)
    ]
