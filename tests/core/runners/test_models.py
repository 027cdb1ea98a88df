"""Model resolution, the built-in requantizations and one-line load errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.errors import ModelLoadError
from core.runners import check_vocab, load_runner, resolve_model
from core.runners.models import BUILTIN_DRAFT, builtin_gguf, file_key, requantized

ROOT = Path(__file__).resolve().parents[3]


def test_builtin_is_found_in_site_packages() -> None:
    source = resolve_model("builtin")
    assert source.is_gguf and source.path == builtin_gguf() and source.path.stat().st_size > 50e6


def test_requantized_builtins_share_the_builtin_tokenizer() -> None:
    for name in ("builtin-draft", "builtin-alt"):
        source = resolve_model(name)
        assert source.is_gguf and source.path != builtin_gguf()
        assert source.tokenizer_path == builtin_gguf()


def test_tiny_random_seeds() -> None:
    assert resolve_model("tiny-random").seed == 0
    assert resolve_model("tiny-random:3").seed == 3
    with pytest.raises(ModelLoadError, match="seed"):
        resolve_model("tiny-random:x")


@pytest.mark.parametrize(
    "name, message",
    [
        ("/nonexistent/model.gguf", "model not found: /nonexistent/model.gguf"),
        ("./no-such-folder", "model not found"),
    ],
)
def test_missing_models_are_one_line_errors(name: str, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message) as info:
        resolve_model(name)
    assert "\n" not in str(info.value)


def test_a_folder_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="config.json"):
        resolve_model(str(tmp_path))


def test_a_corrupt_gguf_is_a_one_line_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(1000))
    with pytest.raises(ModelLoadError, match="bad.gguf") as info:
        load_runner(str(bad), "llama.cpp")
    assert "\n" not in str(info.value)


def test_vocabulary_mismatch_names_the_file() -> None:
    check_vocab(49152, 49152, "m.gguf")
    with pytest.raises(ModelLoadError, match="vocabulary mismatch in m.gguf"):
        check_vocab(50000, 49152, "m.gguf")


def test_requantization_is_safe_under_two_processes(tmp_path: Path) -> None:
    env = {**os.environ, "SPECGATE_CACHE_DIR": str(tmp_path)}
    code = "from core.runners.models import requantized; print(requantized('builtin-draft'))"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    paths = {out.decode().strip() for out, _ in outputs}
    assert len(paths) == 1
    made = Path(paths.pop())
    assert made.is_file() and list(tmp_path.glob("*.tmp")) == []
    # the same file as the user cache's
    assert made.stat().st_size == requantized(BUILTIN_DRAFT).stat().st_size


def test_cache_keys_follow_the_content_not_the_path(tmp_path: Path) -> None:
    """A fresh virtualenv's copy of the built-in GGUF (another path, another mtime) finds the
    caches the first one made; a file whose bytes differ does not."""
    data = bytearray(os.urandom(3 << 20))
    first, copy, changed = tmp_path / "a.gguf", tmp_path / "b" / "a.gguf", tmp_path / "c.gguf"
    copy.parent.mkdir()
    first.write_bytes(data)
    copy.write_bytes(data)
    os.utime(copy, (1, 1))
    data[len(data) // 2] ^= 1  # a byte in the middle slice
    changed.write_bytes(data)
    assert file_key(first) == file_key(copy) != file_key(changed)


def test_a_cache_entry_is_made_once_by_processes_that_start_together(tmp_path: Path) -> None:
    """Three processes (a pipeline's stages) ask for the same entry at once: one makes it."""
    code = (
        "import sys, time; from pathlib import Path; from core.runners.models import cache_lock\n"
        "entry = Path(sys.argv[1]) / 'entry'\n"
        "with cache_lock(entry):\n"
        "    if not entry.exists():\n"
        "        time.sleep(0.5); entry.mkdir(); (entry / sys.argv[2]).touch()\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path), f"maker{i}"], cwd=ROOT) for i in range(3)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    assert len(list((tmp_path / "entry").iterdir())) == 1


def test_made_caches_load_without_writing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 59: an image's cache is read-only at run time (readOnlyRootFilesystem, another uid): the
    transformers runner opened its dequantization lock for writing even with the weights made, and the gpu and
    pipeline pods crash-looped. A made entry (set-up makes it) loads without the lock, as the tokenizer's and
    the requantizations already did."""
    from core.runners import transformers_runner
    from core.runners.tokenizer import load_tokenizer

    def read_only(entry: Path) -> None:
        raise OSError(30, "Read-only file system", str(entry))

    monkeypatch.setattr(transformers_runner, "cache_lock", read_only)
    monkeypatch.setattr("core.runners.tokenizer.cache_lock", read_only)
    model = transformers_runner._load_gguf(builtin_gguf())
    assert model.config.num_hidden_layers == 30
    assert load_tokenizer(resolve_model("builtin")) is not None
    assert requantized(BUILTIN_DRAFT).is_file()
