"""Existing engines as targets (docs/design.md §8): the prompt logprobs of ``sequence + draft + [pad]``
(``pad`` makes the γ+1-th distribution a prompt entry too); T(p) on their top-k, the tail bounded. A probe
learns how the engine reads and writes (``EngineFormat``); echoed tokens that differ from ours are an error,
never a guess; a string several ids share counts only where it is the token there, else in the bound."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import numpy as np
import orjson
import torch

from app.targets.channel import Channel, Expected, Replica, Traffic
from app.targets.engine_listing import EngineFormat, Entry, TokenTable, parse_listing, plain, token_id
from app.targets.failures import ReplicaFailure, WorkerError, refused, status_failure
from core.config import WorkerEntry
from core.errors import ProtocolError
from core.math.random import Purpose, sample_index, uniform
from core.math.sampling import SamplingParams
from core.math.tempering import temper_top_k
from core.modes import SAMPLE, modes_where, scoring_of
from core.protocol import PROTOCOL_VERSION, InfoResponse, VerifyRequest, VerifyResponse, check_verify_response
from core.runners.tokenizer import per_tokenizer
from core.transform import TransformSpec

log = logging.getLogger(__name__)

_UNLIMITED_CONTEXT = 1 << 30  # an engine that does not say how long its context is
_PROBE_MESSAGES = [  # short (an engine may score prompts slowly), with turn markers and non-ASCII text
    {"role": "system", "content": "Hi"},
    {"role": "user", "content": "naïve café, 42!"},
]


class EngineDialect:
    """An OpenAI-compatible engine as a target: no sessions, ``/v1/models`` plus a probe instead of
    ``/v1/info``."""

    health_path: str | None = None  # not every engine has /health: the check itself is the probe
    is_openai_logprobs = True

    def __init__(self, name: str, channel: Channel, expected: Expected, entry: WorkerEntry) -> None:
        assert entry.model is not None and expected.tokenizer is not None
        self.name, self.channel, self.expected, self.vocab_size = name, channel, expected, expected.vocab_size
        self.model, self.top_k, self.max_context = entry.model, entry.logprobs, entry.max_context
        self.formats: dict[str, EngineFormat] = {}  # by replica URL, once probed
        self._table: TokenTable | None = None
        words = [expected.tokenizer.encode(text, add_special_tokens=False) for text in ("A", ".", "0")]
        # what may follow the draft: EOS (a special token), then a letter, a full stop, a digit
        self.pads = [
            t
            for t in [expected.tokenizer.eos_token_id, *(w[0] for w in words if len(w) == 1)]
            if t is not None
        ]

    @property
    def table(self) -> TokenTable:
        if self._table is None:
            # on first use: it decodes every id once (~1 s), once per tokenizer in a process
            self._table = per_tokenizer(
                self.expected.tokenizer,
                ("token table", self.vocab_size),
                lambda: TokenTable(self.expected.tokenizer, self.vocab_size),
            )
            if self._table.ambiguous:
                log.info(
                    "worker %s: %d token ids share their string with another",
                    self.name,
                    self._table.ambiguous,
                )
        return self._table

    async def info(self, replica: Replica) -> InfoResponse:
        """``/v1/models``; the probe too the first time and after the circuit opened (it scores a prompt: too
        slow for every check)."""
        await asyncio.to_thread(lambda: self.table)
        context = await self._model_context(replica)
        if replica.info is not None and replica.url in self.formats:
            return replica.info
        fmt = await self._probe_format(replica)
        known = self.formats.get(replica.url)
        self.formats[replica.url] = fmt
        if fmt != known and not fmt.ids_tokens and self.table.ambiguous:
            log.warning(
                "worker %s (%s) answers token strings: %d of %d ids share theirs with another "
                "(special tokens, partial "
                "UTF-8); their mass is attributed only at their own positions, else counted in the bound",
                self.name,
                replica.url,
                self.table.ambiguous,
                self.vocab_size,
            )
        return InfoResponse(
            protocol_version=PROTOCOL_VERSION,
            modes=[str(m) for m in modes_where("openai_logprobs")],
            model_id=f"{self.model} (openai-logprobs)",
            vocab_size=self.vocab_size,
            tokenizer_fingerprint=self.expected.fingerprint,
            eos_ids=[],
            max_context=context,
            backend="openai-logprobs",
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
            raise ReplicaFailure(
                "garbage", f"/v1/models at {replica.url} is not an OpenAI model list: {exc}"
            ) from exc
        length = served.get(self.model, {}).get("max_model_len")
        return self.max_context or (length if isinstance(length, int) and length > 0 else _UNLIMITED_CONTEXT)

    async def _probe_format(self, replica: Replica) -> EngineFormat:
        """A fixed chat as token ids, then as text; the format from the echo, with and without the chat's
        first token (a BOS)."""
        tokenizer = self.expected.tokenizer
        chat = list(
            tokenizer.apply_chat_template(
                _PROBE_MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        last: ReplicaFailure | None = None
        for ids_prompt in (True, False):
            full = [*chat, self._pad_for(chat, ids_prompt) or 0]
            status, body = await self._complete(replica, full, ids_prompt, None)
            if status != 200:
                last = status_failure(status, body, "/v1/completions")
                if status in (401, 403) or status > 500:  # down or locked: a text prompt fares no better
                    raise last
                continue  # llama-cpp-python answers a token-id prompt with echo by 500 or 422
            entries = parse_listing(body)
            ids_tokens = any(token_id(e.token) is not None for e in entries)
            fmt = EngineFormat(ids_prompt, ids_tokens, self._learn_unlisted(chat, entries, ids_tokens), ())
            shifts = {bool(chat) and chat[0] in fmt.unlisted: self._learn_shift(full, entries, fmt, body)}
            short = [*chat[1:], self._pad_for(chat[1:], ids_prompt) or 0]  # without the chat's first token
            status, body = await self._complete(replica, short, ids_prompt, None)
            if status != 200:
                raise status_failure(status, body, "/v1/completions")
            shifts[bool(chat[1:]) and chat[1] in fmt.unlisted] = self._learn_shift(
                short, parse_listing(body), fmt, body
            )
            return EngineFormat(ids_prompt, ids_tokens, fmt.unlisted, tuple(sorted(shifts.items())))
        assert last is not None
        raise ReplicaFailure(
            "rejected",
            f"{replica.url} answers no /v1/completions with echo + logprobs ({last}); vLLM and "
            "llama-cpp-python's "
            "server do, llama.cpp's llama-server does not",
        )

    def _learn_shift(self, full: list[int], entries: list[Entry], fmt: EngineFormat, body: bytes) -> int:
        """s = 0 when the generated token is listed after the prompt's; 1 when the last entry's top one is the
        generated one."""
        listed = sum(t not in fmt.unlisted for t in full)
        if len(entries) == listed + 1:
            return 0
        top = entries[-1].top if len(entries) == listed else None
        try:
            generated = orjson.loads(body)["choices"][0]["text"][len(self.table.text(full)) :]
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
            generated = None
        if top and generated is not None and plain(max(top, key=lambda k: top[k])) == plain(generated):
            return 1
        raise ReplicaFailure(
            "garbage",
            f"echoed {len(entries)} entries for {listed} tokens: cannot tell which logprobs go "
            "with which token",
        )

    def _learn_unlisted(self, probe: list[int], entries: list[Entry], ids_tokens: bool) -> frozenset[int]:
        """Walk the probe against the echo: ids the engine left out must be special, and always left out."""
        unlisted, listed, e = set[int](), set[int](), 0
        for token in probe:
            if e < len(entries) and self._same(token, entries[e].token, ids_tokens):
                listed.add(token)
                e += 1
            elif token in self.table.special:
                unlisted.add(token)
            else:
                shown = entries[e].token if e < len(entries) else "(nothing)"
                raise ReplicaFailure(
                    "fingerprint", f"tokenizes differently: the probe's token {token} came back as {shown!r}"
                )
        if unlisted & listed:
            raise ReplicaFailure(
                "fingerprint", f"lists tokens {sorted(unlisted & listed)} in one place and not in another"
            )
        return frozenset(unlisted)

    def _same(self, token: int, text: str, ids_tokens: bool) -> bool:
        return token_id(text) == token if ids_tokens else self.table.matches(token, text)

    def scorable(self, sequence: list[int], draft: list[int]) -> int:
        """Draft tokens before the first unlisted one; for a text engine, the longest draft whose text + a pad
        tokenises back to its ids."""
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
        """The token sent after ``tokens``: for a text prompt, one after which the text reads back as
        ``tokens``, else None."""
        unlisted = self._unlisted()
        candidates = [p for p in self.pads if p not in unlisted]
        if ids_prompt:
            return candidates[0]
        return next((pad for pad in candidates if self.table.round_trips([*tokens, pad])), None)

    def _unlisted(self) -> frozenset[int]:
        return frozenset().union(*(f.unlisted for f in self.formats.values()))

    async def verify(
        self, replica: Replica, req: VerifyRequest, agreed: list[int], traffic: Traffic
    ) -> VerifyResponse:
        if req.mode not in modes_where("openai_logprobs"):
            raise WorkerError(self.name, f"an openai-logprobs engine cannot verify in mode {req.mode!r}", 400)
        if replica.url not in self.formats:  # checked before any call; a probe reset it since
            await self.info(replica)
        fmt = self.formats[replica.url]
        sequence = [*agreed[: req.prefix_len], *req.tokens.tolist()]
        draft = req.draft.tolist()
        if not sequence:
            raise WorkerError(self.name, "an engine cannot score the first token of an empty prompt", 400)
        pad = self._pad_for([*sequence, *draft], fmt.ids_prompt)
        if pad is None:  # scorable() cut the draft to where a pad exists: the sequence has none
            raise WorkerError(
                self.name,
                f"the text of the sequence does not tokenise back to its {len(sequence)} ids (it was sampled "
                "token by token): a text-only engine cannot score it; an engine that takes "
                "token-id prompts (vLLM) can",
            )
        full = [*sequence, *draft, pad]
        status, body = await self._complete(replica, full, fmt.ids_prompt, traffic, use_ids=fmt.ids_tokens)
        if status != 200:
            raise refused(self.name, status_failure(status, body, "/v1/completions"))
        rows = self._rows(parse_listing(body), full, len(sequence), fmt, greedy=req.temperature == 0)
        resp = self._response(rows, req, len(full) - 1)
        try:
            check_verify_response(resp, req, self.vocab_size)
        except ProtocolError as exc:
            raise ReplicaFailure("garbage", f"the engine's logprobs make no distribution: {exc}") from exc
        return resp

    async def _complete(
        self,
        replica: Replica,
        tokens: list[int],
        ids_prompt: bool,
        traffic: Traffic | None,
        use_ids: bool = True,
    ) -> tuple[int, bytes]:
        request: dict[str, Any] = {
            "model": self.model,
            "prompt": tokens if ids_prompt else self.table.text(tokens),
            "echo": True,
            "logprobs": self.top_k,
            "max_tokens": 1,
            "temperature": 0,
        }
        if use_ids:
            request["return_tokens_as_token_ids"] = True
        body = orjson.dumps(request)
        headers = {"content-type": "application/json"}
        if traffic is None:  # a probe, not a round: no link emulation, no latency sample
            resp = await self.channel.request(
                "POST", replica, "/v1/completions", content=body, headers=headers
            )
            return resp.status_code, resp.content
        return await self.channel.exchange(replica, "/v1/completions", body, headers, traffic)

    def _rows(
        self, entries: list[Entry], full: list[int], first: int, fmt: EngineFormat, greedy: bool
    ) -> list[tuple[dict[int, float], float]]:
        """Logprobs by id at positions first … len(full) − 1, after checking that the engine scored exactly
        ``full``."""
        shift = fmt.shift(full)
        if shift is None:
            raise WorkerError(
                self.name,
                f"the probe did not learn how the engine aligns prompts that start with token {full[0]}",
            )
        listed = [i for i, t in enumerate(full) if t not in fmt.unlisted]
        if len(entries) not in (len(listed), len(listed) + 1 - shift):
            # + the generated token, unless unlisted
            raise WorkerError(
                self.name,
                f"the engine echoed {len(entries)} tokens for the {len(listed)} it was sent: it "
                "tokenised the text differently",
            )
        for n, index in enumerate(listed):
            if not self._same(full[index], entries[n].token, fmt.ids_tokens):
                raise WorkerError(
                    self.name,
                    f"the engine read token {index} as {entries[n].token!r}, the gateway has {full[index]} "
                    f"({self.table.strings[full[index]]!r}): text → ids does not round-trip; an "
                    "engine that takes token-id prompts (vLLM) can serve this",
                )
        entry_of = {index: n for n, index in enumerate(listed)}
        rows = []
        for position in range(first, len(full)):
            source = position - shift  # the token whose entry holds p(· | full[:position])
            entry = entries[entry_of[source]] if source in entry_of else None
            if entry is None or entry.top is None or entry.logprob is None:
                raise WorkerError(
                    self.name,
                    f"the engine's listing has no logprobs for position {position} (after token "
                    f"{full[source]})",
                )
            rows.append(self._row(entry, full[source], fmt.ids_tokens, greedy))
        return rows

    def _row(
        self, entry: Entry, token: int, ids_tokens: bool, greedy: bool
    ) -> tuple[dict[int, float], float]:
        """The alternatives the listing names for sure (logprobs by id), and a ceiling on the probability
        of any token it leaves out: a string several ids share names nobody, so its mass raises the
        ceiling (to σ when the token here has one: it may have overwritten a namesake's entry). At
        T = 0 the named ones under the ceiling go, so the smallest kept one bounds every unseen token."""
        assert entry.top is not None and entry.logprob is not None
        row: dict[int, float] = {token: entry.logprob}
        unnamed = -math.inf
        for text, value in entry.top.items():
            tid = (
                token_id(text)
                if ids_tokens
                else (token if self.table.matches(token, text) else self.table.id_of(text))
            )
            if tid is None or not 0 <= tid < self.vocab_size:
                unnamed = max(unnamed, value)
            elif tid != token:
                row[tid] = value
        ceiling = math.exp(unnamed)
        if not ids_tokens and self.table.id_of(entry.token) != token:
            ceiling = max(ceiling, 1.0 - sum(math.exp(v) for v in row.values()))
        if greedy and ceiling > 0:
            row = {t: v for t, v in row.items() if math.exp(v) >= ceiling} or row
        return row, ceiling

    def _response(
        self, rows: list[tuple[dict[int, float], float]], req: VerifyRequest, position: int
    ) -> VerifyResponse:
        """T(p) on the top-k the rows share, as a worker would send it; or z_n ~ T(p̂) at T > 0 in
        autoregressive."""
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
        tail, samples = np.asarray(tails, dtype=np.float32), None  # model_ms stays 0: the engine does not say
        if scoring_of(req.mode, req.temperature > 0) == SAMPLE:
            u = uniform(req.seed, req.choice, first, Purpose.WORKER_SAMPLE, req.worker)
            samples = np.array([ids[0][sample_index(torch.from_numpy(probs[0]).double(), u)]], dtype=np.int32)
            if not req.return_probs:
                return VerifyResponse(held=position, samples=samples, tail_mass=tail)
        return VerifyResponse(
            held=position,
            ids=np.asarray(ids, dtype=np.int64),
            probs=np.stack(probs).astype(np.float32),
            tail_mass=tail,
            recon_error=tail,
            samples=samples,
        )

    def _suppressed(
        self, rows: list[tuple[dict[int, float], float]], req: VerifyRequest, first: int
    ) -> list[tuple[dict[int, float], float]]:
        """min_tokens as vLLM orders it (before T, top-k, top-p): no EOS in the rows before it, its mass in
        the tail; no other transform."""
        spec = TransformSpec.from_wire(req.transform) if req.transform is not None else None
        if spec is None or not spec.suppresses:
            return rows
        ids, generated = frozenset(spec.eos_ids), first - spec.prompt_len
        out = []
        for r, (row, ceiling) in enumerate(rows):
            if generated + r < spec.min_tokens:
                row = {t: v for t, v in row.items() if t not in ids}
                if not row:
                    raise WorkerError(
                        self.name,
                        f"the engine listed only EOS at position {first + r}: min_tokens needs a "
                        "larger logprobs in its entry",
                    )
            out.append((row, ceiling))
        return out

    async def free(self, replica: Replica, session_id: str) -> None:
        """Engines hold no session of ours."""
