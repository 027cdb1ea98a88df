"""A freeform tool's grammar as one regular expression over its input (the Responses API's ``custom`` tools,
whose ``format`` is a Lark grammar or a regex): what a JSON string's ``pattern`` holds, so the call can travel
as a JSON string inside any tool format and llguidance still holds every character of it to the grammar.

A Lark grammar becomes a regex by writing every rule and terminal in place. That is exact for the grammars
that need no recursion (a coding agent's ``apply_patch`` is one); a recursive grammar is a ``GrammarError`` (a
ValueError) naming the rule."""

from __future__ import annotations

import re
from dataclasses import dataclass

COMMON = {  # %import common.NAME: Lark's own definitions (lark/grammars/common.lark), as regexes
    "LF": r"\n",
    "CR": r"\r",
    "NEWLINE": r"(?:\r?\n)+",
    "WS": r"[ \t\f\r\n]+",
    "WS_INLINE": r"[ \t]+",
    "DIGIT": r"[0-9]",
    "HEXDIGIT": r"[a-fA-F0-9]",
    "INT": r"[0-9]+",
    "SIGNED_INT": r"[+-]?[0-9]+",
    "DECIMAL": r"(?:[0-9]+\.[0-9]*|\.[0-9]+)",
    "NUMBER": r"(?:[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|\.[0-9]+(?:[eE][+-]?[0-9]+)?)",
    "SIGNED_NUMBER": r"[+-]?(?:[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|\.[0-9]+(?:[eE][+-]?[0-9]+)?)",
    "LCASE_LETTER": r"[a-z]",
    "UCASE_LETTER": r"[A-Z]",
    "LETTER": r"[A-Za-z]",
    "WORD": r"[A-Za-z]+",
    "CNAME": r"[_A-Za-z][_A-Za-z0-9]*",
    "ESCAPED_STRING": r'"(?:\\.|[^"\\\n])*"',
    "SH_COMMENT": r"#[^\n]*",
    "CPP_COMMENT": r"//[^\n]*",
    "C_COMMENT": r"/\*(?s:.)*?\*/",
}
_TOKEN = re.compile(
    r"""
    (?P<space>[ \t\f\r]+|//[^\n]*|\#[^\n]*)
  | (?P<newline>\n)
  | (?P<string>"(?:\\.|[^"\\\n])*"i?)
  | (?P<regex>/(?:\\.|[^/\\\n])+/[imsux]*)
  | (?P<directive>%[a-z]+)
  | (?P<arrow>->)
  | (?P<range>\.\.)
  | (?P<name>_?[A-Za-z][A-Za-z0-9_]*(?:\.[A-Za-z][A-Za-z0-9_]*)*)
  | (?P<priority>\.-?[0-9]+)
  | (?P<number>[0-9]+)
  | (?P<punct>[:|()\[\]?*+~!])
""",
    re.VERBOSE,
)


class GrammarError(ValueError):
    """A freeform grammar this module cannot write out (core.grammar's compile reports it as its own
    GrammarError)."""


_META = frozenset(r"\.+*?()|[]{}^$#&-~")


# a grammar written out past this is refused (rules used twice double it at each level)
MAX_REGEX_BYTES = 256 * 1024


def freeform_pattern(syntax: str, definition: str) -> str:
    """The anchored regex a freeform input must match: a ``regex`` format as given, a ``lark`` one written
    out."""
    if syntax == "regex":
        _check_regex(definition, "the regex")
        return f"^(?:{definition})$"
    if syntax == "lark":
        return f"^(?:{lark_to_regex(definition)})$"
    raise GrammarError(f"a grammar's syntax is lark or regex, not {syntax!r}")


def lark_to_regex(grammar: str) -> str:
    """``grammar`` (Lark: rules, terminals, strings, regexes, groups, ``[]``, ``?*+``, ``~ n`` / ``~ n..m``,
    aliases, ``%import common.X``) as one regex from its ``start`` rule."""
    try:
        definitions = _Parser(grammar).parse()
        if "start" not in definitions:
            raise GrammarError("the Lark grammar has no start rule")
        return _Writer(definitions).write("start")
    except RecursionError:
        raise GrammarError("the Lark grammar nests too deeply") from None


def _check_regex(regex: str, what: str) -> None:
    """A regex whose groups and classes close (so it cannot break out of the group it is put in), in Rust's
    syntax as far as that goes (no verbose mode, whose spaces Rust and Python read apart)."""
    depth, at, classes = 0, 0, 0  # classes: how deep in classes (Rust nests them: [a[bc]], [[:alpha:]])
    while at < len(regex):
        ch = regex[at]
        if ch == "\\":
            if at + 1 == len(regex):
                raise GrammarError(f"{what} ends in a lone backslash")
            at += 2
            continue
        if ch == "[":
            classes += 1
            at += 1
            if regex[at : at + 1] == "^":
                at += 1
            if regex[at : at + 1] == "]":  # a ] first in a class is itself
                at += 1
            continue
        if classes:
            classes -= ch == "]"
        elif ch == "(":
            depth += 1
            if re.match(r"\(\?[a-zA-Z-]*x[a-zA-Z-]*[:)]", regex[at:]):
                raise GrammarError(f"{what} uses the verbose flag x, which is not supported")
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise GrammarError(f"{what} closes a group it never opened: {regex[: at + 1]!r}")
        at += 1
    if depth or classes:
        raise GrammarError(f"{what} leaves a group or a class open: {regex!r}")


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "\\": "\\", '"': '"'}


def _literal(token: str) -> str:
    """A Lark string's text: \\n, \\t, \\r, \\\\, quotes, \\xHH and \\uHHHH read as Lark reads them; any other
    escape kept as written."""
    body, out, at = token[1:-1], [], 0
    while at < len(body):
        ch = body[at]
        if ch != "\\" or at + 1 == len(body):
            out.append(ch)
            at += 1
            continue
        code = body[at + 1]
        width = {"x": 2, "u": 4, "U": 8}.get(code, 0)
        digits = body[at + 2 : at + 2 + width]
        if width and len(digits) == width and all(c in "0123456789abcdefABCDEF" for c in digits):
            out.append(chr(int(digits, 16)))
            at += 2 + width
        elif code in _ESCAPES:
            out.append(_ESCAPES[code])
            at += 2
        else:
            out.append(body[at : at + 2])
            at += 2
    return "".join(out)


@dataclass
class _Token:
    kind: str
    text: str
    line: int


class _Parser:
    """Lark's definitions, each as an expression tree: ("alt", [...]), ("seq", [...]), ("rep", node, lo, hi),
    ("lit", text), ("re", regex), ("ref", name)."""

    def __init__(self, grammar: str) -> None:
        self.tokens = list(self._lex(grammar))
        self.at = 0

    def _lex(self, grammar: str) -> list[_Token]:
        tokens, at, line = [], 0, 1
        while at < len(grammar):
            match = _TOKEN.match(grammar, at)
            if match is None:
                raise GrammarError(
                    f"the Lark grammar cannot be read at line {line}: {grammar[at : at + 20]!r}"
                )
            kind = match.lastgroup or ""
            if kind == "newline":
                line += 1
            if kind != "space":
                tokens.append(_Token(kind, match.group(), line))
            at = match.end()
        tokens.append(_Token("newline", "\n", line))
        return tokens

    def _peek(self, offset: int = 0) -> _Token | None:
        return self.tokens[self.at + offset] if self.at + offset < len(self.tokens) else None

    def _next(self) -> _Token:
        token = self._peek()
        if token is None:
            raise GrammarError("the Lark grammar ends in the middle of a definition")
        self.at += 1
        return token

    def parse(self) -> dict[str, tuple]:
        definitions: dict[str, tuple] = {}
        while self._peek() is not None:
            token = self._next()
            if token.kind == "newline":
                continue
            if token.kind == "directive":
                self._directive(token, definitions)
                continue
            if token.text in ("?", "!") and self._peek() is not None and self._peek().kind == "name":  # type: ignore[union-attr]  # ?rule / !rule: how the tree is shaped
                token = self._next()
            if token.kind != "name":
                raise GrammarError(
                    f"the Lark grammar has {token.text!r} where a definition starts (line {token.line})"
                )
            name = token.text
            if self._peek() is not None and self._peek().kind == "priority":  # type: ignore[union-attr]
                self._next()
            if self._next().kind != "punct" or self.tokens[self.at - 1].text != ":":
                raise GrammarError(f"the Lark grammar's {name} is not followed by ':' (line {token.line})")
            if name in definitions:
                raise GrammarError(f"the Lark grammar defines {name} twice")
            definitions[name] = self._alternatives()
        return definitions

    def _directive(self, token: _Token, definitions: dict[str, tuple]) -> None:
        if token.text != "%import":
            raise GrammarError(
                f"the Lark grammar's {token.text} is not supported in a freeform tool (line {token.line})"
            )
        path = self._next().text
        alias = None
        if self._peek() is not None and self._peek().kind == "arrow":  # type: ignore[union-attr]
            self._next()
            alias = self._next().text
        module, _, name = path.rpartition(".")
        if module != "common" or name not in COMMON:
            raise GrammarError(
                f"the Lark grammar imports {path}: only common's {', '.join(sorted(COMMON))} are known"
            )
        definitions[alias or name] = ("re", COMMON[name])

    def _alternatives(self) -> tuple:
        options = [self._sequence()]
        while True:
            token = self._peek()
            if token is not None and token.kind == "newline":
                # a definition goes on where the next line starts with "|"
                after = self._after_newlines()
                if after is not None and after.text == "|":
                    while self._next().kind == "newline":
                        pass
                    options.append(self._sequence())
                    continue
                return options[0] if len(options) == 1 else ("alt", options)
            if token is not None and token.text == "|":
                self._next()
                options.append(self._sequence())
                continue
            return options[0] if len(options) == 1 else ("alt", options)

    def _after_newlines(self) -> _Token | None:
        offset = 0
        while (token := self._peek(offset)) is not None and token.kind == "newline":
            offset += 1
        return self._peek(offset)

    def _sequence(self) -> tuple:
        items = []
        while (
            (token := self._peek()) is not None
            and token.kind not in ("newline",)
            and token.text not in ("|", ")", "]")
        ):
            if token.kind == "arrow":  # an alias names the tree's node: nothing in the text
                self._next()
                self._next()
                continue
            items.append(self._repeated())
        return items[0] if len(items) == 1 else ("seq", items)

    def _repeated(self) -> tuple:
        node = self._atom()
        while (token := self._peek()) is not None and token.text in ("?", "*", "+", "~"):
            self._next()
            if token.text == "~":
                low = int(self._expect("number").text)
                high = low
                if self._peek() is not None and self._peek().kind == "range":  # type: ignore[union-attr]
                    self._next()
                    high = int(self._expect("number").text)
                node = ("rep", node, low, high)
            else:
                node = ("rep", node, 0 if token.text != "+" else 1, 1 if token.text == "?" else None)
        return node

    def _expect(self, kind: str) -> _Token:
        token = self._next()
        if token.kind != kind:
            raise GrammarError(
                f"the Lark grammar has {token.text!r} where a {kind} belongs (line {token.line})"
            )
        return token

    def _atom(self) -> tuple:
        token = self._next()
        if token.text in ("(", "["):
            inner = self._alternatives_inside()
            close = self._next()
            if close.text != {"(": ")", "[": "]"}[token.text]:
                raise GrammarError(f"the Lark grammar's {token.text} is not closed (line {token.line})")
            return inner if token.text == "(" else ("rep", inner, 0, 1)
        if token.kind == "string":
            insensitive = token.text.endswith("i")
            text = _literal(token.text[:-1] if insensitive else token.text)
            return ("re", f"(?i:{_escape(text)})") if insensitive else ("lit", text)
        if token.kind == "regex":
            body, _, flags = token.text[1:].rpartition("/")
            if "x" in flags:
                raise GrammarError(
                    f"the Lark grammar's regex {token.text} uses the verbose flag x, which is "
                    f"not supported (line {token.line})"
                )
            _check_regex(body, f"the Lark grammar's regex {token.text} (line {token.line})")
            return ("re", f"(?{flags}:{body})" if flags else body)
        if token.kind == "name":
            return ("ref", token.text)
        raise GrammarError(
            f"the Lark grammar has {token.text!r} where a rule, a terminal or a string belongs "
            f"(line {token.line})"
        )

    def _alternatives_inside(self) -> tuple:
        """Inside brackets, newlines are spaces."""
        options = [self._inside_sequence()]
        while (token := self._peek()) is not None and token.text == "|":
            self._next()
            options.append(self._inside_sequence())
        return options[0] if len(options) == 1 else ("alt", options)

    def _inside_sequence(self) -> tuple:
        while (token := self._peek()) is not None and token.kind == "newline":
            self._next()
        node = self._sequence()
        while (token := self._peek()) is not None and token.kind == "newline":
            self._next()
        return node


class _Writer:
    def __init__(self, definitions: dict[str, tuple]) -> None:
        self.definitions = definitions
        self.written: dict[str, str] = {}
        self.open: list[str] = []

    def write(self, name: str) -> str:
        if name in self.written:
            return self.written[name]
        if name in self.open:
            raise GrammarError(
                f"the Lark grammar's {name} is recursive "
                f"({' → '.join([*self.open[self.open.index(name) :], name])}): "
                "a freeform tool's grammar here must be regular"
            )
        if name not in self.definitions:
            raise GrammarError(f"the Lark grammar uses {name}, which it does not define")
        self.open.append(name)
        self.written[name] = self._node(self.definitions[name])
        self.open.pop()
        if len(self.written[name]) > MAX_REGEX_BYTES:
            raise GrammarError(
                f"the Lark grammar written out as one regex passes {MAX_REGEX_BYTES // 1024} KiB "
                f"at {name}: use each rule fewer times"
            )
        return self.written[name]

    def _node(self, node: tuple) -> str:
        kind = node[0]
        if kind == "lit":
            return _escape(node[1])
        if kind == "re":
            return f"(?:{node[1]})"
        if kind == "ref":
            return f"(?:{self.write(node[1])})"
        if kind in ("seq", "alt"):
            parts, size = [], 0
            for child in node[1]:
                parts.append(self._node(child))
                size += len(parts[-1])
                if size > MAX_REGEX_BYTES:
                    raise GrammarError(
                        "the Lark grammar written out as one regex passes "
                        f"{MAX_REGEX_BYTES // 1024} KiB: use each rule fewer times"
                    )
            return "".join(parts) if kind == "seq" else "(?:" + "|".join(parts) + ")"
        inner, low, high = self._node(node[1]), node[2], node[3]
        suffix = {(0, 1): "?", (0, None): "*", (1, None): "+"}.get(
            (low, high), f"{{{low},{'' if high is None else high}}}"
        )
        return f"(?:{inner}){suffix}"


def _escape(text: str) -> str:
    """A literal as a regex (Rust's syntax: only its metacharacters escaped; a newline as ``\\n``)."""
    out = []
    for ch in text:
        if ch in _META:
            out.append("\\" + ch)
        elif ch == "\n":
            out.append(r"\n")
        elif ch == "\t":
            out.append(r"\t")
        elif ch == "\r":
            out.append(r"\r")
        else:
            out.append(ch)
    return "".join(out)
