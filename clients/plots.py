"""PNG plots of a ``specgate bench`` result (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_bench(results: dict[str, Any], folder: Path) -> list[Path]:
    """Speed-up vs RTT per mode, and bytes per round per mode; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    cells = results["cells"]
    written = []
    groups = sorted({(c["workers"], c["temperature"]) for c in cells})
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    modes = list(dict.fromkeys(c["mode"] for c in cells))
    colours = {mode: f"C{i}" for i, mode in enumerate(modes)}  # one colour per mode in every panel
    for ax, (workers, temperature) in zip(axes[0], groups):
        for mode in modes:
            points = sorted((c["rtt_ms"], c["speedup_vs_autoregressive"]) for c in cells if c["mode"] == mode and c["workers"] == workers and c["temperature"] == temperature)
            if points:
                ax.plot(*zip(*points), marker="o", label=mode, color=colours[mode])
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set(title=f"{workers} worker(s), T = {temperature:g}", xlabel="RTT (ms)", ylabel="speed-up over autoregressive")
        ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(_save(fig, folder / "speedup_vs_rtt.png"))
    fig, ax = plt.subplots(figsize=(7, 4))
    first = [c for c in cells if c["rtt_ms"] == min(x["rtt_ms"] for x in cells) and c["workers"] == cells[0]["workers"] and c["temperature"] == cells[-1]["temperature"]]
    names = [c["mode"] for c in first]
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [c["bytes_up_per_round"] for c in first], width=0.4, label="gateway → workers")
    ax.bar([i + 0.2 for i in x], [c["bytes_down_per_round"] for c in first], width=0.4, label="workers → gateway")
    ax.set_yscale("log")
    ax.set_xticks(list(x), names, rotation=20, fontsize=8)
    ax.set(ylabel="bytes per round (log)", title="payload per round by mode")
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(_save(fig, folder / "bytes_per_round.png"))
    return written


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
