"""llama.cpp helpers that load no model: its log level, and its own quantizer (for the built-in
requantizations)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from core.cores import usable_cores
from core.errors import ModelLoadError


def quiet_llama_cpp() -> None:
    """Route llama.cpp's own log lines (load, quantize, context sizes) to errors only."""
    from llama_cpp._logger import set_verbose

    set_verbose(False)


def quantize_gguf(source: Path, target: Path, ftype: int) -> None:
    """Requantize ``source`` into ``target`` with llama.cpp's own quantizer."""
    import llama_cpp

    quiet_llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = usable_cores()
    # the quantizer writes its notes (fallback types for odd-sized tensors) to file descriptor 2 past
    # the log callback: kept out of a normal start, shown when it fails
    with tempfile.TemporaryFile() as notes:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(notes.fileno(), 2)
            status = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        notes.seek(0)
        said = notes.read().decode(errors="replace").strip()
    if status != 0:
        raise ModelLoadError(
            f"llama.cpp could not quantize {source} to {target} (status {status}): {said[-500:]}"
        )
