"""Existing engines as targets (DESIGN §8): an ``openai-logprobs`` target is an OpenAI-compatible
engine (vLLM, llama-cpp-python's server) asked, per round, for its top-k logprobs at every draft
position — ``/v1/completions`` with ``echo: true, logprobs: k, max_tokens: 1``; only the prompt's
logprobs are read. It stands in for a worker in ``autoregressive`` and ``aggregate``:

    sequence + draft + [pad]  ─►  the engine's logprobs p(· | sequence + x_<j), j = 0 … γ,
                                  read from the prompt's echo (raw, temperature 1)
                              ─►  T(p) on the top-k (core.math.tempering), the tail bounded
                              ─►  a VerifyResponse (ids, probs, σ; or the sample z_n)

so the engine's answer is lossy exactly as top-k with ``renormalize`` (§3.3), and every response
says so through its bound. ``pad`` is a token after the draft (the tokenizer's EOS, or a letter,
a full stop, a digit: one after which the text tokenises back), so the γ+1-th distribution is a
prompt entry too and the generated token is ignored.

Prompts and token ids. At its first check the target learns, from a probe, how the engine reads:
token-id prompts (vLLM) or only text (llama-cpp-python: the gateway's ids are detokenised and
must tokenise back to the same ids — checked locally before each call, and the engine's echoed
tokens are compared with ours after it: a difference is an error, never a guess); token ids
in the answer (vLLM's ``return_tokens_as_token_ids``) or token strings, mapped back through the
shared tokenizer. A string several ids share (llama-cpp-python renders every special token and
every partial UTF-8 token as "") is attributed only where it is the token at that position; its
mass is otherwise left out and counted in the bound. The probe also learns which ids the engine
leaves out of its listing (llama-cpp-python skips every BOS; drafts stop before such a token), and
which logprobs go with which token: llama-cpp-python 0.3 pairs each echoed token with the scores
after it, not before, unless it stripped a leading BOS (EngineFormat.shifts).
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import numpy as np
import orjson
import torch

from app.targets.engine_listing import EngineFormat, Entry, TokenTable, parse_listing, plain, token_id
from app.targets.base import (
    Channel,
    Expected,
    Replica,
    ReplicaFailure,
    Traffic,
    WorkerError,
    status_failure,
)
from core.config import WorkerEntry
from core.errors import ProtocolError
from core.math.random import Purpose, sample_index, uniform
from core.math.sampling import SamplingParams
from core.math.tempering import temper_top_k
from core.modes import ENGINE_MODES
from core.names import Mode
from core.transform import TransformSpec
from core.protocol import (
    PROTOCOL_VERSION,
    InfoResponse,
    VerifyRequest,
    VerifyResponse,
    check_verify_response,
)

log = logging.getLogger(__name__)

_UNLIMITED_CONTEXT = 1 << 30  # an engine that does not say how long its context is
_PROBE_MESSAGES = [  # short (an engine may score prompts slowly), with turn markers and non-ASCII text
    {"role": "system", "content": "Hi"},
    {"role": "user", "content": "naïve café, 42!"},
]


class EngineDialect:
    """An OpenAI-compatible engine as a target: no sessions (each call sends the whole sequence),
    ``/v1/models`` plus a probe instead of ``/v1/info``."""

    health_path: str | None = None  # not every engine has /health: the check itself is the probe
    is_engine = True

    def __init__(self, name: str, channel: Channel, expected: Expected, entry: WorkerEntry) -> None:
        assert entry.model is not None and expected.tokenizer is not None
        self.name, self.channel, self.expected = name, channel, expected
        self.model, self.top_k, self.max_context = entry.model, entry.logprobs, entry.max_context
        self.formats: dict[str, EngineFormat] = {}  # by replica URL, once probed
        self._table: TokenTable | None = None
        self._pad_candidates: list[int] | None = None

    @property
    def vocab_size(self) -> int:
        return self.expected.vocab_size

    @property
    def table(self) -> TokenTable:
        if self._table is None:  # built on first use: it decodes every id once (~1 s)
            self._table = TokenTable(self.expected.tokenizer, self.vocab_size)
            if self._table.ambiguous:
                log.info("worker %s: %d token ids share their string with another", self.name, self._table.ambiguous)
        return self._table

    # ----------------------------------------------------------------- the check

    async def info(self, replica: Replica) -> InfoResponse:
        """``/v1/models``; the probe too the first time and after the circuit opened (an engine
        that came back may serve something else) — it scores a prompt, too slow for every check."""
        await asyncio.to_thread(lambda: self.table)
        context = await self._model_context(replica)
        if replica.info is not None and replica.url in self.formats:
            return replica.info
        fmt = await self._probe_format(replica)
        known = self.formats.get(replica.url)
        self.formats[replica.url] = fmt
        if fmt != known and not fmt.ids_tokens and self.table.ambiguous:
            log.warning(
                "worker %s (%s) answers token strings: %d of %d ids share theirs with another (special tokens, partial "
                "UTF-8); their mass is attributed only at their own positions, else counted in the bound",
                self.name, replica.url, self.table.ambiguous, self.vocab_size,
            )
        return InfoResponse(
            protocol_version=PROTOCOL_VERSION, modes=[m.value for m in ENGINE_MODES],
            model_id=f"{self.model} (openai-logprobs)", vocab_size=self.vocab_size,
            tokenizer_fingerprint=self.expected.fingerprint, eos_ids=[], max_context=context, backend="openai-logprobs",
        )

    async def _model_context(self, replica: Replica) -> int:
        """``GET /v1/models``: the engine answers, and maybe says its context (vLLM's max_model_len)."""
        resp = await self.channel.request("GET", replica, "/v1/models")
        if resp.status_code != 200:
            raise status_failure(resp.status_code, resp.content, "/v1/models")
        try:
            models = orjson.loads(resp.content)["data"]
            served = {m["id"]: m for m in models}
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            raise ReplicaFailure("garbage", f"/v1/models at {replica.url} is not an OpenAI model list: {exc}") from exc
        length = served.get(self.model, {}).get("max_model_len")
        return self.max_context or (length if isinstance(length, int) and length > 0 else _UNLIMITED_CONTEXT)

    async def _probe_format(self, replica: Replica) -> EngineFormat:
        """Send a fixed chat as token ids, then as text; learn the format from the echo: which ids
        it names how, which it leaves out, and how it aligns logprobs with tokens — with and
        without the chat's first token (a BOS, for most chat templates)."""
        tokenizer = self.expected.tokenizer
        chat = list(tokenizer.apply_chat_template(_PROBE_MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False))
        last: ReplicaFailure | None = None
        for ids_prompt in (True, False):
            status, body = await self._complete(replica, [*chat, self._pad_for(chat, ids_prompt) or 0], ids_prompt, Traffic(), probe_call=True)
            if status != 200:
                last = status_failure(status, body, "/v1/completions")
                if status in (401, 403) or status > 500:  # down or locked: a text prompt fares no better
                    raise last
                continue  # llama-cpp-python answers a token-id prompt with echo by 500 or 422
            entries = parse_listing(body)
            ids_tokens = any(token_id(e.token) is not None for e in entries)
            fmt = EngineFormat(ids_prompt, ids_tokens, self._learn_unlisted(chat, entries, ids_tokens), ())
            shifts = {}
            for probe in (chat, chat[1:]):
                full = [*probe, self._pad_for(probe, ids_prompt) or 0]
                if probe is not chat:
                    status, body = await self._complete(replica, full, ids_prompt, Traffic(), probe_call=True)
                    if status != 200:
                        raise status_failure(status, body, "/v1/completions")
                    entries = parse_listing(body)
                shifts[bool(probe) and probe[0] in fmt.unlisted] = self._learn_shift(full, entries, fmt, body)
            return EngineFormat(ids_prompt, ids_tokens, fmt.unlisted, tuple(sorted(shifts.items())))
        assert last is not None
        raise ReplicaFailure(
            "rejected",
            f"{replica.url} answers no /v1/completions with echo + logprobs ({last}); vLLM and llama-cpp-python's "
            "server do, llama.cpp's llama-server does not",
        )

    def _learn_shift(self, full: list[int], entries: list[Entry], fmt: EngineFormat, body: bytes) -> int:
        """s = 0 when the generated token is listed after the prompt's (OpenAI's meaning); s = 1
        when it is not and the last entry's most likely token is the generated one."""
        listed = sum(t not in fmt.unlisted for t in full)
        if len(entries) == listed + 1:
            return 0
        top = entries[-1].top if len(entries) == listed else None
        try:
            generated = orjson.loads(body)["choices"][0]["text"][len(self.table.text(full)):]
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
            generated = None
        if top and generated is not None and plain(max(top, key=lambda k: top[k])) == plain(generated):
            return 1
        raise ReplicaFailure("garbage", f"echoed {len(entries)} entries for {listed} tokens: cannot tell which logprobs go with which token")

    def _learn_unlisted(self, probe: list[int], entries: list[Entry], ids_tokens: bool) -> frozenset[int]:
        """Walk the probe against the echo: ids the engine left out must be special, and always left out."""
        unlisted: set[int] = set()
        listed: set[int] = set()
        e = 0
        for token in probe:
            if e < len(entries) and self._same(token, entries[e].token, ids_tokens):
                listed.add(token)
                e += 1
            elif token in self.table.special:
                unlisted.add(token)
            else:
                shown = entries[e].token if e < len(entries) else "(nothing)"
                raise ReplicaFailure("fingerprint", f"tokenizes differently: the probe's token {token} came back as {shown!r}")
        if unlisted & listed:
            raise ReplicaFailure("fingerprint", f"lists tokens {sorted(unlisted & listed)} in one place and not in another")
        return frozenset(unlisted)

    def _same(self, token: int, text: str, ids_tokens: bool) -> bool:
        return token_id(text) == token if ids_tokens else self.table.matches(token, text)

    # ----------------------------------------------------------------- drafts it can score

    def scorable(self, sequence: list[int], draft: list[int]) -> int:
        """Draft tokens before the first one the engine leaves unlisted; for a text engine, the
        longest draft whose text, with a pad token after it, tokenises back to the same ids
        (drafts may stop anywhere: the stopping rule sees draft tokens only, so every mode
        stays what it was)."""
        formats = list(self.formats.values())
        if not formats:
            return len(draft)
        unlisted = self._unlisted()
        keep = next((j for j, t in enumerate(draft) if t in unlisted), len(draft))
        ids_prompt = all(f.ids_prompt for f in formats)
        while keep > 0 and self._pad_for([*sequence, *draft[:keep]], ids_prompt) is None:
            keep -= 1
        return keep

    def _pad_for(self, tokens: list[int], ids_prompt: bool) -> int | None:
        """The token sent after ``tokens``: for a text prompt, one after which the text reads back
        as ``tokens`` (text ending in whitespace reads differently before a special token than
        before a word), else None."""
        candidates = self._pads()
        if ids_prompt:
            return candidates[0]
        return next((pad for pad in candidates if self.table.round_trips([*tokens, pad])), None)

    def _pads(self) -> list[int]:
        """Candidates: EOS (a special token), then a letter, a full stop, a digit."""
        if self._pad_candidates is None:
            tokenizer = self.expected.tokenizer
            words = [tokenizer.encode(text, add_special_tokens=False) for text in ("A", ".", "0")]
            self._pad_candidates = [t for t in [tokenizer.eos_token_id, *(w[0] for w in words if len(w) == 1)] if t is not None]
        unlisted = self._unlisted()
        return [p for p in self._pad_candidates if p not in unlisted]

    def _unlisted(self) -> frozenset[int]:
        """Ids some replica of this engine leaves out of its listing."""
        return frozenset().union(*(f.unlisted for f in self.formats.values()))

    # ----------------------------------------------------------------- verify

    async def verify(self, replica: Replica, req: VerifyRequest, agreed: list[int], traffic: Traffic) -> VerifyResponse:
        if req.mode not in [m.value for m in ENGINE_MODES]:
            raise WorkerError(self.name, f"an openai-logprobs engine cannot verify in mode {req.mode!r}", 400)
        fmt = self.formats.get(replica.url)
        if fmt is None:  # checked before any call; a probe reset it since
            await self.info(replica)
            fmt = self.formats[replica.url]
        sequence = [*agreed[: req.prefix_len], *req.tokens.tolist()]
        draft = req.draft.tolist()
        if not sequence:
            raise WorkerError(self.name, "an engine cannot score the first token of an empty prompt", 400)
        pad = self._pad_for([*sequence, *draft], fmt.ids_prompt)
        if pad is None:  # scorable() cut the draft to where a pad exists: the sequence has none
            raise WorkerError(
                self.name, f"the text of the sequence does not tokenise back to its {len(sequence)} ids (it was sampled "
                "token by token): a text-only engine cannot score it; an engine that takes token-id prompts (vLLM) can",
            )
        full = [*sequence, *draft, pad]
        status, body = await self._complete(replica, full, fmt.ids_prompt, traffic, use_ids=fmt.ids_tokens)
        if status != 200:
            failure = status_failure(status, body, "/v1/completions")
            if failure.kind == "rejected":
                raise WorkerError(self.name, str(failure))
            raise failure
        rows = self._rows(parse_listing(body), full, len(sequence), fmt, greedy=req.temperature == 0)
        resp = self._response(rows, req, len(full) - 1)
        try:
            check_verify_response(resp, req, self.vocab_size)
        except ProtocolError as exc:
            raise ReplicaFailure("garbage", f"the engine's logprobs make no distribution: {exc}") from exc
        return resp

    async def _complete(
        self, replica: Replica, tokens: list[int], ids_prompt: bool, traffic: Traffic, use_ids: bool = True, probe_call: bool = False,
    ) -> tuple[int, bytes]:
        request: dict[str, Any] = {
            "model": self.model, "prompt": tokens if ids_prompt else self.table.text(tokens),
            "echo": True, "logprobs": self.top_k, "max_tokens": 1, "temperature": 0,
        }
        if use_ids:
            request["return_tokens_as_token_ids"] = True
        body = orjson.dumps(request)
        headers = {"content-type": "application/json"}
        if probe_call:  # not a round: no link emulation, no latency sample
            resp = await self.channel.request("POST", replica, "/v1/completions", content=body, headers=headers)
            return resp.status_code, resp.content
        return await self.channel.exchange(replica, "/v1/completions", body, headers, traffic)

    def _rows(self, entries: list[Entry], full: list[int], first: int, fmt: EngineFormat, greedy: bool) -> list[tuple[dict[int, float], float]]:
        """Logprobs by id at positions first … len(full) − 1 (the draft tokens, then the bonus
        position), after checking that the engine scored exactly ``full``."""
        shift = fmt.shift(full)
        if shift is None:
            raise WorkerError(self.name, f"the probe did not learn how the engine aligns prompts that start with token {full[0]}")
        listed = [i for i, t in enumerate(full) if t not in fmt.unlisted]
        if len(entries) not in (len(listed), len(listed) + 1 - shift):  # + the generated token, unless unlisted
            raise WorkerError(self.name, f"the engine echoed {len(entries)} tokens for the {len(listed)} it was sent: it tokenised the text differently")
        for n, index in enumerate(listed):
            if not self._same(full[index], entries[n].token, fmt.ids_tokens):
                raise WorkerError(
                    self.name,
                    f"the engine read token {index} as {entries[n].token!r}, the gateway has {full[index]} "
                    f"({self.table.strings[full[index]]!r}): text → ids does not round-trip; an engine that takes token-id prompts (vLLM) can serve this",
                )
        entry_of = {index: n for n, index in enumerate(listed)}
        rows = []
        for position in range(first, len(full)):
            source = position - shift  # the token whose entry holds p(· | full[:position])
            at = entry_of.get(source)
            entry = entries[at] if at is not None else None
            if entry is None or entry.top is None or entry.logprob is None:
                raise WorkerError(self.name, f"the engine's listing has no logprobs for position {position} (after token {full[source]})")
            rows.append(self._row(entry, full[source], fmt.ids_tokens, greedy))
        return rows

    def _row(self, entry: Entry, token: int, ids_tokens: bool, greedy: bool) -> tuple[dict[int, float], float]:
        """The alternatives the listing names for sure (logprobs by id), and a ceiling on the
        probability of any token it leaves out. A string several ids share names nobody: its
        mass is left out, and the ceiling rises to it; when the token at this position has such
        a string, a namesake's entry may have been overwritten by it, and the ceiling is σ.
        At T = 0 the named ones under the ceiling are dropped, so that the smallest kept one
        bounds every unseen token (certifying an argmax) — unless that would drop them all."""
        assert entry.top is not None and entry.logprob is not None
        row: dict[int, float] = {token: entry.logprob}
        unnamed = -math.inf
        for text, value in entry.top.items():
            tid = token_id(text) if ids_tokens else (token if self.table.matches(token, text) else self.table.id_of(text))
            if tid is None or not 0 <= tid < self.vocab_size:
                unnamed = max(unnamed, value)
            elif tid != token:
                row[tid] = value
        ceiling = math.exp(unnamed)
        if not ids_tokens and self.table.id_of(entry.token) != token:
            ceiling = max(ceiling, 1.0 - sum(math.exp(v) for v in row.values()))
        if greedy and ceiling > 0:
            kept = {t: v for t, v in row.items() if math.exp(v) >= ceiling}
            row = kept or row
        return row, ceiling

    def _response(self, rows: list[tuple[dict[int, float], float]], req: VerifyRequest, position: int) -> VerifyResponse:
        """T(p) on the top-k the rows share, as a worker would send it; or z_n ~ T(p̂) at T > 0
        in autoregressive (``position``: absolute index of the first row's token)."""
        params = SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p)
        first = position - len(req.draft)  # the absolute index of the token drawn at row 0
        rows = self._suppressed(rows, req, first)
        width = min([len(r) for r, _ in rows] + ([req.k] if req.k else []))
        ids, probs, tails = [], [], []
        for row, ceiling in rows:
            top = sorted(row.items(), key=lambda kv: (-kv[1], kv[0]))[:width]
            raw = torch.tensor([math.exp(v) for _, v in top], dtype=torch.float64)
            tempered = temper_top_k(raw, self.vocab_size, params, ceiling=max(ceiling, float(raw.min())))
            ids.append([t for t, _ in top])
            probs.append((tempered.probs * (1 - tempered.tail_bound)).numpy())
            tails.append(tempered.tail_bound)
        tail = np.asarray(tails, dtype=np.float32)
        model_ms = 0.0  # the engine does not say
        if req.mode == Mode.AUTOREGRESSIVE.value and req.temperature > 0:
            u = uniform(req.seed, req.choice, first, Purpose.WORKER_SAMPLE, req.worker)
            sample = ids[0][sample_index(torch.from_numpy(probs[0]).double(), u)]
            samples = np.array([sample], dtype=np.int32)
            if not req.return_probs:
                return VerifyResponse(held=position, samples=samples, tail_mass=tail, model_ms=model_ms)
        else:
            samples = None
        return VerifyResponse(
            held=position, ids=np.asarray(ids, dtype=np.int64), probs=np.stack(probs).astype(np.float32),
            tail_mass=tail, recon_error=tail, samples=samples, model_ms=model_ms,
        )

    def _suppressed(self, rows: list[tuple[dict[int, float], float]], req: VerifyRequest, first: int) -> list[tuple[dict[int, float], float]]:
        """min_tokens, in vLLM's order: the rows before it without EOS, before temperature, top-k
        and top-p are applied to what is left (``_response``) — as the engine would had it masked
        EOS itself. The removed mass counts as tail, which only loosens the bound. (An engine
        carries no other transform: the service refuses those with a 400.)"""
        spec = TransformSpec.from_wire(req.transform) if req.transform is not None else None
        if spec is None or not spec.suppresses:
            return rows
        ids, generated = frozenset(spec.eos_ids), first - spec.prompt_len
        out = []
        for r, (row, ceiling) in enumerate(rows):
            if generated + r < spec.min_tokens:
                row = {t: v for t, v in row.items() if t not in ids}
                if not row:
                    raise WorkerError(self.name, f"the engine listed only EOS at position {first + r}: min_tokens needs a larger logprobs in its entry")
            out.append((row, ceiling))
        return out

    async def free(self, replica: Replica, session_id: str) -> None:
        """Engines hold no session of ours."""
