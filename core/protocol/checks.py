"""Protocol v1's checks (docs/design.md §4): a request in range for this vocabulary (``InvalidRequest``: 400),
a response answering its request (``ProtocolError``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from core.errors import InvalidRequest, ProtocolError
from core.math.sampling import MIN_TEMPERATURE
from core.math.shapes import MAX_TREE_NODES
from core.modes import MODES, ROWS, SAMPLE, SPARSE, VERDICT, scoring_of, verify_modes
from core.names import ProbsDtype
from core.protocol.messages import (
    MAX_LOGPROBS,
    RECONSTRUCTIONS,
    StageRequest,
    VerifyRequest,
    VerifyResponse,
)

Rule = tuple[bool, str, str]  # (broken, message, param): the first broken rule is the 400


def _first_broken(rules: list[Rule]) -> None:
    for broken, message, param in rules:
        if broken:
            raise InvalidRequest(message, param=param)


def check_ids(ids: np.ndarray, vocab_size: int, name: str) -> None:
    """Raise InvalidRequest unless every id of ``ids`` lies in [0, vocab_size)."""
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise InvalidRequest(
            f"{name}: token ids must lie in [0, {vocab_size}), got {int(ids.min())}..{int(ids.max())}",
            param=name,
        )


def _check_tokens(arr: np.ndarray, vocab_size: int, name: str) -> None:
    if arr.ndim != 1:
        raise InvalidRequest(f"{name} must be one-dimensional", param=name)
    check_ids(arr, vocab_size, name)


def _sampling_rules(req: VerifyRequest | StageRequest, vocab_size: int) -> list[Rule]:
    """What a verify call and a pipeline's last stage share: T(p)'s parameters and the payload's form."""
    return [
        (
            req.k is not None and not 0 < req.k <= vocab_size,
            f"k must lie in [1, {vocab_size}], got {req.k}",
            "k",
        ),
        (
            not (req.temperature == 0 or MIN_TEMPERATURE <= req.temperature < np.inf),
            f"temperature must be 0 or ≥ {MIN_TEMPERATURE}",
            "temperature",
        ),
        (req.top_k < 0, "top_k must be ≥ 0 (0 = off)", "top_k"),
        (not 0 < req.top_p <= 1, "top_p must lie in (0, 1]", "top_p"),
        (not 0 <= req.min_p < 1, "min_p must lie in [0, 1)", "min_p"),
        (
            req.probs_dtype not in {d.value for d in ProbsDtype},
            f"probs_dtype must be fp16 or fp32, got {req.probs_dtype!r}",
            "probs_dtype",
        ),
        (
            req.reconstruction not in RECONSTRUCTIONS,
            f"reconstruction must be one of {list(RECONSTRUCTIONS)}",
            "reconstruction",
        ),
    ]


def check_verify_request(req: VerifyRequest, vocab_size: int) -> None:
    """Range checks of a decoded VerifyRequest against a vocabulary of ``vocab_size``."""
    _check_tokens(req.tokens, vocab_size, "tokens")
    _check_tokens(req.draft, vocab_size, "draft")
    served, row = [str(m) for m in verify_modes()], MODES.get(req.mode)
    _first_broken(
        [
            (req.prefix_len < 0, f"prefix_len must be ≥ 0, got {req.prefix_len}", "prefix_len"),
            *_sampling_rules(req, vocab_size),
            (req.mode not in served, f"mode {req.mode!r} is not served: use one of {served}", "mode"),
            (
                row is not None and not row.drafts and req.draft.size > 0,
                f"{req.mode} scores one position: the draft must be empty",
                "draft",
            ),
            (
                not 0 <= req.seed < 2**63 or req.choice < 0 or req.worker < 0,
                "seed must lie in [0, 2**63); choice and worker must be ≥ 0",
                "seed",
            ),
            (
                req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS,
                f"logprobs must lie in [0, {MAX_LOGPROBS}]",
                "logprobs",
            ),
            (
                req.score_tokens and req.prefix_len != 0,
                "score_tokens scores a whole prompt: prefix_len must be 0",
                "score_tokens",
            ),
            (
                req.score_ids is not None and (req.draft.size > 0 or req.score_ids.ndim != 1),
                "score_ids scores one position: the draft must be empty",
                "score_ids",
            ),
        ]
    )
    if req.score_ids is not None:
        check_ids(req.score_ids, vocab_size, "score_ids")
    if req.parents is not None:
        _check_parents(req)
    if req.path is not None:
        _check_path(req)
    ANSWER_CHECKS[scoring_of(req.mode, req.temperature > 0)].request(req, vocab_size)


def _check_parents(req: VerifyRequest) -> None:
    """A tree (protocol v1.1): one parent per node, −1 (the root) or an earlier node."""
    parents = req.parents
    assert parents is not None
    if parents.ndim != 1 or parents.shape != req.draft.shape:
        raise InvalidRequest(
            f"parents must hold one parent per draft node: {parents.shape} for {len(req.draft)} nodes",
            param="parents",
        )
    bad, parent = next(
        ((i, parent) for i, parent in enumerate(parents.tolist()) if not -1 <= parent < i), (None, None)
    )
    _first_broken(
        [
            (
                len(parents) > MAX_TREE_NODES,
                f"a tree of {len(parents)} nodes exceeds the {MAX_TREE_NODES} a worker scores",
                "draft",
            ),
            (
                bad is not None,
                f"parents[{bad}] = {parent}: a node's parent is −1 (the root) or an earlier node "
                "(no parent after its child, no cycle)",
                "parents",
            ),
            (
                not MODES[req.mode].trees,
                f"trees ride on aggregate's or exact's payload; mode {req.mode!r} verifies chains",
                "parents",
            ),
            (
                req.score_tokens or req.score_ids is not None,
                "a tree takes no score_tokens or score_ids",
                "parents",
            ),
        ]
    )


def _check_path(req: VerifyRequest) -> None:
    """The accepted path of the previous call's tree (v1.1): node indices, root to leaf (so increasing),
    within the agreed prefix it ends."""
    path = req.path
    assert path is not None
    values = path.tolist()
    if path.ndim != 1 or not values or len(values) > MAX_TREE_NODES:
        raise InvalidRequest(
            f"path names 1 to {MAX_TREE_NODES} nodes of the previous tree, got shape {path.shape}",
            param="path",
        )
    if values[0] < 0 or any(b <= a for a, b in zip(values, values[1:])):
        raise InvalidRequest(
            f"path {values} is not a root-to-node path: node indices ≥ 0, each a child of the one before",
            param="path",
        )
    if len(values) > req.prefix_len:
        raise InvalidRequest(
            f"path of {len(values)} nodes is longer than the prefix of {req.prefix_len} it ends", param="path"
        )


def _check_draft_probs(req: VerifyRequest) -> None:
    probs = req.draft_probs
    if probs is None or probs.shape != req.draft.shape:
        raise InvalidRequest("split needs draft_probs, one per draft token", param="draft_probs")
    if probs.size and (not np.all(np.isfinite(probs)) or probs.min() <= 0 or probs.max() > 1 + 1e-6):
        raise InvalidRequest(
            "draft_probs must lie in (0, 1]: each is q̂_j of a token drawn from q̂_j", param="draft_probs"
        )


def _check_support_q(req: VerifyRequest) -> None:
    """split's q̂_j on S_j: one probability per support id, each in (0, 1] (q̂_j has mass on its whole
    support)."""
    q = req.support_q
    assert q is not None and req.support_ids is not None
    if q.shape != req.support_ids.shape:
        raise InvalidRequest(
            f"support_q holds one q̂ per support id: {q.shape} for {req.support_ids.shape}", param="support_q"
        )
    if q.size and (not np.all(np.isfinite(q)) or q.min() <= 0 or q.max() > 1 + 1e-6):
        raise InvalidRequest("support_q must lie in (0, 1]: q̂_j on its own support", param="support_q")


def _check_supports(req: VerifyRequest, vocab_size: int, who: str = "exact") -> None:
    """Chains: one support per draft token, S_j holding x_j; trees: one per row (root first, empty at a leaf),
    a node's token in its parent's."""
    ids, sizes, tree = req.support_ids, req.support_sizes, req.parents is not None
    rows = len(req.draft) + tree
    if ids is None or sizes is None or sizes.shape != (rows,) or ids.ndim != 1:
        what = "one support per row (the root, then each node)" if tree else "one support per draft token"
        raise InvalidRequest(f"{who} needs support_ids and support_sizes, {what}", param="support_ids")
    if sizes.size and sizes.min() < (0 if tree else 1) or int(sizes.sum()) != ids.size:
        raise InvalidRequest(
            f"support_sizes must be ≥ {0 if tree else 1} and add up to len(support_ids)",
            param="support_sizes",
        )
    check_ids(ids, vocab_size, "support_ids")
    # every (row, id) pair once, as one key per pair: distinct ids per support, and membership
    keys = (
        np.repeat(np.arange(rows, dtype=np.int64), sizes.astype(np.int64)) * vocab_size + ids.astype(np.int64)
    ).tolist()
    pairs = set(keys)
    if len(pairs) != len(keys):
        raise InvalidRequest("each support must hold distinct ids", param="support_ids")
    holder = [p + 1 for p in req.parents.tolist()] if req.parents is not None else list(range(rows))
    for node, (row, token) in enumerate(zip(holder, req.draft.tolist())):
        if row * vocab_size + token not in pairs:
            raise InvalidRequest(
                f"draft token {node} must lie in the support it was drawn from (row {row})",
                param="support_ids",
            )


def check_verify_response(resp: VerifyResponse, req: VerifyRequest, vocab_size: int) -> None:
    """Raise ProtocolError unless ``resp`` is a well-formed answer to ``req``."""
    sampled = req.temperature > 0
    if req.score_ids is not None:
        _check_logprobs("score_logprobs", resp.score_logprobs, (len(req.score_ids),))
        return
    _check_prompt_logprobs(resp, req, vocab_size)
    answer = ANSWER_CHECKS[scoring_of(req.mode, sampled)]
    if req.logprobs is not None:
        answer.logprobs(resp, req, vocab_size)
    answer.response(resp, req, vocab_size)


def _check_sample(resp: VerifyResponse, req: VerifyRequest, vocab_size: int) -> None:
    if resp.samples is None or resp.samples.shape != (1,):
        raise ProtocolError("samples missing or of the wrong shape, expected (1,)")
    check_ids(np.asarray(resp.samples), vocab_size, "samples")
    if req.return_probs:
        _check_probs(resp, vocab_size, 1)


def _check_verdict(resp: VerifyResponse, req: VerifyRequest, vocab_size: int) -> None:
    greedy = req.temperature == 0
    _check_split(resp, vocab_size, len(req.draft), greedy=greedy, drawn=req.support_q is not None)


def _check_split(
    resp: VerifyResponse, vocab_size: int, gamma: int, greedy: bool, drawn: bool = False
) -> None:
    """``drawn``: the request sent support_q, so the worker drew the token at a rejection (``bonus``) and
    sends no row."""
    if not 0 <= resp.num_accepted <= gamma:
        raise ProtocolError(f"num_accepted {resp.num_accepted} outside [0, {gamma}]")
    if resp.num_accepted == gamma or greedy or drawn:
        check_ids(np.array([resp.bonus]), vocab_size, "bonus")
    else:
        _check_probs(resp, vocab_size, 1)


def _check_exact(resp: VerifyResponse, req: VerifyRequest, vocab_size: int) -> None:
    tree = req.parents is not None
    size = int(np.asarray(req.support_sizes).sum()) if len(req.draft) or tree else 0
    probs, mass, samples = resp.support_probs, resp.complement, resp.complement_samples
    if probs is None or mass is None or samples is None:
        raise ProtocolError("exact answers need support_probs, complement and complement_samples")
    rows = len(req.draft) + tree  # a tree: every row, leaves too (their sample is the bonus)
    if probs.shape != (size,) or mass.shape != (rows,) or samples.shape != (rows,):
        raise ProtocolError(
            f"exact arrays of shapes {probs.shape}, {mass.shape}, {samples.shape}; expected "
            f"({size},), ({rows},), ({rows},)"
        )
    _check_unit("support_probs", probs)
    _check_unit("complement", mass)
    if (
        np.any((samples < 0) & (mass > 0))
        or samples.max(initial=-1) >= vocab_size
        or samples.min(initial=-1) < -1
    ):
        raise ProtocolError("complement_samples must be token ids, −1 only where the complement is empty")
    if not tree:
        check_ids(np.array([resp.bonus]), vocab_size, "bonus")


def _check_unit(name: str, arr: np.ndarray) -> None:
    if not np.all(np.isfinite(arr)) or arr.min(initial=0) < 0 or arr.max(initial=0) > 1 + 1e-3:
        raise ProtocolError(f"{name}: values must be finite probabilities in [0, 1]")


def _check_probs(resp: VerifyResponse, vocab_size: int, num_positions: int) -> None:
    if resp.probs is None or resp.tail_mass is None:
        raise ProtocolError("probs and tail_mass are missing")
    probs = np.asarray(resp.probs)
    width = vocab_size if resp.ids is None else resp.ids.shape[-1]
    if probs.shape != (num_positions, width):
        raise ProtocolError(f"probs shape {probs.shape}, expected {(num_positions, width)}")
    if resp.ids is not None:
        check_ids(np.asarray(resp.ids), vocab_size, "ids")
    per_position = {"tail_mass": resp.tail_mass, "recon_error": resp.recon_error}
    for name, arr in per_position.items():
        if arr is not None and arr.shape != (num_positions,):
            raise ProtocolError(f"{name} shape {arr.shape}, expected {(num_positions,)}")
    for name, arr in {"probs": probs, **per_position}.items():
        if arr is not None:
            _check_unit(name, arr)
    if not np.all(probs.sum(axis=-1) <= 1 + 1e-2):
        raise ProtocolError("probs: a position sums to more than 1")


def _check_prompt_logprobs(resp: VerifyResponse, req: VerifyRequest, vocab_size: int) -> None:
    """What ``score_tokens`` added to an answer: present, shaped, log-probabilities."""
    top = req.logprobs
    if req.score_tokens:
        rows = max(len(req.tokens) - 1, 0)
        _check_logprobs("prompt_logprobs", resp.prompt_logprobs, (rows,))
        if top:
            _check_top(resp.prompt_top_ids, resp.prompt_top_logprobs, (rows, top), vocab_size, "prompt_top")


def _verdict_logprobs(resp: VerifyResponse, req: VerifyRequest, vocab_size: int) -> None:
    """What ``logprobs`` adds to split's verdict: the draft tokens', the bonus's, the top-n."""
    gamma = len(req.draft)
    _check_logprobs("draft_logprobs", resp.draft_logprobs, (gamma,))
    if resp.num_accepted == gamma or req.temperature == 0 or req.support_q is not None:  # of ``bonus``
        _check_logprobs("sample_logprobs", resp.sample_logprobs, (1,))
    _top_logprobs(resp, req, vocab_size)


def _sparse_logprobs(resp: VerifyResponse, req: VerifyRequest, vocab_size: int) -> None:
    """What ``logprobs`` adds to exact's sparse rows: the worker's own samples', the top-n."""
    _check_logprobs("sample_logprobs", resp.sample_logprobs, (len(req.draft) + 1,))
    _top_logprobs(resp, req, vocab_size)


def _top_logprobs(resp: VerifyResponse, req: VerifyRequest, vocab_size: int) -> None:
    if req.logprobs:
        shape = (len(req.draft) + 1, req.logprobs)
        _check_top(resp.top_ids, resp.top_logprobs, shape, vocab_size, "top")


def _no_logprobs(resp: VerifyResponse, req: VerifyRequest, vocab_size: int) -> None:
    """The gateway reads the logprobs off the rows or the sample's row: the answer adds none."""


def _no_support_q(req: VerifyRequest, vocab_size: int) -> None:
    if req.support_q is not None:
        raise InvalidRequest(
            f"support_q is split's (q̂ on the draft's supports): mode {req.mode!r} takes none",
            param="support_q",
        )


def _verdict_request(req: VerifyRequest, vocab_size: int) -> None:
    _check_draft_probs(req)
    if req.support_q is not None:
        _check_supports(req, vocab_size, "split with support_q")
        _check_support_q(req)


def _sparse_request(req: VerifyRequest, vocab_size: int) -> None:
    _no_support_q(req, vocab_size)
    _check_supports(req, vocab_size)


@dataclass(frozen=True)
class AnswerChecks:
    """The checks of one kind of answer (``core.modes.ModeSpec.scoring``): the request fields it needs, the
    answer, and what ``logprobs`` adds to it."""

    request: Callable[[VerifyRequest, int], None]
    response: Callable[[VerifyResponse, VerifyRequest, int], None]
    logprobs: Callable[[VerifyResponse, VerifyRequest, int], None] = _no_logprobs


def _check_rows(resp: VerifyResponse, req: VerifyRequest, vocab_size: int) -> None:
    _check_probs(resp, vocab_size, len(req.draft) + 1)


# by kind of answer; a mode with a kind of its own adds its checks here
ANSWER_CHECKS: dict[str, AnswerChecks] = {
    ROWS: AnswerChecks(_no_support_q, _check_rows),
    SAMPLE: AnswerChecks(_no_support_q, _check_sample),
    VERDICT: AnswerChecks(_verdict_request, _check_verdict, _verdict_logprobs),
    SPARSE: AnswerChecks(_sparse_request, _check_exact, _sparse_logprobs),
}


def _check_logprobs(name: str, values: np.ndarray | None, shape: tuple[int, ...]) -> None:
    if values is None or values.shape != shape:
        raise ProtocolError(f"{name} missing or of the wrong shape, expected {shape}")
    if np.any(np.isnan(values)) or values.max(initial=0) > 1e-3:
        raise ProtocolError(f"{name}: values must be log-probabilities (≤ 0)")


def _check_top(
    ids: np.ndarray | None, values: np.ndarray | None, shape: tuple[int, int], vocab_size: int, name: str
) -> None:
    if ids is None or ids.shape != shape:
        raise ProtocolError(f"{name}_ids missing or of the wrong shape, expected {shape}")
    check_ids(np.asarray(ids), vocab_size, f"{name}_ids")
    _check_logprobs(f"{name}_logprobs", values, shape)


def check_stage_request(req: StageRequest, vocab_size: int, hidden_size: int, first_stage: bool) -> None:
    """Range checks of a decoded StageRequest, at a stage of a model with ``hidden_size``."""
    _check_tokens(req.tokens, vocab_size, "tokens")
    count = len(req.tokens)
    hidden = None if req.hidden is None else list(req.hidden.shape)
    _first_broken(
        [
            (req.seq < 0 or req.prefix_len < 0, "seq and prefix_len must be ≥ 0", "seq"),
            (
                req.parents is not None and req.parents.shape != (count,),
                f"parents must have one entry per new row ({count})",
                "parents",
            ),
            (req.keep is not None and req.keep.ndim != 1, "keep must be one-dimensional", "keep"),
            (
                req.hidden_dtype not in ("f16", "f32"),
                f"hidden_dtype must be f16 or f32, got {req.hidden_dtype!r}",
                "hidden_dtype",
            ),
            (
                first_stage and hidden is not None,
                "the first stage embeds the tokens: hidden must be absent",
                "hidden",
            ),
            (
                not first_stage and count > 0 and hidden != [count, hidden_size],
                f"a later stage needs hidden states [{count}, {hidden_size}], got {hidden}",
                "hidden",
            ),
            (not 0 <= req.score_from <= count, f"score_from must lie in [0, {count}]", "score_from"),
            *_sampling_rules(req, vocab_size),
            (
                req.next is not None
                and not all(
                    isinstance(url, str) and url.startswith(("http://", "https://")) for url in req.next
                ),
                "next must list the stages' http(s) base URLs",
                "next",
            ),
        ]
    )
