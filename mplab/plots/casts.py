"""Lesson 2's figures: what a cast does to a tensor's values.

    exponent_histogram_plot(cap.magnitudes("activation_grads"), "fp16", 2**10)
    scale_sweep_plot(scale_sweep(mags, "fp16"), underflow_tol=0.05)
    swamping_plot(swamping_run(1.0, 1e-4, 1000, "fp16"))

Where the values land among a format's bands (flushed to 0, subnormal, normal, overflow) at a
loss scale, what every scale from 2^0 to 2^24 loses, and the updates a narrow weight drops.
Every share drawn or written is of the nonzero values (zeros lose nothing), as in the tables.
Every number drawn is computed by :mod:`mplab.numerics.casts`, :mod:`mplab.numerics.histograms` and
:mod:`mplab.numerics.failures`; the colours of the formats are :data:`mplab.plots.FORMAT_COLORS`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle, StepPatch

from mplab.numerics.casts import Magnitudes, as_scale, good_scale_window
from mplab.numerics.failures import SwampRun
from mplab.numerics.formats import get_format
from mplab.numerics.histograms import ExponentHistogram, data_bins, exponent_histogram, format_bands
from mplab.plots.formats import FORMAT_COLORS, new_figure

__all__ = ["BAND_COLORS", "exponent_histogram_plot", "scale_sweep_plot", "swamping_plot"]

#: Shading of a format's bands (see mplab.numerics.histograms.format_bands).
BAND_COLORS = {"zero": "#9d9d9d", "subnormal": "#f2c45a", "normal": "#9bd5a4",
               "overflow": "#e45756"}


#: Up to this many histograms get a line each; more are drawn as their total only.
_MAX_LAYER_LINES = 8
#: Text size of the histogram's labels, legend and summary box (points, at 80 dpi).
_FONT = 10


def _histograms(values, bins) -> tuple[dict, list | None]:
    """label -> ExponentHistogram, and the Magnitudes behind them (None when given histograms,
    which carry no exact cast counts)."""
    if isinstance(values, ExponentHistogram):
        return {"values": values}, None
    if isinstance(values, Mapping):
        items = dict(values)
    elif isinstance(values, list | tuple) and values and not isinstance(values[0], numbers.Real):
        items = {f"tensor {i}": v for i, v in enumerate(values)}
    else:
        items = {"values": values}
    if not items:
        raise ValueError("nothing to plot: got an empty dict or list; pass a tensor, a list or "
                         "dict of tensors, Magnitudes or ExponentHistograms")
    if all(isinstance(v, ExponentHistogram) for v in items.values()):
        return items, None
    mags = {k: v if isinstance(v, Magnitudes) else Magnitudes(v) for k, v in items.items()}
    bins = data_bins(list(mags.values())) if bins is None else bins  # one set: they add up
    return {k: exponent_histogram(m, bins) for k, m in mags.items()}, list(mags.values())


def exponent_histogram_plot(values, precision="fp16", scale=1.0, ax=None, *,
                            bins=None, xlim=None, title=None,
                            pyplot: bool = True) -> Figure:
    """Histogram of log2|x · scale| with the format's bands shaded: flushed to 0, subnormal,
    normal, overflow (:func:`mplab.numerics.histograms.format_bands`).

    values: a tensor, a list or dict of tensors (one line per layer, and "all" filled),
    :class:`~mplab.numerics.casts.Magnitudes` (sorted once: redrawing for a new scale then only
    shifts the bins) or :class:`~mplab.numerics.histograms.ExponentHistogram`. A scale of 2^k
    moves every value k binades right; the unscaled total stays as a dashed outline, and a box
    gives the exact shares of the nonzero values a real cast would flush, leave subnormal and
    overflow (not for bare histograms).
    bins: integer log2 edges; None (the default) for the bins that hold every value
    (:func:`mplab.numerics.histograms.data_bins`), so the axis reaches the smallest and the
    largest.
    Values outside given bins are not drawn, and the legend counts them.
    xlim: (lo, hi) in log2 units; fix it to keep the axis still while the scale changes.
    ax: draw there; otherwise a new figure (made by pyplot unless ``pyplot=False``).
    Returns the figure.
    """
    f = get_format(precision)
    s = as_scale(scale)
    shift = math.log2(s)
    hists, mags = _histograms(values, bins)
    first = next(iter(hists.values()))
    total = first
    for h in list(hists.values())[1:]:
        total = total + h
    edges = total.edges.astype(float)
    if ax is None:
        fig = new_figure((10.5, 4.2), pyplot)  # the right quarter: legend and summary box
        ax = fig.subplots()
        fig.subplots_adjust(left=0.07, right=0.72, bottom=0.13, top=0.9)
    bands = format_bands(f)
    nz = np.flatnonzero(total.counts)
    if xlim is None:
        data = (edges[nz[0]] + shift, edges[nz[-1] + 1] + shift) if nz.size else (
            edges[0], edges[-1])
        zero_edge, over_edge = bands[0].hi, bands[-1].lo
        lo = max(min(data[0], zero_edge) - 2, data[0] - 20)
        hi = min(max(data[1], over_edge) + 2, data[1] + 20)
        xlim = (math.floor(lo), math.ceil(hi))
    # Patches go in with add_artist: add_patch recomputes the data limits for each, which
    # made a redraw of the lesson model's figure far slower (benchmarks/RECORDS.md,
    # benchmarks/bench_capture.py); the limits are set explicitly below anyway.
    ax.set_xlim(*xlim)
    for b in bands:
        a, c = max(b.lo, xlim[0]), min(b.hi, xlim[1])
        if a < c:
            ax.add_artist(Rectangle((a, 0), c - a, 1, transform=ax.get_xaxis_transform(),
                                    color=BAND_COLORS[b.name], alpha=0.35, lw=0,
                                    gid=f"band-{b.name}"))
            _band_label(ax, b, a, c)

    def share(h):
        return h.counts / max(h.nonzero, 1)

    def stairs(h, at, **kw):
        return ax.add_artist(StepPatch(share(h), edges + at, baseline=0, **kw))

    handles = []
    if shift:
        handles.append(stairs(total, 0, fill=False, ec="0.35", ls="--", lw=1,
                              label="all, before scaling", gid="hist-unscaled"))
    handles.append(stairs(total, shift, fill=True, color="#4c78a8", alpha=0.55, lw=0,
                          label="all layers" if len(hists) > 1 else "values", gid="hist-all"))
    if 1 < len(hists) <= _MAX_LAYER_LINES:
        import matplotlib as mpl

        cmap = mpl.colormaps["viridis"]
        for i, (name, h) in enumerate(hists.items()):
            handles.append(stairs(h, shift, fill=False, ec=cmap(i / (len(hists) - 1)), lw=1,
                                  label=_short(name), gid=f"hist-{name}"))
    if shift and nz.size:
        peak = int(np.argmax(total.counts))
        x0, y = edges[peak] + 0.5, share(total)[peak]
        ax.annotate("", xy=(x0 + shift, y * 1.05), xytext=(x0, y * 1.05),
                    arrowprops={"arrowstyle": "->", "color": "black", "lw": 1.2})
        ax.text(x0 + shift / 2, y * 1.08, f"× 2^{shift:g}: {shift:g} binades right"
                if shift == int(shift) else f"× {s:g}", ha="center", va="bottom",
                fontsize=_FONT)
    drawn = [total, *hists.values()] if len(hists) <= _MAX_LAYER_LINES else [total]
    top = max(float(share(h).max()) for h in drawn) if nz.size else 1.0
    ax.set_ylim(0, top * 1.4 or 1.0)
    ax.set_xlabel("log2 |x × scale|", fontsize=_FONT + 1)
    ax.set_ylabel("share of nonzero values", fontsize=_FONT + 1)
    ax.tick_params(labelsize=_FONT)
    ax.set_title(title or f"{f.name}: where the values land at scale {_scale_label(s)}",
                 fontsize=_FONT + 2)
    if mags is not None:
        st = [m.stats(f, s, rel_error=False) for m in mags]
        nonzero = sum(x.nonzero for x in st)
        under, sub, over = (sum(getattr(x, k) for x in st)
                            for k in ("underflow", "subnormal", "overflow"))
        pct = (lambda n: f"{100 * n / nonzero:.3g} %") if nonzero else (lambda n: "–")
        text = (f"of the {nonzero:,} nonzero values:\nlost to 0  {pct(under)}\n"
                f"subnormal  {pct(sub)}\noverflow  {pct(over)}")
        ax.text(1.02, 0.02, text, transform=ax.transAxes, fontsize=_FONT, va="bottom",
                gid="cast-summary")
    labels = [h.get_label() for h in handles]
    if len(hists) > _MAX_LAYER_LINES:
        labels[-1] = f"all {len(hists)} layers"
    outside = total.below + total.above
    if outside:  # only with bins given: the default bins hold every value
        handles.append(Rectangle((0, 0), 0, 0, visible=False))
        labels.append(f"{outside:,} values outside\nthe bins, not drawn")
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=_FONT,
              frameon=False)
    return ax.figure


def _band_label(ax, band, a: float, c: float) -> None:
    """The band's name across its top; a band too narrow for it (fp16's overflow band is one
    binade or two) gets it one line lower, reaching into its neighbour from the axis edge, so
    that no label is turned on its side or overlaps another."""
    x0, x1 = ax.get_xlim()
    axis_in = ax.figure.get_figwidth() * ax.get_position().width
    need = len(band.label) * _FONT * 0.6 / 72 / axis_in * (x1 - x0) + 1  # data units
    at, ha, y = (a + c) / 2, "center", 0.98
    if c - a < need:
        y = 0.88
        at, ha = (c, "right") if c >= x1 else (a, "left") if a <= x0 else (at, "center")
    ax.text(at, y, band.label, transform=ax.get_xaxis_transform(), ha=ha, va="top",
            fontsize=_FONT, gid=f"band-label-{band.name}",
            bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.7})


def _short(name: str, width: int = 26) -> str:
    """A layer name that fits a legend: its tail, e.g. '…layer.0.attention.self.query'."""
    return name if len(name) <= width else "…" + name[-(width - 1):]


def _scale_label(s: float) -> str:
    k = math.log2(s)
    return f"2^{k:g}" if k == int(k) else f"{s:g}"


def scale_sweep_plot(sweep, ax=None, *, underflow_tol: float = 1e-3, overflow_tol: float = 0.0,
                     pyplot: bool = True) -> Figure:
    """The shares of the nonzero values lost to 0 and overflowing in a
    :func:`mplab.numerics.casts.scale_sweep`, against log2 of the scale, with the good window
    shaded: the scales that lose at most underflow_tol and overflow at most overflow_tol of the same
    nonzero values (:func:`mplab.numerics.casts.good_scale_window`, computed here so that the curve
    and the window share one denominator). The y axis is linear up to 10^-6 and logarithmic
    above, so that a handful of overflowing values shows. Returns the figure."""
    rows = list(sweep)
    if not rows:
        raise ValueError("the sweep is empty; pass what mplab.numerics.casts.scale_sweep returns")
    window = good_scale_window(rows, underflow_tol, overflow_tol)
    if ax is None:
        fig = new_figure((6.5, 3.2), pyplot)
        ax = fig.subplots()
        fig.subplots_adjust(left=0.12, right=0.97, bottom=0.16, top=0.88)
    k = [math.log2(r["scale"]) for r in rows]
    ax.plot(k, [r["lost (of nonzero)"] for r in rows], "o-", ms=3, color="#4c78a8",
            label="lost to 0", gid="sweep-lost")
    ax.plot(k, [r["overflow (of nonzero)"] for r in rows], "s-", ms=3, color="#e45756",
            label="overflow", gid="sweep-overflow")
    if underflow_tol > 0:  # the tolerance the window is read against, on the same axis
        ax.axhline(underflow_tol, color="#4c78a8", lw=0.8, ls=":", gid="sweep-tol")
    over = "no overflow" if overflow_tol == 0 else f"overflow ≤ {_share(overflow_tol)}"
    if window:
        ax.axvspan(math.log2(window[0]), math.log2(window[1]), color=BAND_COLORS["normal"],
                   alpha=0.35, lw=0, gid="sweep-window",
                   label=f"good scales: lost ≤ {_share(underflow_tol)}, {over}")
    ax.set_xlabel("log2 scale")
    ax.set_ylabel("share of the nonzero values")
    ax.set_yscale("symlog", linthresh=1e-6)
    ax.set_ylim(0, 1)
    ax.set_title(sweep.title if hasattr(sweep, "title") and sweep.title else "Scale sweep",
                 fontsize=10)
    ax.grid(True, alpha=0.25)
    ax.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0.0, 0.1))  # above the zeros
    if not window:
        ax.text(0.5, 0.5, f"no scale loses ≤ {_share(underflow_tol)} with {over}",
                transform=ax.transAxes, ha="center", fontsize=9, gid="sweep-no-window")
    return ax.figure


def _share(x: float) -> str:
    return f"{100 * x:.3g} %"


def swamping_plot(run, ax=None, *, pyplot: bool = True) -> Figure:
    """The weight over the steps of a :func:`mplab.numerics.failures.swamping_run`: what the
    format kept (and the fp32 master copy, if any) against the exact sum, with the first lost
    update marked. Returns the figure."""
    if not isinstance(run, SwampRun):
        raise TypeError("swamping_plot takes what mplab.numerics.failures.swamping_run returns, "
                        f"got {type(run).__name__}")
    if ax is None:
        fig = new_figure((6.5, 3.0), pyplot)
        ax = fig.subplots()
        fig.subplots_adjust(left=0.12, right=0.97, bottom=0.16, top=0.88)
    steps = np.arange(run.steps + 1)
    ax.plot(steps, run.exact, "--", color="0.4", lw=1, label="exact: w0 + k·update")
    if run.master_weights is not None:
        ax.plot(steps, run.master_weights, color=FORMAT_COLORS["fp32"], lw=2.5, alpha=0.6,
                label="fp32 master weight")
    ax.plot(steps, run.weights, color=FORMAT_COLORS.get(run.precision, "#f58518"), lw=1.5,
            label=f"weight the model uses ({run.precision})")
    if run.first_lost is not None:
        k = run.first_lost
        ax.axvline(k, color="#b00020", lw=1, ls=":")
        ax.annotate(f"step {k}: updates start to vanish", xy=(k, run.weights[k]),
                    xytext=(0.45, 0.12), textcoords="axes fraction", fontsize=8,
                    color="#b00020", arrowprops={"arrowstyle": "->", "color": "#b00020"})
    how = "fp32 master weights" if run.master else f"weights kept in {run.precision}"
    ax.set_title(f"w ← w + {run.update:.3g}, {how}: {run.lost_steps} of {run.steps} "
                 "updates lost", fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("weight")
    ax.grid(True, alpha=0.25)
    ax.legend(fontsize=8, loc="upper left")
    return ax.figure
