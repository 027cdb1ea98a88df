"""The tools a coding agent brings that are not plain functions, as functions the model can call, and their
calls back in their own item types:

- a ``custom`` (freeform) tool takes one string: the function's one parameter ``input``, held to the tool's
  grammar (a
  Lark or regex format becomes that string's ``pattern``: core.freeform); its call is a ``custom_tool_call``
  item;
- the client-run tools ``local_shell``, ``shell`` and ``apply_patch`` take the arguments of their item's
  action or
  operation; their calls are ``local_shell_call``, ``shell_call`` and ``apply_patch_call`` items, which the
  client runs;
- a namespaced tool is offered as ``<namespace>__<name>`` and called back with the two apart.

Items sent back in ``input`` become the same calls again (``as_call``) and their outputs tool messages
(``output_text``), so the model reads its own earlier calls as it wrote them."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from app.errors import ApiError
from core.freeform import GrammarError, freeform_pattern
from core.grammar import FREEFORM

INPUT = "input"  # a freeform tool's one parameter
_NOT_A_NAME = re.compile(r"[^A-Za-z0-9_-]")

# tool type → (the function's description, its parameters)
CLIENT_FUNCTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "local_shell": (
        "Runs a command on the user's machine and returns its output. Give the command as argv "
        "(for a shell line: "
        '["bash", "-lc", "…"]).',
        {
            "type": "object",
            "properties": {
                "command": {"type": "array", "items": {"type": "string"}, "minItems": 1},
                "workdir": {"type": "string"},
                "timeout_ms": {"type": "integer", "minimum": 1},
            },
            "required": ["command"],
            "additionalProperties": False,
        },
    ),
    "shell": (
        "Runs shell commands on the user's machine, one after another, and returns their output.",
        {
            "type": "object",
            "properties": {
                "commands": {"type": "array", "items": {"type": "string"}, "minItems": 1},
                "timeout_ms": {"type": "integer", "minimum": 1},
            },
            "required": ["commands"],
            "additionalProperties": False,
        },
    ),
    "apply_patch": (
        "Creates, updates or deletes one file on the user's machine. The diff is in the V4A "
        "format, without line numbers: "
        "for a new file, each line of it prefixed with '+'; for an update, hunks that each start "
        "with '@@ ' and a line "
        "near the change, then the lines around it prefixed with ' ', the removed ones with '-' "
        "and the added ones with '+'.",
        {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "type": {"const": kind},
                        "path": {"type": "string", "minLength": 1},
                        "diff": {"type": "string", "minLength": 1},
                    },
                    "required": ["type", "path", "diff"],
                    "additionalProperties": False,
                }
                for kind in ("create_file", "update_file")
            ]
            + [
                {
                    "type": "object",
                    "properties": {
                        "type": {"const": "delete_file"},
                        "path": {"type": "string", "minLength": 1},
                    },
                    "required": ["type", "path"],
                    "additionalProperties": False,
                }
            ],
        },
    ),
}
CALL_ITEMS = {"local_shell": "local_shell_call", "shell": "shell_call", "apply_patch": "apply_patch_call"}
ITEM_PREFIX = {"function": "fc", "custom": "ctc", "local_shell": "lsh", "shell": "sh", "apply_patch": "apc"}


@dataclass(frozen=True)
class Offer:
    """What a function offered to the model stands for: its tool's type, name and namespace."""

    kind: str  # function | custom | local_shell | shell | apply_patch
    name: str
    namespace: str | None = None


def qualified(namespace: str | None, name: str) -> str:
    """The function name a (namespaced) tool is offered under: ``<namespace>__<name>`` within OpenAI's 64
    characters."""
    if namespace is None:
        return name
    full = _NOT_A_NAME.sub("_", f"{namespace}__{name}")
    return full if len(full) <= 64 else f"{full[:55]}_{hashlib.sha256(full.encode()).hexdigest()[:8]}"


def custom_function(name: str, description: str | None, fmt: Any, path: str) -> dict[str, Any]:
    """A freeform tool as a function of one string: its grammar, if it has one, as the string's pattern."""
    text: dict[str, Any] = {"type": "string"}
    about = "Its input is one string: the tool's input as it is, not JSON."
    if fmt is not None and fmt.type == "grammar":
        try:
            freeform_pattern(fmt.syntax, fmt.definition)  # refused here, by the field, if it cannot be held
        except GrammarError as exc:
            raise ApiError(400, f"{path}.format: {exc}", f"{path}.format.definition") from None
        # core.grammar.strict makes it the pattern
        text[FREEFORM] = {"syntax": fmt.syntax, "definition": fmt.definition}
        about = (
            f"Its input is one string, as it is (not JSON), that follows the {fmt.syntax} grammar in "
            f"{FREEFORM}."
        )
    parameters = {
        "type": "object",
        "properties": {INPUT: text},
        "required": [INPUT],
        "additionalProperties": False,
    }
    return {
        "name": name,
        "description": f"{description}\n\n{about}" if description else about,
        "parameters": parameters,
    }


def client_function(kind: str) -> dict[str, Any]:
    description, parameters = CLIENT_FUNCTIONS[kind]
    return {"name": kind, "description": description, "parameters": parameters}


def call_item(offer: Offer, item_id: str, call_id: str, arguments: str, status: str) -> dict[str, Any]:
    """The output item of a finished call of a client-run tool (its arguments parsed; where they are cut
    short, empty)."""
    try:
        args = json.loads(arguments)
    except ValueError:
        args = {}
    args = args if isinstance(args, dict) else {}
    item: dict[str, Any] = {
        "id": item_id,
        "type": CALL_ITEMS[offer.kind],
        "call_id": call_id,
        "status": status,
    }
    if offer.kind == "local_shell":
        action: dict[str, Any] = {"type": "exec", "command": args.get("command", []), "env": {}}
        for given, field in (("workdir", "working_directory"), ("timeout_ms", "timeout_ms")):
            if given in args:
                action[field] = args[given]
        item["action"] = action
    elif offer.kind == "shell":
        item["action"] = {
            "commands": args.get("commands", []),
            "timeout_ms": args.get("timeout_ms"),
            "max_output_length": None,
        }
        item["environment"] = None
    else:
        operation = {"type": args.get("type", "update_file"), "path": args.get("path", "")}
        if operation["type"] != "delete_file":
            operation["diff"] = args.get("diff", "")
        item["operation"] = operation
    return item


def as_call(item: dict[str, Any]) -> tuple[str, str, str] | None:
    """A client-run tool's call sent back, as (call id, function name, arguments); None for an output item."""
    kind = item["type"]
    call_id = item.get("call_id") or item.get("id") or ""
    if kind == "local_shell_call":
        action = item.get("action") or {}
        args = {"command": action.get("command", [])}
        args |= {"workdir": action["working_directory"]} if action.get("working_directory") else {}
        args |= {"timeout_ms": action["timeout_ms"]} if action.get("timeout_ms") else {}
        return call_id, "local_shell", _compact(args)
    if kind == "shell_call":
        action = item.get("action") or {}
        args = {"commands": action.get("commands", [])} | (
            {"timeout_ms": action["timeout_ms"]} if action.get("timeout_ms") else {}
        )
        return call_id, "shell", _compact(args)
    if kind == "apply_patch_call":
        return call_id, "apply_patch", _compact(item.get("operation") or {})
    return None


def output_text(item: dict[str, Any]) -> str:
    """A client-run tool's output sent back, as the text of its tool message."""
    output = item.get("output")
    if item["type"] == "shell_call_output" and isinstance(output, list):
        parts = []
        for chunk in output:
            outcome = chunk.get("outcome") or {}
            end = (
                f"(exit code {outcome.get('exit_code')})" if outcome.get("type") == "exit" else "(timed out)"
            )
            parts.append("".join(text for text in (chunk.get("stdout"), chunk.get("stderr")) if text) + end)
        return "\n".join(parts)
    if item["type"] == "apply_patch_call_output":
        return output if isinstance(output, str) and output else str(item.get("status", ""))
    return output if isinstance(output, str) else _compact(output)


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
