"""Grammars (docs/design.md §3.9): the one place that talks to llguidance (chosen over xgrammar: ``specgate
bench grammar``). ``GrammarSpec``: a grammar by value; ``Grammars``: compiled once per content; ``Matcher``:
one session's position."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch

from core.freeform import freeform_pattern

# llguidance's JSON compiler: "," and ":" with no whitespace
JSON_OPTIONS: Any = {"whitespace_flexible": False}
# levels of nesting a schema may have (each walk of it recurses; the engine's own parser stops at 128)
MAX_JSON_DEPTH = 64


class GrammarKind(StrEnum):
    JSON_SCHEMA = "json_schema"  # source: the schema as JSON text
    REGEX = "regex"  # source: a regular expression (Rust regex syntax)
    CHOICE = "choice"  # source: a JSON list of the strings allowed
    GRAMMAR = "grammar"  # source: a Lark or GBNF grammar


def engine_version() -> str:
    """The grammar engine and its version: gateway and workers must mask alike (``/v1/info``)."""
    from importlib.metadata import version

    return f"llguidance {version('llguidance')}"


class GrammarError(ValueError):
    """A grammar the engine cannot compile, or one over the limits; the message says which."""


@dataclass(frozen=True)
class GrammarSpec:
    """A grammar by value: what travels to a worker once per session."""

    kind: GrammarKind
    source: str

    @property
    def digest(self) -> str:
        """The content hash the compiled grammars are cached by."""
        return hashlib.sha256(f"{self.kind.value}\0{self.source}".encode()).hexdigest()[:32]

    def to_wire(self) -> dict[str, str]:
        return {"kind": self.kind.value, "source": self.source}

    @classmethod
    def from_wire(cls, value: Any) -> GrammarSpec:
        if (
            not isinstance(value, dict)
            or set(value) != {"kind", "source"}
            or not isinstance(value["source"], str)
        ):
            raise GrammarError("a grammar is {kind, source}")
        try:
            return cls(GrammarKind(value["kind"]), value["source"])
        except ValueError:
            raise GrammarError(
                f"unknown grammar kind {value['kind']!r}: one of {[k.value for k in GrammarKind]}"
            ) from None

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool) -> GrammarSpec:
        """A schema, compactly serialised (its properties keep their order: the output's)."""
        return cls(GrammarKind.JSON_SCHEMA, json.dumps(schema, separators=(",", ":")))


@dataclass(frozen=True)
class GrammarLimits:
    """What one grammar may cost (config ``limits``); over them, a GrammarError."""

    max_source_bytes: int = 64 * 1024
    lexer_fuel: int = 1_000_000  # llguidance's initial lexer fuel (~50k per ms): bounds compile time
    step_fuel: int = 200_000  # per-mask lexer fuel (~14k per ms): bounds one row's mask time
    max_grammar_size: int = 500_000  # symbols in the grammar's productions

    def __post_init__(self) -> None:
        if min(self.max_source_bytes, self.lexer_fuel, self.step_fuel, self.max_grammar_size) <= 0:
            raise ValueError("grammar limits must be > 0")


class Grammars:
    """Compiled grammars for one tokenizer, cached by content (LRU of ``cache_size``)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_ids: list[int],
        limits: GrammarLimits | None = None,
        cache_size: int = 64,
    ) -> None:
        import llguidance.hf

        from core.runners.tokenizer import per_tokenizer

        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.limits = limits or GrammarLimits()
        self._tokenizer = per_tokenizer(
            tokenizer,
            ("llguidance", vocab_size, *self.eos_ids),
            lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=self.eos_ids),
        )
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # compiled on worker threads and the model thread
        self.num_compiled = 0

    def compile(self, spec: GrammarSpec) -> Grammar:
        """The compiled grammar of ``spec`` (from the cache when seen); GrammarError if it does not
        compile."""
        with self._lock:
            cached = self._cache.get(spec.digest)
            if cached is not None:
                self._cache.move_to_end(spec.digest)
                return Grammar(cached, self.vocab_size, self.eos_ids)
        template = self._build(spec)
        with self._lock:
            self._cache[spec.digest] = template
            self.num_compiled += 1
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return Grammar(template, self.vocab_size, self.eos_ids)

    def _build(self, spec: GrammarSpec) -> Any:
        import llguidance

        if len(spec.source.encode()) > self.limits.max_source_bytes:
            raise GrammarError(
                f"the {spec.kind.value} is {len(spec.source.encode())} bytes; the limit is "
                f"{self.limits.max_source_bytes}"
            )
        try:
            if spec.kind is GrammarKind.JSON_SCHEMA:
                # compact JSON, as OpenAI's: the separators are then forced tokens
                text = llguidance.LLMatcher.grammar_from_json_schema(
                    json.dumps(strict(load_schema(spec.source))), defaults=JSON_OPTIONS
                )
            else:
                text = llguidance.grammar_from(spec.kind.value, spec.source)  # type: ignore[arg-type]  # a GrammarKind is one of its formats
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"the {spec.kind.value} does not compile: {exc}") from exc
        limits = llguidance.LLParserLimits(
            initial_lexer_fuel=self.limits.lexer_fuel,
            step_lexer_fuel=self.limits.step_fuel,
            max_grammar_size=self.limits.max_grammar_size,
        )
        error = llguidance.LLMatcher.validate_grammar(text, self._tokenizer, limits=limits)
        if error and not error.startswith("WARNING"):
            raise GrammarError(f"the {spec.kind.value} does not compile: {_first_line(error)}")
        matcher = llguidance.LLMatcher(self._tokenizer, text, log_level=0, limits=limits)
        if matcher.is_error():
            raise GrammarError(f"the {spec.kind.value} does not compile: {_first_line(matcher.get_error())}")
        return matcher


@dataclass(frozen=True)
class Grammar:
    """One compiled grammar; ``matcher()`` starts a session's walk through it."""

    template: Any
    vocab_size: int
    eos_ids: list[int]

    def matcher(self) -> Matcher:
        return Matcher(self.template.deep_copy(), self.vocab_size, self.eos_ids)


class Matcher:
    """A position in a grammar; a token it does not allow makes it dead (``is_dead``: only EOS allowed, so an
    answer ends), a rollback revives it."""

    def __init__(self, engine: Any, vocab_size: int, eos_ids: list[int]) -> None:
        self._engine = engine
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.tokens: list[int] = []  # consumed, oldest first
        # len(tokens) when EOS or a refused token came: the engine holds the tokens before it
        self._stop_at: int | None = None
        # that token was one the grammar does not allow (a dead end), not EOS where it may end
        self._refused = False
        self._bits = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
        self._shifts = torch.arange(32, dtype=torch.int32)

    @property
    def is_dead(self) -> bool:
        return self._stop_at is not None and self._refused

    def consume(self, token: int) -> bool:
        """Advance by ``token``; False (and dead) if not allowed. Refused tokens and EOS never reach the
        engine (its error is for good, EOS not undone)."""
        if self._stop_at is None:
            if token in self.eos_ids:
                self._stop_at, self._refused = len(self.tokens), not self._engine.is_accepting()
            elif not (self._engine.validate_tokens([token]) == 1 and self._engine.consume_token(token)):
                self._stop_at, self._refused = len(self.tokens), True
        self.tokens.append(token)
        return not self.is_dead

    def rollback(self, count: int) -> None:
        """Forget the last ``count`` tokens consumed."""
        keep = len(self.tokens) - min(max(count, 0), len(self.tokens))
        in_engine = len(self.tokens) if self._stop_at is None else self._stop_at
        steps = in_engine - min(keep, in_engine)
        if steps and not self._engine.rollback(steps):
            self._replay(min(keep, in_engine))  # the engine's history is shorter than ours: start over
        if self._stop_at is not None and keep <= self._stop_at:
            self._stop_at, self._refused = None, False
        del self.tokens[keep:]

    def _replay(self, count: int) -> None:
        """Reset the engine and consume our first ``count`` tokens again (all were allowed)."""
        self._engine.reset()
        for token in self.tokens[:count]:
            if not self._engine.consume_token(token):
                raise RuntimeError(
                    f"the grammar engine refused a token it had taken: {self._engine.get_error()}"
                )

    def sync(self, tokens: list[int]) -> None:
        """Make the consumed tokens equal ``tokens``: roll back to the common prefix, consume the rest."""
        common = next(
            (i for i, (held, wanted) in enumerate(zip(self.tokens, tokens)) if held != wanted),
            min(len(self.tokens), len(tokens)),
        )
        self.rollback(len(self.tokens) - common)
        for token in tokens[common:]:
            self.consume(token)

    def allowed(self) -> torch.Tensor:  # [V] bool: the tokens the grammar allows next (EOS where it may end)
        if self._stop_at is not None or self._engine.is_error():
            return self._eos_only()
        self._engine.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        mask = ((self._bits[0, :, None] >> self._shifts) & 1).bool().flatten()[: self.vocab_size]
        return mask if bool(mask.any()) else self._eos_only()

    def _eos_only(self) -> torch.Tensor:
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[self.eos_ids] = True
        return mask


# specgate's keyword on a string schema: {"syntax": "lark" | "regex", "definition": …}, held as its pattern
FREEFORM = "x-freeform"
# keyword → {name: schema}
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def strict(schema: Any) -> Any:
    """OpenAI's strict mode (xgrammar's and vLLM's default): objects with ``properties`` take no others unless
    said so, or a small model invents keys."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: strict(sub) for name, sub in value.items()}
        elif key in ("const", "enum", "default", "examples"):
            out[key] = value  # values, not schemas
        else:
            out[key] = strict(value)
    if "properties" in out and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    freeform = out.pop(FREEFORM, None)
    if isinstance(freeform, dict):
        # a freeform tool's input: its grammar as the string's pattern (the prompt shows the grammar)
        out["pattern"] = freeform_pattern(str(freeform.get("syntax")), str(freeform.get("definition", "")))
    return out


def json_depth(value: Any) -> int:
    """Levels of nesting of a JSON value (a scalar: 0), without recursion: no value is too deep to measure."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            deepest = max(deepest, depth)
            continue
        deepest = max(deepest, depth + 1)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def load_schema(source: str) -> Any:
    """A schema given as JSON text, within MAX_JSON_DEPTH; GrammarError (a ValueError) otherwise."""
    try:
        schema = json.loads(source)
    except RecursionError:
        raise GrammarError(
            f"the json_schema is nested too deeply; at most {MAX_JSON_DEPTH} levels are allowed"
        ) from None
    except ValueError as exc:
        raise GrammarError(f"the json_schema is not valid JSON: {exc}") from None
    depth = json_depth(schema)
    if depth > MAX_JSON_DEPTH:
        raise GrammarError(
            f"the json_schema is nested {depth} levels deep; at most {MAX_JSON_DEPTH} are allowed"
        )
    return schema


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "unknown error"
