"""A chain draft (docs/design.md §3.1–3.2): γ tokens from q̂, a decode each; a grammar's forced runs ride free
on the decode before; model+lookup: lookup first."""

from __future__ import annotations

import threading

import torch

from app.drafting.batcher import DraftSteps, StepBatcher
from app.drafting.lookup import Branch, Record
from app.drafting.request import DraftRequest, delta, delta_support
from core.math.random import Purpose, sample_index, uniforms
from core.math.sampling import apply_sampling, normalised, truncated_support
from core.math.tree import SparseRow, TokenTree


class ChainRows:
    """The rows q̂ of a chain as drafted: dense, or on truncated supports (sampled there, docs/design.md
    §9)."""

    def __init__(self, request: DraftRequest, vocab_size: int) -> None:
        self.truncating, self.vocab_size = request.truncating, vocab_size
        self.rows: list[torch.Tensor] = []
        self.supports: list[SparseRow] = []

    def add_delta(self, token: int) -> None:
        if self.truncating:
            self.supports.append(delta_support(token))
        else:
            self.rows.append(delta(token, self.vocab_size))

    def tree(self, tokens: list[int]) -> TokenTree:
        return TokenTree.chain(tokens, self.supports if self.truncating else self.rows)


def chain_steps(
    batcher: StepBatcher,
    request: DraftRequest,
    gamma: int,
    limit: int | None,
    cancel: threading.Event | None,
    branch: Branch | None = None,
    record: Record | None = None,
) -> DraftSteps:
    """A chain of ``gamma`` drafted tokens (forced ones free, within ``limit``). ``branch`` (model+lookup):
    the lookup's run first, each token kept while it is the model's top-1 or measures at least a model
    token's acceptance; ``record`` gets each token's kind. Stops after the token in progress on ``cancel``."""
    runner, sequence, session_id = batcher.runner, request.sequence, request.session_id
    run = branch.tokens if branch is not None else []
    eos = set(runner.info.eos_ids)
    logits = yield from batcher.catch_up(session_id, sequence)
    limit = max(gamma, limit or gamma) if request.grammar or run else gamma
    draws = uniforms(
        request.seed, request.choice, list(range(len(sequence), len(sequence) + limit)), Purpose.DRAFT_SAMPLE
    )
    tokens: list[int] = []
    rows = ChainRows(request, runner.info.vocab_size)
    if run:
        # model+lookup: one decode scores the lookup's run; its tokens stay while each is the model's top-1
        assert branch is not None
        # [len, V]: the row after each
        after = yield runner.append_item(session_id, run[:limit], min(len(run), limit))
        for j, token in enumerate(run[:limit]):
            if (
                int(torch.argmax(request.shaped(logits, tokens))) != token
                and branch.rates[j] < branch.model_rate
            ):
                break
            tokens.append(token)
            logits = after[len(tokens) - 1]
            rows.add_delta(token)
        runner.crop(session_id, len(sequence) + len(tokens))
        if record is not None:
            record.lookup = list(enumerate(branch.keys[: len(tokens)]))
        if tokens and (tokens[-1] in eos or len(tokens) >= limit):
            return rows.tree(tokens)
    sampled = 0  # tokens that took a draft step (forced ones do not)
    while True:
        tokens.append(_draw(request, request.shaped(logits, tokens), float(draws[len(tokens)]), rows))
        sampled += 1
        forced = (
            request.transformer.forced_run([*sequence, *tokens], limit - len(tokens), eos)
            if request.transformer is not None and request.grammar and tokens[-1] not in eos
            else []
        )
        for token in forced:  # T(q) is a point mass there, as every worker's T(p)
            tokens.append(token)
            rows.add_delta(token)
        if record is not None and branch is not None:
            # forced ones are decided: never tested
            record.lookup.append((len(tokens) - 1 - len(forced), branch.model_key))
        if (
            tokens[-1] in eos
            or sampled == gamma
            or len(tokens) >= limit
            or (cancel is not None and cancel.is_set())
        ):
            break
        # the sampled token and the run after it, one decode
        logits = (yield runner.append_item(session_id, tokens[-1 - len(forced) :], 1))[0]
    return rows.tree(tokens)


def _draw(request: DraftRequest, logits: torch.Tensor, u: float, rows: ChainRows) -> int:
    """The next token from q̂ = sampling(logits) (its argmax when greedy), its row kept in ``rows``."""
    q = apply_sampling(logits[None], request.params)[0]
    if rows.truncating:  # renormalised in float64 on the support
        ids, probs = truncated_support(q, *request.truncation)
        rows.supports.append((ids, probs))
        return int(ids[sample_index(probs, u)])
    q = normalised(q)  # q̂ as sampled: the accept test's numbers too
    rows.rows.append(q)
    return int(torch.argmax(q)) if request.params.is_greedy else sample_index(q, u)
