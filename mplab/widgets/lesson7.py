"""Lesson 7 widgets: pick a failure, run it, read the diagnosis, apply the fix, run again;
and pick a model size, profile its step, see where the bf16 speed-up went.

    from mplab.widgets.lesson7 import failure_lab, speedup_profile
    panel = failure_lab("clip_before_unscale")
    panel          # "run it", then "apply the fix and run again"; panel.rows: every run
    speedup_profile(found)   # found: a bench.step_profile; "profile" adds a row per size

Each press runs one of :data:`mplab.diagnosis.lab.FAILURES` (the broken loop, or with a fix switched
on) and shows what :func:`mplab.diagnose` makes of the run, so the learner sees the cause
named from the run's own numbers, and then sees it gone.
"""

from __future__ import annotations

import html
import warnings

import ipywidgets as widgets
from matplotlib.figure import Figure

from mplab import bench, plots
from mplab._display import Table
from mplab.diagnosis import CAUSES, Diagnosis, diagnose, lab
from mplab.train import NonFiniteLossError, TrainResult, TrainWarning
from mplab.widgets._common import StaticView, guarded, png

__all__ = ["failure_lab", "FailureLab", "verdict", "runs_figure", "speedup_profile",
           "SpeedupProfile", "profile_figure", "PROFILE_SIZES"]

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


# ---- where the speed-up went: a step op by op, at a size the learner picks --------------------

#: The sizes the profile offers: (hidden, layers) by label.
PROFILE_SIZES = {"hidden 128, 2 layers": (128, 2), "hidden 256, 2 layers": (256, 2),
                 "hidden 512, 4 layers": (512, 4), "hidden 768, 4 layers": (768, 4)}
_ATTENTIONS = {"torch's choice": "torch", "mplab's choice": "mplab"}


class SpeedupProfile(StaticView, widgets.VBox):
    """A model size, an attention backend and "profile": one training step op by op, fp32
    against bf16 (`bench.step_profile`), in words, as a table and as bars; every profile
    pressed adds a row to `rows` (the matmuls' share and speed-up, Amdahl's bound, the
    step's speed-up), so the share is seen to move with the size. Build it with
    :func:`speedup_profile`. As data: `found` (the last profile), `rows`, `message`."""

    def __init__(self, found: dict | None = None):
        super().__init__()
        if found is not None and not (isinstance(found, dict) and "table" in found):
            raise TypeError(f"found must be what bench.step_profile returns, got "
                            f"{type(found).__name__}")
        self.size = widgets.Dropdown(options=list(PROFILE_SIZES), value="hidden 256, 2 layers",
                                     description="model")
        self.attention = widgets.ToggleButtons(options=list(_ATTENTIONS),
                                               description="attention")
        self.button = widgets.Button(description="profile", button_style="primary")
        self.button.on_click(lambda _: self.profile())
        self.message, self.words, self.table = widgets.HTML(), widgets.HTML(), widgets.HTML()
        self.plot = widgets.Image(format="png")
        self.history = widgets.HTML()
        self.found: dict | None = None
        # the batch of the profile shown first, so that every row profiles the same batch
        shape = (found or {}).get("shape", {})
        self.batch = {k: shape[k] for k in ("batch_size", "max_length") if k in shape}
        self.rows = Table([], title="each profile pressed: the matmuls' share of the fp32 step "
                                    "and their speed-up, the bound they set, the step's "
                                    "speed-up")
        self.children = [widgets.HBox([self.size, self.button]), self.attention, self.message,
                         self.words, self.plot, self.table, self.history]
        if found is not None:
            shape = found["shape"]
            size = (shape["hidden_size"], shape["num_hidden_layers"])
            self.size.value = next((k for k, v in PROFILE_SIZES.items() if v == size),
                                   self.size.value)
            self._show(found)
        else:
            self.words.value = "<span style='color:#666'>Press “profile”.</span>"

    @guarded
    def profile(self) -> None:
        """Profile the chosen size (what "profile" does)."""
        hidden, layers = PROFILE_SIZES[self.size.value]
        self.button.disabled = True
        self.message.value = f"profiling {html.escape(self.size.value)} in fp32 and bf16…"
        try:
            found = bench.step_profile(hidden=hidden, layers=layers, **self.batch,
                                       attention=_ATTENTIONS[self.attention.value])
        finally:
            self.button.disabled, self.message.value = False, ""
        self._show(found)

    def _show(self, found: dict) -> None:
        self.found = found
        shape = found["shape"]
        self.rows = Table(self.rows.rows + [{
            "model": f"hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layer(s)",
            "attention in bf16": found["attention"]["bf16"],
            "matmuls' share of fp32": f"{found['matmul_share']:.0%}",
            "matmuls' speed-up": round(found["matmul_speedup"], 2),
            "bound": round(found["bound"], 2), "step's speed-up": round(found["step_speedup"], 2),
            "step / bound": f"{found['step_speedup'] / found['bound']:.0%}"}],
            title=self.rows.title)
        self.words.value = html.escape(bench.explain_profile(found))
        self.table.value = found["table"]._repr_html_()
        self.plot.value = png(profile_figure(found))
        self.history.value = self.rows._repr_html_()


def profile_figure(found: dict, top: int = 10) -> Figure:
    """The profile's `top` ops as bars, fp32 beside bf16 (ms per step)."""
    rows = [r for r in found["table"] if r["kind"]][:top][::-1]  # not the rest, not the step
    fig = Figure(figsize=(7, 0.35 * len(rows) + 1.2), layout="constrained")
    ax = fig.subplots()
    at = range(len(rows))
    for shift, precision, color in ((0.2, "fp32", "#4c78a8"), (-0.2, "bf16", "#f58518")):
        ax.barh([i + shift for i in at], [r[f"{precision} ms"] for r in rows], height=0.4,
                color=color, label=precision)
    ax.set_yticks(list(at), [r["op"].replace("_scaled_dot_product_", "sdpa ")[:40] for r in rows],
                  fontsize=8)
    ax.set_xlabel("ms per step (the op's own time)")
    ax.legend(loc="lower right")
    return fig


def speedup_profile(found: dict | None = None) -> SpeedupProfile:
    """The profile widget, showing `found` (a `bench.step_profile`) first if given."""
    return SpeedupProfile(found)
