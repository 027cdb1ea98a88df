"""Gather what the device check (scripts/device_check.py) needs on a lent GPU machine beyond its image, into
``.device/`` (git-ignored; the device tool's ``carry`` takes it, 64 MiB a call):

  python scripts/device_wheels.py           # .device/wheels: cp312 manylinux wheels; .device/tokenizer: the
  built-in's, as a small file python scripts/device_wheels.py --gguf    # and the built-in GGUF in two halves:
  .device/gguf-1, .device/gguf-2 (a call each)

The wheels are the project's dependencies and what they need, as installed here (the versions the suite ran),
less what the image holds (scripts/device_image_packages.txt) and llama-cpp-python (compiled; the check drafts
on transformers without it). pip downloads them for the device's Python, one by one with no dependencies of
their own; one that has no wheel for it is named in ``.device/manifest.json`` and the check goes on without
it."""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as metadata
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / ".device"
SKIP = {"llama-cpp-python"}  # compiled from source here; the device check's draft runs on transformers
# on the image, but pydantic needs a recent one (≥ 4.14): carried, it shadows the image's
ALWAYS = {"typing-extensions"}
# the image is Ubuntu 24.04's Python 3.12 (glibc 2.39): any manylinux_2_N for N ≤ 39 runs there; pip matches N
# exactly
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(39, 4, -1)] + [
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
    "any",
]
DEVICE_PYTHON = "3.12"
HALVES = 2


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages() -> set[str]:
    lines = (ROOT / "scripts" / "device_image_packages.txt").read_text().splitlines()
    return {normal(line.strip()) for line in lines if line.strip() and not line.startswith("#")}


def project_dependencies() -> list[str]:
    import tomllib

    return list(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])


def needed(roots: list[str], skip: set[str]) -> dict[str, str]:
    """name → installed version of every distribution ``roots`` need (markers read for the device's Python),
    less ``skip``."""
    from packaging.requirements import Requirement

    environment = {
        "python_version": DEVICE_PYTHON,
        "python_full_version": f"{DEVICE_PYTHON}.3",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "os_name": "posix",
        "extra": "",
    }
    out: dict[str, str] = {}
    todo = [Requirement(root) for root in roots]
    while todo:
        requirement = todo.pop()
        name = normal(requirement.name)
        if (
            name in out
            or name in skip
            or (requirement.marker is not None and not requirement.marker.evaluate(environment))
        ):
            continue
        try:
            distribution = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            print(f"  {name}: not installed here, left out", file=sys.stderr)
            continue
        out[name] = distribution.version
        todo += [Requirement(text) for text in distribution.requires or []]
    return out


def download(name: str, version: str, into: Path) -> str | None:
    """The wheel's file name, or None where pip finds none for the device."""
    platforms = [flag for platform in PLATFORMS for flag in ("--platform", platform)]
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        DEVICE_PYTHON,
        "--implementation",
        "cp",
        *platforms,
        "-d",
        str(into),
        f"{name}=={version}",
    ]
    before = set(into.iterdir())
    run = subprocess.run(command, capture_output=True, text=True)
    made = sorted(set(into.iterdir()) - before)
    if run.returncode != 0 or not made:
        print(
            f"  {name}=={version}: no wheel for CPython {DEVICE_PYTHON} "
            f"({run.stderr.strip().splitlines()[-1:] or run.returncode})",
            file=sys.stderr,
        )
        return None
    return made[0].name


def tokenizer(into: Path) -> list[str]:
    """The built-in's tokenizer as this machine converted it (core.runners.tokenizer's cache): a few MB, not
    the GGUF."""
    from core.runners.models import builtin_gguf, cache_dir, file_key, resolve_model
    from core.runners.tokenizer import load_tokenizer

    load_tokenizer(resolve_model("builtin"))  # converted and cached, if not yet
    folder = cache_dir() / "tokenizers" / file_key(builtin_gguf())
    into.mkdir(parents=True)
    files = []
    for path in sorted(folder.iterdir()):
        if path.is_file():
            shutil.copy2(path, into / path.name)
            files.append(path.name)
    return files


def gguf_halves(out: Path) -> dict[str, object]:
    """The built-in GGUF cut in two: ``gguf-1/part`` and ``gguf-2/part``, its sha256 to check them joined."""
    from core.runners.models import builtin_gguf

    data = builtin_gguf().read_bytes()
    cut = len(data) // HALVES
    for index, part in enumerate((data[:cut], data[cut:]), start=1):
        folder = out / f"gguf-{index}"
        folder.mkdir(parents=True)
        (folder / "part").write_bytes(part)
    return {
        "file": builtin_gguf().name,
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "halves": HALVES,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python scripts/device_wheels.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--gguf",
        action="store_true",
        help="the built-in GGUF too, in two halves (a call of the device tool each)",
    )
    args = parser.parse_args(argv)
    shutil.rmtree(OUT, ignore_errors=True)
    wheels = OUT / "wheels"
    wheels.mkdir(parents=True)
    image = image_packages()
    wanted = needed(project_dependencies() + sorted(ALWAYS), (image - ALWAYS) | SKIP)
    print(
        f"carrying {len(wanted)} distributions the image lacks: {', '.join(sorted(wanted))}", file=sys.stderr
    )
    got, missing = {}, []
    for name, version in sorted(wanted.items()):
        wheel = download(name, version, wheels)
        if wheel is None:
            missing.append(f"{name}=={version}")
        else:
            got[name] = wheel
    manifest: dict[str, object] = {
        "python": DEVICE_PYTHON,
        "wheels": got,
        "missing": missing,
        "wheel_bytes": sum(p.stat().st_size for p in wheels.iterdir()),
        "tokenizer": tokenizer(OUT / "tokenizer"),
    }
    if args.gguf:
        manifest["gguf"] = gguf_halves(OUT)
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=2))
    sizes = {
        path.name: sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        for path in OUT.iterdir()
        if path.is_dir()
    }
    print(
        f"wrote {OUT}: "
        + ", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in sorted(sizes.items())),
        file=sys.stderr,
    )
    if missing:
        print(f"no wheel for: {', '.join(missing)} (the check runs without them)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
