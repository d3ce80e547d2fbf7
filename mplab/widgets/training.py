"""The training panel lessons 4, 5 and 6 share: train the lesson model in fp32, fp16 or bf16
on any path, and compare the runs.

    from mplab.widgets import training_panel
    panel = training_panel(steps=60)
    panel          # pick a path, precision and device, press "train"; panel.results: the runs

Each press runs :func:`mplab.train.train` (the plain PyTorch path unless another `path` is
picked), plots the loss as it goes and adds the run's figures to a table, so runs in different
paths and precisions sit side by side.
"""

from __future__ import annotations

import html
import math
import warnings

import ipywidgets as widgets
import torch

from mplab import plots
from mplab._display import Table
from mplab.train import (
    PATHS,
    PRECISIONS,
    NonFiniteLossError,
    TrainConfig,
    TrainResult,
    TrainWarning,
    train,
)
from mplab.widgets._common import StaticView, guarded, png

__all__ = ["training_panel", "TrainingPanel", "comparison"]

_REDRAWS = 12  # live plot updates per run: a redraw costs several steps (benchmarks/RECORDS.md)


def _devices() -> list[tuple[str, str]]:
    options = [("auto", "auto"), ("cpu", "cpu")]
    if torch.cuda.is_available():
        options.append(("cuda", "cuda"))
    return options


class TrainingPanel(StaticView, widgets.VBox):
    """Precision and device selectors, a step count and a "train" button. Build it with
    :func:`training_panel`.

    Outputs: `plot` (the loss of every run so far, live during a run), `table` (one row per
    run: speed, memory, final loss, accuracy, the dtype the matmuls ran in; the same rows as
    data in `rows`, a Table), `message` (warnings and errors), `progress`. `results` is the
    list of TrainResults.
    """

    def __init__(self, steps: int = 60, precision: str = "bf16", device: str = "auto",
                 path: str = "torch", *, runs=(), **settings):
        super().__init__()
        if path not in PATHS:
            raise ValueError(f"unknown path {path!r}; accepted: " + ", ".join(map(repr, PATHS)))
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}; accepted: "
                             + ", ".join(map(repr, PRECISIONS)))
        devices = [value for _, value in _devices()]
        if device not in devices:
            raise ValueError(f"device {device!r} is not available here; accepted: "
                             + ", ".join(map(repr, devices)))
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= 5000:
            raise ValueError(f"steps must be a whole number from 1 to 5000, got {steps!r}")
        fixed = {"path", "precision", "device", "steps", "on_step"} & set(settings)
        if fixed:
            raise ValueError(f"{sorted(fixed)} are the panel's own controls, not settings")
        TrainConfig(**settings)  # a bad setting fails here, not at the first press
        self.settings = {"progress": False, **settings}
        self.results: list[TrainResult] = list(runs.values() if isinstance(runs, dict) else runs)
        if not all(isinstance(r, TrainResult) for r in self.results):
            raise ValueError("runs must be TrainResults (what mplab.train.train returns), got "
                             + ", ".join(sorted({type(r).__name__ for r in self.results})))
        self.path = widgets.ToggleButtons(options=PATHS, value=path, description="path")
        self.path.add_class("mplab-train-path")
        self.precision = widgets.ToggleButtons(options=PRECISIONS, value=precision,
                                               description="precision")
        self.precision.add_class("mplab-train-precision")
        self.device = widgets.Dropdown(options=_devices(), value=device, description="device",
                                       layout=widgets.Layout(width="180px"))
        self.device.add_class("mplab-train-device")
        self.steps = widgets.IntSlider(steps, min=1, max=5000, description="steps",
                                       continuous_update=False)
        self.button = widgets.Button(description="train", icon="play", button_style="primary")
        self.button.add_class("mplab-train-button")
        self.clear = widgets.Button(description="clear runs", icon="trash")
        self.progress = widgets.IntProgress(value=0, min=0, max=steps, description="step")
        self.message = widgets.HTML()
        self.message.add_class("mplab-train-message")
        self.plot = widgets.Image(format="png", layout=widgets.Layout(max_width="100%",
                                                                      height="auto"))
        self.table = widgets.HTML()
        self.table.add_class("mplab-train-table")
        self.children = [
            widgets.HTML("<b>Train the lesson model</b> by one of mplab.train's paths (torch: "
                         "the plain PyTorch loop, autocast and a GradScaler in fp16), with the "
                         "figures of every run kept below."),
            self.path, self.precision, widgets.HBox([self.device, self.steps]),
            widgets.HBox([self.button, self.clear, self.progress]),
            self.message, self.plot, self.table]
        self.add_class("mplab-training-panel")
        self.button.on_click(lambda _: self.run())
        self.clear.on_click(lambda _: self._clear())
        self._render()

    @guarded
    def run(self) -> None:
        """Train once with the chosen settings (what the "train" button does)."""
        self.message.value = ""
        steps = self.steps.value
        self.progress.max, self.progress.value = steps, 0
        self.button.disabled = True
        every = max(1, math.ceil(steps / _REDRAWS))

        def on_step(step, result):
            self.progress.value = step
            if step % every == 0 and step < steps:
                self.plot.value = self._figure(result)

        try:
            with warnings.catch_warnings():  # the panel shows them in its message instead
                warnings.simplefilter("ignore", TrainWarning)
                result = train(path=self.path.value, precision=self.precision.value,
                               device=self.device.value,
                               steps=steps, on_step=on_step, **self.settings)
        except NonFiniteLossError as e:  # a result, and a lesson: show both
            result = e.result
        finally:
            self.button.disabled = False
        self.results.append(result)
        notes = result.warnings + ([result.stopped] if result.stopped else [])
        self.message.value = "<br>".join(
            f'<span style="color:#b00020">{html.escape(n)}</span>' for n in notes)
        self._render()

    def _runs(self, current: TrainResult | None = None) -> dict[str, TrainResult]:
        runs = self.results + ([current] if current is not None else [])
        return {f"{i + 1}: {r.path}, {r.precision} on {r.device}": r
                for i, r in enumerate(runs)}

    def _figure(self, current: TrainResult | None = None) -> bytes:
        with warnings.catch_warnings():  # a run not learning yet is labelled so in the plot
            warnings.simplefilter("ignore", plots.LossCurveWarning)
            return png(plots.loss_curves_plot(self._runs(current), pyplot=False))

    @guarded
    def _clear(self) -> None:
        self.results = []
        self._render()

    def _render(self) -> None:
        self.plot.value = self._figure() if self.results else b""
        self.rows = comparison(self.results)
        self.table.value = _table_html(self.rows)


def comparison(results: list[TrainResult]) -> Table:
    """One row per run, each against the first fp32 run (`TrainResult.versus`): what the
    panel's table shows, as data."""
    fp32 = next((r for r in results if r.precision == "fp32" and r.samples_per_s), None)
    rows = []
    for i, r in enumerate(results):
        speed = r.versus(fp32)["speedup"] if fp32 and r.samples_per_s else None
        rows.append({
            "run": i + 1, "path": r.path, "precision": r.precision,
            "device": r.device_name or r.device,
            "matmuls ran in": str(r.compute_dtype).removeprefix("torch.") if r.compute_dtype
            else "–",
            "steps": len(r.losses), "final loss": f"{r.final_loss:.4f}" if r.losses else "–",
            "accuracy": "–" if r.eval_accuracy is None else f"{r.eval_accuracy:.3f}",
            "samples/s": f"{r.samples_per_s:.1f}",
            "vs fp32": "–" if speed is None else f"{speed:.2f}×",
            "peak memory": f"{r.peak_memory_bytes / 2**20:.0f} MiB ({r.peak_memory_kind})",
            "skipped (fp16)": len(r.skipped_steps) if r.precision == "fp16" else "–",
            "really mixed?": _mixed(r)})
    return Table(rows)


def _mixed(result: TrainResult) -> str:
    """The audit's answer for a run: did low-precision matmuls run over fp32 master weights?"""
    if result.audit is None:
        return "–"
    if result.audit.mixed:
        return "yes"
    return "no" + (f" ({len(result.audit.fallbacks)} silent fallback"
                   f"{'s' if len(result.audit.fallbacks) != 1 else ''})"
                   if result.audit.fallbacks else "")


def _table_html(table: Table) -> str:
    if not table.rows:
        return '<span style="color:#666">No runs yet: press "train".</span>'
    th = "".join(f'<th style="padding:1px 8px;text-align:left">{html.escape(h)}</th>'
                 for h in table.columns)
    rows = "".join("<tr>" + "".join(f'<td style="padding:1px 8px">{html.escape(str(c))}</td>'
                                    for c in row.values()) + "</tr>" for row in table)
    return ('<table style="border-collapse:collapse;font-size:12px">'
            f'<thead><tr style="border-bottom:1px solid #999">{th}</tr></thead>'
            f"<tbody>{rows}</tbody></table>")


def training_panel(steps: int = 60, precision: str = "bf16", device: str = "auto",
                   path: str = "torch", *, runs=(), **settings) -> TrainingPanel:
    """Train the lesson model from a panel: path, precision, device and steps, a "train" button,
    a live loss plot and a table comparing every run. `runs`: TrainResults (a list, or a dict
    of them) to start with, a lesson's own, so the first view already compares something;
    `settings` go to mplab.train.train (e.g. batch_size=16, eval_samples=200)."""
    return TrainingPanel(steps, precision, device, path, runs=runs, **settings)
