"""A freeform tool's Lark grammar written out as one regex (core.freeform): what each construct becomes,
checked by matching (Python's re and llguidance's regexes agree on this subset), and the grammars it refuses,
by name."""

from __future__ import annotations

import re

import pytest

from core.freeform import GrammarError, freeform_pattern, lark_to_regex

GRAMMAR = """
start: greeting (SEP name)~1..2 [PUNCT]
     | "bye"i
greeting: "hi" | "hello" -> hello
name: /[a-z]+/ NUMBER?
SEP: ", "
PUNCT.2: "!" | "?"
%import common.NUMBER
"""


@pytest.mark.parametrize(
    "text, matches",
    [
        ("hi, bob", True),
        ("hello, bob, al!", True),
        ("hi, bob7?", True),
        ("BYE", True),
        ("Bye", True),
        ("hi", False),
        ("hi, bob, al, cy", False),
        ("hi,bob", False),
        ("hi, Bob", False),
        ("bye!", False),
    ],
)
def test_each_construct_means_what_lark_means(text: str, matches: bool) -> None:
    assert bool(re.fullmatch(freeform_pattern("lark", GRAMMAR), text)) is matches


def test_a_regex_format_is_anchored_and_cannot_break_out_of_its_group() -> None:
    assert re.fullmatch(freeform_pattern("regex", r"\d+"), "42") and not re.fullmatch(
        freeform_pattern("regex", r"\d+"), "a42"
    )
    for broken in ("a)|(b", "(a", "[a", "[[a](])|(b[[c])]", "[[x](]a)|b\\"):
        # the last two: nested classes, a lone backslash
        with pytest.raises(GrammarError):
            freeform_pattern("regex", broken)
    # brackets in a class and escaped are themselves
    assert re.fullmatch(freeform_pattern("regex", r"[)(]\("), ")(")


@pytest.mark.parametrize(
    "grammar, text, matches",
    [
        # "?" right before a name applies to what precedes it
        ('start: "-"?DIGIT+\n%import common.DIGIT', "12", True),
        ('start: SIGN?INT\nSIGN: "+" | "-"\n%import common.INT', "7", True),
        ('?start: "x"', "x", True),  # "?" before a definition's name shapes Lark's tree, nothing else
        ('start: "\\b"', "\\b", True),  # an escape Lark does not read stays as written
        ('start: "\\x41\\n"', "A\n", True),
        # no raw newline inside, as Lark's
        ("start: ESCAPED_STRING\n%import common.ESCAPED_STRING", '"a\nb"', False),
    ],
)
def test_what_the_counter_example_hunt_found_stays_fixed(grammar: str, text: str, matches: bool) -> None:
    assert bool(re.fullmatch(freeform_pattern("lark", grammar), text)) is matches


@pytest.mark.parametrize(
    "grammar, says",
    [
        ('start: item\nitem: "(" item ")" | "x"', "recursive (item → item)"),
        ('start: a\na: b\nb: "x" a', "recursive (a → b → a)"),
        ('start: "x" WS\n%import common.NOPE', "only common's"),
        ('start: "x"\n%ignore " "', "%ignore is not supported"),
        ('item: "x"', "no start rule"),
        ("start: missing", "does not define"),
        ('start: "x" ]', "where a definition starts"),
        ('start: "x" &', "cannot be read"),
        ("start: " + "(" * 1200 + '"a"' + ")" * 1200, "nests too deeply"),
        # 300 bytes that double 24 times
        (
            'start: r24\nr0: "ab"\n' + "\n".join(f"r{i}: r{i - 1} r{i - 1}" for i in range(1, 25)),
            "passes 256 KiB",
        ),
        ("start: /a)|(b/", "closes a group it never opened"),
        ("start: /[ a]+/x", "verbose flag"),
        # Rust nests classes: those parens are outside them
        ("start: /[[a](][[a](]))|((b[[c])][[c])]/", "closes a group"),
    ],
)
def test_what_cannot_be_written_out_is_said(grammar: str, says: str) -> None:
    with pytest.raises(GrammarError, match=re.escape(says)):
        lark_to_regex(grammar)
