"""A plug-in, whole, in one file: the toy mode ``first-choice`` (its row and its strategy) and the toy tool
format ``bracketed``, registered when the file is imported (``SPECGATE_PLUGINS=tests.app.toy_plugin``);
tests/app/test_mode_plugin.py serves them end to end."""

from __future__ import annotations

from app.engine.round import Round, array
from app.engine.spec import RoundResult
from app.engine.strategies import STRATEGIES, RoundStrategy
from app.tool_formats import CallStyle
from app.tool_formats.base import register as register_format
from app.tool_formats.json_calls import JsonCallFormat
from core.modes import ROWS, ModeSpec, Payload, register

TOY = "first-choice"


class FirstChoice(RoundStrategy):
    """The draft kept while it is the worker's top-1 at each position, then the worker's top-1 (one worker,
    T = 0: greedy decoding's tokens, on a one-id row a position)."""

    async def verify(self, rnd: Round) -> RoundResult:
        (resp,) = await rnd.call(mode=TOY, k=1)
        top = array(resp.ids)[:, 0].tolist()
        draft = rnd.draft.ids()
        accepted = next((j for j, token in enumerate(draft) if token != top[j]), len(draft))
        return RoundResult(
            [*draft[:accepted], top[accepted]], drafted=len(draft), accepted=accepted, traffic=rnd.traffic
        )


@register_format
class Bracketed(JsonCallFormat):
    """``[[call]]{"name": …, "args": …}[[/call]]``, one call an answer."""

    name = "bracketed"
    style = CallStyle("[[call]]", ("",), "args", None, "[[/call]]")

    def detects(self, template: str) -> bool:
        return False


# a top-1 row a position: bounded, not lossless, as the usage block says
FIELDS = frozenset({"mode", "profile", "num_draft_tokens", "drafter"})
MODE = register(ModeSpec(TOY, FIELDS, frozenset({Payload.TOP_K}), strategy=TOY, scoring=(ROWS, ROWS)))
STRATEGIES[TOY] = FirstChoice()
