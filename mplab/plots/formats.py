"""Figures of the formats: a figure of the lessons' size, each format's colour, and the spacing
of a format's numbers (lesson 1). Every number drawn here is computed by mplab."""

from __future__ import annotations

import io
import math

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FixedLocator, NullLocator
from PIL import Image

from mplab.numerics.formats import FORMATS, FloatFormat, get_format, ulp

__all__ = ["FORMAT_COLORS", "new_figure", "ulp_steps", "ulp_plot", "mark_ulp", "closeup_range",
           "MarkerPng"]

#: One colour per format, shared by every plot and widget that names a format.
FORMAT_COLORS = {
    "fp32": "#4c78a8", "tf32": "#72b7b2", "fp16": "#f58518",
    "bf16": "#e45756", "fp8_e4m3": "#54a24b", "fp8_e5m2": "#b279a2",
    "fp8_e4m3fnuz": "#88d27a", "fp8_e5m2fnuz": "#d6a5c9", "fp6_e3m2": "#9d755d",
    "fp6_e2m3": "#bab0ac", "fp4_e2m1": "#eeca3b", "e8m0": "#000000",
}

# Edge markers: where a format's numbers start (underflow) and stop (overflow).
_EDGES = (("min_subnormal", "o", "smallest subnormal"),
          ("min_normal", "s", "smallest normal"),
          ("max_finite", "X", "largest finite"))


def _formats(precisions) -> list[FloatFormat]:
    return [get_format(f) for f in (precisions or FORMATS)]


def new_figure(size: tuple[float, float], pyplot: bool = True) -> Figure:
    """A figure of this size (inches, at 80 dpi): made by pyplot, so that a notebook shows it,
    or with ``pyplot=False`` one pyplot does not know, for a widget to render itself."""
    if pyplot:
        import matplotlib.pyplot as plt

        return plt.figure(figsize=size, dpi=80)
    fig = Figure(figsize=size, dpi=80)
    FigureCanvasAgg(fig)
    return fig


# --- lesson 1: the spacing of each format's numbers --------------------------------------------

def ulp_steps(precision) -> tuple[list[float], list[float]]:
    """The spacing of a format's numbers as a staircase: x from the smallest subnormal to the
    largest finite, ulp(x) on each step (constant across the subnormals, doubling per binade)."""
    f = get_format(precision)
    xs = [float(f.min_subnormal)] + [2.0 ** e for e in range(f.emin, f.emax + 1)]
    xs.append(float(f.max_finite))
    return xs, [ulp(x, f) for x in xs]


def closeup_range(precisions=None) -> tuple[float, float] | None:
    """Magnitudes spanned by the narrow formats (5 exponent bits or fewer: fp16 and fp8),
    with a margin of 16x each side; None when no format is that narrow."""
    narrow = [f for f in _formats(precisions) if f.exp_bits <= 5]
    if not narrow:
        return None
    return (min(float(f.min_subnormal) for f in narrow) / 16,
            max(float(f.max_finite) for f in narrow) * 16)


def ulp_plot(x=None, precisions=None, ax=None, *, pyplot: bool = True) -> Figure:
    """Spacing between neighbouring numbers (ulp) against magnitude, one staircase per format,
    on log-log axes, each format's underflow and overflow edges marked, and x marked on every
    curve whose range holds it.

    Without ax: a new figure of two panels, every format's whole range and a close-up of the
    narrow formats' range (:func:`closeup_range`), made by pyplot so that a notebook shows it
    (end the line with ``;`` to show it once); ``pyplot=False`` makes a figure pyplot does not
    know, for a widget to render itself. With ax: one panel over the whole range, in ax.
    Returns the figure.
    """
    fmts = _formats(precisions)
    if ax is not None:
        _draw_ulp(ax, x, fmts, None, "Spacing of neighbouring numbers")
        ax.legend(*_legend_entries(ax), loc="lower right", fontsize=7)
        return ax.figure
    close = closeup_range(fmts)
    fig = new_figure((11.5, 3.5) if close else (8.0, 3.5), pyplot)
    axes = fig.subplots(1, 2 if close else 1, squeeze=False)[0]
    fig.subplots_adjust(left=0.06, right=0.78 if close else 0.68, bottom=0.15, top=0.9,
                        wspace=0.25)
    _draw_ulp(axes[0], x, fmts, None, "Every format, whole range")
    if close:
        _draw_ulp(axes[1], x, fmts, close, "Close-up: fp16 and fp8 territory")
    fig.legend(*_legend_entries(axes[-1]), loc="upper left", fontsize=8, frameon=False,
               bbox_to_anchor=(axes[-1].get_position().x1 + 0.01, 0.92))
    return fig


def _draw_ulp(ax, x, fmts, xlim, title) -> None:
    lo, hi = math.inf, 0.0
    for f in fmts:
        color = FORMAT_COLORS.get(f.name, "black")
        xs, ys = ulp_steps(f)
        ax.step(xs, ys, where="post", color=color, lw=1.5, label=f.name, gid=f"ulp-{f.name}")
        for attr, marker, _ in _EDGES:
            edge = float(getattr(f, attr))
            ax.plot([edge], [ulp(edge, f)], marker=marker, ms=6, color=color, mec="black",
                    mew=0.6, ls="none", gid=f"edge-{f.name}-{attr}")
        lo, hi = min(lo, xs[0]), max(hi, xs[-1])
    ax.set_xscale("log")
    ax.set_yscale("log")
    xlim = xlim or (lo / 16, hi * 16)
    ax.set_xlim(*xlim)
    ys = [ulp(v, f) for f in fmts for v in xlim]
    ax.set_ylim(min(ys) / 16, max(ys) * 16)
    for axis, (a, b) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
        axis.set_major_locator(FixedLocator(_decade_ticks(a, b)))
        axis.set_minor_locator(NullLocator())
    ax.set_xlabel("magnitude |x|")
    ax.set_ylabel("spacing to the next number")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", alpha=0.25)
    mark_ulp(ax, x, fmts)


def _decade_ticks(lo: float, hi: float, most: int = 8) -> list[float]:
    """Powers of ten from lo to hi, every 1st, 2nd, 5th, 10th... decade, at most `most`."""
    first, last = math.ceil(math.log10(lo)), math.floor(math.log10(hi))
    step = next(k for k in (1, 2, 5, 10, 20, 50, 100) if (last - first) // k < most)
    first = math.ceil(first / step) * step
    return [10.0 ** k for k in range(first, last + 1, step)]


def _legend_entries(ax) -> tuple[list, list[str]]:
    """The formats' lines, then what the edge markers and the marker of x mean."""
    handles, labels = ax.get_legend_handles_labels()
    for _, marker, text in _EDGES:
        handles.append(Line2D([], [], marker=marker, color="0.6", mec="black", mew=0.6,
                              ls="none"))
        labels.append(text)
    handles.append(Line2D([], [], color="black", ls="--", lw=1, marker="o", mfc="white"))
    labels.append("your number |x|")
    return handles, labels


def mark_ulp(ax, x, precisions=None) -> list:
    """Move (or first draw) the marker of x on an ulp_plot panel: a dashed line at |x| and a
    dot on each format's curve whose range holds |x|. An x of None, 0, inf or NaN (nowhere on
    a log axis) hides the marker. Returns the marker's artists (animated: see MarkerPng)."""
    fmts = _formats(precisions)
    by_gid = {a.get_gid(): a for a in [*ax.lines, *ax.texts]}
    if "ulp-marker-line" not in by_gid:
        by_gid["ulp-marker-line"] = ax.axvline(1.0, color="black", ls="--", lw=1,
                                               gid="ulp-marker-line")
        for f in fmts:
            by_gid[f"ulp-marker-{f.name}"], = ax.plot(
                [], [], marker="o", ms=7, mfc="white", mec=FORMAT_COLORS.get(f.name, "black"),
                mew=2, ls="none", gid=f"ulp-marker-{f.name}")
        by_gid["ulp-marker-text"] = ax.text(0.02, 0.96, "", transform=ax.transAxes, va="top",
                                            fontsize=9, gid="ulp-marker-text")
    a = abs(x) if x is not None else math.nan
    lo, hi = ax.get_xlim()
    shown = x is not None and 0 < a < math.inf
    line = by_gid["ulp-marker-line"]
    line.set_visible(shown and lo <= a <= hi)
    line.set_xdata([a, a])
    for f in fmts:
        on_curve = shown and float(f.min_subnormal) <= a <= float(f.max_finite) and lo <= a <= hi
        by_gid[f"ulp-marker-{f.name}"].set_data(([a], [ulp(a, f)]) if on_curve else ([], []))
    text = by_gid["ulp-marker-text"]
    if x is None:
        text.set_text("")
    elif not shown:
        text.set_text(f"x = {x!r}: not on a log axis")
    elif not lo <= a <= hi:
        text.set_text(f"|x| = {a:.4g}: off this panel")
    else:
        text.set_text(f"|x| = {a:.4g}")
    artists = [line, text] + [by_gid[f"ulp-marker-{f.name}"] for f in fmts]
    for artist in artists:
        artist.set_animated(True)  # savefig still draws them; MarkerPng redraws only them
    return artists


class MarkerPng:
    """PNG frames of an ulp_plot whose marker moves, fast enough for a widget callback.

    The figure's static part (curves, ticks, legend) is drawn once; each frame restores it
    and draws only the marker, several times faster than a savefig of the whole figure
    (benchmarks/RECORDS.md). Give it a figure pyplot does not manage
    (``ulp_plot(..., pyplot=False)``): it becomes that figure's canvas.
    """

    def __init__(self, fig: Figure, precisions=None):
        self.fig = fig
        self.formats = _formats(precisions)
        self.canvas = FigureCanvasAgg(fig)
        self._background = None

    def png(self, x) -> bytes:
        """The figure with x marked, as PNG bytes."""
        artists = [a for ax in self.fig.axes for a in mark_ulp(ax, x, self.formats)]
        if self._background is None:
            self.canvas.draw()  # skips animated artists: the marker is not in the background
            self._background = self.canvas.copy_from_bbox(self.fig.bbox)
        self.canvas.restore_region(self._background)
        for artist in artists:
            self.fig.draw_artist(artist)
        buf = io.BytesIO()
        Image.frombuffer("RGBA", self.canvas.get_width_height(), self.canvas.buffer_rgba(),
                         "raw", "RGBA", 0, 1).save(buf, format="png", compress_level=1)
        return buf.getvalue()
