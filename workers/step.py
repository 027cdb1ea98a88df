"""One step of a worker (DESIGN §4), on the model thread: the calls of distinct sessions —
verify calls and stage messages — checked and cropped one by one, **one** runner forward over
all of them, then each scored (``workers.scoring``) with its rows transformed by its own prefix
(DESIGN §3.9). The ``VerifyScheduler`` (workers/scheduler.py) batches calls into steps."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from core.errors import ContextOverflow, InvalidRequest
from core.protocol import StageRequest, VerifyRequest, check_verify_request
from core.runners.base import ForwardItem
from workers.scoring import score, tree_item
from workers.stage import StageSteps
from workers.transforms import Shaping


class Steps(StageSteps):
    """Part of ``WorkerState`` (``workers.state``): the verify step."""

    def verify(self, req: VerifyRequest, timing: dict[str, float] | None = None) -> Any:
        """Crop, append, score: the body of ``POST /v1/verify`` for one call alone (runs on the
        model thread). ``timing`` gets the milliseconds of the model and of the scoring."""
        answer = self.verify_batch([req], [timing if timing is not None else {}])[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    def verify_batch(self, reqs: list[VerifyRequest | StageRequest], timings: list[dict[str, float]]) -> list[Any]:
        """One scheduler step (runs on the model thread): the calls of distinct sessions checked
        and cropped one by one, then **one** runner forward over all of them, then each scored.
        Per call its ``VerifyResponse``, or the exception it alone fails with (a prefix that
        does not match, a malformed tree, …); its batch-mates are served. Each call's
        ``model_ms`` is the step's forward; ``batch_sessions`` how many calls shared it."""
        answers: list[Any] = [None] * len(reqs)
        items, order = [], []
        for i, req in enumerate(reqs):
            try:
                items.append(self._prepare_stage(req) if isinstance(req, StageRequest) else self._prepare(req))
                order.append(i)
            except Exception as exc:  # noqa: BLE001 - this call's answer
                answers[i] = exc
        started = time.perf_counter()
        try:
            outputs = self.runner.forward_each([item for item, *_ in items]) if items else []
        finally:
            for i in order:
                self.sessions.touch(reqs[i].session_id)
            for i in order:
                self.sessions.evict(keep=reqs[i].session_id)
        model_ms = (time.perf_counter() - started) * 1e3
        self.counters["model_seconds"] += model_ms / 1e3
        self.counters["steps"] += 1
        for (item, scored_tokens, shaping), i, logits in zip(items, order, outputs):
            if isinstance(logits, Exception):
                answers[i] = logits
                continue
            req = reqs[i]
            if isinstance(req, StageRequest):
                try:
                    answers[i] = self._stage_answer(req, logits, model_ms)
                except Exception as exc:  # noqa: BLE001 - this call's answer
                    answers[i] = exc
                timings[i]["model"] = model_ms
                continue
            self.counters["positions_scored"] += len(req.draft) + 1
            scored = time.perf_counter()
            try:
                rows = logits[scored_tokens:]
                if shaping is not None:  # DESIGN §3.9: each row by its own prefix
                    transformer, agreed, paths = shaping
                    rows = transformer.rows(rows, agreed, paths)
                resp = score(rows, req, self.runner.length(req.session_id), model_ms, logits[:scored_tokens] if req.score_tokens else None)
                answers[i] = replace(resp, batch_sessions=len(items)) if len(items) > 1 else resp
            except Exception as exc:  # noqa: BLE001 - this call's answer
                answers[i] = exc
            timings[i]["model"], timings[i]["score"] = model_ms, (time.perf_counter() - scored) * 1e3
        return answers

    def _prepare(self, req: VerifyRequest) -> tuple[ForwardItem, int, Shaping | None]:
        """Check a call and crop its session: the item it forwards, how many of its logits
        rows score its own tokens (echo) before the γ+1 decided positions, and how its rows are
        transformed (DESIGN §3.9; None: they are not)."""
        self.check_limits(req)
        if req.path is not None:  # v1.1: the previous tree's accepted path becomes agreed tokens (hash checked there)
            self.sessions.keep_path(req.session_id, req.prefix_len, req.prefix_hash, req.path.tolist())
        else:
            self.sessions.check_prefix(req.session_id, req.prefix_len, req.prefix_hash)
        self.sessions.admit(req.session_id, tree=req.parents is not None)
        self.runner.crop(req.session_id, req.prefix_len)
        shaping = self._shaping(req)
        scored_tokens = max(len(req.tokens) - 1, 0) if req.score_tokens else 0  # echo: the prompt's own rows too
        if req.parents is not None:  # a tree: the root's and every node's row in one forward
            return tree_item(req, self.runner.tokens(req.session_id)), scored_tokens, shaping
        tokens = [*req.tokens.tolist(), *req.draft.tolist()]
        return self.runner.append_item(req.session_id, tokens, len(req.draft) + 1 + scored_tokens), scored_tokens, shaping

    def _shaping(self, req: VerifyRequest) -> Shaping | None:
        """The session's transform (set by a call that starts it, prefix_len 0) with the agreed
        tokens and each scored row's path after them: a chain's draft[:j], a tree node's path."""
        if req.prefix_len == 0:
            self.start_transform(req.session_id, req.transform)
        transformer = self.sessions.transforms.get(req.session_id)
        if transformer is None:
            return None
        agreed = [*self.runner.tokens(req.session_id)[: req.prefix_len], *req.tokens.tolist()]
        draft = req.draft.tolist()
        if req.parents is None:
            return transformer, agreed, [draft[:j] for j in range(len(draft) + 1)]
        return transformer, agreed, [[], *tree_paths(draft, req.parents.tolist())]

    def check_limits(self, req: VerifyRequest) -> None:
        check_verify_request(req, self.runner.info.vocab_size)
        if len(req.draft) > self.settings.max_draft:
            raise InvalidRequest(f"draft of {len(req.draft)} tokens exceeds max_draft {self.settings.max_draft}", param="draft")
        if req.tokens.size == 0 and req.prefix_len == 0:
            raise InvalidRequest("a session starts with at least one token", param="tokens")
        total = req.prefix_len + len(req.tokens) + len(req.draft)
        if total > self.max_context:
            raise ContextOverflow(
                f"prefix {req.prefix_len} + {len(req.tokens)} tokens + draft {len(req.draft)} "
                f"exceeds the context of {self.max_context}",
                param="draft",
            )



def tree_paths(tokens: list[int], parents: list[int]) -> list[list[int]]:
    """Each node's tokens from the root's child down to itself (parents come before children)."""
    paths: list[list[int]] = []
    for node, parent in enumerate(parents):
        paths.append([*(paths[parent] if parent >= 0 else []), tokens[node]])
    return paths


