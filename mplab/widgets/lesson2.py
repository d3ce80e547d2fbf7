"""Lesson 2 widgets: move the loss scale over a real model's gradients; watch updates vanish.

    from mplab.widgets.lesson2 import loss_scale_explorer, swamping_demo
    explorer = loss_scale_explorer(fixtures.lesson_capture())   # explorer.log2_scale = 16
    demo = swamping_demo()                                       # demo.master.value = True

The numbers come from :mod:`mplab.numerics.casts` (exact counts of what torch's casts do) and
:mod:`mplab.numerics.failures`, the figures from :mod:`mplab.plots.casts`; this module only builds
the controls and shows the results.
"""

from __future__ import annotations

import html
import math

import ipywidgets as widgets

from mplab import plots
from mplab.amp.capture import KINDS, Capture
from mplab.numerics.casts import CastStats, combined, largest_safe_scale
from mplab.numerics.failures import SwampRun, finite_number, swamp_threshold, swamping_run
from mplab.numerics.formats import get_format
from mplab.numerics.histograms import data_bins, format_bands
from mplab.widgets._common import StaticView, guarded, png

__all__ = ["loss_scale_explorer", "LossScaleExplorer", "swamping_demo", "SwampingDemo",
           "SWAMP_FORMATS", "LOSS_SCALE_FORMATS", "percent", "update_rule"]

#: Formats the loss-scale explorer offers: the ones a gradient can be stored in.
LOSS_SCALE_FORMATS = ("fp16", "bf16", "fp8_e5m2", "fp8_e4m3")
#: Formats the swamping demo can keep its weight in (fp32 too, the master weights' format).
SWAMP_FORMATS = ("fp16", "bf16", "fp32", "fp8_e5m2", "fp8_e4m3")
_LOST_RED = 0.01  # a layer losing more than 1 % of its nonzero values is shown in red
#: The shares of CastStats.nonzero_row the explorer shows (each of the layer's nonzero values).
_LOST, _SUB, _OVER = "lost (of nonzero)", "subnormal (of nonzero)", "overflow (of nonzero)"


def percent(x: float) -> str:
    """A share as the widgets write it: "0", "12.3 %", or "<0.001 %" below 10^-5."""
    if x == 0:
        return "0"
    return f"{100 * x:.3g} %" if x >= 1e-5 else "<0.001 %"


def _choice(value, accepted, what: str) -> str:
    if value not in accepted:
        raise ValueError(f"unknown {what} {value!r}; accepted: " + ", ".join(map(repr, accepted)))
    return value


# --- the loss-scale explorer --------------------------------------------------------------------

class LossScaleExplorer(StaticView, widgets.VBox):
    """A captured step's values under a loss scale. Build it with :func:`loss_scale_explorer`.

    Controls a test (or a learner) can drive: `slider` (log2 of the scale, 0 to 24),
    `precision` (the format cast to), `kind`, `layer` ("" for all layers, or one layer's name:
    the histogram shows it alone); outputs: `plot` (PNG of the per-layer exponent histograms),
    `summary`, `table` (per layer: the shares of its nonzero values lost to 0, landing
    subnormal, overflowing), `message`. `scale` is the scale shown; `stats` the per-layer
    CastStats; `table_rows` the table's rows as data (layer, type and
    :meth:`~mplab.numerics.casts.CastStats.nonzero_row`); `total` all layers' CastStats together.
    """

    def __init__(self, capture: Capture, kind: str = "activation_grads",
                 precision: str = "fp16", log2_scale: int = 0):
        super().__init__()
        if not isinstance(capture, Capture):
            raise TypeError("loss_scale_explorer takes what mplab.amp.capture.capture returns, "
                            f"got {type(capture).__name__}")
        precision = get_format(precision).name
        _choice(precision, LOSS_SCALE_FORMATS, "precision")
        _choice(kind, KINDS, "kind")
        if isinstance(log2_scale, bool) or not isinstance(log2_scale, int) or not (
                0 <= log2_scale <= 24):
            raise ValueError(f"log2_scale must be a whole number from 0 to 24, got {log2_scale!r}")
        self.capture = capture
        self._quiet = False
        self._xlims: dict[str, tuple[int, int]] = {}
        self.stats: dict[str, CastStats] = {}
        self.total: CastStats | None = None
        self.table_rows: list[dict] = []
        self.slider = widgets.IntSlider(log2_scale, min=0, max=24, description="log2 scale",
                                        continuous_update=False,
                                        style={"description_width": "initial"},
                                        layout=widgets.Layout(width="420px"))
        self.slider.add_class("mplab-scale-slider")
        self.precision = widgets.Dropdown(options=LOSS_SCALE_FORMATS, value=precision,
                                          description="format",
                                          layout=widgets.Layout(width="200px"))
        self.precision.add_class("mplab-scale-format")
        self.kind = widgets.Dropdown(options=[(k.replace("_", " "), k) for k in KINDS],
                                     value=kind, description="values",
                                     layout=widgets.Layout(width="260px"))
        self.kind.add_class("mplab-scale-kind")
        self.layer = widgets.Dropdown(description="layer", layout=widgets.Layout(width="480px"))
        self.layer.add_class("mplab-scale-layer")
        self._set_layers()
        self.message = widgets.HTML()
        self.summary = widgets.HTML()
        self.summary.add_class("mplab-scale-summary")
        self.plot = widgets.Image(format="png", layout=widgets.Layout(max_width="100%",
                                                                      height="auto"))
        self.plot.add_class("mplab-scale-plot")
        self.table = widgets.HTML()
        self.table.add_class("mplab-scale-table")
        self.children = [
            widgets.HTML("<b>Loss scale explorer</b>: one training step's values, multiplied "
                         "by the scale and cast to the format."),
            widgets.HBox([self.slider, self.precision]), widgets.HBox([self.kind, self.layer]),
            self.message, self.summary, self.plot, self.table]
        self.add_class("mplab-loss-scale")
        for control in (self.slider, self.precision, self.layer):
            control.observe(self._changed, "value")
        self.kind.observe(self._kind_changed, "value")
        self._render()

    @property
    def scale(self) -> float:
        return 2.0 ** self.slider.value

    @property
    def log2_scale(self) -> int:
        return self.slider.value

    @log2_scale.setter
    def log2_scale(self, k: int) -> None:
        self.slider.value = k

    def _set_layers(self) -> None:
        names = list(self.capture.tensors(self.kind.value))
        self._quiet = True  # one redraw for a new kind, not one more for its layer list
        try:
            what = "tensors" if self.kind.value == "weight_grads" else "layers"
            self.layer.options = [(f"all {len(names)} {what}", "")] + [(n, n) for n in names]
            self.layer.value = ""
        finally:
            self._quiet = False

    @guarded
    def _kind_changed(self, change=None) -> None:
        self._set_layers()
        self._render()

    @guarded
    def _changed(self, change=None) -> None:
        if not self._quiet:
            self._render()

    def _render(self) -> None:
        self.message.value = ""
        kind, precision, s = self.kind.value, self.precision.value, self.scale
        mags = self.capture.magnitudes(kind)
        shown = {self.layer.value: mags[self.layer.value]} if self.layer.value in mags else mags
        if not mags:
            self.summary.value = f"This capture holds no {kind.replace('_', ' ')}."
            self.stats, self.total, self.table_rows = {}, None, []
            self.table.value, self.plot.value = "", b""
            return
        self.stats = {n: m.stats(precision, s, rel_error=False) for n, m in mags.items()}
        self.total = combined(list(self.stats.values()), precision, s)
        self.table_rows = [{"layer": n, "type": self.capture.type_of(n, kind), **st.nonzero_row()}
                           for n, st in self.stats.items()]
        what = self.layer.value or kind.replace("_", " ")
        self.plot.value = png(plots.exponent_histogram_plot(
            shown, precision, s, pyplot=False,
            xlim=self._xlims.setdefault(kind, _xlim(self.capture, kind)),
            title=f"{what} × 2^{self.slider.value} cast to {precision}"))
        self.summary.value = _summary_html(self.total,
                                           largest_safe_scale(list(mags.values()), precision))
        self.table.value = _table_html(self.table_rows)


def _xlim(capture: Capture, kind: str) -> tuple[int, int]:
    """A fixed log2 axis for one capture and kind, so the histogram moves and the axes stay:
    from below the smallest value (and fp16's flush edge, the lowest of the formats that
    flush anything here; bf16's is 100 binades further down) to past the largest at 2^24."""
    mags = [m for m in capture.magnitudes(kind).values() if m.values.size]
    bins = data_bins(mags)  # the bins the histogram draws: they hold every value
    lowest = format_bands("fp16")[0].hi
    lo = min(bins[0] if mags else 0, lowest) - 2
    hi = max((bins[-1] if mags else 0) + 24, get_format("fp16").emax + 2) + 2
    return math.floor(lo), math.ceil(hi)


def _summary_html(total: CastStats, safe: float) -> str:
    shares = total.nonzero_row()
    over_style = ' style="color:#b00020;font-weight:bold"' if total.overflow else ""
    safe_text = f"2^{int(math.log2(safe))}" if math.isfinite(safe) and safe >= 1 else f"{safe:g}"
    share = percent if total.nonzero else (lambda x: "–")
    return (f'<div style="font-size:13px;margin:4px 0">At scale 2^{int(math.log2(total.scale))} '
            f"({total.scale:,.0f}), of the {total.nonzero:,} nonzero values: "
            f"<b>{share(shares[_LOST])}</b> lost to 0, {share(shares[_SUB])} "
            f"subnormal (few bits left), <span{over_style}>{share(shares[_OVER])} "
            f"overflow</span>. Largest safe scale for {total.precision}: {safe_text}.</div>")


def _table_html(rows: list[dict]) -> str:
    head = ["layer", "type", "nonzero", _LOST, _SUB, _OVER, "max |x·scale|"]
    th = "".join(f'<th style="padding:1px 8px;text-align:left">{h}</th>' for h in head)
    body = []
    for r in rows:
        lost_style = (' style="color:#b00020;font-weight:bold"' if r[_LOST] > _LOST_RED
                      else "")
        over_style = ' style="color:#b00020;font-weight:bold"' if r[_OVER] else ""
        cells = [f"<code>{html.escape(r['layer'])}</code>", html.escape(r["type"]),
                 f"{r['nonzero']:,}", f"<span{lost_style}>{percent(r[_LOST])}</span>",
                 percent(r[_SUB]), f"<span{over_style}>{percent(r[_OVER])}</span>",
                 f"{r['max |x·scale|']:.4g}"]
        body.append("<tr>" + "".join(f'<td style="padding:1px 8px">{c}</td>' for c in cells)
                    + "</tr>")
    return ('<table style="border-collapse:collapse;font-size:12px;line-height:1.4">'
            f'<thead><tr style="border-bottom:1px solid #999">{th}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table>")


def loss_scale_explorer(capture: Capture, kind: str = "activation_grads",
                        precision: str = "fp16", log2_scale: int = 0) -> LossScaleExplorer:
    """Per-layer exponent histograms and cast table of a :func:`mplab.amp.capture.capture`, with a
    log2 loss-scale slider (2^0 to 2^24), a format and a kind of value to look at."""
    return LossScaleExplorer(capture, kind, precision, log2_scale)


# --- swamping and master weights ----------------------------------------------------------------

def _signed(x: float) -> str:
    return f"{x:g}".replace("-", "−")  # a real minus sign, as in the rule's "−"


def update_rule(grad: float) -> str:
    """The SGD step for a fixed gradient as a learner reads it: the rule, the gradient's
    value, and what the step does to w (never "− lr × (−1)", a minus of a minus)."""
    g = finite_number(grad, "grad")
    rule = f"w ← w − lr × g, with gradient g = {_signed(g)}"
    if g == 0:
        return rule + ": the weight never moves"
    times = "" if abs(g) == 1 else f"{abs(g):g} × "
    return rule + f": each step {'adds' if g < 0 else 'subtracts'} {times}lr"


class SwampingDemo(StaticView, widgets.VBox):
    """``w ← w − lr·grad`` repeated, with the weight kept in a narrow format or behind an fp32
    master copy. Build it with :func:`swamping_demo`.

    Controls: `lr` (log slider), `precision` (the format the weight is kept in), `master`
    (toggle); outputs: `plot`, `summary`, `message`; `run` is the
    :class:`mplab.numerics.failures.SwampRun` shown.
    """

    def __init__(self, w0: float = 1.0, grad: float = -1.0, lr: float = 1e-4, steps: int = 1000,
                 precision: str = "fp16", master: bool = False):
        super().__init__()
        precision = _choice(get_format(precision).name, SWAMP_FORMATS, "precision")
        self.w0 = finite_number(w0, "w0")
        self.grad = finite_number(grad, "grad")
        if not (isinstance(lr, int | float) and not isinstance(lr, bool) and 1e-6 <= lr <= 1):
            raise ValueError(f"lr must be a number from 1e-6 to 1, got {lr!r}")
        self.steps = steps
        swamping_run(self.w0, 0.0, steps)  # checks steps (a whole number up to 10^6)
        self.run: SwampRun | None = None
        self.lr = widgets.FloatLogSlider(lr, base=10, min=-6, max=0, step=0.25,
                                         description="learning rate", readout_format=".2g",
                                         continuous_update=False,
                                         style={"description_width": "initial"},
                                         layout=widgets.Layout(width="420px"))
        self.lr.add_class("mplab-swamp-lr")
        self.precision = widgets.Dropdown(options=SWAMP_FORMATS, value=precision,
                                          description="weights in",
                                          layout=widgets.Layout(width="200px"))
        self.precision.add_class("mplab-swamp-format")
        self.master = widgets.ToggleButton(master, description="fp32 master weights",
                                           icon="check" if master else "",
                                           layout=widgets.Layout(width="190px"))
        self.master.add_class("mplab-swamp-master")
        self.message = widgets.HTML()
        self.summary = widgets.HTML()
        self.summary.add_class("mplab-swamp-summary")
        self.plot = widgets.Image(format="png", layout=widgets.Layout(max_width="100%",
                                                                      height="auto"))
        self.plot.add_class("mplab-swamp-plot")
        self.children = [
            widgets.HTML(f"<b>Swamping</b>: from w0 = {_signed(self.w0)}, {steps:,} steps "
                         f"of {update_rule(self.grad)}."),
            widgets.HBox([self.lr, self.precision, self.master]), self.message, self.summary,
            self.plot]
        self.add_class("mplab-swamping")
        for control in (self.lr, self.precision, self.master):
            control.observe(self._changed, "value")
        self._render()

    @guarded
    def _changed(self, change=None) -> None:
        self._render()

    def _render(self) -> None:
        self.message.value = ""
        self.master.icon = "check" if self.master.value else ""
        update = -self.lr.value * self.grad
        precision = self.precision.value
        self.run = swamping_run(self.w0, update, self.steps, precision, master=self.master.value)
        self.plot.value = png(plots.swamping_plot(self.run, pyplot=False))
        threshold = swamp_threshold(update, precision)
        where = ("The update itself rounds to 0 in " + precision if threshold == 0 else
                 f"In {precision}, an update of {abs(update):.3g} vanishes once |w| ≥ "
                 f"{threshold:g}")
        self.summary.value = (
            f'<div style="font-size:13px;margin:4px 0"><b>{self.run.lost_steps:,} of '
            f"{self.run.steps:,} updates lost</b>; the weight moved "
            f"{100 * self.run.applied:.3g} % of the way it should have "
            f"(ends at {self.run.final:.6g}, exact {self.run.expected:.6g}). {where}.</div>")


def swamping_demo(w0: float = 1.0, grad: float = -1.0, lr: float = 1e-4, steps: int = 1000,
                  precision: str = "fp16", master: bool = False) -> SwampingDemo:
    """SGD steps ``w ← w − lr·grad`` on one weight kept in a format (or as an fp32 master
    copy), with a learning-rate slider, a format and a master-weights toggle."""
    return SwampingDemo(w0, grad, lr, steps, precision, master)
