"""``exact``: lossless federated verification with sparse payloads (docs/design.md §3.5)."""

from __future__ import annotations

import numpy as np
import torch

from app.engine.round import Round, array, lanes, round_uniforms, worker_logprobs
from app.engine.spec import RoundResult
from app.engine.strategies.base import RoundStrategy
from app.engine.strategies.greedy import certified_greedy
from core.math.aggregation import mixed_probability, normalise_weights
from core.math.exact import ExactPosition, normalised_payload, verify_exact
from core.math.random import Purpose, uniform
from core.math.relaxed import relaxation_factor_on_support, relaxed_distance
from core.math.walk import SparseNode, node_supports, verify_tree_exact
from core.names import Mode
from core.protocol import VerifyResponse


class ExactStrategy(RoundStrategy):
    """Lossless federated verification with sparse payloads (docs/design.md §3.5): a chain drawn from q̂ is
    verified by ``verify_exact``; a tree, or a chain of fixed (top-1) children, by the tree walk (§3.6)."""

    async def verify(self, rnd: Round) -> RoundResult:
        if rnd.req.params.is_greedy:
            return await certified_greedy(rnd)
        if not rnd.draft.is_sampled_chain:
            return await exact_walk(rnd)
        req, draft = rnd.req, rnd.draft
        supports = [draft.support(j - 1)[0] for j in range(len(draft))]  # S_j, ascending ids
        responses = await _call_on(rnd, supports)
        rows = sparse_rows(responses, supports)
        positions = [
            ExactPosition(row.support, row.p, row.complement, row.samples, draft.support(j - 1)[1].double())
            for j, row in enumerate(rows)
        ]
        draft_index = [int((s == x).nonzero()[0, 0]) for s, x in zip(supports, draft.ids())]
        accept_u, final_u = round_uniforms(rnd)
        choice_u = uniform(req.seed, req.choice, rnd.positions[-1], Purpose.WORKER_CHOICE)
        relaxation = (
            req.spec.relaxation
            if req.spec.relaxation is not None and req.spec.relaxation.tau_max > 0 and positions
            else None
        )
        taus, weights = None, rnd.weights
        if relaxation is not None:
            w = normalise_weights(weights)
            taus = torch.tensor(
                [
                    relaxation_factor_on_support(
                        w @ pos.p.double(), pos.q, float(w @ pos.complement.double()), relaxation
                    )
                    for pos in positions
                ],
                dtype=torch.float64,
            )
        verdict = verify_exact(
            positions,
            draft_index,
            [r.bonus for r in responses],
            weights,
            accept_u,
            final_u[:-1],
            choice_u,
            taus,
        )
        tokens = verdict.output(draft.ids())
        result = RoundResult(tokens, drafted=len(draft), accepted=verdict.num_accepted, traffic=rnd.traffic)
        if req.top_logprobs is not None:
            a = verdict.num_accepted
            values = [mixed_probability(pos.p[:, i], weights) for pos, i in zip(positions, draft_index[:a])]
            last, _ = await _final_logprob(rnd, positions[a] if a < len(positions) else None, a, tokens)
            result.logprobs = worker_logprobs(rnd, tokens, [*values, last])
        if taus is not None:
            # the emitted draft positions follow τ q̂ + (1 − τ) p; the bonus position p itself
            at = min(len(tokens), len(positions))
            result.lossy.taus = taus[:at].tolist()
            result.lossy.relaxed_tv = [
                float(relaxed_distance(w @ pos.p.double(), pos.q, taus[j]))
                for j, pos in enumerate(positions[:at])
            ] + [0.0] * (len(tokens) - at)
        return result


async def _call_on(rnd: Round, supports: list[torch.Tensor]) -> list[VerifyResponse]:
    """Every worker's p_n on the ``supports``, the mass off each, a sample from off each, a bonus sample."""
    ids = torch.cat(supports).numpy() if supports else np.zeros(0, np.int64)
    sizes = np.array([len(s) for s in supports], dtype=np.int32)
    return await rnd.call(
        mode=Mode.EXACT.value, support_ids=ids, support_sizes=sizes, logprobs=rnd.req.top_logprobs
    )


async def _final_logprob(
    rnd: Round, row: SparseNode | None, answer_row: int, tokens: list[int]
) -> tuple[float, bool]:
    """log p of the round's last token, and whether a short call asked for it: from the row's support when
    it lies there; else it is a worker's own sample, whose log p_n that worker sent at ``answer_row`` —
    with several workers the mixture needs every p_n of it (``Round.score``)."""
    value = _on_support(row, tokens[-1], rnd.weights) if row is not None else None
    if value is not None:
        return value, False
    if len(rnd.responses) == 1:
        return float(array(rnd.responses[0].sample_logprobs)[answer_row]), False
    return await rnd.score(len(rnd.sequence) + len(tokens) - 1, tokens[-1], tokens[:-1]), True


def sparse_rows(responses: list[VerifyResponse], supports: list[torch.Tensor]) -> list[SparseNode]:
    """Each row of the workers' answers: p_n on S, the mass off it, the samples from off it
    (``normalised_payload``)."""
    bounds = np.cumsum([0] + [len(s) for s in supports])
    rows = []
    for j, support in enumerate(supports):
        p = torch.stack(
            [
                torch.tensor(array(r.support_probs)[bounds[j] : bounds[j + 1]], dtype=torch.float64)
                for r in responses
            ]
        )
        complement = torch.tensor([float(array(r.complement)[j]) for r in responses], dtype=torch.float64)
        rows.append(
            SparseNode(
                support,
                *normalised_payload(p, complement),
                [int(array(r.complement_samples)[j]) for r in responses],
            )
        )
    return rows


async def exact_walk(rnd: Round) -> RoundResult:
    """A tree — or a chain of fixed children — on exact's payload (docs/design.md §3.5, §3.6): every row
    answers on S_v (q̂'s support there and the children) with the mass off it and a sample from off it. A
    chain travels as a chain: its leaf's sample is each worker's bonus sample."""
    req, tree = rnd.req, rnd.draft
    supports = node_supports(tree)
    sent = supports[:-1] if tree.is_chain else supports
    responses = await _call_on(rnd, sent)
    rows = sparse_rows(responses, sent)
    if tree.is_chain:  # the leaf: nothing on its (empty) support, each worker's z_n ~ p_n
        n = len(responses)
        rows.append(
            SparseNode(
                supports[-1],
                torch.zeros(n, 0, dtype=torch.float64),
                torch.ones(n, dtype=torch.float64),
                [r.bonus for r in responses],
            )
        )
    verdict = verify_tree_exact(rows, tree, rnd.weights, *lanes(rnd))
    tokens = verdict.output(tree)
    result = RoundResult(
        tokens,
        drafted=len(tree),
        accepted=verdict.num_accepted,
        traffic=rnd.traffic,
        path=None if tree.is_chain else list(verdict.path),
    )
    if req.top_logprobs is not None:
        path_rows = [0, *(node + 1 for node in verdict.path)]  # the row each emitted token was decided at
        values = [_on_support(rows[row], token, rnd.weights) for row, token in zip(path_rows, tokens[:-1])]
        accepted = [v for v in values if v is not None]
        assert len(accepted) == verdict.num_accepted  # an accepted node lies on its parent's support
        last, scored = await _final_logprob(rnd, rows[path_rows[-1]], path_rows[-1], tokens)
        if scored:
            result.path = None  # the short call replaced the tree's rows by the path: nothing to keep
        result.logprobs = worker_logprobs(rnd, tokens, [*accepted, last], path_rows)
    return result


def _on_support(row: SparseNode, token: int, weights: torch.Tensor) -> float | None:
    """log p(token) under the mixture where ``token`` lies on the row's support, else None."""
    match = (row.support == token).nonzero()
    return mixed_probability(row.p[:, int(match[0, 0])], weights) if len(match) else None
