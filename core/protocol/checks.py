"""Protocol v1's checks (DESIGN §4): a decoded request is in range for this vocabulary
(``InvalidRequest``, a 400 naming the field), and a response answers its request (``ProtocolError``:
the worker answered garbage)."""

from __future__ import annotations

import numpy as np

from core.errors import InvalidRequest, ProtocolError
from core.math.sampling import MIN_TEMPERATURE
from core.math.shapes import MAX_TREE_NODES
from core.names import Mode, ProbsDtype
from core.protocol.messages import (
    MAX_LOGPROBS,
    RECONSTRUCTIONS,
    SERVED_MODES,
    StageRequest,
    VerifyRequest,
    VerifyResponse,
)


def check_ids(ids: np.ndarray, vocab_size: int, name: str) -> None:
    """Raise InvalidRequest unless every id of ``ids`` lies in [0, vocab_size)."""
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise InvalidRequest(
            f"{name}: token ids must lie in [0, {vocab_size}), got {int(ids.min())}..{int(ids.max())}",
            param=name,
        )


def check_verify_request(req: VerifyRequest, vocab_size: int) -> None:
    """Range checks of a decoded VerifyRequest against a vocabulary of ``vocab_size``."""
    for name in ("tokens", "draft"):
        arr = getattr(req, name)
        if arr.ndim != 1:
            raise InvalidRequest(f"{name} must be one-dimensional", param=name)
        check_ids(arr, vocab_size, name)
    if req.prefix_len < 0:
        raise InvalidRequest(f"prefix_len must be ≥ 0, got {req.prefix_len}", param="prefix_len")
    if req.k is not None and not 0 < req.k <= vocab_size:
        raise InvalidRequest(f"k must lie in [1, {vocab_size}], got {req.k}", param="k")
    if not (req.temperature == 0 or MIN_TEMPERATURE <= req.temperature < np.inf):
        raise InvalidRequest(f"temperature must be 0 or ≥ {MIN_TEMPERATURE}", param="temperature")
    if req.top_k < 0:
        raise InvalidRequest("top_k must be ≥ 0 (0 = off)", param="top_k")
    if not 0 < req.top_p <= 1:
        raise InvalidRequest("top_p must lie in (0, 1]", param="top_p")
    if not 0 <= req.min_p < 1:
        raise InvalidRequest("min_p must lie in [0, 1)", param="min_p")
    if req.probs_dtype not in {d.value for d in ProbsDtype}:
        raise InvalidRequest(f"probs_dtype must be fp16 or fp32, got {req.probs_dtype!r}", param="probs_dtype")
    if req.mode not in SERVED_MODES:
        raise InvalidRequest(f"mode {req.mode!r} is not served: use one of {list(SERVED_MODES)}", param="mode")
    if req.mode == Mode.AUTOREGRESSIVE.value and req.draft.size:
        raise InvalidRequest("autoregressive scores one position: the draft must be empty", param="draft")
    if req.reconstruction not in RECONSTRUCTIONS:
        raise InvalidRequest(f"reconstruction must be one of {list(RECONSTRUCTIONS)}", param="reconstruction")
    if not 0 <= req.seed < 2**63 or req.choice < 0 or req.worker < 0:
        raise InvalidRequest("seed must lie in [0, 2**63); choice and worker must be ≥ 0", param="seed")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise InvalidRequest(f"logprobs must lie in [0, {MAX_LOGPROBS}]", param="logprobs")
    if req.score_tokens and req.prefix_len != 0:
        raise InvalidRequest("score_tokens scores a whole prompt: prefix_len must be 0", param="score_tokens")
    if req.score_ids is not None:
        if req.draft.size or req.score_ids.ndim != 1:
            raise InvalidRequest("score_ids scores one position: the draft must be empty", param="score_ids")
        check_ids(req.score_ids, vocab_size, "score_ids")
    if req.parents is not None:
        _check_parents(req)
    if req.path is not None:
        _check_path(req)
    if req.mode == Mode.SPLIT.value:
        _check_draft_probs(req)
    if req.mode == Mode.EXACT.value and req.temperature > 0:
        _check_supports(req, vocab_size)


def _check_parents(req: VerifyRequest) -> None:
    """A tree (protocol v1.1): one parent per node, −1 (the root) or an earlier node."""
    parents = req.parents
    assert parents is not None
    if parents.ndim != 1 or parents.shape != req.draft.shape:
        raise InvalidRequest(f"parents must hold one parent per draft node: {parents.shape} for {len(req.draft)} nodes", param="parents")
    if len(parents) > MAX_TREE_NODES:
        raise InvalidRequest(f"a tree of {len(parents)} nodes exceeds the {MAX_TREE_NODES} a worker scores", param="draft")
    bad = next((i for i, parent in enumerate(parents.tolist()) if not -1 <= parent < i), None)
    if bad is not None:
        raise InvalidRequest(
            f"parents[{bad}] = {int(parents[bad])}: a node's parent is −1 (the root) or an earlier node (no parent after its child, no cycle)",
            param="parents",
        )
    if req.mode not in (Mode.AGGREGATE.value, Mode.TREE.value, Mode.EXACT.value):
        raise InvalidRequest(f"trees ride on aggregate's or exact's payload; mode {req.mode!r} verifies chains", param="parents")
    if req.score_tokens or req.score_ids is not None:
        raise InvalidRequest("a tree takes no score_tokens or score_ids", param="parents")


def _check_path(req: VerifyRequest) -> None:
    """The accepted path of the previous call's tree (v1.1): node indices, root to leaf (so
    increasing), within the agreed prefix it ends."""
    path = req.path
    assert path is not None
    values = path.tolist()
    if path.ndim != 1 or not values or len(values) > MAX_TREE_NODES:
        raise InvalidRequest(f"path names 1 to {MAX_TREE_NODES} nodes of the previous tree, got shape {path.shape}", param="path")
    if values[0] < 0 or any(b <= a for a, b in zip(values, values[1:])):
        raise InvalidRequest(f"path {values} is not a root-to-node path: node indices ≥ 0, each a child of the one before", param="path")
    if len(values) > req.prefix_len:
        raise InvalidRequest(f"path of {len(values)} nodes is longer than the prefix of {req.prefix_len} it ends", param="path")


def _check_draft_probs(req: VerifyRequest) -> None:
    probs = req.draft_probs
    if probs is None or probs.shape != req.draft.shape:
        raise InvalidRequest("split needs draft_probs, one per draft token", param="draft_probs")
    if probs.size and (not np.all(np.isfinite(probs)) or probs.min() <= 0 or probs.max() > 1 + 1e-6):
        raise InvalidRequest("draft_probs must lie in (0, 1]: each is q̂_j of a token drawn from q̂_j", param="draft_probs")


def _check_supports(req: VerifyRequest, vocab_size: int) -> None:
    """Chains: one support per draft token (S_j holds x_j). Trees: one per row, the root's then
    each node's, empty at a leaf; each node's token lies in its parent's support."""
    ids, sizes, tree = req.support_ids, req.support_sizes, req.parents is not None
    rows = len(req.draft) + 1 if tree else len(req.draft)
    if ids is None or sizes is None or sizes.shape != (rows,) or ids.ndim != 1:
        what = "one support per row (the root, then each node)" if tree else "one support per draft token"
        raise InvalidRequest(f"exact needs support_ids and support_sizes, {what}", param="support_ids")
    if sizes.size and sizes.min() < (0 if tree else 1) or int(sizes.sum()) != ids.size:
        raise InvalidRequest(f"support_sizes must be ≥ {0 if tree else 1} and add up to len(support_ids)", param="support_sizes")
    check_ids(ids, vocab_size, "support_ids")
    # every (row, id) pair once, as one key per pair: distinct ids per support, and membership
    keys = (np.repeat(np.arange(rows, dtype=np.int64), sizes.astype(np.int64)) * vocab_size + ids.astype(np.int64)).tolist()
    pairs = set(keys)
    if len(pairs) != len(keys):
        raise InvalidRequest("each support must hold distinct ids", param="support_ids")
    holder = [p + 1 for p in req.parents.tolist()] if req.parents is not None else list(range(rows))
    for node, (row, token) in enumerate(zip(holder, req.draft.tolist())):
        if row * vocab_size + token not in pairs:
            raise InvalidRequest(f"draft token {node} must lie in the support it was drawn from (row {row})", param="support_ids")


def check_verify_response(resp: VerifyResponse, req: VerifyRequest, vocab_size: int) -> None:
    """Raise ProtocolError unless ``resp`` is a well-formed answer to ``req``."""
    gamma, sampled = len(req.draft), req.temperature > 0
    if req.score_ids is not None:
        _check_logprobs("score_logprobs", resp.score_logprobs, (len(req.score_ids),))
        return
    _check_asked_logprobs(resp, req, vocab_size)
    if req.mode == Mode.AUTOREGRESSIVE.value and sampled:
        if resp.samples is None or resp.samples.shape != (1,):
            raise ProtocolError("samples missing or of the wrong shape, expected (1,)")
        check_ids(np.asarray(resp.samples), vocab_size, "samples")
        if req.return_probs:
            _check_probs(resp, vocab_size, 1)
    elif req.mode == Mode.SPLIT.value:
        _check_split(resp, vocab_size, gamma, greedy=not sampled)
    elif req.mode == Mode.EXACT.value and sampled:
        _check_exact(resp, req, vocab_size)
    else:
        _check_probs(resp, vocab_size, gamma + 1)


def _check_split(resp: VerifyResponse, vocab_size: int, gamma: int, greedy: bool) -> None:
    if not 0 <= resp.num_accepted <= gamma:
        raise ProtocolError(f"num_accepted {resp.num_accepted} outside [0, {gamma}]")
    if resp.num_accepted == gamma or greedy:
        check_ids(np.array([resp.bonus]), vocab_size, "bonus")
    else:
        _check_probs(resp, vocab_size, 1)


def _check_exact(resp: VerifyResponse, req: VerifyRequest, vocab_size: int) -> None:
    gamma = len(req.draft)
    size = int(np.asarray(req.support_sizes).sum()) if gamma else 0
    probs, mass, samples = resp.support_probs, resp.complement, resp.complement_samples
    if probs is None or mass is None or samples is None:
        raise ProtocolError("exact answers need support_probs, complement and complement_samples")
    rows = gamma + 1 if req.parents is not None else gamma  # a tree: every row, leaves too (their sample is the bonus)
    if req.parents is not None:
        size = int(np.asarray(req.support_sizes).sum())
    if probs.shape != (size,) or mass.shape != (rows,) or samples.shape != (rows,):
        raise ProtocolError(f"exact arrays of shapes {probs.shape}, {mass.shape}, {samples.shape}; expected ({size},), ({rows},), ({rows},)")
    for name, arr in (("support_probs", probs), ("complement", mass)):
        if not np.all(np.isfinite(arr)) or arr.min(initial=0) < 0 or arr.max(initial=0) > 1 + 1e-3:
            raise ProtocolError(f"{name}: values must be finite probabilities in [0, 1]")
    if np.any((samples < 0) & (mass > 0)) or samples.max(initial=-1) >= vocab_size or samples.min(initial=-1) < -1:
        raise ProtocolError("complement_samples must be token ids, −1 only where the complement is empty")
    if req.parents is None:
        check_ids(np.array([resp.bonus]), vocab_size, "bonus")


def _check_probs(resp: VerifyResponse, vocab_size: int, num_positions: int) -> None:
    if resp.probs is None or resp.tail_mass is None:
        raise ProtocolError("probs and tail_mass are missing")
    probs = np.asarray(resp.probs)
    width = vocab_size if resp.ids is None else resp.ids.shape[-1]
    if probs.shape != (num_positions, width):
        raise ProtocolError(f"probs shape {probs.shape}, expected {(num_positions, width)}")
    if resp.ids is not None:
        check_ids(np.asarray(resp.ids), vocab_size, "ids")
    checked = [("probs", probs), ("tail_mass", resp.tail_mass)]
    if resp.recon_error is not None:
        checked.append(("recon_error", resp.recon_error))
    for name, arr in checked[1:]:
        if arr.shape != (num_positions,):
            raise ProtocolError(f"{name} shape {arr.shape}, expected {(num_positions,)}")
    for name, arr in checked:
        if not np.all(np.isfinite(arr)) or arr.min(initial=0) < 0 or arr.max(initial=0) > 1 + 1e-3:
            raise ProtocolError(f"{name}: values must be finite probabilities in [0, 1]")
    if not np.all(probs.sum(axis=-1) <= 1 + 1e-2):
        raise ProtocolError("probs: a position sums to more than 1")


def _check_asked_logprobs(resp: VerifyResponse, req: VerifyRequest, vocab_size: int) -> None:
    """What ``logprobs`` / ``score_tokens`` added to an answer: present, shaped, log-probabilities."""
    gamma, top = len(req.draft), req.logprobs
    if req.score_tokens:
        rows = max(len(req.tokens) - 1, 0)
        _check_logprobs("prompt_logprobs", resp.prompt_logprobs, (rows,))
        if top:
            _check_top(resp.prompt_top_ids, resp.prompt_top_logprobs, (rows, top), vocab_size, "prompt_top")
    if top is None:
        return
    if req.mode == Mode.SPLIT.value:
        _check_logprobs("draft_logprobs", resp.draft_logprobs, (gamma,))
        if resp.num_accepted == gamma or req.temperature == 0:
            _check_logprobs("sample_logprobs", resp.sample_logprobs, (1,))
    if req.mode == Mode.EXACT.value and req.temperature > 0:
        _check_logprobs("sample_logprobs", resp.sample_logprobs, (gamma + 1,))
    if top and req.mode in (Mode.SPLIT.value, Mode.EXACT.value):
        _check_top(resp.top_ids, resp.top_logprobs, (gamma + 1, top), vocab_size, "top")


def _check_logprobs(name: str, values: np.ndarray | None, shape: tuple[int, ...]) -> None:
    if values is None or values.shape != shape:
        raise ProtocolError(f"{name} missing or of the wrong shape, expected {shape}")
    if np.any(np.isnan(values)) or values.max(initial=0) > 1e-3:
        raise ProtocolError(f"{name}: values must be log-probabilities (≤ 0)")


def _check_top(ids: np.ndarray | None, values: np.ndarray | None, shape: tuple[int, int], vocab_size: int, name: str) -> None:
    if ids is None or ids.shape != shape:
        raise ProtocolError(f"{name}_ids missing or of the wrong shape, expected {shape}")
    check_ids(np.asarray(ids), vocab_size, f"{name}_ids")
    _check_logprobs(f"{name}_logprobs", values, shape)


def check_stage_request(req: StageRequest, vocab_size: int, hidden_size: int, first_stage: bool) -> None:
    """Range checks of a decoded StageRequest, at a stage of a model with ``hidden_size``."""
    if req.tokens.ndim != 1:
        raise InvalidRequest("tokens must be one-dimensional", param="tokens")
    check_ids(req.tokens, vocab_size, "tokens")
    count = len(req.tokens)
    if req.seq < 0 or req.prefix_len < 0:
        raise InvalidRequest("seq and prefix_len must be ≥ 0", param="seq")
    if req.parents is not None and req.parents.shape != (count,):
        raise InvalidRequest(f"parents must have one entry per new row ({count})", param="parents")
    if req.keep is not None and req.keep.ndim != 1:
        raise InvalidRequest("keep must be one-dimensional", param="keep")
    if req.hidden_dtype not in ("f16", "f32"):
        raise InvalidRequest(f"hidden_dtype must be f16 or f32, got {req.hidden_dtype!r}", param="hidden_dtype")
    if first_stage and req.hidden is not None:
        raise InvalidRequest("the first stage embeds the tokens: hidden must be absent", param="hidden")
    if not first_stage and count and (req.hidden is None or req.hidden.shape != (count, hidden_size)):
        shape = None if req.hidden is None else list(req.hidden.shape)
        raise InvalidRequest(f"a later stage needs hidden states [{count}, {hidden_size}], got {shape}", param="hidden")
    if not 0 <= req.score_from <= count:
        raise InvalidRequest(f"score_from must lie in [0, {count}]", param="score_from")
    if req.k is not None and not 0 < req.k <= vocab_size:
        raise InvalidRequest(f"k must lie in [1, {vocab_size}], got {req.k}", param="k")
    if not (req.temperature == 0 or MIN_TEMPERATURE <= req.temperature < np.inf):
        raise InvalidRequest(f"temperature must be 0 or ≥ {MIN_TEMPERATURE}", param="temperature")
    if req.top_k < 0 or not 0 < req.top_p <= 1:
        raise InvalidRequest("top_k must be ≥ 0 and top_p in (0, 1]", param="top_k")
    if req.probs_dtype not in {d.value for d in ProbsDtype}:
        raise InvalidRequest(f"probs_dtype must be fp16 or fp32, got {req.probs_dtype!r}", param="probs_dtype")
    if req.reconstruction not in RECONSTRUCTIONS:
        raise InvalidRequest(f"reconstruction must be one of {list(RECONSTRUCTIONS)}", param="reconstruction")
    if not 0 <= req.min_p < 1:
        raise InvalidRequest("min_p must lie in [0, 1)", param="min_p")
    if req.next is not None and not all(isinstance(url, str) and url.startswith(("http://", "https://")) for url in req.next):
        raise InvalidRequest("next must list the stages' http(s) base URLs", param="next")
