"""Matplotlib figures the lessons share. Every number drawn here is computed by mplab.

The colours of the formats, the spacing of their numbers (lesson 1), a loss scaler's run
(lesson 3) and training losses (lesson 4). Lesson 2's figures of what a cast does to a
tensor's values are :mod:`mplab.cast_plots`.
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FixedLocator, NullLocator
from PIL import Image

from mplab.formats import FORMATS, FloatFormat, get_format, ulp

__all__ = ["FORMAT_COLORS", "new_figure", "ulp_steps", "ulp_plot", "mark_ulp", "closeup_range",
           "MarkerPng", "scaler_timeline_plot", "loss_curves_plot", "learned_share",
           "LossCurveWarning"]

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
    and draws only the marker. Measured on a 2-core CPU: savefig of the whole figure ~200 ms,
    a frame here ~30 ms (about 12 ms of it PNG encoding). Give it a figure pyplot does not
    manage (``ulp_plot(..., pyplot=False)``): it becomes that figure's canvas.
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


# --- lessons 3 and 4: a loss scaler's run, training losses --------------------------------------

def scaler_timeline_plot(history, ax=None, *, init_scale=None, pyplot: bool = True) -> Figure:
    """A loss scaler's run: log2 of the scale each iteration used (a staircase), the iterations
    that found an inf/NaN and skipped their step (red crosses), and the growth tracker (grey
    bars, right axis). `history` is ``mplab.scaler.GradScaler.history`` (records with
    ``scale``, ``new_scale``, ``growth_tracker``, ``found_inf``), or an fp16
    ``mplab.train.TrainResult`` (its scales and skipped steps; a run records no tracker, so
    there are no bars); with no records yet the axes show `init_scale` alone. Iterations
    count from 1, as a run's `skipped_steps` do. Returns the figure."""
    records = _scaler_records(history)
    if any(not all(hasattr(r, k) for k in ("scale", "new_scale", "growth_tracker", "found_inf"))
           for r in records):
        raise TypeError("scaler_timeline_plot takes GradScaler.history: records with scale, "
                        "new_scale, growth_tracker and found_inf, or an fp16 TrainResult")
    if ax is None:
        fig = new_figure((7.0, 3.0), pyplot)
        ax = fig.subplots()
        fig.subplots_adjust(left=0.1, right=0.9, bottom=0.17, top=0.88)
    bars = ax.twinx()
    it = np.arange(1, len(records) + 1)  # iteration k at x = k, counting from 1
    trackers = [r.growth_tracker for r in records if r.growth_tracker is not None]
    if trackers:
        bars.bar(it, trackers, color="0.85", width=0.8, label="growth tracker (after update)")
    if records:
        scales = [r.scale for r in records] + [records[-1].new_scale]
        logs = [math.log2(s) if s > 0 else -math.inf for s in scales]
        ax.step(np.arange(len(scales)) + 0.5, logs, where="post", color=FORMAT_COLORS["fp16"],
                lw=2, label="log2 scale used")
        bad = [k for k, r in enumerate(records, 1) if r.found_inf]
        if bad:
            ax.plot(bad, [logs[k - 1] for k in bad], "x", color="#b00020", ms=9, mew=2,
                    label="inf/NaN: step skipped, scale backs off")
    elif init_scale:
        ax.axhline(math.log2(init_scale), color=FORMAT_COLORS["fp16"], lw=2,
                   label="log2 init_scale")
    ax.set_zorder(bars.get_zorder() + 1)  # the scale line in front of the bars
    ax.patch.set_visible(False)
    ax.set_xlabel("iteration")
    ax.set_ylabel("log2 scale")
    bars.set_ylabel("growth tracker" if trackers else "", color="0.45")
    bars.set_ylim(0, max(trackers + [1]) * 3)
    if not trackers:
        bars.set_yticks([])
    ax.set_xlim(0.2, max(len(records), 10) + 0.8)
    skipped = sum(bool(r.found_inf) for r in records)
    ax.set_title(f"{len(records)} iterations, {skipped} skipped", fontsize=10)
    ax.grid(True, alpha=0.25)
    handles, labels = ax.get_legend_handles_labels()
    h2, l2 = bars.get_legend_handles_labels()
    ax.legend(handles + h2, labels + l2, fontsize=7, loc="best")
    return ax.figure


class _Update(NamedTuple):
    scale: float
    new_scale: float
    growth_tracker: int | None
    found_inf: bool


def _scaler_records(history) -> list:
    """GradScaler.history as a list, or the same records read off a TrainResult's scales."""
    if not (hasattr(history, "scales") and hasattr(history, "skipped_steps")):
        return list(history)
    if not history.scales and history.losses:
        raise TypeError(f"this {history.precision} run used no GradScaler (only fp16 does), so "
                        "it has no scale to plot")
    first = history.config.get("init_scale", 2.0**16)
    used = [first] + history.scales[:-1]
    skipped = set(history.skipped_steps)
    return [_Update(s, new, None, step in skipped)
            for step, (s, new) in enumerate(zip(used, history.scales), 1)]


class LossCurveWarning(UserWarning):
    """A loss curve drawn from a run that has not learned: it says nothing about precision."""


def learned_share(losses, chance: float = math.log(2)) -> float:
    """How far a run's loss fell from `chance` (ln 2 for two classes: a head that knows
    nothing) towards 0, as a share: the mean of its last quarter of steps (at least 3)
    against `chance`. 0: still at chance; 1: loss 0. A curve under 1/4 has not learned yet."""
    losses = np.asarray(losses, dtype=float)
    if losses.size == 0:
        return 0.0
    tail = losses[-max(3, losses.size // 4):]
    return float((chance - tail.mean()) / chance)


def running_mean(values, n: int) -> np.ndarray:
    """The mean of each value and the up to n - 1 before it: from the first step on, so a
    smoothed curve starts where its run starts."""
    values = np.asarray(values, dtype=float)
    total = np.concatenate([[0.0], np.cumsum(values)])
    ends = np.arange(1, values.size + 1)
    starts = np.maximum(ends - n, 0)
    return (total[ends] - total[starts]) / (ends - starts)


def loss_curves_plot(results, ax=None, *, smooth: int = 10, chance: float = math.log(2),
                     pyplot: bool = True) -> Figure:
    """Training losses of several runs side by side (a list or dict of
    ``mplab.train.TrainResult``): each run's per-step loss faint, its running mean over `smooth`
    steps bold (`running_mean`: from step 1, so runs of any length are smoothed alike and
    equal steps give equal points), skipped fp16 steps as crosses, chance (`chance`) dotted.
    A run shorter than twice `smooth` is marked with dots. Each run has its own line style;
    runs with the same losses bit for bit share one line and one label ("fp32 = fp16"), so
    none hides under another. A run whose loss has not fallen a quarter of the way from
    `chance` (`learned_share`) is labelled so, with a LossCurveWarning: its curve shows no
    learning to compare. Returns the figure."""
    runs = dict(results) if isinstance(results, Mapping) else {
        f"{r.precision} on {r.device}": r for r in results}
    if not runs or not all(hasattr(r, "losses") for r in runs.values()):
        raise TypeError("loss_curves_plot takes TrainResults (what mplab.train.train returns), "
                        "as a list or a dict of label -> result")
    lines: dict[tuple, list] = {}  # the losses -> the labels and first result drawing them
    for label, r in runs.items():
        lines.setdefault(tuple(r.losses), []).append((label, r))
    if ax is None:
        fig = new_figure((6.5, 3.2), pyplot)
        ax = fig.subplots()
        fig.subplots_adjust(left=0.11, right=0.97, bottom=0.16, top=0.88)
    colors = {"fp32": FORMAT_COLORS["fp32"], "fp16": FORMAT_COLORS["fp16"],
              "bf16": FORMAT_COLORS["bf16"]}
    smoothed = False
    for i, same in enumerate(lines.values()):
        label, r = same[0]
        losses = np.asarray(r.losses, dtype=float)
        if losses.size == 0:
            continue
        if len(same) > 1:
            label = " = ".join(name for name, _ in same) + " (same losses, bit for bit)"
        if learned_share(losses, chance) < 0.25:
            warnings.warn(f"{label}: after {losses.size} steps its loss is still near chance "
                          f"({chance:.3f}): its curve shows no learning to compare (train "
                          "longer, or from a pretrained model)", LossCurveWarning, stacklevel=2)
            label += ": not learning yet"
        color = colors.get(getattr(r, "precision", ""), f"C{i}")
        style = ("-", "--", ":", "-.")[i % 4]
        steps = np.arange(1, losses.size + 1)
        marker = "o" if losses.size < 2 * smooth else None  # a short run's steps, as dots
        if smooth > 1:
            ax.plot(steps, losses, color=color, alpha=0.25, lw=0.8)
            ax.plot(steps, running_mean(losses, smooth), color=color, lw=2, ls=style,
                    marker=marker, ms=4, label=label)
            smoothed = True
        else:
            ax.plot(steps, losses, color=color, lw=2, ls=style, marker=marker, ms=4, label=label)
        skipped = [s for s in getattr(r, "skipped_steps", []) if 1 <= s <= losses.size]
        if skipped:
            ax.plot(skipped, losses[np.asarray(skipped) - 1], "x", color="#b00020", ms=6)
    ax.axhline(chance, color="0.5", lw=0.8, ls=":", label=(
        f"chance: ln 2 = {chance:.3f}" if math.isclose(chance, math.log(2))
        else f"chance: {chance:.3f}"))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title("Training loss" + (f" (faint: each step; bold: mean of the last {smooth})"
                                    if smoothed else ""),
                 fontsize=10)
    ax.grid(True, alpha=0.25)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    return ax.figure


_PATH_COLORS = {"torch": "#ee4c2c", "accelerate": "#7b1fa2", "trainer": "#f9a825"}


def paths_chart(profiles, ax=None, *, pyplot: bool = True) -> Figure:
    """The course's chart of the ways to train, placed by measurement
    (``mplab.train.compare.profiles()``): ease of use across (fewer lines of code to the
    right), ability to customise up (how many of the training step's parts your code writes
    itself). Returns the figure."""
    rows = list(profiles)
    if not rows or not all({"path", "lines of code", "steps you write"} <= set(r) for r in rows):
        raise TypeError("paths_chart takes what mplab.train.compare.profiles() returns")
    if ax is None:
        fig = new_figure((5.5, 4.0), pyplot)
        ax = fig.subplots()
        fig.subplots_adjust(left=0.14, right=0.95, bottom=0.15, top=0.9)
    total = int(rows[0]["steps you write"].split(" of ")[1])
    for r in rows:
        written = int(r["steps you write"].split(" of ")[0])
        ax.scatter(r["lines of code"], written, s=160, color=_PATH_COLORS.get(r["path"], "0.4"),
                   zorder=3)
        ax.annotate(f"{r['path']}\n{r['lines of code']} lines, writes {written}/{total}",
                    (r["lines of code"], written), textcoords="offset points", xytext=(10, -4),
                    fontsize=8)
    most = max(r["lines of code"] for r in rows)
    ax.set_xlim(most * 1.25, -most * 0.5)  # fewer lines is easier: easier to the right
    ax.set_xticks([t for t in ax.get_xticks() if 0 <= t <= most * 1.25])
    ax.set_xlim(most * 1.25, -most * 0.5)  # set_xticks may widen the limits again
    ax.set_ylim(-0.8, total + 0.8)
    ax.set_xlabel("ease of use →  (lines of code you write, fewer to the right)")
    ax.set_ylabel("ability to customise ↑  (steps you write)")
    ax.set_title("The ways to train, measured from the code that runs", fontsize=10)
    ax.grid(True, alpha=0.25)
    return ax.figure
