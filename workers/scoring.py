"""Logits -> what a verify call returns (docs/design.md §3.2, §3.3): ``T(p_n)``, compressed to top-k
when asked, with σ_n and e_n; or the worker's own sample z_n ~ T(p_n) (autoregressive).
The math is core's: the gateway reconstructs with the very functions used here for e_n."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from core.math.aggregation import aggregate, reconstruct, tv_distance
from core.math.compression import compress_top_k
from core.math.random import Purpose, sample_index, sample_rows, uniform, uniforms
from core.math.sampling import SamplingParams, apply_sampling, normalised
from core.math.speculative import count_accepted, residual, verify_greedy
from core.math.tree import depths_of
from core.modes import ROWS, SAMPLE, SPARSE, VERDICT, scoring_of
from core.names import Reconstruction
from core.protocol import StageRequest, VerifyRequest, VerifyResponse
from core.runners.base import ForwardItem


def sampling_params(req: VerifyRequest | StageRequest) -> SamplingParams:
    return SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, min_p=req.min_p)


@dataclass(frozen=True)
class RowSpec:
    """Rows of logits on the wire: T(·) by ``params``, the top ``k`` (None: whole) with ``reconstruction`` for
    e_n, in ``probs_dtype``."""

    params: SamplingParams
    k: int | None
    reconstruction: str
    probs_dtype: str

    @classmethod
    def of(cls, req: VerifyRequest | StageRequest) -> RowSpec:
        return cls(sampling_params(req), req.k, req.reconstruction, req.probs_dtype)


def score_rows(logits: torch.Tensor, spec: RowSpec, held: int, model_ms: float) -> VerifyResponse:
    # logits: [rows, V] fp32
    """T(p) at each row as ``spec`` says (a pipeline's last stage: its scored rows)."""
    return _distributions(apply_sampling(logits, spec.params), spec, held, model_ms, None, _allowed(logits))


def _allowed(logits: torch.Tensor) -> torch.Tensor | None:
    """The ids a grammar left each row (its −inf masks others), None when every logit is finite: one sum tells
    (any −inf, +inf or NaN makes it non-finite), the mask only then."""
    if bool(torch.isfinite(logits.sum())):
        return None
    finite = torch.isfinite(logits)
    return None if bool(finite.all()) else finite


def score(
    logits: torch.Tensor,  # [γ+1, V] fp32
    req: VerifyRequest,
    held: int,
    model_ms: float,
    prompt_logits: torch.Tensor | None = None,  # [num_new − 1, V] fp32, score_tokens only
) -> VerifyResponse:
    """The answer to ``req`` from the logits at its γ+1 positions (``prompt_logits``: rows predicting
    tokens[1:]), with the logprobs it asked for."""
    params = sampling_params(req)
    probs = apply_sampling(logits, params)
    if req.score_ids is not None:
        ids = torch.from_numpy(np.asarray(req.score_ids, dtype=np.int64))
        return VerifyResponse(
            held=held, score_logprobs=_logs(normalised(probs[:1])[0, ids]), model_ms=model_ms
        )
    resp = _answer(probs, req, held, model_ms, params, _allowed(logits))
    asked = _asked_logprobs(probs, req, resp)
    if req.score_tokens and prompt_logits is not None:
        asked.update(_prompt_logprobs(normalised(apply_sampling(prompt_logits, params)), req))
    return replace(resp, **asked) if asked else resp


def _answer(
    probs: torch.Tensor,
    req: VerifyRequest,
    held: int,
    model_ms: float,
    params: SamplingParams,
    allowed: torch.Tensor | None = None,
) -> VerifyResponse:
    """``allowed``: a grammar's ids per row, where the gateway's residual reconstruction spreads σ (e_n is
    measured on what it rebuilds)."""
    return SCORINGS[scoring_of(req.mode, not params.is_greedy)].answer(probs, req, held, model_ms, allowed)


def _rows(
    probs: torch.Tensor, req: VerifyRequest, held: int, model_ms: float, allowed: torch.Tensor | None
) -> VerifyResponse:
    return _distributions(probs, req, held, model_ms, None, allowed)


def _sample(
    probs: torch.Tensor, req: VerifyRequest, held: int, model_ms: float, allowed: torch.Tensor | None
) -> VerifyResponse:
    """autoregressive at T > 0: the worker's own z ~ T(p) at its one position (and the row, if asked)."""
    u = uniform(req.seed, req.choice, _first_position(req), Purpose.WORKER_SAMPLE, req.worker)
    samples = np.array([sample_index(probs[0], u)], dtype=np.int32)
    if not req.return_probs:
        return VerifyResponse(held=held, samples=samples, model_ms=model_ms)
    return _distributions(probs, req, held, model_ms, samples, allowed)


def _first_position(req: VerifyRequest) -> int:  # the absolute index of the token decided at slot 0
    return req.prefix_len + len(req.tokens)


def _split(
    probs: torch.Tensor, req: VerifyRequest, held: int, model_ms: float, allowed: torch.Tensor | None = None
) -> VerifyResponse:
    # probs: [γ+1, V]
    """DSSD's worker half: the accept test with its own stream; the bonus, or p at the rejection."""
    gamma, base = len(req.draft), _first_position(req)
    if req.temperature == 0:  # greedy: accept while x_j is the argmax, then emit the argmax
        verdict = verify_greedy(probs, req.draft.tolist())
        return VerifyResponse(
            held=held, num_accepted=verdict.num_accepted, bonus=verdict.token, model_ms=model_ms
        )
    draft = torch.from_numpy(req.draft.astype(np.int64))
    accept_u = uniforms(req.seed, req.choice, list(range(base, base + gamma)), Purpose.ACCEPT, req.worker)
    # a copy: the decoded frame is read-only
    q_draft = torch.from_numpy(np.array(req.draft_probs, dtype=np.float64))
    # an fp32 row sums to 1 ± 1e-6
    accepted = count_accepted(normalised(probs[:gamma])[torch.arange(gamma), draft], q_draft, accept_u)
    if accepted == gamma:
        bonus = sample_index(
            probs[gamma], uniform(req.seed, req.choice, base + gamma, Purpose.BONUS, req.worker)
        )
        return VerifyResponse(held=held, num_accepted=gamma, bonus=bonus, model_ms=model_ms)
    if req.support_q is not None:
        # q̂ at the rejection is known here: its residual drawn where p is, no row sent
        return VerifyResponse(
            held=held,
            num_accepted=accepted,
            bonus=split_residual_draw(probs[accepted], req, accepted),
            model_ms=model_ms,
        )
    rejected = _distributions(probs[accepted : accepted + 1], req, held, model_ms, None)
    return replace(rejected, num_accepted=accepted)


def split_residual_draw(p: torch.Tensor, req: VerifyRequest, accepted: int) -> int:
    # p: [V] T(p) at the rejected position
    """The token at split's rejection, drawn from norm(max(0, p − q̂)) with the gateway's numbers: p as the
    gateway's ``mixture`` makes it of the one worker's row, q̂ the draft's on its support (``support_q``), the
    gateway's RESIDUAL stream."""
    sizes = np.asarray(req.support_sizes, dtype=np.int64)
    start = int(sizes[:accepted].sum())
    ids = torch.from_numpy(np.asarray(req.support_ids, dtype=np.int64)[start : start + int(sizes[accepted])])
    q_values = torch.from_numpy(
        np.array(req.support_q, dtype=np.float64)[start : start + int(sizes[accepted])]
    )
    # mixture() of one row, one worker
    p_row = aggregate(normalised(p[None].double())[None], torch.ones(1))[0]
    # TokenTree.q_row
    q_row = torch.zeros(p.shape[-1], dtype=torch.float64).index_put_((ids,), q_values, accumulate=True)
    u = uniform(req.seed, req.choice, _first_position(req) + accepted, Purpose.RESIDUAL)
    return sample_index(residual(p_row, q_row), u)


def _exact(
    probs: torch.Tensor, req: VerifyRequest, held: int, model_ms: float, allowed: torch.Tensor | None = None
) -> VerifyResponse:
    # probs: [γ+1, V]
    """Per row p_n on S_j, the mass off it, a sample from off it; a bonus sample (a tree: none; a leaf's empty
    S samples all of p_n)."""
    gamma, base, tree = len(req.draft), _first_position(req), req.parents is not None
    sizes = torch.from_numpy(np.asarray(req.support_sizes, dtype=np.int64))
    ids = torch.from_numpy(np.asarray(req.support_ids, dtype=np.int64))
    rows = int(sizes.shape[0])
    depths = [0, *depths_of(req.parents.tolist())] if req.parents is not None else list(range(gamma))
    row_of = torch.repeat_interleave(torch.arange(rows), sizes)
    outside = probs[:rows].double().index_put((row_of, ids), torch.zeros((), dtype=torch.float64))
    # summed directly, not 1 − the rest; row by row, since a batched sum adds in another order
    mass = torch.stack([row.sum() for row in outside]) if rows else torch.zeros(0, dtype=torch.float64)
    u = uniforms(
        req.seed, req.choice, [base + d for d in depths[:rows]], Purpose.WORKER_COMPLEMENT, req.worker
    )
    samples = sample_rows(outside, u) if rows else torch.zeros(0, dtype=torch.long)
    bonus = (
        -1
        if tree
        else sample_index(
            probs[gamma], uniform(req.seed, req.choice, base + gamma, Purpose.WORKER_BONUS, req.worker)
        )
    )
    return VerifyResponse(
        # complement: f64, as summed
        held=held,
        support_probs=probs[row_of, ids].numpy(),
        complement=mass.numpy(),
        complement_samples=torch.where(mass > 0, samples, -1).int().numpy(),
        bonus=bonus,
        model_ms=model_ms,
    )


def _distributions(
    probs: torch.Tensor,
    req: VerifyRequest | RowSpec,
    held: int,
    model_ms: float,
    samples: np.ndarray | None,
    allowed: torch.Tensor | None = None,
) -> VerifyResponse:  # probs: [γ+1, V]; allowed: [γ+1, V] bool
    zeros = np.zeros(probs.shape[0], dtype=np.float32)
    if req.k is None or req.k == probs.shape[-1]:
        return VerifyResponse(
            held=held,
            probs=probs.numpy(),
            tail_mass=zeros,
            recon_error=zeros,
            samples=samples,
            probs_dtype=req.probs_dtype,
            model_ms=model_ms,
        )
    top = compress_top_k(probs, req.k)
    method = Reconstruction(req.reconstruction)
    if method is Reconstruction.RENORMALIZE:
        error = top.tail_mass  # TV(p/ρ on S, p) = σ exactly
    else:
        rebuilt = reconstruct(top.ids, top.probs, probs.shape[-1], method, top.tail_mass, allowed)
        error = tv_distance(rebuilt, probs).float()
    return VerifyResponse(
        held=held,
        ids=top.ids.numpy(),
        probs=top.probs.numpy(),
        tail_mass=top.tail_mass.numpy(),
        recon_error=error.numpy(),
        samples=samples,
        probs_dtype=req.probs_dtype,
        model_ms=model_ms,
    )


def _logs(probs: torch.Tensor) -> np.ndarray:
    """Natural logs as f32, log 0 floored at log 1e-45 (finite on the wire and in JSON)."""
    return torch.log(probs.double().clamp(min=1e-45)).float().numpy()


def _top(probs: torch.Tensor, n: int) -> tuple[np.ndarray, np.ndarray]:  # [rows, n] ids, [rows, n] logs
    """The n most likely ids per row, ties to the lowest id (as compress_top_k: the same on any device)."""
    ids = compress_top_k(probs, n).ids
    return ids.numpy(), _logs(probs.gather(-1, ids))


def _asked_logprobs(probs: torch.Tensor, req: VerifyRequest, resp: VerifyResponse) -> dict[str, Any]:
    # probs: [γ+1, V], T(p_n)
    """What only this worker knows of the emitted tokens' log-probabilities (split: the draft tokens
    and the bonus; exact: its own samples), and its top-n; only in modes whose answer lacks the rows."""
    logprobs = SCORINGS[scoring_of(req.mode, req.temperature > 0)].logprobs
    if req.logprobs is None or logprobs is None:
        return {}
    probs = normalised(probs)  # the distributions the gateway verifies with (an fp32 row sums to 1 ± 3e-5)
    out = logprobs(probs, req, resp)
    if req.logprobs:
        out["top_ids"], out["top_logprobs"] = _top(probs, req.logprobs)
    return out


def _verdict_logprobs(probs: torch.Tensor, req: VerifyRequest, resp: VerifyResponse) -> dict[str, Any]:
    """split's: the draft tokens', and the bonus's or the token's drawn at the rejection."""
    gamma = len(req.draft)
    out = {"draft_logprobs": _logs(probs[torch.arange(gamma), torch.from_numpy(req.draft.astype(np.int64))])}
    if resp.num_accepted == gamma or req.temperature == 0 or req.support_q is not None:
        out["sample_logprobs"] = _logs(probs[resp.num_accepted, resp.bonus : resp.bonus + 1])
    return out


def _sparse_logprobs(probs: torch.Tensor, req: VerifyRequest, resp: VerifyResponse) -> dict[str, Any]:
    """exact's: the worker's own samples', and the bonus's (a tree's leaves hold theirs)."""
    samples = np.asarray(resp.complement_samples, dtype=np.int64)
    own = [
        probs[j, y] if y >= 0 else torch.tensor(1.0, dtype=probs.dtype)
        for j, y in enumerate(samples.tolist())
    ]
    bonus = [probs[len(req.draft), resp.bonus]] if req.parents is None else []
    return {"sample_logprobs": _logs(torch.stack([*own, *bonus]))}


@dataclass(frozen=True)
class Scoring:
    """How a worker answers a verify call of one kind of answer (``core.modes.ModeSpec.scoring``) on the
    host: ``answer`` from the call's T(p) rows; ``logprobs``: what the answer adds for ``logprobs`` (None:
    the gateway reads them off the rows). workers.device_scoring.DEVICE_SCORINGS scores the same kinds where
    the logits are, bit for bit (tests/workers/test_device_scoring.py)."""

    answer: Callable[[torch.Tensor, VerifyRequest, int, float, torch.Tensor | None], VerifyResponse]
    logprobs: Callable[[torch.Tensor, VerifyRequest, VerifyResponse], dict[str, Any]] | None = None


# by kind of answer; a mode with a kind of its own adds its scoring here (and to DEVICE_SCORINGS)
SCORINGS: dict[str, Scoring] = {
    ROWS: Scoring(_rows),
    SAMPLE: Scoring(_sample),
    VERDICT: Scoring(_split, _verdict_logprobs),
    SPARSE: Scoring(_exact, _sparse_logprobs),
}


def _prompt_logprobs(probs: torch.Tensor, req: VerifyRequest) -> dict[str, Any]:
    # probs: [num_new − 1, V], normalised T(p_n)
    following = torch.from_numpy(req.tokens[1:].astype(np.int64))
    out = {"prompt_logprobs": _logs(probs[torch.arange(len(following)), following])}
    if req.logprobs:
        out["prompt_top_ids"], out["prompt_top_logprobs"] = _top(probs, req.logprobs)
    return out


def tree_item(req: VerifyRequest, held: list[int], fed: int = 0) -> ForwardItem:
    """A tree call's forward: the new agreed tokens as a chain (none: the last held token again, the root's
    row), then the nodes under the root. ``fed``: the call's first tokens are in the session already (pieces
    of a long prompt)."""
    assert req.parents is not None
    start, tokens = req.prefix_len + fed, req.tokens.tolist()[fed:]
    if not tokens:
        start -= 1
        tokens = [held[start]]
    first = start + len(tokens)  # the row of node 0
    parents = [
        *range(start - 1, first - 1),
        *(first - 1 if p < 0 else first + p for p in req.parents.tolist()),
    ]
    return ForwardItem(
        req.session_id,
        start,
        [*tokens, *req.draft.tolist()],
        parents,
        list(range(len(tokens) - 1, len(tokens) + len(req.draft))),
    )
