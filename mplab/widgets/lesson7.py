"""Lesson 7 widget: pick a failure, run it, read the diagnosis, apply the fix, run again.

    from mplab.widgets.lesson7 import failure_lab
    panel = failure_lab("clip_before_unscale")
    panel          # "run it", then "apply the fix and run again"; panel.rows: every run

Each press runs one of :data:`mplab.diagnosis.lab.FAILURES` (the broken loop, or with a fix switched
on) and shows what :func:`mplab.diagnose` makes of the run, so the learner sees the cause
named from the run's own numbers, and then sees it gone.
"""

from __future__ import annotations

import html
import warnings

import ipywidgets as widgets
from matplotlib.figure import Figure

from mplab import plots
from mplab._display import Table
from mplab.diagnosis import CAUSES, Diagnosis, diagnose, lab
from mplab.train import NonFiniteLossError, TrainResult, TrainWarning
from mplab.widgets._common import StaticView, guarded, png

__all__ = ["failure_lab", "FailureLab", "verdict", "runs_figure"]

_COLORS = {"broken": "#e45756", "fixed": "#4c78a8"}


class FailureLab(StaticView, widgets.VBox):
    """A failure picker, "run it", a fix picker and "apply the fix and run again". Build it with
    :func:`failure_lab`.

    Shows the failure's symptom and its code (`code`, in an accordion), the losses of both
    runs and what the hooks saw that tells the failure apart (`plot`), each run's diagnosis
    and the `verdict`. As data: `broken` and `fixed`
    (TrainResults or None), `diagnoses` ({"broken": Diagnosis, "fixed": Diagnosis}), `rows`
    (a Table, one row per run pressed), `message` (running…, errors).
    """

    def __init__(self, failure: str = "clip_before_unscale", steps: int | None = None):
        super().__init__()
        if failure not in lab.FAILURES:
            raise ValueError(f"unknown failure {failure!r}; accepted: "
                             + ", ".join(map(repr, lab.FAILURES)))
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int)
                                  or not 1 <= steps <= 1000):
            raise ValueError(f"steps must be None (each failure's own) or a whole number from "
                             f"1 to 1000, got {steps!r}")
        self.settings = {} if steps is None else {"steps": steps}
        self.broken: TrainResult | None = None
        self.fixed: TrainResult | None = None
        self.fixed_by: str | None = None  # the fix `fixed` ran with
        self.diagnoses: dict[str, Diagnosis] = {}
        self.rows = Table([], title="every run so far")
        wide = widgets.Layout(width="460px")
        self.failure = widgets.Dropdown(options=[(f.title, f.name) for f in lab.FAILURES.values()],
                                        value=failure, description="failure", layout=wide)
        self.run_button = widgets.Button(description="run it", icon="play",
                                         button_style="danger")
        self.fix = widgets.Dropdown(description="fix", layout=widgets.Layout(width="260px"))
        self.fix_button = widgets.Button(description="apply the fix and run again",
                                         icon="wrench", button_style="success",
                                         layout=widgets.Layout(width="240px"))
        self.symptom = widgets.HTML()
        self.code = widgets.HTML()
        self.message = widgets.HTML()
        self.verdict = widgets.HTML()
        self.plot = widgets.Image(format="png", layout=widgets.Layout(max_width="100%",
                                                                      height="auto"))
        half = widgets.Layout(width="50%", padding="0 8px 0 0")
        self.views = {"broken": widgets.HTML(layout=half), "fixed": widgets.HTML(layout=half)}
        self.table = widgets.HTML()
        for name in ("failure", "run_button", "fix", "fix_button", "symptom", "code", "message",
                     "verdict", "plot", "table"):
            getattr(self, name).add_class(f"mplab-lab-{name.replace('_', '-')}")
        for kind, view in self.views.items():
            view.add_class(f"mplab-lab-diagnosis-{kind}")
        self.loop = widgets.Accordion(children=[self.code], selected_index=None,
                                      titles=("the loop that runs: the bug, and each fix "
                                              "behind `fix ==`",))
        self.children = [
            widgets.HTML("<b>The failure lab</b>: pick a failure, run it, read the diagnosis, "
                         "apply the fix, run again."),
            widgets.HBox([self.failure, self.run_button]), self.symptom, self.loop,
            widgets.HBox([self.fix, self.fix_button]), self.message, self.verdict, self.plot,
            widgets.HBox(list(self.views.values())), self.table]
        self.add_class("mplab-failure-lab")
        self.failure.observe(lambda _: self._pick(), names="value")
        self.run_button.on_click(lambda _: self.run())
        self.fix_button.on_click(lambda _: self.apply_fix())
        self._pick()

    @property
    def current(self) -> lab.Failure:
        return lab.FAILURES[self.failure.value]

    @guarded
    def run(self) -> None:
        """Reproduce the failure (what "run it" does)."""
        self._run("broken", None)

    @guarded
    def apply_fix(self) -> None:
        """Run again with the chosen fix (what "apply the fix and run again" does)."""
        self._run("fixed", self.fix.value)

    def _run(self, kind: str, fix: str | None) -> None:
        failure = self.current
        self._busy(True, f"running {failure.name}"
                         + ("" if fix is None else f" with the fix {fix!r}") + "…")
        try:
            with warnings.catch_warnings():  # diagnose reports them, in the run's own words
                warnings.simplefilter("ignore", TrainWarning)
                try:
                    result = failure.run(fix, **self.settings)
                except NonFiniteLossError as e:  # a run of one's own may stop so: keep it
                    result = e.result
        finally:
            self._busy(False, "")  # also after an error, which `guarded` then shows
        setattr(self, kind, result)
        if kind == "fixed":
            self.fixed_by = fix
        self.diagnoses[kind] = diagnose(result)
        self.rows = Table(self.rows.rows + [_row(failure, fix, result, self.diagnoses[kind])],
                          title=self.rows.title)
        if kind == "fixed":
            self.verdict.value = _verdict_html(verdict(failure, self.diagnoses["fixed"]))
        self._render()

    def _busy(self, busy: bool, message: str) -> None:
        for control in (self.failure, self.run_button, self.fix, self.fix_button):
            control.disabled = busy
        self.message.value = html.escape(message)

    @guarded
    def _pick(self) -> None:
        """A new failure: its fixes, symptom and code; the runs of the last one are put away
        (they stay in `rows`)."""
        failure = self.current
        self.fix.options = failure.fixes
        self.fix.value = failure.fixes[0]
        self.symptom.value = f"<i>What a learner sees:</i> {html.escape(failure.symptom)}"
        self.code.value = f"<pre style='font-size:12px'>{html.escape(failure.code)}</pre>"
        self.broken = self.fixed = self.fixed_by = None
        self.diagnoses = {}
        self.message.value = self.verdict.value = ""
        self._render()

    def _render(self) -> None:
        runs = {label: r for label, r in (("broken", self.broken),
                                          (f"fixed ({self.fixed_by})", self.fixed))
                if r is not None}
        self.plot.value = png(runs_figure(runs)) if runs else b""
        for kind, view in self.views.items():
            found = self.diagnoses.get(kind)
            view.value = (f"<b>The {kind} run</b><br>" + found._repr_html_() if found else
                          f"<span style='color:#666'>The {kind} run's diagnosis shows here: "
                          f"press “{'run it' if kind == 'broken' else 'apply the fix'}”.</span>")
        self.table.value = (
            "<style>.mplab-lab-table td, .mplab-lab-table th {padding:1px 8px}</style>"
            + self.rows._repr_html_()) if self.rows.rows else ""


def verdict(failure: lab.Failure, fixed: Diagnosis) -> str:
    """Whether a fix worked, by the only test that counts: diagnose no longer finds the cause
    the failure reproduces (on a CPU an fp16 run still gets the "no_units" warning)."""
    if not failure.fixed_in(fixed):
        return f"still there: diagnose still finds {failure.title}"
    others = [CAUSES[name] for name in fixed.names if name != failure.name]
    return (f"fixed: diagnose no longer finds {failure.title}"
            + (f" (it still reports: {'; '.join(others)})" if others else ""))


def _verdict_html(text: str) -> str:
    colour = "#1b7a2e" if text.startswith("fixed") else "#b00020"
    return f"<b style='color:{colour}'>{html.escape(text)}</b>"


def _row(failure: lab.Failure, fix: str | None, result: TrainResult,
         diagnosis: Diagnosis) -> dict:
    return {"failure": failure.name, "fix": fix or "none (broken)",
            "steps": len(result.losses),
            "final loss": result.final_loss if result.losses else "–",
            "skipped steps": len(result.skipped_steps),
            "final scale": result.scales[-1] if result.scales else "–",
            "diagnose's cause": diagnosis.cause or "none"}


#: What the hooks saw, by what tells a failure apart best: (field, axis label, title, log2 axis)
_SERIES = {
    "grad_norms": ("gradient norm before clipping", "the norm clip_grad_norm_ saw", True),
    "zero_grad_fractions": ("share exactly 0", "gradient entries that were 0", False),
    "scales": ("loss scale", "GradScaler's scale per step", True),
    "unchanged_weight_fractions": ("share unchanged", "bf16 weights a step left as they were",
                                   False),
}


def _telling(runs: dict[str, TrainResult]) -> str | None:
    """The recorded series to draw beside the losses: clipped norms, else zero gradients if a
    run had no scaler, else the scale, else the unchanged weights; None if none was recorded."""
    def has(r, name):
        return any(v is not None for v in getattr(r, name))

    if any(has(r, "grad_norms") for r in runs.values()):
        return "grad_norms"
    if any(has(r, "zero_grad_fractions") and not r.scales for r in runs.values()):
        return "zero_grad_fractions"
    for name in ("scales", "unchanged_weight_fractions"):
        if any(has(r, name) for r in runs.values()):
            return name
    return None


def runs_figure(runs: dict[str, TrainResult]) -> Figure:
    """The runs' losses per step (skipped steps crossed) and, beside them, what the hooks saw
    that tells the failure apart (`_telling`): broken and fixed overlaid."""
    series = _telling(runs)
    fig = plots.new_figure((9.0, 2.8) if series else (5.0, 2.8), pyplot=False)
    axes = fig.subplots(1, 2 if series else 1, squeeze=False)[0]
    fig.subplots_adjust(left=0.08 if series else 0.14, right=0.98, bottom=0.18, top=0.88,
                        wspace=0.25)
    for label, r in runs.items():
        color = _COLORS[label.split()[0]]
        axes[0].plot(range(1, len(r.losses) + 1), r.losses, color=color, lw=1.5,
                     label=label if r.losses else f"{label}: {r.stopped or 'no steps'}")
        skipped = [s for s in r.skipped_steps if 1 <= s <= len(r.losses)]
        if skipped:
            axes[0].plot(skipped, [r.losses[s - 1] for s in skipped], "x", color="black",
                         ms=5, label=f"{label}: skipped step")
        values = getattr(r, series) if series else []
        points = [(i, v) for i, v in enumerate(values, 1) if v is not None]
        if points:
            axes[1].step(*zip(*points), where="post", color=color, lw=1.5, label=label)
    axes[0].set(xlabel="step", ylabel="training loss", title="loss per step")
    if series:
        ylabel, title, log = _SERIES[series]
        if log:
            axes[1].set_yscale("log", base=2)
        axes[1].set(xlabel="step", ylabel=ylabel, title=title)
    for ax in axes:
        ax.title.set_fontsize(10)
        ax.grid(True, alpha=0.25)
        ax.legend(fontsize=7)
    return fig


def failure_lab(failure: str = "clip_before_unscale", steps: int | None = None) -> FailureLab:
    """The failure lab as a widget: pick one of mplab.diagnosis.lab.FAILURES, run it, read
    mplab.diagnose's verdict, apply a fix, run again. `steps` overrides every failure's own
    step count (None keeps each failure's)."""
    return FailureLab(failure, steps)
