"""The grammar engine (llguidance) over the built-in model's real tokenizer: compiling and its
cache, the errors a bad grammar gets, and a matcher's walk (consume, mask, dead ends, rollback)."""

from __future__ import annotations

import json

import pytest
import torch

from core.grammar import GrammarError, GrammarKind, GrammarLimits, Grammars, GrammarSpec, strict
from core.runners.models import resolve_model
from core.runners.tokenizer import load_tokenizer

V = 49152
EOS = 2  # <|im_end|>


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return load_tokenizer(resolve_model("builtin"))


@pytest.fixture(scope="module")
def grammars(tokenizer) -> Grammars:  # type: ignore[no-untyped-def]
    return Grammars(tokenizer, V, [EOS], GrammarLimits(max_source_bytes=4096))


SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 4}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


def test_a_schema_walks_to_its_end_and_then_allows_only_eos(grammars: Grammars, tokenizer) -> None:  # type: ignore[no-untyped-def]
    matcher = grammars.compile(GrammarSpec.json_schema(SCHEMA)).matcher()
    tokens = tokenizer.encode('{"a":12,"b":"xy"}')
    for token in tokens:
        allowed = matcher.allowed()
        assert allowed[token] and not allowed[EOS]
        assert matcher.consume(token)
    end = matcher.allowed()
    assert end.nonzero().flatten().tolist() == [EOS]
    assert matcher.consume(EOS)


def test_only_a_single_allowed_token_is_forced(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """At a complete answer the grammar allows only EOS: one EOS id is forced; with two (the
    built-in model's 0 and 2) none is — each target weighs them its own way, and the token id
    and its log-probability show which (a round decides)."""
    from core.transform import LogitsTransform, TransformSpec

    done = tokenizer.encode('{"a":1,"b":""}')
    for eos_ids, forced in (([EOS], EOS), ([0, EOS], None)):
        grammars = Grammars(tokenizer, V, eos_ids, GrammarLimits(max_source_bytes=4096))
        transformer = LogitsTransform.build(
            TransformSpec(grammar=GrammarSpec.json_schema(SCHEMA)), V, grammars
        )
        assert transformer.forced(done) == forced
        assert transformer.forced_run(done, 4, set(eos_ids)) == ([] if forced is None else [EOS])


def test_properties_keep_their_order_and_json_is_compact(grammars: Grammars, tokenizer) -> None:  # type: ignore[no-untyped-def]
    matcher = grammars.compile(GrammarSpec.json_schema(SCHEMA)).matcher()
    matcher.sync(tokenizer.encode('{"'))
    allowed = matcher.allowed().nonzero().flatten().tolist()
    assert [tokenizer.decode([t]) for t in allowed] == ["a"]  # "a" first (the schema's order), forced
    matcher.sync(tokenizer.encode('{"a":1'))
    assert not matcher.allowed()[tokenizer.encode(" ")[0]]  # no whitespace


def test_a_refused_token_is_a_dead_end_that_rollback_revives(grammars: Grammars, tokenizer) -> None:  # type: ignore[no-untyped-def]
    matcher = grammars.compile(GrammarSpec.json_schema(SCHEMA)).matcher()
    start = matcher.allowed()
    bad = int((~start).nonzero()[0, 0])
    assert not matcher.consume(bad) and matcher.is_dead
    assert matcher.allowed().nonzero().flatten().tolist() == [EOS]  # ends the answer, no hang
    assert not matcher.consume(tokenizer.encode("{")[0])  # still dead
    matcher.rollback(2)
    assert not matcher.is_dead and torch.equal(matcher.allowed(), start)


def test_sync_rolls_back_to_the_common_prefix(grammars: Grammars, tokenizer) -> None:  # type: ignore[no-untyped-def]
    spec = GrammarSpec(GrammarKind.CHOICE, json.dumps(["yes please", "no thanks"]))
    matcher = grammars.compile(spec).matcher()
    yes, no = tokenizer.encode("yes please"), tokenizer.encode("no thanks")
    matcher.sync(yes)
    assert matcher.allowed().nonzero().flatten().tolist() == [EOS]
    matcher.sync(no[:1])
    fresh = grammars.compile(spec).matcher()
    fresh.sync(no[:1])
    assert matcher.tokens == no[:1] and torch.equal(matcher.allowed(), fresh.allowed())


def test_compiled_grammars_are_cached_by_content(grammars: Grammars) -> None:
    before = grammars.num_compiled
    spec = GrammarSpec(GrammarKind.REGEX, r"[0-9]{3}-[a-z]+")
    grammars.compile(spec)
    grammars.compile(GrammarSpec(GrammarKind.REGEX, r"[0-9]{3}-[a-z]+"))
    assert grammars.num_compiled == before + 1
    assert spec.digest != GrammarSpec(GrammarKind.GRAMMAR, spec.source).digest


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (GrammarSpec(GrammarKind.REGEX, "(("), "regex does not compile"),
        (GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type": "nope"}'), "json_schema does not compile"),
        (GrammarSpec(GrammarKind.JSON_SCHEMA, "not json"), "json_schema does not compile"),
        (GrammarSpec(GrammarKind.GRAMMAR, "start: undefined_rule"), "grammar does not compile"),
        (GrammarSpec(GrammarKind.REGEX, "a" * 5000), "the limit is 4096"),
    ],
)
def test_a_bad_grammar_says_what_is_wrong(grammars: Grammars, spec: GrammarSpec, says: str) -> None:
    with pytest.raises(GrammarError, match=says):
        grammars.compile(spec)


def test_the_wire_form_round_trips_and_rejects_garbage() -> None:
    spec = GrammarSpec(GrammarKind.CHOICE, '["a"]')
    assert GrammarSpec.from_wire(spec.to_wire()) == spec
    for bad in ({"kind": "lisp", "source": "x"}, {"kind": "regex"}, "regex", {"kind": "regex", "source": 3}):
        with pytest.raises(GrammarError):
            GrammarSpec.from_wire(bad)


def test_rollback_over_eos_and_a_refused_token(grammars: Grammars, tokenizer) -> None:  # type: ignore[no-untyped-def]
    spec = GrammarSpec(GrammarKind.CHOICE, json.dumps(["no"]))
    matcher = grammars.compile(spec).matcher()
    tokens = tokenizer.encode("no")
    before = matcher.allowed()
    for token in tokens:
        matcher.consume(token)
    assert matcher.consume(EOS) and not matcher.is_dead
    assert matcher.allowed().nonzero().flatten().tolist() == [EOS]
    matcher.rollback(len(tokens) + 1)  # the draft's path, EOS included, given back
    assert matcher.tokens == [] and torch.equal(matcher.allowed(), before)
    assert not matcher.consume(EOS) and matcher.is_dead  # EOS before the grammar may end: refused
    matcher.rollback(1)
    assert torch.equal(matcher.allowed(), before)


def test_objects_with_properties_take_no_others_unless_the_schema_says_so(
    grammars: Grammars, tokenizer
) -> None:  # type: ignore[no-untyped-def]
    from core.grammar import strict

    schema = {
        "type": "object",
        "properties": {"properties": {"type": "object", "properties": {"x": {"const": {"properties": 1}}}}},
        "$defs": {"d": {"properties": {}}},
    }
    assert strict(schema) == {
        "type": "object",
        "additionalProperties": False,
        "$defs": {"d": {"properties": {}, "additionalProperties": False}},
        "properties": {
            "properties": {
                "type": "object",
                "properties": {"x": {"const": {"properties": 1}}},
                "additionalProperties": False,
            }
        },
    }
    assert (
        strict({"type": "object"}) == {"type": "object"}
        and strict({"properties": {}, "additionalProperties": True})["additionalProperties"] is True
    )
    matcher = grammars.compile(
        GrammarSpec.json_schema(
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        )
    ).matcher()
    matcher.sync(tokenizer.encode('{"a":1'))
    assert not matcher.allowed()[tokenizer.encode(",")[0]]  # no second key


def test_a_freeform_tools_grammar_holds_the_string_a_call_carries(grammars: Grammars, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Issue 75: a custom tool's Lark grammar, written out as one regex (core.freeform), is the ``pattern`` of
    the JSON string its call carries: llguidance holds every decoded character to it (escapes included), and
    refuses a string the grammar does not make, token by token."""
    from core.freeform import freeform_pattern

    lark = (
        'start: "*** Begin Patch" LF ("*** Add File: " /(.+)/ LF ("+" /(.*)/ LF)+)+ "*** End Patch" '
        "LF?\n%import common.LF\n"
    )
    schema = {
        "type": "object",
        "properties": {"input": {"type": "string", "x-freeform": {"syntax": "lark", "definition": lark}}},
        "required": ["input"],
    }
    assert strict(schema)["properties"]["input"] == {
        "type": "string",
        "pattern": freeform_pattern("lark", lark),
    }
    compiled = grammars.compile(GrammarSpec.json_schema(schema))

    def walk(text: str) -> bool:
        matcher = compiled.matcher()
        return all(
            matcher.consume(token)
            for token in tokenizer.encode(json.dumps({"input": text}, separators=(",", ":")))
        ) and bool(matcher.allowed()[EOS])

    assert walk('*** Begin Patch\n*** Add File: a "b".txt\n+tab\there \\ ok\n*** End Patch\n')
    assert not walk("*** Begin Patch\n*** End Patch\n")  # no file
    assert not walk("rm -rf /")
