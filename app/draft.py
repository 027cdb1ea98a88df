"""The draft model at the gateway: proposes γ tokens per round from q̂ (DESIGN §3.1–3.2).

One runner serves every request, and drafting requests share its decodes: each draft is a
generator that yields the ``ForwardItem`` it needs next (a prompt chunk, a drafted token, a
tree depth) and gets that item's logits back. ``DraftModel``'s step loop runs one runner
``forward_each`` per step over the items of every draft in progress, on the model thread, so
the event loop keeps streaming while a step runs and N concurrent drafts cost one decode per
token position, not N (continuous batching: a draft joins at the next step, leaves when done).

Lookup (DESIGN §3.10, ``Drafter``): the session's context is indexed (``PromptLookup``) and the
outputs of ended sessions go into a bounded ``SuffixIndex``; a lookup proposal is a chain of
deterministic tokens (q̂ = δ), drafted with no model step (``lookup``) or checked by the draft
model in one decode and kept while it is the model's top-1 (``model+lookup``).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import deque
from collections.abc import Collection, Generator
from dataclasses import dataclass, field

import torch

from core.math.random import Purpose, sample_index, uniform, uniforms
from core.math.sampling import SamplingParams, apply_sampling, normalised, truncate, truncated_support
from core.lookup import NO_PROPOSAL, AcceptanceStats, LookupParams, PromptLookup, Proposal, SuffixIndex
from core.math.tree import ChildRule, SparseRow, TokenTree, TreeShape, sparse_rows
from core.names import Drafter
from core.runners import ModelRunner
from core.runners.base import ForwardItem, common_prefix
from core.runners.model_thread import ModelThread
from core.transform import Transformer

DEFAULT_BATCH_TOKENS = 128  # a draft step's new rows, all requests together (DraftConfig.max_batch_tokens)
LOOKUP_PRIOR = 0.5  # a lookup token's acceptance, given the one before it was accepted, before any is measured
MODEL_PRIOR = 0.7  # a draft model token's (a chain's), likewise
SLOT_PRIOR = (0.7, 0.15)  # a sampled tree's node's acceptance per level of its path: first child, a later one (before measured)


@dataclass
class DraftClock:
    """Where one draft's seconds went: in the runner (``draft_model``: the steps it shared),
    and the rest of the drafting — sampling, truncation, the tree's bookkeeping —
    (``draft_sampling``)."""

    model_s: float = 0.0
    total_s: float = 0.0

    def parts(self) -> dict[str, float]:
        return {"draft_model": self.model_s, "draft_sampling": max(self.total_s - self.model_s, 0.0)}


Steps = Generator[ForwardItem, torch.Tensor, TokenTree]  # a draft: yields items, gets their logits


@dataclass(eq=False)
class _Drafting:
    """A draft in progress: its generator, the item it waits on, its clock and its outcome."""

    steps: Steps
    done: asyncio.Future[TokenTree]
    clock: DraftClock = field(default_factory=DraftClock)
    item: ForwardItem | None = None
    started: bool = False
    stop: bool = False  # its caller went away: closed at the next step
    result: TokenTree | None = None
    error: BaseException | None = None

    @property
    def finished(self) -> bool:
        return self.result is not None or self.error is not None

    def advance(self, logits: torch.Tensor | None) -> None:
        """Run the draft on to its next item (or its end) with the logits of the last one."""
        started = time.perf_counter()
        try:
            self.item = self.steps.send(logits)  # type: ignore[arg-type]  # None primes it
        except StopIteration as end:
            self.item, self.result = None, end.value
        except Exception as exc:  # noqa: BLE001 - the draft's own failure, handed to its caller
            self.item, self.error = None, exc
        finally:
            self.clock.total_s += time.perf_counter() - started

    def fail(self, exc: BaseException) -> None:
        """Its item failed: raise it in the draft (its ``finally`` runs), and end it."""
        try:
            self.steps.throw(exc)
        except BaseException as raised:  # noqa: BLE001 - the item's failure, handed to the caller
            self.error = raised
        else:
            self.error = exc
            self.steps.close()
        self.item = None


class DraftModel:
    def __init__(self, runner: ModelRunner, thread: ModelThread | None = None, max_batch_tokens: int = DEFAULT_BATCH_TOKENS) -> None:
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be ≥ 1, got {max_batch_tokens}")
        self.runner = runner
        self.thread = thread or ModelThread()  # every runner call (core.runners.model_thread)
        self.max_batch_tokens = max_batch_tokens  # new rows per step, all drafts together (one always goes)
        self.prefill_chunk = max(1, max_batch_tokens // 2)  # a prompt's rows per step: others ride along
        self.steps: deque[int] = deque(maxlen=1024)  # drafts per step, the latest steps (tests)
        self.num_steps = self.num_step_drafts = 0  # since start (metrics: the mean draft batch)
        self.lookup_params = LookupParams()
        self._lookups: dict[str, PromptLookup] = {}  # session -> its context's n-grams
        self.suffixes = SuffixIndex(self.lookup_params)  # the outputs of ended sessions
        self.num_lookups = self.num_lookup_hits = self.num_lookup_tokens = 0  # since start (metrics)
        self.acceptance = AcceptanceStats()  # measured: lookup tokens by place and match, tree nodes by place in their shape
        self._records: dict[str, _Record] = {}  # session -> what its last tree's nodes were (``observe``)
        self._arrived: list[_Drafting] = []
        self._busy: dict[str, asyncio.Future[TokenTree]] = {}  # session -> its draft in progress
        self._loop_task: asyncio.Task[None] | None = None

    @property
    def vocab_size(self) -> int:
        return self.runner.info.vocab_size

    async def propose(
        self, session_id: str, sequence: list[int], gamma: int, params: SamplingParams, seed: int, choice: int,
        truncation: tuple[int, float] = (0, 1.0), cancel: threading.Event | None = None,
        timing: dict[str, float] | None = None, transformer: Transformer | None = None, limit: int | None = None,
        drafter: Drafter = Drafter.MODEL, shared: bool = True,
    ) -> TokenTree:
        """Draft ``gamma`` tokens after ``sequence`` (the agreed tokens of the session);
        ``truncation`` = (draft_top_k, draft_top_p) sparsifies q̂ (TSLT), losslessly. Once
        ``cancel`` is set, drafting stops after the token in progress (a prepared draft whose
        assumption failed). The tokens depend on ``sequence`` and the positions only: the draws
        are keyed by position, so a draft prepared ahead equals the one drafted later.
        ``timing`` gets the seconds of the draft model and of the sampling (``DraftClock``);
        ``transformer`` (DESIGN §3.9, min_tokens included) reshapes each position's logits as the
        workers reshape theirs; with a
        grammar, the tokens it forces are drafted without a draft step of their own (one decode
        feeds a run of them) and do not count in ``gamma``, up to ``limit`` tokens in all.
        ``drafter`` (DESIGN §3.10): ``lookup`` drafts the lookup's proposal alone (δ rows, no
        model step); ``model+lookup`` puts the part of it the model agrees with first, free.
        ``shared`` = False (a seeded request) leaves out the suffix index of other sessions'
        outputs: those may come from the same seed, whose draws would then test a draft they
        shaped, and a seeded answer must not depend on what ran before it."""
        await self._idle(session_id)
        if cancel is not None and cancel.is_set():
            return TokenTree.chain([], [])
        most = max(gamma, limit or gamma)
        if drafter is Drafter.LOOKUP:
            return self._lookup_chain(session_id, sequence, most, transformer, shared, timing)
        branch = self._branch(session_id, sequence, most, transformer, shared, params.is_greedy) if drafter is Drafter.MODEL_LOOKUP else None
        record = _Record() if branch is not None else None
        steps = self._chain(session_id, sequence, gamma, params, seed, choice, truncation, cancel, transformer, limit, branch, record)
        tree = await self._run(session_id, steps, timing)
        if record is not None:
            self._records[session_id] = record
        return tree

    def _lookup_chain(
        self, session_id: str, sequence: list[int], count: int, transformer: Transformer | None, shared: bool, timing: dict[str, float] | None,
    ) -> TokenTree:
        """The lookup's proposal alone: a chain of δ rows, no model step (its time is the draft's sampling)."""
        started = time.perf_counter()
        tokens = self._lookup(session_id, sequence, count, transformer, shared).tokens
        if timing is not None:
            timing["draft_sampling"] = timing.get("draft_sampling", 0.0) + time.perf_counter() - started
        return TokenTree.chain(tokens, [_delta_support(t) for t in tokens])

    def _lookup(self, session_id: str, sequence: list[int], count: int, transformer: Transformer | None, shared: bool = True) -> Proposal:
        """The lookup's proposal after ``sequence``: prompt lookup in the session's context, else
        the suffix index of ended sessions' outputs; cut before an EOS's successors and before
        the first token a grammar does not allow (it could not be accepted)."""
        if count <= 0:
            return NO_PROPOSAL
        index = self._lookups.setdefault(session_id, PromptLookup(self.lookup_params))
        index.sync(sequence)
        proposal: Proposal = index.propose(count)
        if not proposal.tokens and shared:
            proposal = self.suffixes.propose(sequence, count)
        tokens = proposal.tokens
        eos = set(self.runner.info.eos_ids)
        end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
        tokens = tokens[:end]
        if tokens and transformer is not None and transformer.masks_any:
            masks = transformer.masks(sequence, [tokens[:j] for j in range(len(tokens))])  # [len, V]
            tokens = tokens[:next((j for j, t in enumerate(tokens) if not bool(masks[j, t])), len(tokens))]
        self.num_lookups += 1
        self.num_lookup_hits += bool(tokens)
        self.num_lookup_tokens += len(tokens)
        return Proposal(tokens, proposal.match if tokens else 0)

    def _branch(self, session_id: str, sequence: list[int], count: int, transformer: Transformer | None, shared: bool, greedy: bool) -> _Branch:
        """The lookup's proposal as a branch: each token's acceptance given the one before it, as
        measured for its place in the run, its match's length and greedy or not (the prior alone
        for a seeded request: ``shared`` = False); and a model token's, likewise (a chain's)."""
        proposal = self._lookup(session_id, sequence, count, transformer, shared)
        keys: list[tuple[object, ...]] = [("lookup", greedy, min(proposal.match, 4), j) for j in range(len(proposal.tokens))]
        model = ("model", greedy)
        return _Branch(proposal.tokens, keys, [self.acceptance.rate(key, LOOKUP_PRIOR, shared) for key in keys], shared, model, self.acceptance.rate(model, MODEL_PRIOR, shared))

    def observe(self, session_id: str, path: list[int]) -> None:
        """The walk of the session's last tree accepted ``path``: its lookup tokens (each tested
        once the one before it was accepted) and its nodes' places count in ``acceptance`` —
        only the candidates the walk tested: which nodes exist below that depends on draws at
        positions past the round's end, which the next round draws again (keyed by position), and
        rates that moved with them would make the next round's draft depend on its own draws (a
        cold counter-example hunt measured TV 0.095 when every drafted node counted)."""
        record = self._records.pop(session_id, None)
        if record is None:
            return
        accepted = set(path)
        for j, (node, key) in enumerate(record.lookup):
            if j and record.lookup[j - 1][0] not in accepted:
                break
            self.acceptance.observe(key, node in accepted)
        for node, parent, key in record.slots:  # a node whose test the walk reached: one below the root or an accepted node
            if parent < 0 or parent in accepted:  # (whether the others exist depends on draws past the walk's end, which the next round redraws)
                self.acceptance.observe(key, node in accepted)

    async def propose_tree(
        self, session_id: str, sequence: list[int], shape: TreeShape, params: SamplingParams, seed: int, choice: int,
        truncation: tuple[int, float] = (0, 1.0), timing: dict[str, float] | None = None, transformer: Transformer | None = None,
        depth_limit: int | None = None, extra: int = 0, drafter: Drafter = Drafter.MODEL, shared: bool = True,
    ) -> TokenTree:
        """Draft a tree of ``shape`` after ``sequence`` (DESIGN §3.6): one batched draft decode
        per depth over the nodes that get children. The draws are keyed by position and lane
        (a draw's rank at its depth), so lane 0 of a one-wide tree draws the chain's numbers.
        With a grammar and ``extra`` > 0, the runs of tokens it forces come free, up to ``extra``
        nodes in all, no deeper than ``depth_limit``: after each node that gets children (best
        first), fed with it in its depth's decode, and taking no depth of ``shape`` (its children
        follow the run); then below the leaves.
        ``drafter`` (DESIGN §3.10): ``model+lookup`` joins the lookup's proposal to the tree as a
        branch of deterministic children (first at the root; merged where the model drafted the
        same token), sharing the node budget: with fixed children its tokens rank by their
        measured acceptance among the model's by draft probability (EAGLE-2's top N); with
        sampled ones each displaces the model's least valuable place in the shape while its
        expected acceptance is higher (``_displaced``), and the root's drawn children come from
        q̂ without the lookup's token. ``lookup`` drafts the proposal alone (δ rows, no model
        step). ``shared`` as in ``propose`` (and a seeded request's weighing uses priors only)."""
        await self._idle(session_id)
        room = depth_limit if depth_limit is not None else shape.max_depth
        if drafter is Drafter.LOOKUP:
            return self._lookup_chain(session_id, sequence, room, transformer, shared, timing)
        branch = self._branch(session_id, sequence, room, transformer, shared, params.is_greedy) if drafter is Drafter.MODEL_LOOKUP else None
        record = _Record() if branch is not None else None
        grammar = extra > 0 and transformer is not None and transformer.matcher is not None
        limit = (depth_limit if depth_limit is not None else shape.max_depth) if grammar else 0
        # sampled children: each path gets its own ``extra`` (a budget shared across branches would let
        # one branch's draws shape another's round, and the next round redraws those keys); fixed
        # children draw nothing: one budget for the tree
        per_path = shape.rule is not ChildRule.FIXED
        left = [extra if grammar else 0]
        steps = self._tree_of(session_id, sequence, shape, params, seed, choice, truncation, transformer, limit, left, per_path, branch, record)
        tree = await self._run(session_id, steps, timing)
        if grammar and transformer is not None and (per_path or left[0] > 0):
            tree = self._with_forced_runs(tree, transformer, sequence, limit, extra if per_path else left[0], per_path)
        if record is not None:
            self._records[session_id] = record
        return tree

    def _with_forced_runs(self, tree: TokenTree, transformer: Transformer, sequence: list[int], depth_limit: int, extra: int, per_path: bool = False) -> TokenTree:
        """``tree`` with the tokens the grammar forces after each leaf hung below it: each such
        child is drawn from a point mass (its parent's q̂ row is δ), as every target's T(p) is there.
        ``per_path``: each leaf's run within ``extra`` less the point masses on its path already."""
        eos = set(self.runner.info.eos_ids)
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        n = len(tokens)
        logq = [math.log(q) if q > 0 else -1e9 for q in tree.q_values().tolist()]
        score, depth = [0.0] * n, [0] * n
        for v in range(n):
            above = parents[v]
            score[v] = (score[above] if above >= 0 else 0.0) + logq[v]
            depth[v] = (depth[above] if above >= 0 else 0) + 1
        inner = set(parents)
        leaves = sorted((v for v in range(n) if v not in inner and tokens[v] not in eos), key=lambda v: (-score[v], v))
        added: list[tuple[int, int]] = []  # (parent, token)
        for leaf in leaves:
            used = sum(1 for v in tree.path_to(leaf) if logq[v] == 0.0) if per_path else len(added)
            room = min(extra - used, depth_limit - depth[leaf])
            if room <= 0:
                continue
            path = [tokens[v] for v in tree.path_to(leaf)]
            parent = leaf
            for token in transformer.forced_run([*sequence, *path], room, eos):
                added.append((parent, token))
                parent = n + len(added) - 1
        if not added:
            return tree
        width = tree.q_ids.shape[1]
        ids = torch.cat([tree.q_ids, torch.full((len(added), width), -1, dtype=tree.q_ids.dtype)])
        probs = torch.cat([tree.q_probs, torch.zeros(len(added), width, dtype=tree.q_probs.dtype)])
        for parent, token in added:  # the parent's row: δ at its forced child (a leaf had none)
            ids[parent + 1] = -1
            probs[parent + 1] = 0
            ids[parent + 1, 0], probs[parent + 1, 0] = token, 1.0
        flags = None if tree.deterministic is None else torch.cat([tree.deterministic, torch.zeros(len(added), dtype=torch.bool)])
        return TokenTree(
            torch.tensor([*tokens, *(t for _, t in added)], dtype=torch.long), torch.tensor([*parents, *(p for p, _ in added)], dtype=torch.long),
            ids, probs, tree.rule, flags,
        )

    async def free(self, session_id: str, output: list[int] | None = None) -> None:
        """Forget the session, after its draft in progress (if any) has ended; its ``output``
        (the tokens it generated) joins the suffix index."""
        await self._idle(session_id)
        self._lookups.pop(session_id, None)
        self._records.pop(session_id, None)
        if output:
            self.suffixes.add(output)
        await self.thread.run(self.runner.free, session_id)

    # ----------------------------------------------------------------- the step loop

    async def _idle(self, session_id: str) -> None:
        """Wait until the session has no draft in progress (one draft per session at a time)."""
        while (busy := self._busy.get(session_id)) is not None:
            await asyncio.wait([busy])

    async def _run(self, session_id: str, steps: Steps, timing: dict[str, float] | None) -> TokenTree:
        drafting = _Drafting(steps, asyncio.get_running_loop().create_future())
        self._busy[session_id] = drafting.done
        drafting.done.add_done_callback(lambda done: self._busy.pop(session_id) if self._busy.get(session_id) is done else None)
        self._arrived.append(drafting)
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._step_loop())
        try:
            tree = await asyncio.shield(drafting.done)
        except asyncio.CancelledError:
            drafting.stop = True  # the step loop closes it; the session stays busy until then
            raise
        if timing is not None:
            for name, seconds in drafting.clock.parts().items():
                timing[name] = timing.get(name, 0.0) + seconds
        return tree

    async def _step_loop(self) -> None:
        """Steps while any draft is in progress; a draft that arrives joins the next step."""
        active: list[_Drafting] = []
        try:
            while True:
                active += self._arrived
                self._arrived = []
                if not active:
                    return
                try:
                    await self.thread.run(self._step, active)
                except Exception as exc:  # noqa: BLE001 - a broken step fails its drafts, not the loop
                    for d in active:
                        d.item, d.error = None, d.error or exc
                for d in active:
                    if d.finished or d.stop:
                        _settle(d)
                active = [d for d in active if not d.done.done()]
        finally:
            self._loop_task = None
            for d in [*active, *self._arrived]:  # the loop was cancelled (shutdown)
                if not d.done.done():
                    d.done.cancel()

    def _step(self, drafts: list[_Drafting]) -> None:
        """On the model thread: start new drafts and close stopped ones, then one
        ``forward_each`` over the waiting items, oldest first, within ``max_batch_tokens``
        (one always goes), and run each draft on to its next item."""
        for d in drafts:
            if d.stop and not d.finished:
                d.steps.close()
                d.item = None
            elif not d.started:
                d.started = True
                d.advance(None)
        taken: list[_Drafting] = []
        budget = self.max_batch_tokens
        for d in drafts:
            if d.item is not None and not d.stop and (not taken or len(d.item.tokens) <= budget):
                taken.append(d)
                budget -= len(d.item.tokens)
        if not taken:
            return
        started = time.perf_counter()
        results = self.runner.forward_each([d.item for d in taken if d.item is not None])
        seconds = time.perf_counter() - started
        self.steps.append(len(taken))
        self.num_steps += 1
        self.num_step_drafts += len(taken)
        for d, result in zip(taken, results):
            d.clock.model_s += seconds
            d.clock.total_s += seconds
            if isinstance(result, Exception):
                d.fail(result)
            else:
                d.advance(result)

    # ----------------------------------------------------------------- the drafts

    def _feed(self, session_id: str, tokens: list[int]) -> Generator[ForwardItem, torch.Tensor, torch.Tensor]:
        """Append ``tokens`` to the session in chunks of ≤ ``prefill_chunk`` rows, one per step
        (an empty list feeds the last held row again); the logits of the last row."""
        logits = None
        for begin in range(0, max(len(tokens), 1), self.prefill_chunk):
            logits = yield self.runner.append_item(session_id, tokens[begin:begin + self.prefill_chunk], 1)
        assert logits is not None
        return logits[0]

    def _chain(
        self, session_id: str, sequence: list[int], gamma: int, params: SamplingParams, seed: int, choice: int,
        truncation: tuple[int, float], cancel: threading.Event | None, transformer: Transformer | None = None,
        limit: int | None = None, branch: _Branch | None = None, record: _Record | None = None,
    ) -> Steps:
        """A chain of ``gamma`` drafted tokens (forced ones free, within ``limit``). ``branch``
        (model+lookup): the lookup's run first, one decode scoring it, each token kept while it
        is the model's top-1 there or its measured acceptance is at least a model token's (a
        confident lookup the small model does not see); the model drafts on after what was kept.
        ``record`` gets each token's kind (``observe``)."""
        run = branch.tokens if branch is not None else []
        runner = self.runner
        eos = set(runner.info.eos_ids)
        if not runner.has_session(session_id):
            runner.adopt(session_id, sequence)  # a prompt cache's rows (a long system prompt: tools)
        common = common_prefix(runner.tokens(session_id), sequence)
        runner.crop(session_id, common)
        logits = yield from self._feed(session_id, sequence[common:])
        grammar = transformer is not None and transformer.matcher is not None
        limit = max(gamma, limit or gamma) if grammar or run else gamma
        draws = uniforms(seed, choice, list(range(len(sequence), len(sequence) + limit)), Purpose.DRAFT_SAMPLE)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []  # dense q̂ rows, or
        supports: list[SparseRow] = []  # truncated ones, sampled on their support (DESIGN §9)
        truncating = not params.is_greedy and truncation != (0, 1.0)
        sampled = 0  # tokens that took a draft step (forced ones do not)

        def shaped(logits: torch.Tensor) -> torch.Tensor:  # [V]: the next position's logits as the targets' are transformed
            return logits if transformer is None else transformer.rows(logits[None], sequence, [tokens])[0]

        if run:  # model+lookup: one decode scores the lookup's run; its tokens stay while each is the model's top-1
            assert branch is not None
            after = yield runner.append_item(session_id, run[: limit], min(len(run), limit))  # [len, V]: the row after each
            for j, token in enumerate(run[:limit]):
                if int(torch.argmax(shaped(logits))) != token and branch.rates[j] < branch.model_rate:
                    break
                tokens.append(token)
                logits = after[len(tokens) - 1]
                if truncating:
                    supports.append(_delta_support(token))
                else:
                    rows.append(_delta(token, self.vocab_size))
            runner.crop(session_id, len(sequence) + len(tokens))
            if record is not None:
                record.lookup = list(enumerate(branch.keys[: len(tokens)]))
            if tokens and (tokens[-1] in eos or len(tokens) >= limit):
                return TokenTree.chain(tokens, supports if truncating else rows)
        while True:
            j = len(tokens)
            logits = shaped(logits)
            q = apply_sampling(logits[None], params)[0]
            if truncating:  # renormalised in float64 on the support
                ids, probs = truncated_support(q, *truncation)
                token = int(ids[sample_index(probs, float(draws[j]))])
                supports.append((ids, probs))
            else:
                q = normalised(q)  # q̂ as sampled: the accept test's numbers too
                token = int(torch.argmax(q)) if params.is_greedy else sample_index(q, float(draws[j]))
                rows.append(q)
            tokens.append(token)
            sampled += 1
            forced = transformer.forced_run([*sequence, *tokens], limit - len(tokens), eos) if transformer is not None and grammar and token not in eos else []
            for token in forced:  # T(q) is a point mass there, as every worker's T(p)
                tokens.append(token)
                if truncating:
                    supports.append((torch.tensor([token]), torch.ones(1, dtype=torch.float64)))
                else:
                    rows.append(_delta(token, self.vocab_size))
            if record is not None and branch is not None:
                record.lookup.append((len(tokens) - 1 - len(forced), branch.model_key))  # forced ones are decided: never tested
            if tokens[-1] in eos or sampled == gamma or len(tokens) >= limit or (cancel is not None and cancel.is_set()):
                break
            logits = (yield runner.append_item(session_id, tokens[-1 - len(forced) :], 1))[0]  # the sampled token and the run after it, one decode
        return TokenTree.chain(tokens, supports if truncating else rows)

    def _tree_of(
        self, session_id: str, sequence: list[int], shape: TreeShape, params: SamplingParams, seed: int, choice: int,
        truncation: tuple[int, float], transformer: Transformer | None = None, depth_limit: int = 0, left: list[int] | None = None,
        per_path: bool = False, branch: _Branch | None = None, record: _Record | None = None,
    ) -> Steps:
        """The tree's drafting. With ``left`` = [n > 0] (a grammar's free nodes still to place;
        what is not used is left there), a node that gets children first gets the run of tokens
        the grammar forces after it, no deeper than ``depth_limit``: the run is fed with the node
        in the depth's decode, and the node's children come after it (the run's rows are δ).
        ``branch``: a lookup proposal joined as deterministic children (``propose_tree``); what
        the tree's nodes were goes into ``record``."""
        runner, eos = self.runner, set(self.runner.info.eos_ids)
        if not runner.has_session(session_id):
            runner.adopt(session_id, sequence)
        common = common_prefix(runner.tokens(session_id), sequence)
        runner.crop(session_id, common)
        logits = yield from self._feed(session_id, sequence[common:])
        start = len(sequence)
        q_at = {-1: self._q(self._shaped(transformer, logits, sequence, []), params, truncation)}
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []  # cumulative draft log-probability (the fixed rule's ranking)
        row_of = {-1: start - 1}  # node -> its row in the draft session
        frontier = [-1]
        depths: list[int] = []  # per node: its depth in the tree (forced runs included)
        free: set[int] = set()  # the nodes of forced runs
        lanes: dict[int, int] = {}  # position -> draws taken there (a draw's key: position, lane)
        sampled = shape.rule is not ChildRule.FIXED
        plan = self._plan(shape, branch) if sampled and branch is not None else None  # decided before any draw
        excluded = {-1: branch.tokens[0]} if plan is not None and branch is not None and plan[0] else {}  # drawn after the lookup's child: from q̂ without it
        try:
            for depth in range(1, shape.max_depth + 1):
                fresh = []
                for parent, token, score in _children(frontier, q_at, scores, shape, depth, start, depths, lanes, params, seed, choice, excluded):
                    tokens.append(token)
                    parents.append(parent)
                    scores.append(score)
                    depths.append(depths[parent] + 1 if parent >= 0 else 1)
                    fresh.append(len(tokens) - 1)
                frontier = [n for n in fresh if tokens[n] not in eos]
                if shape.rule is ChildRule.FIXED:  # EAGLE-2: expand the best top_k of this depth
                    frontier = sorted(frontier, key=lambda n: (-scores[n], n))[: shape.top_k]
                if depth == shape.max_depth or not frontier:
                    break
                runs = {n: self._forced_below(n, tokens, parents, scores, depths, free, transformer, sequence, depth_limit, left, eos, per_path) for n in frontier}
                feed: list[int] = []
                feed_parents: list[int] = []
                ends: list[int] = []
                held = runner.length(session_id)
                for n in frontier:
                    for k, node in enumerate([n, *runs[n]]):
                        feed_parents.append(row_of[parents[node]] if k == 0 else held + len(feed) - 1)
                        row_of[node] = held + len(feed)
                        feed.append(tokens[node])
                    ends.append(len(feed) - 1)
                rows = yield ForwardItem(session_id, held, feed, feed_parents, ends)
                expand = []
                for n, node_logits in zip(frontier, rows):
                    run = [n, *runs[n]]
                    for above, below in zip(run, run[1:]):
                        q_at[above] = _delta(tokens[below], self.vocab_size)
                    last = run[-1]
                    q_at[last] = self._q(self._shaped(transformer, node_logits, sequence, _path(last, tokens, parents)), params, truncation)
                    if tokens[last] not in eos and (not free or depths[last] < depth_limit):
                        expand.append(last)
                frontier = expand
                if not frontier:
                    break
        finally:
            if runner.has_session(session_id):
                runner.crop(session_id, start)  # the session is the agreed sequence again
        if shape.rule is ChildRule.FIXED:
            marks = _merged(branch, tokens, parents, scores, depths) if branch is not None else []
            tree, order = _best_nodes(tokens, parents, scores, q_at, shape.nodes, self.vocab_size, free, marks)
            if record is not None and branch is not None:
                kept = {n: i for i, n in enumerate(order)}
                record.lookup = [(kept[n], key) for n, key in zip(marks, branch.keys) if n in kept]
            return tree
        if branch is None or plan is None:
            return _tree(tokens, parents, q_at, shape.rule, self.vocab_size)
        return _with_branch(tokens, parents, q_at, free, shape, branch, plan, record, self.vocab_size)

    def _plan(self, shape: TreeShape, branch: _Branch) -> _Plan:
        """A sampled tree's share between the lookup's branch and the model's places
        (``_displaced``), from the measured rates (priors for a seeded request)."""
        keys: dict[tuple[int, ...], tuple[object, ...]] = {place: ("slot", shape.rule.value, shape.widths, place) for place in _shape_places(shape.widths)}
        values = {place: self.acceptance.rate(key, _slot_prior(place), branch.measured) for place, key in keys.items()}
        count, gone = _displaced(values, branch.rates)
        return count, gone, keys


    def _forced_below(
        self, node: int, tokens: list[int], parents: list[int], scores: list[float], depths: list[int], free: set[int],
        transformer: Transformer | None, sequence: list[int], depth_limit: int, left: list[int] | None, eos: set[int],
        per_path: bool = False,
    ) -> list[int]:
        """Hang the run of tokens the grammar forces after ``node`` below it (new nodes, within
        ``left`` and ``depth_limit``); the nodes added, top down."""
        if left is None or left[0] <= 0 or transformer is None or transformer.matcher is None:
            return []
        if per_path:  # ``left`` is each path's budget: its forced nodes so far count against it
            above, used = node, 0
            while above >= 0:
                used += above in free
                above = parents[above]
            room = min(left[0] - used, depth_limit - depths[node])
        else:
            room = min(left[0], depth_limit - depths[node])
        if room <= 0:
            return []
        added: list[int] = []
        for token in transformer.forced_run([*sequence, *_path(node, tokens, parents)], room, eos):
            above = added[-1] if added else node
            tokens.append(token)
            parents.append(above)
            scores.append(scores[above])  # log 1
            depths.append(depths[above] + 1)
            free.add(len(tokens) - 1)
            added.append(len(tokens) - 1)
        if not per_path:
            left[0] -= len(added)
        return added

    @staticmethod
    def _shaped(transformer: Transformer | None, logits: torch.Tensor, sequence: list[int], path: list[int]) -> torch.Tensor:
        return logits if transformer is None else transformer.rows(logits[None], sequence, [path])[0]

    @staticmethod
    def _q(logits: torch.Tensor, params: SamplingParams, truncation: tuple[int, float]) -> torch.Tensor:
        q = apply_sampling(logits[None], params)[0]
        return truncate(q, *truncation) if not params.is_greedy and truncation != (0, 1.0) else normalised(q)  # q̂ as sampled, in float64


_Plan = tuple[int, set[tuple[int, ...]], dict[tuple[int, ...], tuple[object, ...]]]  # lookup tokens taken, places given up, each place's kind


def _with_branch(
    tokens: list[int], parents: list[int], q_at: dict[int, torch.Tensor], free: set[int], shape: TreeShape, branch: _Branch, plan: _Plan,
    record: _Record | None, vocab_size: int,
) -> TokenTree:
    """A sampled tree with the lookup's branch first at the root: its tokens displace the model's
    places the plan gives up (those nodes and what hangs below them go)."""
    count, gone, keys = plan
    places = _places(tokens, parents, free)
    dropped: set[int] = set()
    for n in range(len(tokens)):
        if (n not in free and places[n] in gone) or (parents[n] >= 0 and parents[n] in dropped):
            dropped.add(n)
    kept = [n for n in range(len(tokens)) if n not in dropped]
    index = {-1: -1, **{n: count + i for i, n in enumerate(kept)}}
    empty = torch.zeros(vocab_size)
    rows = [q_at[-1], *([empty] * count), *(q_at.get(n, empty) for n in kept)]  # a lookup node's row: no draft there
    ids, probs = sparse_rows(rows)
    tree = TokenTree(
        torch.tensor([*branch.tokens[:count], *(tokens[n] for n in kept)], dtype=torch.long),
        torch.tensor([*range(-1, count - 1), *(index[parents[n]] for n in kept)], dtype=torch.long),
        ids, probs, shape.rule, torch.tensor([True] * count + [False] * len(kept)),
    )
    if record is not None:
        record.lookup = list(zip(range(count), branch.keys))
        record.slots = [(index[n], index[parents[n]], keys[places[n]]) for n in kept if n not in free and places[n] in keys]
    return tree


def _path(node: int, tokens: list[int], parents: list[int]) -> list[int]:
    """The tokens from the root's child down to ``node``."""
    path = []
    while node >= 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


def _drafted_above(node: int, parents: list[int], free: Collection[int]) -> int:
    """The nearest ancestor of ``node`` that was drafted (not forced); −1 for the root."""
    node = parents[node]
    while node >= 0 and node in free:
        node = parents[node]
    return node


def _settle(d: _Drafting) -> None:
    """On the event loop: hand a finished (or stopped) draft's outcome to its caller."""
    if d.done.done():
        return
    if d.result is not None:
        d.done.set_result(d.result)
    elif d.error is not None:
        d.done.set_exception(d.error)
    else:
        d.done.cancel()


def _delta(token: int, vocab_size: int) -> torch.Tensor:
    row = torch.zeros(vocab_size, dtype=torch.float64)
    row[token] = 1.0
    return row


def _delta_support(token: int) -> SparseRow:
    return torch.tensor([token]), torch.ones(1, dtype=torch.float64)


def _children(
    frontier: list[int], q_at: dict[int, torch.Tensor], scores: list[float], shape: TreeShape, depth: int, start: int, depths: list[int],
    lanes: dict[int, int], params: SamplingParams, seed: int, choice: int, excluded: dict[int, int] | None = None,
) -> list[tuple[int, int, float]]:
    """(parent, token, cumulative log q̂) of the children of every frontier node, in order:
    the ``top_k`` most likely (fixed), or ``widths[depth − 1]`` draws (sampled; without
    replacement a drawn token leaves q̂ for its siblings). A draw is keyed by its position and
    its lane, the draws already taken at that position (``lanes``): without forced runs, every
    node of a depth has one position and its draws take lanes 0, 1, … in order. ``excluded``:
    parent -> the token of its deterministic (lookup) child, which its draws leave out."""
    out: list[tuple[int, int, float]] = []
    for parent in frontier:
        q = q_at[parent]
        base = scores[parent] if parent >= 0 else 0.0
        position = start + (depths[parent] if parent >= 0 else 0)
        if shape.rule is ChildRule.FIXED:
            top = torch.topk(q, max(1, min(shape.top_k, int((q > 0).sum()))))
            out.extend((parent, int(t), base + math.log(float(p))) for t, p in zip(top.indices, top.values) if p > 0)
            continue
        left = q.clone()
        if excluded and parent in excluded:
            left[excluded[parent]] = 0
        for _ in range(shape.widths[depth - 1]):
            if not bool((left > 0).any()):
                break
            lane = lanes.get(position, 0)
            lanes[position] = lane + 1
            if params.is_greedy:
                token = int(torch.argmax(left))
            else:
                token = sample_index(left, uniform(seed, choice, position, Purpose.DRAFT_SAMPLE, lane=lane))
            out.append((parent, token, base + math.log(max(float(q[token]), 1e-45))))
            if shape.rule is ChildRule.SAMPLED_DISTINCT:
                left[token] = 0
                if not bool((left > 0).any()):
                    break
    return out


def _tree(tokens: list[int], parents: list[int], q_at: dict[int, torch.Tensor], rule: ChildRule, vocab_size: int) -> TokenTree:
    """The nodes as drafted (parents before children), q̂ at the root and at every expanded node."""
    empty = torch.zeros(vocab_size)
    ids, probs = sparse_rows([q_at[-1], *(q_at.get(n, empty) for n in range(len(tokens)))])
    return TokenTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long), ids, probs, rule)


def _best_nodes(
    tokens: list[int], parents: list[int], scores: list[float], q_at: dict[int, torch.Tensor], budget: int, vocab_size: int,
    free: Collection[int] = (), marks: Collection[int] = (),
) -> tuple[TokenTree, list[int]]:  # the tree, and which node each of its nodes was
    """EAGLE-2's rerank: the ``budget`` nodes of best cumulative score — a node never outscores
    its parent, so they form a tree — ordered by depth, siblings best first (``marks``, the
    lookup's deterministic children, first of all). The ``free`` nodes (forced runs) are not
    counted: one stays when the drafted node above its run stays."""
    kept_set = set(sorted((n for n in range(len(tokens)) if n not in free), key=lambda n: (-scores[n], n))[:budget])
    for n in range(len(tokens)):  # parents come first
        if n in free and _drafted_above(n, parents, free) in kept_set | {-1}:
            kept_set.add(n)
        elif n in kept_set and parents[n] >= 0 and parents[n] not in kept_set:  # below a run that went (a lookup's child)
            kept_set.discard(n)
    depth: dict[int, int] = {-1: 0}
    for n in range(len(tokens)):
        depth[n] = depth[parents[n]] + 1
    marked = set(marks)
    order = sorted(kept_set, key=lambda n: (depth[n], n not in marked, -scores[n], n))
    index = {-1: -1, **{n: i for i, n in enumerate(order)}}
    empty = torch.zeros(vocab_size)
    ids, probs = sparse_rows([q_at[-1], *(q_at.get(n, empty) for n in order)])
    flags = torch.tensor([n in marked for n in order], dtype=torch.bool) if marked else None
    tree = TokenTree(
        torch.tensor([tokens[n] for n in order], dtype=torch.long), torch.tensor([index[parents[n]] for n in order], dtype=torch.long),
        ids, probs, ChildRule.FIXED, flags,
    )
    return tree, order


@dataclass
class _Branch:
    """A lookup proposal: its tokens, their kinds (``AcceptanceStats`` keys), each one's
    acceptance given the one before it, whether those were measured (not a prior), and a draft
    model token's kind and acceptance (what a chain weighs a lookup token against)."""

    tokens: list[int]
    keys: list[tuple[object, ...]]
    rates: list[float]
    measured: bool
    model_key: tuple[object, ...] = ("model",)
    model_rate: float = MODEL_PRIOR


@dataclass
class _Record:
    """What a draft's nodes were, for ``DraftModel.observe``: (node, kind) of its lookup nodes in
    run order — a chain's every token, lookup or model, in order: each is tested once the one
    before it was accepted — and of a sampled tree's drafted nodes by their place in its shape."""

    lookup: list[tuple[int, tuple[object, ...]]] = field(default_factory=list)
    slots: list[tuple[int, int, tuple[object, ...]]] = field(default_factory=list)  # (node, its parent, kind)


def _merged(branch: _Branch, tokens: list[int], parents: list[int], scores: list[float], depths: list[int]) -> list[int]:
    """The lookup's branch joined to a fixed tree's nodes: each token is the child of the one
    before it (the root's for the first), merged with a drafted sibling of the same token;
    scored by the log of its measured acceptance on top of its parent's (a node never outscores
    its parent: EAGLE-2's rerank keeps a tree). The branch's nodes, in run order."""
    above, out = -1, []
    for token, rate in zip(branch.tokens, branch.rates):
        score = (scores[above] if above >= 0 else 0.0) + math.log(max(rate, 1e-9))
        match = next((n for n in range(len(tokens)) if parents[n] == above and tokens[n] == token), None)
        if match is None:
            tokens.append(token)
            parents.append(above)
            scores.append(score)
            depths.append(depths[above] + 1 if above >= 0 else 1)
            match = len(tokens) - 1
        else:
            scores[match] = max(scores[match], score)
        out.append(match)
        above = match
    return out


def _places(tokens: list[int], parents: list[int], free: Collection[int]) -> dict[int, tuple[int, ...]]:
    """Each drafted node's place in its sampled shape: the ranks of its path among the drafted
    children of each node above (forced runs take no place)."""
    places: dict[int, tuple[int, ...]] = {}
    ranks: dict[int, int] = {}  # drafted parent -> its drafted children so far
    for n in range(len(tokens)):
        if n in free:
            continue
        above = _drafted_above(n, parents, free)
        rank = ranks.get(above, 0)
        ranks[above] = rank + 1
        places[n] = (*(places[above] if above >= 0 else ()), rank)
    return places


def _shape_places(widths: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every place of a full sampled tree of ``widths``, depth by depth."""
    out: list[tuple[int, ...]] = []
    level: list[tuple[int, ...]] = [()]
    for k in widths:
        level = [(*place, rank) for place in level for rank in range(k)]
        out.extend(level)
    return out


def _slot_prior(place: tuple[int, ...]) -> float:
    value = 1.0
    for rank in place:
        value *= SLOT_PRIOR[0] if rank == 0 else SLOT_PRIOR[1]
    return value


def _displaced(values: dict[tuple[int, ...], float], rates: list[float]) -> tuple[int, set[tuple[int, ...]]]:
    """How many of the lookup's tokens join a sampled tree and the shape's places they take:
    the j-th token's expected acceptance (the product of the rates up to it) against the least
    valuable place that can go — a leaf of what is left, the last of its siblings — while it is
    higher. The choice depends on the context and the measured rates, never on the draws."""
    left, gone, reach = set(values), set[tuple[int, ...]](), 1.0
    for rate in rates:
        reach *= rate
        removable = [
            place for place in left
            if not any(len(other) == len(place) + 1 and other[:-1] == place for other in left)
            and not any(other[:-1] == place[:-1] and other[-1] > place[-1] for other in left if len(other) == len(place))
        ]
        if not removable:
            break
        low = min(removable, key=lambda place: (values[place], -len(place), [-r for r in place]))
        if values[low] >= reach:
            break
        left.discard(low)
        gone.add(low)
    return len(gone), gone
