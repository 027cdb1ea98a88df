"""``aggregate``: SpecFed (docs/design.md §3.3)."""

from __future__ import annotations

import torch

from app.engine.round import Round, array, lanes, mixture, round_uniforms, token_logprobs
from app.engine.spec import RoundResult
from app.engine.strategies.base import RoundStrategy
from core.math.aggregation import bias_bound
from core.math.relaxed import relaxation_factors, relaxed_distance, verify_relaxed
from core.math.sampling import normalised
from core.math.walk import verify_tree, verify_tree_greedy
from core.names import Mode, Reconstruction


class AggregateStrategy(RoundStrategy):
    """SpecFed (docs/design.md §3.3): p̂ = Σ w_n p̂_n from every worker's T(p_n), full or top-k, verifies the
    draft; a tree has a row per node plus the root, walked by the rule of its children (§3.6)."""

    async def verify(self, rnd: Round) -> RoundResult:
        req, spec = rnd.req, rnd.req.spec
        responses = await rnd.call(
            mode=Mode.AGGREGATE.value, k=spec.k, reconstruction=spec.reconstruction.value
        )
        allowed = (
            rnd.allowed() if spec.k is not None and spec.reconstruction is Reconstruction.RESIDUAL else None
        )
        target = mixture(
            responses,
            rnd.vocab_size,
            rnd.weights,
            spec.reconstruction,
            normalise=not req.params.is_greedy,
            allowed=allowed,
        )
        tree = rnd.draft
        relaxed = spec.relaxed and not req.params.is_greedy and len(tree) > 0 and tree.is_sampled_chain
        if relaxed:  # DSD's relaxed test is for sampled chains: it needs the dense q̂ rows
            assert spec.relaxation is not None
            q = tree.q_rows(rnd.vocab_size)
            taus = relaxation_factors(target, q, spec.relaxation)
            chain = verify_relaxed(target, q, tree.ids(), *round_uniforms(rnd), taus)
            tokens, accepted = chain.output(tree.ids()), chain.num_accepted
            rows = list(range(len(tokens)))
        else:
            verdict = (
                verify_tree_greedy(target, tree)
                if req.params.is_greedy
                else verify_tree(target, tree, *lanes(rnd))
            )
            tokens, accepted = verdict.output(tree), verdict.num_accepted
            rows = [0, *(node + 1 for node in verdict.path)]  # the root's row, then each accepted node's
        used = len(tokens)
        logprobs = (
            token_logprobs(normalised(target[rows]), tokens, req.top_logprobs)
            if req.top_logprobs is not None
            else None
        )
        result = RoundResult(
            tokens, drafted=len(tree), accepted=accepted, traffic=rnd.traffic, logprobs=logprobs
        )
        if not relaxed and not tree.is_chain:
            result.path = list(verdict.path)
        if relaxed:  # the emitted draft positions follow τ q + (1 − τ) p; the bonus position p itself
            at = min(used, len(tree))
            result.lossy.taus = taus[:at].tolist()
            result.lossy.relaxed_tv = relaxed_distance(target[:at], q[:at], taus[:at]).tolist() + [0.0] * (
                used - at
            )
        if not spec.is_lossless:
            sigma = torch.stack([torch.tensor(array(r.tail_mass)) for r in responses])[:, rows]
            error = torch.stack([torch.tensor(array(r.recon_error)) for r in responses])[:, rows]
            result.lossy.bound = bias_bound(sigma, rnd.weights).tolist()
            result.lossy.error = bias_bound(error, rnd.weights).tolist()
        return result
