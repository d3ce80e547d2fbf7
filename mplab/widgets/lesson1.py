"""Lesson 1 widget: the precision explorer.

    from mplab.widgets.lesson1 import precision_explorer
    explorer = precision_explorer(0.1)
    explorer          # show it; explorer.value is the number, readable and settable from Python

One number in every format side by side: its bits as coloured boxes (click one to flip it), its
neighbours in each format (◀ ▶), what each format stores and what that costs, and where the number
sits on the plot of spacing against magnitude. Every figure comes from mplab.numerics.formats,
mplab.numerics.explain and mplab.plots; this module only builds the controls and renders results.
Any format of mplab.numerics.formats.ALL_FORMATS can be a row: e8m0 has no sign bit to draw, fp4 and
fp6 have 4 and 6 bits and no inf or NaN, the FNUZ formats no -0 (its pattern is NaN).
"""

from __future__ import annotations

import dataclasses
import functools
import html
import math
import re
import sys
from typing import NamedTuple

import ipywidgets as widgets
import traitlets

from mplab import plots
from mplab.fixtures import layer_weight
from mplab.numerics import explain, formats
from mplab.numerics.formats import FloatFormat
from mplab.widgets._common import StaticView, guarded

__all__ = ["precision_explorer", "PrecisionExplorer", "read_number", "Reading", "presets",
           "FIELD_COLORS"]

#: Colour of a bit box by field: (bit is 1, bit is 0).
FIELD_COLORS = {
    "sign": ("#c0392b", "#f5d5d1"),
    "exponent": ("#1f6fb4", "#d3e4f4"),
    "mantissa": ("#b86e00", "#f7e4c3"),
}
ACCEPTED = "numbers like 0.1, -1e-8, 65504, 1/3, 2**-24, pi, inf or nan"


# --- what the explorer reads and shows (plain functions: tests call them directly) ----------

def presets() -> list[tuple[str, str]]:
    """The preset dropdown's (label, text) pairs; the text is read like typed text."""
    w = layer_weight()
    return [("0.1", "0.1"), ("65504", "65504"), ("1e-8", "1e-8"), ("π", "pi"), ("1/3", "1/3"),
            ("70000", "70000"), ("448", "448"),
            (f"a weight of nn.Linear(768, 768) as initialised (seed 0, weight[0, 0]) = {w:.4g}",
             repr(w))]


class Reading(NamedTuple):
    """What the explorer makes of typed text: the Python float, and a word if that lost it."""

    value: float
    note: str = ""


def read_number(text: str) -> Reading:
    """The Python float the explorer holds for what a learner typed (via formats.parse_number).

    Raises ValueError naming what was given and what is accepted.
    """
    if len(text) > 100:
        raise ValueError(f"{text[:30]!r}… is too long (100 characters at most); try {ACCEPTED}")
    exact = formats.parse_number(text)  # ValueError: "could not read 'abc' as a number; try ..."
    try:
        x = float(exact)
        if math.isinf(x) and not re.search("inf|∞", text, re.IGNORECASE):
            raise OverflowError  # "1e99999999" comes back from parse_number as inf already
    except OverflowError:
        raise ValueError(f"{text!r} is larger than the largest Python float "
                         f"({sys.float_info.max!r}), the type the explorer holds; try a smaller "
                         "number, or inf") from None
    if x == 0 and exact != 0:
        return Reading(x, f"{text.strip()} is closer to 0 than the smallest Python float "
                          f"({math.ulp(0.0)!r}), so the explorer holds {x!r}.")
    return Reading(x)


def _num(v: float) -> str:
    return "—" if v != v else f"{v:.3g}"


def _field(f: FloatFormat, bit: int) -> str:
    """The field that bit position (0 = least significant) belongs to."""
    if f.signed and bit == f.bits - 1:
        return "sign"
    return "exponent" if bit >= f.man_bits else "mantissa"


# --- the widget --------------------------------------------------------------------------

class _SignedFloat(traitlets.CFloat):
    """A float trait that also notifies 0.0 -> -0.0 (== calls them equal; their bits differ)."""

    def set(self, obj, value):
        old = obj._trait_values.get(self.name)
        super().set(obj, value)
        new = obj._trait_values[self.name]
        if old == new == 0 and math.copysign(1, old) != math.copysign(1, new):
            obj._notify_trait(self.name, old, new)


class _BitRow:
    """One format's row: name, ◀, bit boxes grouped by field, ▶, stored value."""

    def __init__(self, f: FloatFormat, explorer: PrecisionExplorer, styles, bit_layout, width):
        self.f, self.bits = f, None
        self.buttons = {}  # bit position (0 = least significant) -> Button
        groups = {"sign": [], "exponent": [], "mantissa": []}
        for bit in range(f.bits - 1, -1, -1):
            field = _field(f, bit)
            b = widgets.Button(description="0", style=styles[field][0], layout=bit_layout,
                               tooltip=f"{f.name} bit {bit}: {field} (click to flip)")
            b.add_class("mplab-bit")
            b.add_class(f"mplab-bit-{f.name}-{bit}")
            b.on_click(functools.partial(explorer._flip, f, bit))
            self.buttons[bit] = b
            groups[field].append(b)
        self.styles = styles
        step = widgets.Layout(width="28px", height="26px", padding="0", margin="0 4px")
        self.down = widgets.Button(description="◀", layout=step,
                                   tooltip=f"{f.name}: the next smaller number (next_down)")
        self.up = widgets.Button(description="▶", layout=step,
                                 tooltip=f"{f.name}: the next larger number (next_up)")
        self.down.add_class(f"mplab-down-{f.name}")
        self.up.add_class(f"mplab-up-{f.name}")
        self.down.on_click(functools.partial(explorer._step, f, False))
        self.up.on_click(functools.partial(explorer._step, f, True))
        color = plots.FORMAT_COLORS.get(f.name, "black")
        name = widgets.HTML(
            f'<span title="{html.escape(f.title)}: {1 if f.signed else "no"} sign, '
            f'{f.exp_bits} exponent, {f.man_bits} mantissa bits">'
            f'<span style="color:{color}">■</span> <b>{f.name}</b></span>',
            layout=widgets.Layout(width="120px"))
        self.value = widgets.HTML(layout=widgets.Layout(width="auto"))
        self.value.add_class(f"mplab-value-{f.name}")
        fields = [widgets.HBox(g, layout=widgets.Layout(margin="0 6px 0 0"))
                  for g in groups.values() if g]
        # no sign bit (e8m0): start where the others' exponents start, not under their signs
        indent = "0" if f.signed else "0 0 0 26px"
        bits = widgets.HBox(fields, layout=widgets.Layout(width=width, flex="0 0 auto",
                                                          padding=indent))
        self.box = widgets.HBox([name, self.down, bits, self.up, self.value],
                                layout=widgets.Layout(align_items="center"))
        self.box.add_class(f"mplab-row-{f.name}")

    def show(self, d) -> None:
        """Show the decomposition d (its bits and stored value); only changed bits are sent."""
        for bit, button in self.buttons.items():
            one = d.bits >> bit & 1
            if self.bits is None or one != self.bits >> bit & 1:
                with button.hold_sync():  # text and colour in one message
                    button.description = str(one)
                    button.style = self.styles[_field(self.f, bit)][0 if one else 1]
        self.bits = d.bits
        self.value.value = (f"<code>= {html.escape(repr(d.value))}</code> "
                            f'<span style="color:#666">{d.kind}</span>')


class PrecisionExplorer(StaticView, widgets.VBox):
    """One number in every format, bit by bit. Build it with :func:`precision_explorer`.

    `value` is the number explored (a Python float, i.e. a double), readable and settable
    from Python; `text`, `preset`, `rows[name].buttons[bit]`, `rows[name].down/.up`,
    `message`, `table` and `plot` are the controls and outputs a test can drive, and
    `table_rows` the rows the table shows, as data (:func:`mplab.numerics.explain.stored_row`).
    """

    value = _SignedFloat(0.1, help="the number being explored (a Python float)")

    def __init__(self, value=0.1, precisions=None):
        super().__init__()
        self.formats = [formats.get_format(f) for f in (precisions or formats.FORMATS)]
        if len({f.name for f in self.formats}) != len(self.formats):
            raise ValueError(f"precisions must have distinct names, got {precisions!r}")
        self._pending = {}  # what the next render should show besides the value
        self._pin = None  # (format, bits) last clicked: kept when it is one of many NaNs
        self._syncing = False
        self._rendered = False

        self.text = widgets.Text(description="Your number", placeholder=ACCEPTED,
                                 continuous_update=False, style={"description_width": "initial"},
                                 layout=widgets.Layout(width="330px"))
        self.text.add_class("mplab-text")
        self.preset = widgets.Dropdown(options=presets(), value=None, description="or pick",
                                       style={"description_width": "initial"},
                                       layout=widgets.Layout(width="360px"))
        self.preset.add_class("mplab-preset")
        self.message = widgets.HTML()
        self.message.add_class("mplab-message")
        self.current = widgets.HTML()
        self.current.add_class("mplab-current")
        widest = max(f.bits for f in self.formats)
        width = f"{widest * 20 + 14}px"  # 19px boxes + 1px gap, 6px between fields
        bit_layout = widgets.Layout(width="19px", height="26px", padding="0", margin="0 1px 0 0")
        styles = {field: tuple(widgets.ButtonStyle(button_color=c, font_family="monospace",
                                                   font_weight="bold" if one else "normal",
                                                   text_color="white" if one else "#444")
                               for one, c in ((True, colors[0]), (False, colors[1])))
                  for field, colors in FIELD_COLORS.items()}
        self.rows = {f.name: _BitRow(f, self, styles, bit_layout, width) for f in self.formats}
        self.table = widgets.HTML()
        self.table.add_class("mplab-table")
        self.table_rows: list[dict] = []
        self._png = _ulp_frames(tuple(self.formats))
        width, _ = self._png.canvas.get_width_height()  # its own size, smaller if need be
        self.plot = widgets.Image(format="png", layout=widgets.Layout(
            width=f"{width}px", max_width="100%", height="auto"))
        self.plot.add_class("mplab-plot")
        self.children = [
            widgets.HTML("<b>Precision explorer</b>: one number, stored in every format."),
            widgets.HBox([self.text, self.preset]), self.message, self.current,
            widgets.HTML(_legend_html()),
            *(row.box for row in self.rows.values()),
            self.table, self.plot,
        ]
        self.add_class("mplab-explorer")
        self.text.observe(self._on_text, "value")
        self.preset.observe(self._on_preset, "value")
        self.observe(self._on_value, "value")
        self._show(read_number(value).value if isinstance(value, str) else value)

    # --- callbacks: read the input, call mplab.numerics.formats, show --------------------------
    @guarded
    def _on_text(self, change) -> None:
        if self._syncing:
            return
        try:
            reading = read_number(change["new"])
        except ValueError as e:
            self._say(f"{e}. Still showing {self.value!r}.", error=True)
            return
        self._show(reading.value, text=change["new"])
        self._say(reading.note)

    @guarded
    def _on_preset(self, change) -> None:
        if self._syncing or change["new"] is None:
            return
        self._show(read_number(change["new"]).value, text=change["new"], preset=change["new"])

    @guarded
    def _flip(self, f: FloatFormat, bit: int, _button=None) -> None:
        bits = self.rows[f.name].bits ^ (1 << bit)
        self._show(formats.from_bits(bits, f), pin=(f.name, bits))

    @guarded
    def _step(self, f: FloatFormat, up: bool, _button=None) -> None:
        stored = formats.round_to(self.value, f)
        new = (formats.next_up if up else formats.next_down)(stored, f)
        if not math.isnan(stored) and not _holds(f, new):
            # fp4/fp6 past their top (no inf, no NaN to step to), e8m0 below 2^-127 (no zero)
            why = ("no inf and no NaN" if f.nan == "none" else "no zero" if not f.subnormals
                   else "nothing there")
            self._say(f"{f.name} has no number {'above' if up else 'below'} {stored!r} "
                      f"(it has {why}); still showing {self.value!r}.")
            return
        self._show(new)
        if math.isnan(stored):
            self._say("NaN has no neighbours: flip a bit back, or type a number.")

    def _on_value(self, change=None) -> None:
        pending, self._pending = self._pending, {}
        self._pin = pending.get("pin")
        self._render(pending.get("text"), pending.get("preset"))
        self._rendered = True

    def _show(self, x, **pending) -> None:
        """Make x the explorer's number; pending: the pin, text and preset to show with it."""
        self._pending, self._rendered = pending, False
        self.value = x
        if not self._rendered:  # the same value again (0.10 typed for 0.1): traitlets is silent
            self._on_value()

    # --- rendering ---------------------------------------------------------------------------
    def _say(self, text: str, error: bool = False) -> None:
        color = "#b00020" if error else "#555"
        self.message.value = f'<span style="color:{color}">{html.escape(text)}</span>'

    def _render(self, text=None, preset=None) -> None:
        x = self.value
        self._say("")
        self._syncing = True
        try:
            self.text.value = repr(x) if text is None else text
            self.preset.value = preset
        finally:
            self._syncing = False
        self.current.value = (f"x = <code>{html.escape(repr(x))}</code> "
                              '<span style="color:#666">(a Python float, i.e. fp64; each row '
                              "shows what a cast to that format stores)</span>")
        self.table_rows = []
        for f in self.formats:
            d = explain.decompose(x, f)
            if self._pin and self._pin[0] == f.name:  # keep the NaN pattern the learner made
                s, e, m = formats.field_bits(self._pin[1], f)
                d = dataclasses.replace(d, bits=self._pin[1], sign=s, exponent=e, mantissa=m)
            self.rows[f.name].show(d)
            self.table_rows.append(explain.stored_row(x, d, f))
        self.table.value = _table_html(self.table_rows, {f.name: f for f in self.formats})
        self.plot.value = self._png.png(x)


def _holds(f: FloatFormat, v: float) -> bool:
    """Whether v is a number of the format (a zero of either sign counts: FNUZ keeps only +0)."""
    if math.isnan(v):
        return f.nan != "none"
    return formats.round_to(v, f) == v


@functools.cache
def _ulp_frames(formats: tuple[FloatFormat, ...]) -> plots.MarkerPng:
    """One ulp plot per set of formats, shared by every explorer: drawing its static part
    costs many times what moving its marker does (benchmarks/RECORDS.md; callbacks run one at
    a time, so sharing is safe)."""
    return plots.MarkerPng(plots.ulp_plot(None, formats, pyplot=False), formats)


def _legend_html() -> str:
    boxes = "".join(
        f'<span style="background:{one};color:white;padding:1px 6px;margin-right:2px;'
        f'font-family:monospace;font-weight:bold">1</span>'
        f'<span style="background:{zero};color:#444;padding:1px 6px;margin-right:6px;'
        f'font-family:monospace">0</span>{field} &nbsp;&nbsp; '
        for field, (one, zero) in FIELD_COLORS.items())
    return (f'<div style="margin:4px 0">{boxes}<span style="color:#555">Click a bit to flip '
            "it; ◀ ▶ step to the neighbouring number in that format.</span></div>")


def _table_html(rows: list[dict], formats: dict[str, FloatFormat]) -> str:
    head = list(rows[0]) if rows else []
    th = "".join(f'<th style="padding:2px 8px;text-align:left">{h}</th>' for h in head)
    body = []
    for r in rows:
        digits = (formats[r["format"]].bits + 3) // 4
        cells = [f"<b>{r['format']}</b>", f"<code>{r['stored value, exactly']}</code>", r["kind"],
                 _num(r["abs. error"]), _num(r["rel. error"]), _num(r["spacing here (ulp)"]),
                 f"<code>0x{r['bits']:0{digits}X}</code>",
                 f'<span style="color:#b00020">{r["note"]}</span>']
        body.append("<tr>" + "".join(f'<td style="padding:2px 8px">{c}</td>' for c in cells)
                    + "</tr>")
    return (f'<table style="border-collapse:collapse;font-size:12px;line-height:1.5;'
            f'margin:6px 0">'
            f'<thead><tr style="border-bottom:1px solid #999">{th}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table>")


def precision_explorer(value=0.1, precisions=None) -> PrecisionExplorer:
    """The precision explorer for value (a number, or text like "1/3"), over `precisions`
    (default: the course's six, mplab.numerics.formats.FORMATS; ``ALL_FORMATS`` adds lesson 9's).
    `.value` is the number it shows."""
    return PrecisionExplorer(value, precisions)
