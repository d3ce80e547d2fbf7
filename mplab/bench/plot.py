"""The bench's figure: speed-up over fp32 against model size, and peak memory beside it."""

from __future__ import annotations

from matplotlib.figure import Figure

from mplab.plots import FORMAT_COLORS, new_figure


def bench_plot(rows, *, pyplot: bool = False) -> Figure:
    """Left: each precision's training speed-up over fp32 against the model's parameters (the
    dashed line is fp32). Right: peak memory of the same runs. `rows`: `BenchRow`s or their
    dicts (a `--json` file's "rows")."""
    models = [r if isinstance(r, dict) else r.as_dict() for r in rows]
    models = [r for r in models if r.get("kind") == "model"]
    if not models:
        raise ValueError("bench_plot needs model rows (kind 'model'), as mplab.bench measures")
    fig = new_figure((10, 3.6), pyplot)
    speed, memory = fig.subplots(1, 2)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.16, top=0.88, wspace=0.25)
    for precision in dict.fromkeys(r["precision"] for r in models):
        mine = sorted((r for r in models if r["precision"] == precision),
                      key=lambda r: r["parameters"])
        x = [r["parameters"] / 1e6 for r in mine]
        color = FORMAT_COLORS.get(precision, "0.4")
        speed.plot(x, [r["speedup_vs_fp32"] for r in mine], "o-", color=color, label=precision)
        memory.plot(x, [r["peak_memory_bytes"] / 2**20 for r in mine], "o-", color=color,
                    label=precision)
    speed.axhline(1.0, color=FORMAT_COLORS["fp32"], ls="--", lw=1)
    for ax, label, title in ((speed, "speed-up over fp32", "Training speed-up vs model size"),
                             (memory, "peak memory (MiB)", "Peak memory of the same runs")):
        ax.set_xscale("log")
        ax.set_xlabel("parameters (millions)")
        ax.set_ylabel(label)
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.25)
        ax.legend(fontsize=8)
    return fig
