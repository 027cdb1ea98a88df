"""A freeform tool's Lark grammar written out as one regex (core.freeform): what each construct becomes, checked by
matching (Python's re and llguidance's regexes agree on this subset), and the grammars it refuses, by name."""

from __future__ import annotations

import re

import pytest

from core.freeform import GrammarError, freeform_pattern, lark_to_regex

GRAMMAR = '''
start: greeting (SEP name)~1..2 [PUNCT]
     | "bye"i
greeting: "hi" | "hello" -> hello
name: /[a-z]+/ NUMBER?
SEP: ", "
PUNCT.2: "!" | "?"
%import common.NUMBER
'''


@pytest.mark.parametrize("text, matches", [
    ("hi, bob", True), ("hello, bob, al!", True), ("hi, bob7?", True), ("BYE", True), ("Bye", True),
    ("hi", False), ("hi, bob, al, cy", False), ("hi,bob", False), ("hi, Bob", False), ("bye!", False),
])
def test_each_construct_means_what_lark_means(text: str, matches: bool) -> None:
    assert bool(re.fullmatch(freeform_pattern("lark", GRAMMAR), text)) is matches


def test_a_regex_format_is_anchored() -> None:
    assert re.fullmatch(freeform_pattern("regex", r"\d+"), "42") and not re.fullmatch(freeform_pattern("regex", r"\d+"), "a42")


@pytest.mark.parametrize("grammar, says", [
    ('start: item\nitem: "(" item ")" | "x"', "recursive (item → item)"),
    ('start: a\na: b\nb: "x" a', "recursive (a → b → a)"),
    ('start: "x" WS\n%import common.NOPE', "only common's"),
    ('start: "x"\n%ignore " "', "%ignore is not supported"),
    ('item: "x"', "no start rule"),
    ('start: missing', "does not define"),
    ('start: "x" ]', "where a definition starts"),
    ('start: "x" &', "cannot be read"),
])
def test_what_cannot_be_written_out_is_said(grammar: str, says: str) -> None:
    with pytest.raises(GrammarError, match=re.escape(says)):
        lark_to_regex(grammar)
