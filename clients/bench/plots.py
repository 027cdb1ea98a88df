"""PNG plots of a ``specgate bench`` result (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_bench(results: dict[str, Any], folder: Path) -> list[Path]:
    """``specgate bench``: speed-up vs RTT per mode, and bytes per round per mode; returns the files
    written."""
    plt = _pyplot(folder)
    cells = results["cells"]
    written = []
    groups = sorted({(c["workers"], c["temperature"]) for c in cells})
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    modes = list(dict.fromkeys(c["mode"] for c in cells))
    colours = {mode: f"C{i}" for i, mode in enumerate(modes)}  # one colour per mode in every panel
    for ax, (workers, temperature) in zip(axes[0], groups):
        for mode in modes:
            points = sorted(
                (c["rtt_ms"], c["speedup_vs_autoregressive"])
                for c in cells
                if c["mode"] == mode and c["workers"] == workers and c["temperature"] == temperature
            )
            if points:
                ax.plot(*zip(*points), marker="o", label=mode, color=colours[mode])
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set(
            title=f"{workers} worker(s), T = {temperature:g}",
            xlabel="RTT (ms)",
            ylabel="speed-up over autoregressive",
        )
        ax.legend(fontsize=8)
    written.append(_save(fig, folder / "speedup_vs_rtt.png"))
    fig, ax = plt.subplots(figsize=(7, 4))
    first = [
        c
        for c in cells
        if c["rtt_ms"] == min(x["rtt_ms"] for x in cells)
        and c["workers"] == cells[0]["workers"]
        and c["temperature"] == cells[-1]["temperature"]
    ]
    names = [c["mode"] for c in first]
    x = range(len(names))
    ax.bar(
        [i - 0.2 for i in x], [c["bytes_up_per_round"] for c in first], width=0.4, label="gateway → workers"
    )
    ax.bar(
        [i + 0.2 for i in x], [c["bytes_down_per_round"] for c in first], width=0.4, label="workers → gateway"
    )
    ax.set_yscale("log")
    ax.set_xticks(list(x), names, rotation=20, fontsize=8)
    ax.set(ylabel="bytes per round (log)", title="payload per round by mode")
    ax.legend(fontsize=8)
    written.append(_save(fig, folder / "bytes_per_round.png"))
    return written


def _pyplot(folder: Path) -> Any:
    """matplotlib's pyplot, without a display; ``folder`` made."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    return plt


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def plot_dsd(results: dict[str, Any], folder: Path) -> list[Path]:
    """``bench dsd``: tokens/s against γ per link (overlap off / on, auto as lines), and the speed-up against
    RTT."""
    plt = _pyplot(folder)
    cells = results["cells"]
    groups = list(dict.fromkeys((c["workers"], c["link"]) for c in cells))
    fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 3.8), squeeze=False)
    for ax, (workers, link) in zip(axes[0], groups):
        same = [c for c in cells if (c["workers"], c["link"]) == (workers, link)]
        for overlap, colour in ((False, "C0"), (True, "C1")):
            fixed = sorted(
                (c["gamma"], c["tokens_per_s"])
                for c in same
                if c["overlap"] == overlap and not c["auto"] and c["cell"] != "autoregressive"
            )
            ax.plot(
                *zip(*fixed), marker="o", color=colour, label=f"fixed γ, overlap {'on' if overlap else 'off'}"
            )
            auto = next(c for c in same if c["auto"] and c["overlap"] == overlap)
            ax.axhline(
                auto["tokens_per_s"],
                color=colour,
                linestyle="--",
                label=f"auto (mean γ {auto['gamma']:.1f}), overlap {'on' if overlap else 'off'}",
            )
        base = next(c for c in same if c["cell"] == "autoregressive")
        ax.axhline(base["tokens_per_s"], color="grey", linewidth=0.8, label="autoregressive")
        ax.set(title=f"N = {workers}, {link}", xlabel="γ", ylabel="tokens/s")
        ax.legend(fontsize=6)
    written = [_save(fig, folder / "dsd_tokens_per_s_vs_gamma.png")]
    fig, ax = plt.subplots(figsize=(6, 4))
    single = [c for c in cells if c["workers"] == 1]
    for label, pick in (
        ("best fixed γ", lambda c: not c["auto"] and not c["overlap"]),
        ("best fixed γ + overlap", lambda c: not c["auto"] and c["overlap"]),
        ("auto", lambda c: c["auto"] and not c["overlap"]),
        ("auto + overlap", lambda c: c["auto"] and c["overlap"]),
    ):
        points = []
        for rtt in sorted({c["rtt_ms"] for c in single}):
            chosen = [c for c in single if c["rtt_ms"] == rtt and c["cell"] != "autoregressive" and pick(c)]
            points.append((rtt, max(c["speedup_vs_autoregressive"] for c in chosen)))
        ax.plot(*zip(*points), marker="o", label=label)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set(
        xlabel="RTT (ms)",
        ylabel="speed-up over autoregressive",
        title="exact, 1 worker: DSD overlap and adaptive γ",
    )
    ax.legend(fontsize=8)
    written.append(_save(fig, folder / "dsd_speedup_vs_rtt.png"))
    return written


def plot_tree(results: dict[str, Any], folder: Path) -> list[Path]:
    """``bench tree``: tokens per round against the node budget (chain vs tree, per T), and the speed-up
    against RTT at 14 nodes."""
    plt = _pyplot(folder)
    rows = results["cells"]
    temperatures = sorted({r["temperature"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    first_link = rows[0]["link"]
    for i, t in enumerate(temperatures):
        for shape, style in (("chain", "--"), ("tree", "-")):
            points = sorted(
                (r["budget"], r["mean_accepted_length"])
                for r in rows
                if r["shape"] == shape and r["temperature"] == t and r["link"] == first_link
            )
            if points:
                axes[0].plot(*zip(*points), style, marker="o", color=f"C{i}", label=f"{shape}, T = {t:g}")
        for shape, style in (("tree", "-"), ("chain", "--")):
            points = sorted(
                (r["rtt_ms"], r["speedup_vs_autoregressive"])
                for r in rows
                if r["shape"] == shape and r["budget"] == 14 and r["temperature"] == t
            )
            if points:
                axes[1].plot(*zip(*points), style, marker="o", color=f"C{i}", label=f"{shape} 14, T = {t:g}")
    axes[0].set(
        xlabel="verified nodes per round",
        ylabel="tokens per round",
        title="tokens per round at equal budgets",
    )
    axes[1].axhline(1.0, color="grey", linewidth=0.8)
    axes[1].set(xlabel="RTT (ms)", ylabel="speed-up over autoregressive", title="14 nodes per round")
    for ax in axes:
        ax.legend(fontsize=8)
    return [_save(fig, folder / "tree_vs_chain.png")]
