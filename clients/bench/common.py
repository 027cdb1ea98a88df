"""What every benchmark does with its figures: progress on stderr, JSON on request."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def write_json(path: str | None, results: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(results, indent=2))
        progress(f"wrote {path}")
