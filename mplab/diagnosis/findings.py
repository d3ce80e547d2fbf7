"""What diagnose finds: the causes it can name (`CAUSES`, one list, each declared by the check
that names it with `@emits`), a `Finding` and a `Diagnosis`."""

from __future__ import annotations

import html
from dataclasses import asdict, dataclass, field

__all__ = ["SEVERITIES", "CAUSES", "emits", "Finding", "Diagnosis"]

SEVERITIES = ("broken", "warning", "note")

#: Every cause diagnose can name, with a short title.
CAUSES = {
    "fp16_overflow": "an fp16 activation overflowed: the loss became inf/NaN",
    "scaler_bypassed": "optimizer.step() on scaled gradients: scaler.step() never ran",
    "diverged": "the weights diverged: the loss climbed, or became inf/NaN",
    "scale_collapse": "the loss scale collapsed toward 0 (every step skipped)",
    "extra_update": "GradScaler.update() ran more than once per iteration",
    "accumulation_scaler": "accumulation: the scaler ran on micro-batches that do not step",
    "clip_before_unscale": "gradients clipped before scaler.unscale_()",
    "no_scaler": "fp16 without a GradScaler: gradients underflow to 0",
    "fp8_grad_scale": "fp8 gradients cast at a scale that does not fit them: flushed to 0 "
                      "or saturated",
    "fp8_zero_amax": "an fp8 scale taken from an amax of 0: inf or huge, and NaN where it meets "
                     "0 or inf",
    "fp16_loss": "the loss was computed in fp16: it overflowed (or a log met a 0) where fp32 "
                 "would not",
    "eps_underflow": "an eps too small for the format rounded to 0: a norm or Adam divided by 0",
    "step_overflow": "the optimizer step made the weights inf/NaN from finite gradients",
    "stale_grads": "gradients never zeroed: each step adds the last ones again",
    "scale_stuck": "the loss scale stuck below 1: a backward overflows fp16 at any scale",
    "fp16_ignored": "fp16 was asked for but silently ignored",
    "autocast_off": "autocast was off, or not around the forward pass: an fp32 run",
    "no_units": "low precision on a CPU without units for it: slow",
    "pure_low_precision": "weights stored in low precision: no fp32 master weights",
    "compensated_weights": "bf16 weights with compensated or stochastic updates",
    "scaler_with_bf16": "a GradScaler used with bf16 (not needed)",
    "frequent_skips": "many skipped steps",
    "scale_calibrating": "skipped steps at the start: the scale calibrating",
    "stalled": "the loss did not fall",
    "too_small": "the matrices are too small for low precision to pay",
    # a run that raised (diagnose(err)):
    "fp16_weights_scaled": "fp16 weights under a GradScaler: it refuses to unscale fp16 "
                           "gradients",
    "scaler_called_twice": "GradScaler.unscale_() or step() called twice in one iteration",
    "scaler_unused": "scaler.step() without scaler.scale(loss).backward() in the iteration",
    "mixed_dtypes": "an op got tensors of two dtypes: a custom autograd Function, a hand cast",
    "fill_out_of_range": "a fill or mask constant out of the format's range (-1e9 in fp16)",
    "precision_refused": "the device refused the precision or the device asked for",
    "crashed": "the run raised an error that is not a known mixed precision one",
    "pays": "low precision pays on this machine",
}


def emits(*causes: str):
    """Declare the causes a check can name (keys of CAUSES): the registry's other half."""
    unknown = [c for c in causes if c not in CAUSES]
    if unknown:
        raise ValueError(f"unknown cause(s) {unknown}; CAUSES lists {', '.join(CAUSES)}")

    def declare(check):
        check.causes = causes
        return check
    return declare


@dataclass
class Finding:
    """One cause: `name` (a key of CAUSES), how bad (`severity`: "broken", "warning" or
    "note"), what happened (`cause`), the run's numbers that show it, and the `fix`."""

    name: str
    severity: str
    cause: str
    evidence: list[str] = field(default_factory=list)
    fix: str = ""

    @property
    def title(self) -> str:
        return CAUSES[self.name]


@dataclass
class Diagnosis:
    """What `diagnose` found: `findings` (worst first), `run` (what the run was)."""

    run: str
    findings: list[Finding]

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.findings]

    @property
    def cause(self) -> str | None:
        """The name of the worst problem (broken or warning), None for a healthy run."""
        return next((f.name for f in self.findings if f.severity != "note"), None)

    @property
    def ok(self) -> bool:
        return self.cause is None

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def as_dict(self) -> dict:
        return {"run": self.run, "cause": self.cause,
                "findings": [asdict(f) | {"title": f.title} for f in self.findings]}

    def __str__(self) -> str:
        lines = [f"Diagnosis of {self.run}"]
        if self.ok:
            lines.append("  nothing wrong found.")
        for f in self.findings:
            lines.append(f"\n[{f.severity}] {f.title}\n  cause: {f.cause}")
            lines += [f"  - {e}" for e in f.evidence]
            if f.fix:
                lines.append(f"  fix: {f.fix}")
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        colour = {"broken": "#b00020", "warning": "#a65e00", "note": "#555"}
        parts = [f"<b>Diagnosis of {html.escape(self.run)}</b>"]
        if self.ok:
            parts.append("<p>Nothing wrong found.</p>")
        for f in self.findings:
            evidence = "".join(f"<li>{html.escape(e)}</li>" for e in f.evidence)
            parts.append(
                f"<div style='margin:.5em 0'><b style='color:{colour[f.severity]}'>"
                f"[{f.severity}] {html.escape(f.title)}</b><br>{html.escape(f.cause)}"
                f"<ul>{evidence}</ul>" + (f"<i>Fix:</i> {html.escape(f.fix)}" if f.fix else "")
                + "</div>")
        return "".join(parts)

