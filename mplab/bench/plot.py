"""The bench's figure: speed-up over fp32 against model size, and peak memory beside it."""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.ticker import NullLocator

from mplab.plots import FORMAT_COLORS, new_figure

#: One marker (and size) per precision, so that two precisions with equal memory both show.
_MARKERS = {"fp32": ("o", 6), "tf32": ("D", 6), "bf16": ("s", 8), "fp16": ("^", 5)}


def bench_plot(rows, *, pyplot: bool = False) -> Figure:
    """Left: each precision's training speed-up over fp32 against the model's parameters, each
    point named by its size (hidden/layers); the dashed line is fp32 (1×), above it low
    precision pays. Right: peak memory of the same runs, per precision.

    `rows`: `BenchRow`s, their dicts (a `--json` file's "rows"), or a whole record
    (`lesson_bench()`, a loaded `--json` file), whose device then titles the figure."""
    title = ""
    if isinstance(rows, dict):
        if "rows" not in rows:
            raise ValueError("bench_plot takes a bench record (a dict with 'rows', as "
                             "lesson_bench() returns and --json writes) or its rows")
        title, rows = rows.get("device", ""), rows["rows"]
    models = [r if isinstance(r, dict) else r.as_dict() for r in rows]
    models = [r for r in models if r.get("kind") == "model"]
    if not models:
        raise ValueError("bench_plot needs model rows (kind 'model'), as mplab.bench measures")
    fig = new_figure((10, 4), pyplot)
    speed, memory = fig.subplots(1, 2)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.14, top=0.8 if title else 0.84,
                        wspace=0.25)
    if title:
        fig.suptitle(title, fontsize=9)
    speed.axhline(1.0, color=FORMAT_COLORS["fp32"], ls="--", lw=1, label="fp32 (1×)")
    for precision in dict.fromkeys(r["precision"] for r in models):
        mine = sorted((r for r in models if r["precision"] == precision
                       and r.get("speedup_vs_fp32") is not None),
                      key=lambda r: r["parameters"])
        x = [r["parameters"] / 1e6 for r in mine]
        marker, size = _MARKERS.get(precision, ("o", 6))
        style = {"color": FORMAT_COLORS.get(precision, "0.4"), "label": precision,
                 "marker": marker, "markersize": size}
        memory.plot(x, [r["peak_memory_bytes"] / 2**20 for r in mine], "-", **style)
        if precision == "fp32":
            continue  # its speed-up is the dashed line
        speed.plot(x, [r["speedup_vs_fp32"] for r in mine], "-", **style)
        for r, xi in zip(mine, x):
            speed.annotate(f"{r['hidden']}/{r['layers']}", (xi, r["speedup_vs_fp32"]),
                           textcoords="offset points", xytext=(0, 7), ha="center", fontsize=7,
                           color=style["color"])
    sizes = sorted({r["parameters"] / 1e6 for r in models})
    kinds = {r.get("memory_kind") for r in models} - {None}
    counted = f"\n{kinds.pop().removesuffix(' (torch.profiler)')}" if len(kinds) == 1 else ""
    for ax, label, what in ((speed, "speed-up over fp32 (×)",
                             "Training speed-up vs model size (above the line: it pays)"),
                            (memory, "peak memory (MiB)",
                             f"Peak memory of the same runs{counted}")):
        ax.set_xscale("log")
        ax.set_xticks(sizes, [f"{s:.2g}" for s in sizes], fontsize=8)
        ax.xaxis.set_minor_locator(NullLocator())
        ax.margins(x=0.1, y=0.12)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("parameters (millions)")
        ax.set_ylabel(label)
        ax.set_title(what, fontsize=10)
        ax.grid(True, alpha=0.25)
        ax.legend(fontsize=8)
    return fig
