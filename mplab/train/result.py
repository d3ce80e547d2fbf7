"""The record every training run returns, whichever path trained it, and what runs say read
side by side: where loss curves overlap, when a gap in step time is noise, whether an
accuracy rose beyond chance (each decided here, then said in words)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from mplab._display import Table
from mplab.amp.audit import DTYPE_FIELDS, Audit
from mplab.numerics.formats import dtype_from_name, dtype_name

__all__ = ["OWN_LOOP", "STOP_REASONS", "TrainResult", "loss_overlaps", "StepTimeNoise",
           "step_time_noise", "AccuracyRise", "accuracy_rise"]

try:
    MPLAB_VERSION = version("mplab")
except PackageNotFoundError:  # run from a source tree that was never installed
    MPLAB_VERSION = "unknown"
#: `TrainResult.path` of a loop of one's own, recorded by `Recorder` (not one of mplab's paths).
OWN_LOOP = "own loop"
#: Why a run stopped early (`TrainResult.stop_reason`): the code, and what it means.
STOP_REASONS = {"non_finite_loss": "the loss became inf or NaN, so training stopped"}


@dataclass
class TrainResult:
    """What a run did and measured. `as_dict()` is plain JSON; `summary()` the key figures.

    - `compute_dtype`: the dtype the model's first matmul layer was *observed* to produce on
      the first step (a forward hook), which is what the matmuls ran in; not the one asked for.
      `output_dtype`: the model output's (logits') dtype, observed the same way; `grad_dtype`
      the gradients' at the first optimizer step; `param_dtype` and `optimizer_state_dtype`
      the weights' (the master copy) and the optimizer states' at the end.
    - `audit`: the `mplab.amp.audit.Audit` of the run (prints as a report): whether mixed
      precision really happened, and each silent fallback, which `warnings` also holds.
    - `losses`: per optimizer step, the mean over its micro-batches (and processes).
    - `scales`: the GradScaler's scale after each step's `update()` (fp16 only, else empty);
      `skipped_steps`: steps whose gradients held an inf/NaN, so the optimizer did not step.
    - `grad_norms`: per step, the gradient norm after unscaling and before clipping (only
      with `max_grad_norm`); inf on a skipped step.
    - `zero_grad_fractions` (fp16 runs): per step, the share of gradient entries that were
      exactly 0 when the optimizer stepped, embedding tables left out (underflow; None on a
      skipped step). `unchanged_weight_fractions` (weights stored in bf16/fp16): the share of
      them a step left as they were (swamped updates). `scaler_calls` (a `Recorder`'s own
      loops): how often `unscale_`, `step` and `update` ran in each iteration. All are seen
      by hooks (mplab.train.watch), for `mplab.diagnose`.
    - `has_units`: whether the CPU has arithmetic units for the precision (None on a GPU);
      `matmul_slowdown`: where it was measured slow before the run, how many times as long a
      256x256 matmul took in the precision as in fp32 (one thread; None otherwise).
    - `step_seconds`: the time of each step this call trained (after a resume, from where it
      resumed): the first includes warm-up (kernels, allocations), so a steady speed is the
      median of the rest (`steady_step_seconds`).
    - `samples_per_s`, `tokens_per_s`: over the training steps alone (no evaluation, no
      checkpointing), all processes together; tokens count padding, which is computed on too.
    - `peak_memory_bytes`: on a GPU, `torch.cuda.max_memory_allocated` since the run began; on
      a CPU, the process's peak resident set size (`ru_maxrss`), which includes everything the
      process held before the run. `peak_memory_kind` says which.
    - `ranks` (lesson 8, multi-process runs with the watch): per rank, in rank order, what it
      held after the first step (`ranks.held_bytes`: weights, gradients, optimizer states), its
      parameters' local shapes and dtypes, and the collectives that step sent (op, dtype,
      calls, bytes): plain data, the same in the JSON.
    - `numerics`: where the first inf/NaN of each kind was seen (which module's output, the
      loss, which gradient, which weight after the optimizer step), gradients found never
      zeroed, and each layer's numbers every few steps (mplab.train.layers, for diagnose).
    - `stopped`: None for a run that finished, else why it stopped early, in words;
      `stop_reason` the same as a code (a key of `STOP_REASONS`).
    """

    path: str
    precision: str
    device: str
    model: str
    steps: int = 0
    compute_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    param_dtype: torch.dtype | None = None
    grad_dtype: torch.dtype | None = None
    optimizer_state_dtype: torch.dtype | None = None
    losses: list[float] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    skipped_steps: list[int] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    zero_grad_fractions: list[float | None] = field(default_factory=list)
    unchanged_weight_fractions: list[float | None] = field(default_factory=list)
    scaler_calls: list[dict] = field(default_factory=list)
    has_units: bool | None = None
    attention: str = ""  # the attention backend it used, and why (`hardware.attention_backend`)
    matmul_slowdown: float | None = None
    eval_accuracy: float | None = None
    eval_history: list[tuple[int, float]] = field(default_factory=list)
    samples_per_s: float = 0.0
    tokens_per_s: float = 0.0
    seconds: float = 0.0
    train_seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)
    peak_memory_bytes: int = 0
    peak_memory_kind: str = ""
    parameters: int = 0
    world_size: int = 1
    global_batch_size: int = 0
    resumed_from: int | None = None
    stopped: str | None = None
    stop_reason: str | None = None
    warnings: list[str] = field(default_factory=list)
    device_name: str = ""
    torch_version: str = torch.__version__
    mplab_version: str = MPLAB_VERSION
    config: dict = field(default_factory=dict)
    ranks: list[dict] = field(default_factory=list)
    numerics: dict = field(default_factory=dict)
    audit: Audit | None = None

    def as_dict(self) -> dict:
        """Plain types only: dtypes as their names ("bfloat16"), non-finite floats as strings."""
        out = asdict(self)
        for key in DTYPE_FIELDS:
            out[key] = dtype_name(getattr(self, key))
        out["audit"] = self.audit.as_dict() if self.audit is not None else None
        out["eval_history"] = [list(pair) for pair in self.eval_history]
        return _json_safe(out)

    @classmethod
    def from_dict(cls, data: dict) -> TrainResult:
        """The record back from `as_dict()` (or a `--json` file). A record this version cannot
        read (a field missing or of another type: half-written, or from another mplab) raises
        a ValueError that names the field, and the mplab that wrote it."""
        if not isinstance(data, dict):
            raise ValueError(f"a training record is a dict (as_dict()), got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        data = _from_json_safe({k: v for k, v in data.items() if k in known})
        problem = _unreadable(data)
        try:
            if problem is None:
                for key in DTYPE_FIELDS:
                    data[key] = dtype_from_name(data.get(key))
                data["audit"] = Audit.from_dict(data["audit"]) if data.get("audit") else None
                data["eval_history"] = [tuple(pair) for pair in data.get("eval_history", [])]
                return cls(**data)
        except (TypeError, ValueError, KeyError, AttributeError) as err:
            problem = f"{type(err).__name__}: {err}"
        wrote = data.get("mplab_version")
        raise ValueError(
            f"mplab {MPLAB_VERSION} cannot read this training record: {problem}; "
            + (f"it was written by mplab {wrote}: read it with that version, or record the run "
               "again" if wrote and wrote != MPLAB_VERSION else
               "is it whole? (a run that was stopped while writing it leaves it cut short)"))

    def write_json(self, file: str | Path) -> None:
        Path(file).write_text(json.dumps(self.as_dict(), indent=1, allow_nan=False) + "\n")

    @property
    def final_loss(self) -> float | None:
        return self.losses[-1] if self.losses else None

    @property
    def steady_step_seconds(self) -> float | None:
        """The median step time without the first (warm-up) step; None before two steps."""
        times = sorted(self.step_seconds[1:])
        if not times:
            return None
        mid = len(times) // 2
        return times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2

    def versus(self, baseline: TrainResult, last: int = 10) -> dict:
        """How this run compares with `baseline` (its fp32 twin): `speedup` (samples/s
        ratio, > 1 is faster), `loss_change` (the relative change of the mean loss over the
        `last` steps both runs trained, e.g. +0.002 is 0.2 % higher), `memory_ratio` (peak
        memory, this / baseline), the steps compared, and `largest_gap` (the largest
        difference of the two losses at any step both trained; 0.0 when they are equal bit for
        bit) at `gap_step` (counting from 1)."""
        if not isinstance(baseline, TrainResult):
            raise TypeError(f"versus() takes another TrainResult, got {type(baseline).__name__}")
        k = min(len(self.losses), len(baseline.losses))
        n = min(last, k)
        ours = sum(self.losses[k - n:k]) / n if n else math.nan
        theirs = sum(baseline.losses[k - n:k]) / n if n else math.nan
        gaps = [abs(a - b) for a, b in zip(self.losses[:k], baseline.losses[:k])]
        return {
            "speedup": (self.samples_per_s / baseline.samples_per_s
                        if baseline.samples_per_s else math.nan),
            "loss_change": (ours - theirs) / theirs if n and theirs else math.nan,
            "memory_ratio": (self.peak_memory_bytes / baseline.peak_memory_bytes
                             if baseline.peak_memory_bytes else math.nan),
            "steps_compared": (k - n + 1, k) if n else None,
            "largest_gap": max(gaps) if gaps else math.nan,
            "gap_step": gaps.index(max(gaps)) + 1 if gaps else None,
        }

    def summary(self) -> Table:
        """The key figures as a two-column table (what the CLI prints)."""
        mem = f"{self.peak_memory_bytes / 2**20:.1f} MiB ({self.peak_memory_kind})"
        first = f"{self.losses[0]:.4f}" if self.losses else "-"
        last = f"{self.final_loss:.4f}" if self.losses else "-"
        rows = [
            ("path / precision", f"{self.path} / {self.precision}"),
            ("device", f"{self.device} ({self.device_name})" if self.device_name else self.device),
            ("matmuls ran in", dtype_name(self.compute_dtype) or "-"),
            ("weights / gradients / optimizer states",
             " / ".join(dtype_name(d) or "-" for d in (self.param_dtype, self.grad_dtype,
                                                        self.optimizer_state_dtype))),
            ("model output", dtype_name(self.output_dtype) or "-"),
            ("model", f"{self.model} ({self.parameters:,} parameters)"),
            ("steps", f"{len(self.losses)} of {self.steps}"
                      + (f" (resumed at {self.resumed_from})" if self.resumed_from else "")),
            ("global batch", f"{self.global_batch_size} ({self.world_size} process"
                             f"{'es' if self.world_size > 1 else ''})"),
            ("loss first -> last", f"{first} -> {last}"),
            ("eval accuracy", "-" if self.eval_accuracy is None else f"{self.eval_accuracy:.3f}"),
            ("samples/s", f"{self.samples_per_s:.1f}"),
            ("tokens/s", f"{self.tokens_per_s:.0f}"),
            ("seconds (training)", f"{self.seconds:.1f} ({self.train_seconds:.1f})"),
            ("peak memory", mem),
        ]
        if self.ranks:  # lesson 8: what rank 0 holds and sent in step 1 (the others: the JSON)
            held = self.ranks[0]["held_bytes"]
            rows.append(("rank 0 holds (weights / gradients / optimizer)",
                         " / ".join(f"{held[k] / 2**20:.2f}" for k in
                                    ("weights", "gradients", "optimizer")) + " MiB"))
            rows.append(("rank 0 sent in step 1", "; ".join(
                f"{c['op']} {c['dtype']} x{c['calls']} {c['bytes'] / 2**20:.2f} MiB"
                for c in self.ranks[0]["collectives"]) or "-"))
        if self.precision == "fp16":
            scale = f"{self.scales[-1]:g}" if self.scales else "-"
            rows.append(("skipped steps / last scale", f"{len(self.skipped_steps)} / {scale}"))
        if self.stopped:
            rows.append(("STOPPED", self.stopped.splitlines()[0]))
        return Table([{"figure": k, "value": v} for k, v in rows],
                     title=f"mplab.train: {self.precision} on {self.device}")


def _json_safe(value):
    """JSON has no inf/NaN: write them as the strings "inf", "-inf", "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


_NUMBER_LISTS = ("losses", "scales", "grad_norms", "step_seconds")
_FIRST_KEYS = {"forward": ("step", "module", "kind", "dtype", "min", "max"), "loss": ("step",),
               "backward": ("step", "module", "kind", "dtype", "min", "max"),
               "step": ("step", "parameter", "grad_amax", "weight_amax_before")}


def _unreadable(data: dict) -> str | None:
    """What makes `data` no record this version can read, in words; None if it can."""
    missing = [k for k in ("path", "precision", "device", "model") if k not in data]
    if missing:
        return f"no {', '.join(map(repr, missing))}"
    for key in _NUMBER_LISTS:
        values = data.get(key, [])
        if not isinstance(values, list) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            return f"{key!r} must be a list of numbers"
    if not all(isinstance(s, int) for s in data.get("skipped_steps", [])):
        return "'skipped_steps' must be a list of step numbers"
    for key in ("config", "numerics"):
        if not isinstance(data.get(key, {}), dict):
            return f"{key!r} must be a dict"
    first = data.get("numerics", {}).get("first", {})
    for phase, entry in (first.items() if isinstance(first, dict) else [("first", None)]):
        keys = _FIRST_KEYS.get(phase)
        if keys is None or not isinstance(entry, dict) or any(k not in entry for k in keys):
            return f"numerics['first'][{phase!r}] is not what this version records"
    return None


def _from_json_safe(value):
    if value in ("inf", "-inf", "nan"):
        return float(value)
    if isinstance(value, dict):
        return {k: _from_json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json_safe(v) for v in value]
    return value


def loss_overlaps(runs: dict[str, TrainResult], share: float = 0.01) -> str:
    """A line per pair of runs (label -> TrainResult): their largest loss gap at any step both
    trained (`TrainResult.versus`), and whether it is under `share` of the range the plot spans,
    i.e. whether one curve is drawn over the other, so a reader knows both are there."""
    if not isinstance(runs, dict) or not runs or not all(isinstance(r, TrainResult)
                                                         for r in runs.values()):
        raise ValueError("loss_overlaps takes a dict of label -> TrainResult, got "
                         f"{type(runs).__name__}")
    losses = [x for r in runs.values() for x in r.losses if math.isfinite(x)]
    span = max(losses) - min(losses) if losses else 0.0
    labels, lines = list(runs), []
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            v = runs[a].versus(runs[b])
            gap, steps = v["largest_gap"], min(len(runs[a].losses), len(runs[b].losses))
            if not math.isfinite(gap):
                continue
            if gap == 0:
                lines.append(f"{a} and {b}: the same losses bit for bit over the {steps} steps "
                             "both trained, drawn as one line")
                continue
            where = (f"under {share:.0%} of the {span:.3f} the losses span: the curves lie on "
                     "top of each other" if gap < share * span else f"{gap / span:.0%} of the "
                     f"{span:.3f} the losses span: the curves part there")
            lines.append(f"{a} and {b}: largest gap {gap:.4f}, at step {v['gap_step']} of the "
                         f"{steps} both trained, {where}")
    return "\n".join(lines)


@dataclass(frozen=True)
class StepTimeNoise:
    """Two runs' steady step times (:func:`step_time_noise`), and whether their gap is this
    machine's noise: it is when the losses agree to the last bit (`same_losses`), for then the
    two runs did the same arithmetic. `step_ratio`: the run's steady step over the baseline's
    (NaN when either has none)."""

    run: str
    baseline: str
    same_losses: bool
    step_ratio: float

    def paragraphs(self) -> list[str]:
        """What the ratio means, to print under the runs' table: none when the losses differ
        (the runs did different arithmetic, so their gap need not be noise)."""
        if not self.same_losses:
            return []
        return [f"The {self.run} run's losses are the {self.baseline} run's to the last bit, and "
                f"its steady step took {self.step_ratio:.2f}x as long:\nbetween runs that agree "
                "to the last bit, a difference of that size is this machine's noise (warm-up, "
                "the order of the runs, other work on it)."]


def step_time_noise(run: TrainResult, baseline: TrainResult) -> StepTimeNoise:
    """`run` against `baseline` (its fp32 twin), each named by its precision: whether their
    losses agree bit for bit, and the ratio of their steady step times."""
    if not isinstance(run, TrainResult) or not isinstance(baseline, TrainResult):
        raise TypeError(f"step_time_noise takes two TrainResults, got {type(run).__name__} and "
                        f"{type(baseline).__name__}")
    ours, theirs = run.steady_step_seconds, baseline.steady_step_seconds
    ratio = ours / theirs if ours is not None and theirs else math.nan
    return StepTimeNoise(run.precision, baseline.precision, run.losses == baseline.losses, ratio)


@dataclass(frozen=True)
class AccuracyRise:
    """How far an evaluation accuracy moved over a run, against chance (:func:`accuracy_rise`).

    `noise`: two standard errors of an accuracy measured on `held_out` reviews at its widest
    (p = 1/2), 2·sqrt(p(1-p)/n): re-drawing the reviews moves it that much by chance alone.
    `beyond_chance`: whether `rise` (the last accuracy less the first) is past it; `fell`,
    whether it fell past it.
    """

    first: float
    last: float
    rise: float
    noise: float
    held_out: int
    steps: int
    beyond_chance: bool

    def says(self, elsewhere: str = "") -> str:
        """The decision in words; `elsewhere`, said in brackets after a rise within chance, is
        where the run trains longer (lesson 6: a machine with bf16 units)."""
        if self.beyond_chance:
            return (f"The accuracy rose by {self.rise:.3f}, past the ±{self.noise:.3f} that "
                    f"chance gives on {self.held_out} reviews: the model learned.")
        if self.fell:
            return (f"In {self.steps} steps the accuracy fell by {-self.rise:.3f}, past the "
                    f"±{self.noise:.3f} that chance gives on {self.held_out} reviews: the run "
                    "made the model worse; read its losses before trusting it.")
        return (f"In {self.steps} steps the accuracy moved by {self.rise:+.3f}, within the "
                f"±{self.noise:.3f} that chance gives on {self.held_out} reviews: too few steps "
                "for this model to learn" + (f" ({elsewhere})" if elsewhere else ""))

    @property
    def fell(self) -> bool:
        """The accuracy fell by more than chance explains."""
        return self.rise < -self.noise

    __str__ = says


def accuracy_rise(accuracies: Sequence[float], held_out: int, steps: int) -> AccuracyRise:
    """The first and the last of a run's evaluation `accuracies` (each over the same `held_out`
    reviews, in the order measured), `steps` optimizer steps apart, against chance."""
    accuracies = list(accuracies)
    if not accuracies:
        raise ValueError("accuracy_rise needs the run's evaluation accuracies, first to last; "
                         "got none (did the run evaluate?)")
    if isinstance(held_out, bool) or not isinstance(held_out, int) or held_out < 1:
        raise ValueError(f"held_out is the number of reviews each accuracy was measured on, a "
                         f"positive int; got {held_out!r}")
    noise = 2 * (0.25 / held_out) ** 0.5
    rise = accuracies[-1] - accuracies[0]
    return AccuracyRise(accuracies[0], accuracies[-1], rise, noise, held_out, steps,
                        rise > noise)
