"""Lesson 3 widget: step through dynamic loss scaling one iteration at a time.

    from mplab.widgets.lesson3 import scaler_stepper
    stepper = scaler_stepper(growth_interval=3)
    stepper        # "next step", "inject inf", "10 clean steps"; stepper.scaler.history

Each click runs one real iteration of :class:`mplab.amp.scaler.GradScaler` (scale the loss,
backward, step, update) on a small model (:class:`mplab.fixtures.ScalerRun`), and the same
iteration with ``torch.amp.GradScaler`` beside it, so the widget shows torch agreeing at every
step.
"""

from __future__ import annotations

import ipywidgets as widgets
import torch

from mplab import plots
from mplab.amp.scaler import GradScaler
from mplab.fixtures import ScalerRun
from mplab.widgets._common import StaticView, guarded, png

__all__ = ["scaler_stepper", "ScalerStepper", "GROWTH_FACTORS", "BACKOFF_FACTORS", "ROWS_SHOWN"]

GROWTH_FACTORS = (2.0, 4.0, 1.5, 1.001)
BACKOFF_FACTORS = (0.5, 0.25, 0.9)
#: Iterations the table lists (the plot shows them all).
ROWS_SHOWN = 8


class ScalerStepper(StaticView, widgets.VBox):
    """Dynamic loss scaling, one iteration per click. Build it with :func:`scaler_stepper`.

    Buttons: `next_step`, `inject_inf`, `ten_steps`, `reset`; settings (changing one restarts
    the run): `init_scale` (log2), `growth_interval`, `growth_factor`, `backoff_factor`.
    Outputs: `plot` (scale and tracker over the iterations), `table` (the latest iterations;
    `table_rows` holds them as data), `agreement` (whether torch.amp.GradScaler, run beside it,
    has the same scale, tracker and weights), `message`. `scaler` is the
    :class:`mplab.amp.scaler.GradScaler` being stepped; `run` and `torch_run` are the two runs
    (:class:`mplab.fixtures.ScalerRun`), with mplab's scaler and with torch's.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 3,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5):
        super().__init__()
        k = _log2_exact(init_scale)
        if growth_factor not in GROWTH_FACTORS:
            raise ValueError(f"growth_factor {growth_factor!r} is not offered; accepted: "
                             + ", ".join(map(repr, GROWTH_FACTORS)))
        if backoff_factor not in BACKOFF_FACTORS:
            raise ValueError(f"backoff_factor {backoff_factor!r} is not offered; accepted: "
                             + ", ".join(map(repr, BACKOFF_FACTORS)))
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or not (
                1 <= growth_interval <= 50):
            raise ValueError(f"growth_interval must be a whole number from 1 to 50, got "
                             f"{growth_interval!r}")
        style = {"description_width": "initial"}
        self.init_scale = widgets.IntSlider(k, min=0, max=30, description="init scale 2^",
                                            style=style, continuous_update=False)
        self.growth_interval = widgets.IntSlider(growth_interval, min=1, max=50, style=style,
                                                 description="growth_interval",
                                                 continuous_update=False)
        self.growth_factor = widgets.Dropdown(options=GROWTH_FACTORS, value=growth_factor,
                                              description="growth_factor", style=style,
                                              layout=widgets.Layout(width="200px"))
        self.backoff_factor = widgets.Dropdown(options=BACKOFF_FACTORS, value=backoff_factor,
                                               description="backoff_factor", style=style,
                                               layout=widgets.Layout(width="200px"))
        self.next_step = widgets.Button(description="next step", icon="step-forward")
        self.inject_inf = widgets.Button(description="inject inf", icon="bolt",
                                         button_style="danger")
        self.ten_steps = widgets.Button(description="10 clean steps", icon="forward")
        self.reset = widgets.Button(description="reset", icon="undo")
        for name in ("next_step", "inject_inf", "ten_steps", "reset"):
            getattr(self, name).add_class(f"mplab-scaler-{name.replace('_', '-')}")
        self.message = widgets.HTML()
        self.agreement = widgets.HTML()
        self.agreement.add_class("mplab-scaler-agreement")
        self.status = widgets.HTML()
        self.status.add_class("mplab-scaler-status")
        self.plot = widgets.Image(format="png", layout=widgets.Layout(max_width="100%",
                                                                      height="auto"))
        self.table = widgets.HTML()
        self.table.add_class("mplab-scaler-table")
        self.table_rows: list[dict] = []
        self.children = [
            widgets.HTML("<b>GradScaler, step by step</b>: each click is one iteration "
                         "(scale the loss, backward, step, update)."),
            widgets.HBox([self.init_scale, self.growth_interval]),
            widgets.HBox([self.growth_factor, self.backoff_factor]),
            widgets.HBox([self.next_step, self.inject_inf, self.ten_steps, self.reset]),
            self.message, self.status, self.agreement, self.plot, self.table]
        self.add_class("mplab-scaler-stepper")
        self.next_step.on_click(lambda _: self._steps([False]))
        self.inject_inf.on_click(lambda _: self._steps([True]))
        self.ten_steps.on_click(lambda _: self._steps([False] * 10))
        self.reset.on_click(lambda _: self._restart())
        for control in (self.init_scale, self.growth_interval, self.growth_factor,
                        self.backoff_factor):
            control.observe(lambda _: self._restart(), "value")
        self._restart()

    def _settings(self) -> dict:
        return {"init_scale": 2.0**self.init_scale.value,
                "growth_factor": self.growth_factor.value,
                "backoff_factor": self.backoff_factor.value,
                "growth_interval": self.growth_interval.value}

    @guarded
    def _restart(self) -> None:
        self.scaler = GradScaler("cpu", **self._settings())
        self.run = ScalerRun(self.scaler)
        self.torch_run = ScalerRun(torch.amp.GradScaler("cpu", **self._settings()))
        self._render()

    @guarded
    def _steps(self, injections: list[bool]) -> None:
        for inject in injections:
            self.run.iteration(inject)
            self.torch_run.iteration(inject)
        self._render()

    def _render(self) -> None:
        self.message.value = ""
        rows = self.run.history_rows()
        ours, theirs = self.scaler.state_dict(), self.torch_run.scaler.state_dict()
        self.agreement.value = (
            '<span style="color:#1a7f37">✓ torch.amp.GradScaler, run beside it, has the same '
            "scale, tracker and weights.</span>" if self.run.agrees_with(self.torch_run) else
            '<span style="color:#b00020;font-weight:bold">✗ torch.amp.GradScaler differs: '
            f"scale {theirs['scale']!r}, tracker {theirs['_growth_tracker']}.</span>")
        skipped = sum(r["inf/NaN found"] for r in rows)
        interval = self.growth_interval.value
        self.status.value = (
            f'<div style="font-size:13px">After {len(rows)} iterations: scale '
            f"<b>{ours['scale']:g}</b>, growth tracker <b>{ours['_growth_tracker']}</b> "
            f"of {interval} (the scale grows when {interval} clean iterations in a row "
            f"are done), {skipped} step{'s' if skipped != 1 else ''} skipped.</div>")
        self.plot.value = png(plots.scaler_timeline_plot(self.scaler.history, pyplot=False,
                                                          init_scale=2.0**self.init_scale.value))
        self.table_rows = rows[-ROWS_SHOWN:]
        self.table.value = _table_html(self.table_rows)


def _log2_exact(init_scale) -> int:
    if isinstance(init_scale, bool) or not isinstance(init_scale, int | float):
        raise ValueError(f"init_scale must be a power of two from 1 to 2**30, got {init_scale!r}")
    k = float(init_scale).hex()
    if init_scale <= 0 or not k.startswith("0x1.0000000000000p"):
        raise ValueError(f"init_scale must be a power of two from 1 to 2**30, got {init_scale!r}")
    exponent = int(k.split("p")[1])
    if not 0 <= exponent <= 30:
        raise ValueError(f"init_scale must be a power of two from 1 to 2**30, got {init_scale!r}")
    return exponent


def _table_html(records: list[dict]) -> str:
    if not records:  # a stepper not yet clicked (and its static view) says what will appear
        return ('<div style="font-size:12px;color:#555">No iteration yet: <b>next step</b> '
                "runs a clean one, <b>inject inf</b> one whose gradients overflow. Each is "
                "listed here: the scale it used, whether an inf/NaN was found, whether the "
                "optimizer stepped, the new scale and the tracker.</div>")
    head = ["iteration", "scale used", "inf/NaN found", "step", "new scale", "tracker"]
    th = "".join(f'<th style="padding:1px 10px;text-align:left">{h}</th>' for h in head)
    rows = []
    for r in records:
        found = r["inf/NaN found"]
        red = ' style="color:#b00020;font-weight:bold"' if found else ""
        cells = [r["iteration"], f"{r['scale used']:g}",
                 f"<span{red}>{'yes' if found else 'no'}</span>", r["step"],
                 f"{r['new scale']:g}", r["tracker"]]
        rows.append("<tr>" + "".join(f'<td style="padding:1px 10px">{c}</td>' for c in cells)
                    + "</tr>")
    return ('<table style="border-collapse:collapse;font-size:12px">'
            f'<thead><tr style="border-bottom:1px solid #999">{th}</tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table>")


def scaler_stepper(init_scale: float = 2.0**16, growth_interval: int = 3,
                   growth_factor: float = 2.0, backoff_factor: float = 0.5) -> ScalerStepper:
    """Step through :class:`mplab.amp.scaler.GradScaler` one iteration per click, with inf
    injection, its settings as controls, and a live timeline of scale, tracker and skips."""
    return ScalerStepper(init_scale, growth_interval, growth_factor, backoff_factor)
