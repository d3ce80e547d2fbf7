"""The bench's figure: speed-up over fp32 against model size, and peak memory beside it."""

from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import NullLocator

from mplab.plots import FORMAT_COLORS, new_figure

from .record import machine_name

__all__ = ["bench_plot"]

#: One marker (and size) per precision, so that two precisions with equal memory both show.
_MARKERS = {"fp32": ("o", 6), "tf32": ("D", 6), "bf16": ("s", 8), "fp16": ("^", 5)}
_PAYS = "above the line: it pays"


def bench_plot(rows, *, pyplot: bool = False) -> Figure:
    """Left: each low precision's training speed-up over fp32 against the model's parameters;
    the dashed line is fp32 (1×), above it low precision pays. Where every low precision was
    timed at one size only (a CPU without units for them), a bar per precision at that size
    instead, with its value. Right: peak memory of the same runs, per precision. Each size is
    named under its tick (parameters in millions, hidden/layers).

    `rows`: `BenchRow`s, their dicts (a `--json` file's "rows"), or a whole record
    (`lesson_bench()`, a loaded `--json` file), whose device then titles the figure."""
    title = ""
    if isinstance(rows, dict):
        if "rows" not in rows:
            raise ValueError("bench_plot takes a bench record (a dict with 'rows', as "
                             "lesson_bench() returns and --json writes) or its rows")
        title, rows = machine_name(rows.get("device", "")), rows["rows"]
    models = [r if isinstance(r, dict) else r.as_dict() for r in rows]
    models = [r for r in models if r.get("kind") == "model"]
    if not models:
        raise ValueError("bench_plot needs model rows (kind 'model'), as mplab.bench measures")
    series = {p: sorted((r for r in models if r["precision"] == p
                         and r.get("speedup_vs_fp32") is not None),
                        key=lambda r: r["parameters"])
              for p in dict.fromkeys(r["precision"] for r in models)}
    low = {p: mine for p, mine in series.items() if p != "fp32" and mine}
    fig = new_figure((10, 4.2), pyplot)
    speed, memory = fig.subplots(1, 2)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.2, top=0.8 if title else 0.84,
                        wspace=0.25)
    if title:
        fig.suptitle(title, fontsize=9)
    speed.axhline(1.0, color=FORMAT_COLORS["fp32"], ls="--", lw=1, label="fp32 (1×)")
    if low and all(len(mine) == 1 for mine in low.values()):
        _speed_bars(speed, low)
    else:
        for precision, mine in low.items():
            speed.plot([r["parameters"] / 1e6 for r in mine],
                       [r["speedup_vs_fp32"] for r in mine], "-", **_style(precision))
        _size_axis(speed, models)
        speed.set_title(f"Training speed-up vs model size ({_PAYS})", fontsize=10)
    for precision, mine in series.items():
        memory.plot([r["parameters"] / 1e6 for r in mine],
                    [r["peak_memory_bytes"] / 2**20 for r in mine], "-", **_style(precision))
    _size_axis(memory, models)
    kinds = {r.get("memory_kind") for r in models} - {None}
    counted = f"\n{kinds.pop().removesuffix(' (torch.profiler)')}" if len(kinds) == 1 else ""
    memory.set_title(f"Peak memory of the same runs{counted}", fontsize=10)
    speed.set_ylabel("speed-up over fp32 (×)")
    memory.set_ylabel("peak memory (MiB)")
    for ax in (speed, memory):
        ax.margins(y=0.12)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.25)
        ax.legend(fontsize=8)
    return fig


def _style(precision: str) -> dict:
    marker, size = _MARKERS.get(precision, ("o", 6))
    return {"color": FORMAT_COLORS.get(precision, "0.4"), "label": precision,
            "marker": marker, "markersize": size}


def _size(row: dict) -> str:
    return f"{row['hidden']}/{row['layers']}"


def _size_words(row: dict) -> str:
    return f"hidden {row['hidden']}, {row['layers']} layers"


def _size_axis(ax: Axes, models: list[dict]) -> None:
    """A log axis of parameters with a tick per model size, named under it (hidden/layers),
    so that no label sits on the points: two precisions at one size share one tick."""
    names = {r["parameters"] / 1e6: _size(r) for r in models}
    sizes = sorted(names)
    ax.set_xscale("log")
    ax.set_xticks(sizes, [f"{s:.2g}\n{names[s]}" for s in sizes], fontsize=8)
    ax.xaxis.set_minor_locator(NullLocator())
    ax.margins(x=0.1)
    ax.set_xlabel("parameters (millions), hidden/layers")


def _speed_bars(ax: Axes, low: dict[str, list[dict]]) -> None:
    """One bar per low precision at the one size it was timed, its speed-up written on it: a
    curve of one point says nothing about size, and its labels would pile up on each other."""
    timed = {p: mine[0] for p, mine in low.items()}
    for i, (precision, row) in enumerate(timed.items()):
        style = _style(precision)
        bars = ax.bar([i], [row["speedup_vs_fp32"]], width=0.5, color=style["color"],
                      label=precision)
        ax.bar_label(bars, [f"{row['speedup_vs_fp32']:.2f}×"], fontsize=8, padding=2)
    ax.set_xticks(range(len(timed)), [f"{p}\n{_size_words(r)}" for p, r in timed.items()],
                  fontsize=8)
    ax.set_xlim(-0.75, len(timed) - 0.25)
    sizes = {_size_words(r) for r in timed.values()}
    where = (f"at {sizes.pop()},\nthe one size timed" if len(sizes) == 1 else
             "each at the one size\nit was timed")
    ax.set_title(f"Training speed-up {where} in {' and '.join(timed)} ({_PAYS})",
                 fontsize=10)
    ax.set_xlabel("precision, and the model size it was timed at")
