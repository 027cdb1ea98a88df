"""A GPU machine's Python, as far as its packages go, built here: a folder of links to this environment's
installed distributions that the device image holds (scripts/device_image_packages.txt), and those the device
check carries (scripts/device_wheels.py), imported from with no site-packages. What the image lacks and
nothing carries fails to import, as it would there (its versions are this environment's, not the image's)."""

from __future__ import annotations

import importlib.metadata as metadata
import subprocess
import sys
from pathlib import Path

from scripts.device_wheels import normal

ROOT = Path(__file__).resolve().parents[1]


def package_site(names: set[str], into: Path) -> Path:
    """``into`` holding links to the import names and metadata of every installed distribution named in
    ``names``."""
    into.mkdir(parents=True, exist_ok=True)
    for distribution in metadata.distributions():
        if normal(distribution.metadata["Name"]) not in names:
            continue
        base = Path(str(distribution.locate_file("")))
        tops = {Path(str(f)).parts[0] for f in distribution.files or [] if Path(str(f)).parts}
        tops = {t for t in tops if t not in ("..", "__pycache__") and not t.endswith((".data", ".pth"))}
        tops.add(Path(distribution._path).name)  # its .dist-info: importlib.metadata's answers
        for top in tops:
            source, link = base / top, into / top
            if source.exists() and not link.exists():
                link.symlink_to(source)
    return into


def import_alone(modules: list[str], site: Path) -> dict[str, str]:
    """Each module imported in a fresh Python that sees the standard library, the checkout and ``site`` only:
    "ok" or the error."""
    code = (
        "import importlib, json, sys\n"
        f"sys.path[:] = [p for p in sys.path if 'site-packages' not in p] + [{str(ROOT)!r}, {str(site)!r}]\n"
        "out = {}\n"
        f"for name in {modules!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "        out[name] = 'ok'\n"
        "    except Exception as exc:\n"
        "        out[name] = f'{type(exc).__name__}: {exc}'\n"
        "print(json.dumps(out))\n"
    )
    run = subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    if run.returncode != 0:
        raise AssertionError(run.stderr[-2000:])
    import json

    return dict(json.loads(run.stdout.strip().splitlines()[-1]))
