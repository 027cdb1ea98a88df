"""The worker's sessions: which exist and which to drop (LRU, session cap, TTL, memory cap); their KV caches
live in the runner; each one's transform (docs/design.md §3.9: the grammar engine, grammars compiled off the
model thread)."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from core.errors import InvalidRequest, SessionShort, WorkerFull
from core.grammar import GrammarLimits, Grammars, GrammarSpec
from core.protocol import prefix_hash
from core.runners.base import ModelRunner
from core.transform import LogitsTransform, TransformSpec
from workers.settings import WorkerSettings

RETRY_AFTER_S = 1  # what a WorkerFull answer's Retry-After says: a round frees a session in about that


@dataclass(eq=False)
class SessionStore:
    runner: ModelRunner
    max_sessions: int
    ttl_s: float
    memory_cap_bytes: int
    live_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    num_evicted: int = 0
    _last_used: OrderedDict[str, float] = field(default_factory=OrderedDict)
    _trees: set[str] = field(default_factory=set)  # sessions that sent tree calls
    # a session's transform (docs/design.md §3.9), from the call that started it
    transforms: dict[str, LogitsTransform] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._last_used)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._last_used

    def check_prefix(self, session_id: str, prefix_len: int, expected_hash: str) -> None:
        """Raise SessionShort unless the session holds ``prefix_len`` tokens hashing as given."""
        if prefix_len == 0:
            return
        held = (
            self.runner.tokens(session_id)[: self.runner.sequence_length(session_id)]
            if session_id in self._last_used
            else []
        )
        if prefix_len > len(held):
            raise SessionShort(session_id, len(held), f"asked for a prefix of {prefix_len}")
        if prefix_hash(held[:prefix_len]) != expected_hash:
            raise SessionShort(session_id, 0, "the prefix hash differs")

    def keep_path(self, session_id: str, prefix_len: int, expected_hash: str, path: list[int]) -> None:
        """v1.1 ``path``: keep the held tree's accepted nodes as the last ``len(path)`` of ``prefix_len``
        agreed tokens; SessionShort without it."""
        base = prefix_len - len(path)
        tree = self.runner.tree_nodes(session_id, base) if session_id in self._last_used else None
        if tree is None:
            held = min(self.runner.sequence_length(session_id), base) if session_id in self._last_used else 0
            raise SessionShort(session_id, held, f"holds no tree after {base} tokens to keep a path of")
        tokens, parents = tree
        for place, node in enumerate(path):
            if node >= len(tokens) or parents[node] != (path[place - 1] if place else -1):
                raise InvalidRequest(
                    f"path {path} is not a root-to-node path of the {len(tokens)}-node tree the "
                    f"previous call left (node {node} at place {place})",
                    param="path",
                )
        agreed = self.runner.tokens(session_id)[:base] + [tokens[node] for node in path]
        if prefix_hash(agreed) != expected_hash:
            raise SessionShort(session_id, base, "the path's tokens differ from the prefix hash")
        self.runner.keep(session_id, [*range(base), *(base + node for node in path)])

    def admit(self, session_id: str, tree: bool = False) -> None:
        """A call's session, held from now on; a new one needs a KV place no session used in the last
        ``live_s`` s holds (else ``WorkerFull``)."""
        if tree:
            self._trees.add(session_id)  # the runner may place it apart (llama.cpp: a context of its own)
        if session_id in self._last_used:
            return
        chains, trees = self.live()
        if self.runner.is_full(chains, trees, tree):
            raise WorkerFull(len(chains) + len(trees), self.live_s, RETRY_AFTER_S)
        self.touch(session_id)

    def live(self) -> tuple[list[str], list[str]]:
        """The chain and the tree sessions used in the last ``live_s`` s (they keep their KV places)."""
        now = self.clock()
        live = [s for s, last in self._last_used.items() if now - last < self.live_s]
        return [s for s in live if s not in self._trees], [s for s in live if s in self._trees]

    @property
    def slots(self) -> int:
        """Sessions this worker serves at once: ``max_sessions``, or fewer where the KV cache refuses a new
        one first."""
        places = self.runner.session_places
        return self.max_sessions if places is None else min(self.max_sessions, places)

    def fill(self) -> float:
        """How full the worker is (what an autoscaler reads): 1.0 where a new session gets ``worker_full``
        (its live sessions hold every KV place) or starts evicting (``max_sessions`` held), whichever comes
        first."""
        places = self.runner.session_places
        held = self.runner.places_held(*self.live()) / places if places else 0.0
        return max(held, len(self) / self.max_sessions)

    def touch(self, session_id: str) -> None:
        self._last_used[session_id] = self.clock()
        self._last_used.move_to_end(session_id)

    def free(self, session_id: str) -> bool:
        existed = self._last_used.pop(session_id, None) is not None
        self._trees.discard(session_id)
        self.transforms.pop(session_id, None)
        self.runner.free(session_id)
        return existed

    def evict(self, keep: str | None = None) -> None:
        """Drop idle sessions past their TTL, then LRU ones while over a cap."""
        now = self.clock()
        for session_id, last in list(self._last_used.items()):
            if now - last > self.ttl_s and session_id != keep:
                self._evict_one(session_id)
        while len(self._last_used) > self.max_sessions or self.runner.memory_bytes() > self.memory_cap_bytes:
            victim = next((s for s in self._last_used if s != keep), None)
            if victim is None:
                break
            self._evict_one(victim)

    def _evict_one(self, session_id: str) -> None:
        self.free(session_id)
        self.num_evicted += 1


# a call's transform, its agreed tokens, each scored row's path after them
Shaping = tuple[LogitsTransform, list[int], list[list[int]]]


def shaped(rows: torch.Tensor, shaping: Shaping | None) -> torch.Tensor:
    """``rows`` each transformed by its own prefix (docs/design.md §3.9), when the call has a transform."""
    if shaping is None:
        return rows
    transformer, agreed, paths = shaping
    return transformer.rows(rows, agreed, paths)


class Transforms:
    """Each session's transform, and the grammar engine they compile with (built on first use)."""

    def __init__(self, settings: WorkerSettings, runner: ModelRunner, sessions: SessionStore) -> None:
        self.settings, self.runner, self.sessions = settings, runner, sessions
        self._grammars: Grammars | None = None

    def transformer(self, wire: dict[str, Any]) -> LogitsTransform:
        try:
            spec = TransformSpec.from_wire(wire)
            return LogitsTransform.build(
                spec, self.runner.info.vocab_size, self.grammars() if spec.grammar is not None else None
            )
        except ValueError as exc:  # GrammarError included
            raise InvalidRequest(str(exc), param="transform") from exc

    def start_transform(self, session_id: str, wire: dict[str, Any] | None) -> None:
        """A call that starts a session (prefix_len 0) sets its transform (docs/design.md §3.9), or none."""
        self.sessions.transforms.pop(session_id, None)
        if wire is not None:
            self.sessions.transforms[session_id] = self.transformer(wire)

    async def precompile(self, wire: dict[str, Any] | None, starts: bool) -> None:
        """Compile a starting call's grammar into the engine's cache off the model thread, so its batch-mates
        do not wait for it."""
        if not starts or not isinstance(wire, dict) or "grammar" not in wire:
            return
        try:
            spec = GrammarSpec.from_wire(wire["grammar"])
            await asyncio.to_thread(lambda: self.grammars().compile(spec))
        except ValueError as exc:  # GrammarError included
            raise InvalidRequest(f"transform: {exc}", param="transform") from exc

    def grammars(self) -> Grammars:
        """The grammar engine over this model's tokenizer (built on first use: ~0.25 s)."""
        if self._grammars is None:
            info = self.runner.info
            self._grammars = Grammars(
                self.runner.tokenizer,
                info.vocab_size,
                info.eos_ids,
                GrammarLimits(max_source_bytes=self.settings.max_grammar_bytes),
            )
        return self._grammars
