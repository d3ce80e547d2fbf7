"""Figures of training: a loss scaler's run (lesson 3), training losses side by side (lessons 4
and 9), how much of a training loop each library takes over (lessons 5 and 6) and each layer's
numbers over the steps, against fp16's limits (lesson 7)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
from matplotlib.figure import Figure

from mplab.plots.formats import FORMAT_COLORS, new_figure

__all__ = ["scaler_timeline_plot", "loss_curves_plot", "learned_share", "running_mean",
           "LossCurveWarning", "paths_chart", "layers_plot"]


def scaler_timeline_plot(history, ax=None, *, init_scale=None, pyplot: bool = True) -> Figure:
    """A loss scaler's run: log2 of the scale each iteration used (a staircase), the iterations
    that found an inf/NaN and skipped their step (red crosses), and the growth tracker (grey
    bars, right axis). `history` is ``mplab.amp.scaler.GradScaler.history`` (records with
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


# a field's limits in fp16: what its curve is read against (mplab.train.layers.LAYER_FIELDS)
_FP16_LINES = {"amax": [(65504.0, "fp16's largest, 65504")],
               "amin": [(2.0 ** -14, "fp16's smallest normal, 2^-14"),
                        (2.0 ** -24, "fp16's smallest, 2^-24: below, 0")]}


def layers_plot(result, field: str = "amax", phase: str = "forward", modules=None, *,
                top: int = 6, ax=None, pyplot: bool = True) -> Figure:
    """One run's layers over its steps (what `mplab.train.layers` sampled into
    `result.numerics["layers"]`): `field` of each module's forward output or, with
    `phase="backward"`, of the gradient reaching it, against fp16's limits. `modules`: the
    names to draw; by default the `top` whose `field` rose highest (for "amin", sank lowest),
    the layers nearest the limits. The step where the first inf/NaN began is marked. Returns
    the figure."""
    numerics = getattr(result, "numerics", None)
    rows = (numerics or {}).get("layers") if isinstance(numerics, dict) else None
    if not rows:
        raise ValueError("layers_plot draws a run recorded with mplab's layer watch (a "
                         "TrainResult from mplab.train or a Recorder, with numerics['layers']); "
                         "this one has none")
    fields = [k for k in rows[0] if k not in ("step", "module", "phase", "dtype")]
    if field not in fields or phase not in ("forward", "backward"):
        raise ValueError(f"layers_plot(field={field!r}, phase={phase!r}): fields are "
                         f"{', '.join(fields)}; phase 'forward' or 'backward'")
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        if row["phase"] == phase and isinstance(row.get(field), (int, float)):
            series.setdefault(row["module"], []).append((row["step"], row[field]))
    if modules is None:
        def extreme(name):
            values = [v for _, v in series[name] if math.isfinite(v)] or [0.0]
            return -min(values) if field == "amin" else max(values)
        modules = sorted(series, key=extreme, reverse=True)[:top]
    missing = [m for m in modules if m not in series]
    if missing:
        raise ValueError(f"no {phase} rows for {missing}; the run has {', '.join(series)}")
    if ax is None:
        fig = new_figure((6.5, 3.4), pyplot)
        ax = fig.subplots()
        fig.subplots_adjust(left=0.12, right=0.97, bottom=0.15, top=0.88)
    shares = field not in ("amax", "amin")
    for i, name in enumerate(modules):
        steps, values = zip(*series[name])
        shown = [v * 100 if shares else (v if v > 0 else math.nan) for v in values]
        ax.plot(steps, shown, marker="o", ms=3, lw=1.5, ls=("-", "--", ":", "-.")[i % 4],
                color=f"C{i}", label=name)
    for value, label in ([] if shares else _FP16_LINES.get(field, [])):
        ax.axhline(value, color=FORMAT_COLORS["fp16"], lw=1, ls=":", label=label)
    began = ((numerics.get("first") or {}).get(phase) or {}).get("step")
    if began:
        ax.axvline(began, color="#b00020", lw=1, ls="--", label=f"first inf/NaN: step {began}")
    if not shares:
        ax.set_yscale("log")
    what = "output" if phase == "forward" else "output's gradient"
    ax.set_ylabel(f"{field} (%)" if shares else f"{field} of the {what}")
    ax.set_xlabel("optimizer step (sampled)")
    ax.set_title(f"Each layer's {what}: {field}, every {numerics.get('every', '?')} steps",
                 fontsize=10)
    ax.legend(fontsize=7, loc="best")
    return ax.figure
