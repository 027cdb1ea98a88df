"""``python scripts/config_docs.py > docs/configuration.md``: the page generated from the settings models
(each key's type, default, environment variable and its ``Field(description=...)``), so it cannot drift (a
test checks it)."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from core.config import SpecgateConfig  # noqa: E402
from workers.settings import WorkerSettings  # noqa: E402

HEADER = """# Configuration

Generated from `core/config.py` and `workers/settings.py` by `python scripts/config_docs.py`;
a test fails when this page and the code disagree.

The gateway (`specgate gateway`, `specgate serve`) reads YAML (`--config FILE`) and the
environment: `SPECGATE_<KEY>` for a top-level key, `SPECGATE_<SECTION>__<KEY>` inside a section
(e.g. `SPECGATE_SPECULATIVE__MODE=autoregressive`), JSON for lists (`SPECGATE_WORKERS='[…]'`).
The environment wins over the file. Without `--config` the built-in default is used
(`config/builtin.yaml`). A bad key or value stops start-up with a message naming it.

`SPECGATE_PLUGINS` (comma-separated module names) is imported by the gateway and every worker before
anything else is read: a mode, a drafter or a tool format it registers may then be named here
(docs/design.md §3, "How to add a mode").
"""


def render() -> str:
    parts = [HEADER, "## Gateway\n", _table(SpecgateConfig, "SPECGATE_")]
    parts += [
        "\n## Worker\n",
        "`specgate worker` flags override these; the environment overrides the defaults.\n",
        _table(WorkerSettings, "SPECGATE_WORKER_"),
    ]
    return "\n".join(parts)


def _table(model: type[BaseModel], env: str) -> str:
    return (
        "\n".join(
            [
                "| key | type | default | environment | meaning |",
                "| --- | --- | --- | --- | --- |",
                *_rows(model, "", env),
            ]
        )
        + "\n"
    )


def _rows(model: type[BaseModel], prefix: str, env: str | None) -> list[str]:
    """One row per key; sections recurse; list items (workers) are described inside their list."""
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        var = f"`{env}{name.upper()}`" if env is not None else "(in the list)"
        args = get_args(field.annotation)
        section = next((arg for arg in (field.annotation, *args) if _is_model(arg)), None)
        item = args[0] if get_origin(field.annotation) is list and _is_model(args[0]) else None
        if section is not None and item is None:
            rows += _rows(section, f"{key}.", f"{env}{name.upper()}__" if env is not None else None)
            continue
        rows.append(
            f"| `{key}` | {_type(field.annotation)} | {_default(field)} | {var} | {_meaning(field)} |"
        )
        if item is not None:
            rows += _rows(item, f"{key}[].", None)
    return rows


def _meaning(field: FieldInfo) -> str:
    """A key's ``Field(description=...)``, escaped for a table cell."""
    return (field.description or "").replace("|", "\\|")


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _type(annotation: Any) -> str:
    if get_origin(annotation) in (Union, types.UnionType):
        return " \\| ".join(_type(a) for a in get_args(annotation))
    if get_origin(annotation) is list:
        return f"list of {_type(get_args(annotation)[0])}"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and hasattr(annotation, "__members__"):  # an enum
        return " \\| ".join(f"`{m.value}`" for m in annotation)  # type: ignore[attr-defined]
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        return "`[]`" if field.default_factory() == [] else "(section)"  # type: ignore[call-arg]
    if field.default is PydanticUndefined:
        return "required"
    return "`null`" if field.default is None else f"`{getattr(field.default, 'value', field.default)}`"


if __name__ == "__main__":
    sys.stdout.write(render())
