"""Lesson 7's failure lab: each way a mixed precision run breaks, reproduced on a small model.

    from mplab.diagnosis import lab
    result = lab.run("clip_before_unscale")            # the broken run: a TrainResult
    mplab.diagnose(result)                             # names the cause and the fix
    fixed = lab.run("clip_before_unscale", fix="unscale_first")
    print(lab.FAILURES["clip_before_unscale"].code)    # the loop that ran, bug and fix

Every failure is a plain PyTorch loop (or an `mplab.train` call where the failure lies in a
setting) that a learner could have written, on the lab model (the lesson transformer at
hidden 64, one layer) and the shipped sentiment data, with a `Recorder` watching; `fix=`
switches on the lines that repair it, so a broken run and its fix differ only there. Runs
are seeded: the same call gives the same record.

Each failure is named by the `mplab.diagnosis.CAUSES` entry its broken run reproduces; the
causes a fixed run shows instead (a note that all is well) are its `fix_causes`. Together
they reproduce every cause diagnose can name in a training run.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

from mplab.diagnosis.findings import CAUSES, Diagnosis
from mplab.diagnosis.lab_crashes import (
    custom_function,
    fill_out_of_range,
    fp16_weights_scaled,
    scaler_called_twice,
)
from mplab.diagnosis.lab_fp8 import fp8_zero_amax
from mplab.diagnosis.lab_numerics import (
    Fp16Backward,
    MaskedHead,
    adam_eps,
    adam_eps_zero,
    fp16_loss,
    masked_entropy,
    scale_stuck,
    stale_grads,
)
from mplab.diagnosis.lab_runs import (
    BATCH,
    BF16_FIX_BYTES,
    LAB_PRETRAINED,
    LAB_SHAPE,
    LR,
    CannotReproduce,
    Fp32Island,
    accumulation_error,
    accumulation_scaler,
    autocast_off,
    clip_before_unscale,
    compare_bf16_fixes,
    diverged,
    extra_update,
    fp8_grad_scale,
    fp16_ignored,
    fp16_overflow,
    frequent_skips,
    grow_feed_forward,
    lab_batches,
    lab_model,
    no_scaler,
    no_units,
    pure_bf16,
    scale_collapse,
    scaler_bypassed,
    scaler_with_bf16,
    stalled,
)
from mplab.train import NonFiniteLossError, TrainResult
from mplab.train.result import OWN_LOOP

__all__ = ["CannotReproduce", "LAB_SHAPE", "BATCH", "LAB_PRETRAINED", "LR", "lab_model",
           "lab_batches", "Fp32Island", "fp16_overflow", "grow_feed_forward", "no_scaler",
           "clip_before_unscale", "extra_update", "scale_collapse", "accumulation_scaler",
           "accumulation_error", "fp16_ignored", "no_units", "scaler_bypassed", "diverged",
           "autocast_off", "scaler_with_bf16", "frequent_skips", "stalled", "fp8_grad_scale",
           "pure_bf16", "BF16_FIX_BYTES", "compare_bf16_fixes", "Failure", "FAILURES", "run",
           "CRASHES", "fp16_loss", "adam_eps", "stale_grads", "scale_stuck",
           "Fp16Backward", "adam_eps_zero", "MaskedHead", "masked_entropy", "fp8_zero_amax"]


@dataclass(frozen=True)
class Failure:
    """One failure: the diagnose cause it reproduces (`name`; its title is CAUSES'), what a
    learner sees, the fixes `run` accepts (the first is the one the lesson applies), the
    causes a fixed run shows instead (`fix_causes`: notes that all is well) and the code that
    runs."""

    name: str
    symptom: str
    fixes: tuple[str, ...]
    runner: Callable[..., TrainResult]
    fix_causes: tuple[tuple[str, str], ...] = ()  # (fix, the cause its run shows)

    @property
    def title(self) -> str:
        return CAUSES[self.name]

    @property
    def code(self) -> str:
        return inspect.getsource(self.runner)

    def run(self, fix: str | None = None, **settings) -> TrainResult:
        if fix is not None and fix not in self.fixes:
            raise ValueError(f"{self.name} has no fix {fix!r}; accepted: "
                             f"{', '.join(map(repr, self.fixes))} or None (the broken run)")
        try:
            result = self.runner(fix=fix, **settings)
        except NonFiniteLossError as err:  # a run that stopped is still the lab's run
            _label(err.result, self.name, fix)
            raise
        return _label(result, self.name, fix)

    def fixed_in(self, diagnosis: Diagnosis) -> bool:
        """Is the failure gone from a run's diagnosis? The only test that counts: diagnose no
        longer names its cause (other findings, such as the CPU's, may stay)."""
        return self.name not in diagnosis


def _label(result: TrainResult, name: str, fix: str | None) -> TrainResult:
    """Name the run by what it is (diagnose's header reads it): the lab's failure and fix,
    and mplab.train's path where the run went through one rather than a loop of its own."""
    label = f"lab run {name}" + (f" with fix {fix}" if fix else "")
    if result.path != OWN_LOOP:
        label += f" (mplab.train, {result.path} path)"
    result.config["label"] = label
    return result


FAILURES = {f.name: f for f in [
    Failure("fp16_overflow", "the loss is NaN from the first step", ("bf16", "fp32_island"),
            fp16_overflow),
    Failure("scaler_bypassed", "the loss explodes to NaN in a step or two, nothing skipped",
            ("scaler_step",), scaler_bypassed),
    Failure("diverged", "the loss climbs far above where it started", ("lower_lr",), diverged),
    Failure("no_scaler", "it trains, but most gradient entries are exactly 0",
            ("scaler", "bf16"), no_scaler),
    Failure("clip_before_unscale", "training runs, the gradient norms are huge",
            ("unscale_first",), clip_before_unscale),
    Failure("extra_update", "the scale jumps around", ("update_once",), extra_update),
    Failure("scale_collapse", "the loss is finite but flat; the scale halves every step",
            ("eps",), scale_collapse),
    Failure("accumulation_scaler", "training runs, but learns from one micro-batch in four",
            ("step_only",), accumulation_scaler),
    Failure("pure_low_precision", "the loss falls more slowly than fp32's, or stalls",
            ("fp32_master", "kahan", "stochastic"), pure_bf16,
            (("kahan", "compensated_weights"), ("stochastic", "compensated_weights"))),
    Failure("frequent_skips", "about every other step is skipped, all through the run",
            ("default_growth",), frequent_skips, (("default_growth", "scale_calibrating"),)),
    Failure("fp16_ignored", "fp16 trains exactly like fp32", ("supported",), fp16_ignored),
    Failure("autocast_off", "bf16 was asked for, and every matmul ran in fp32",
            ("same_device",), autocast_off),
    Failure("no_units", "correct, but far slower than fp32", ("fp32",), no_units),
    Failure("scaler_with_bf16", "nothing visible: bf16 with a GradScaler that never acts",
            ("drop_scaler",), scaler_with_bf16),
    Failure("stalled", "the loss stays where it started", ("higher_lr",), stalled),
    Failure("fp8_grad_scale", "fp8 gradients almost all exactly 0; the loss falls late",
            ("scaled_e5m2",), fp8_grad_scale),
    Failure("fp16_loss", "the loss is NaN at every step; the model's outputs are finite",
            ("fp32_loss",), fp16_loss, (("fp32_loss", "scale_calibrating"),)),
    Failure("eps_underflow", "a model loaded in fp16 gives NaN right after its first Adam "
            "step", ("fp32_master", "eps"), adam_eps),
    Failure("step_overflow", "the loss is fine at step 1, NaN from step 2 on; no forward "
            "overflowed", ("default_eps",), adam_eps_zero),
    Failure("fill_out_of_range", "the loss is NaN at every step; one module's output holds "
            "-inf and nothing else large", ("finfo_min",), masked_entropy),
    Failure("fp8_zero_amax", "fp8 training is NaN from the second step; the first was fine",
            ("amax_floor", "torchao"), fp8_zero_amax),
    Failure("stale_grads", "the loss falls oddly fast, then swings", ("zero_grad",),
            stale_grads),
    Failure("scale_stuck", "the loss barely moves; the scale sits below 1", ("fp32_backward",),
            scale_stuck),
]}

#: Failures whose broken run raises: `CRASHES[name].run()` raises the error people report
#: (diagnose(err) names it by `name`), and `.run(fix)` trains clean.
CRASHES = {f.name: f for f in [
    Failure("fp16_weights_scaled", "ValueError: Attempting to unscale FP16 gradients.",
            ("fp32_weights",), fp16_weights_scaled),
    Failure("scaler_called_twice", "RuntimeError: unscale_() has already been called on this "
            "optimizer since the last update()", ("unscale_once",), scaler_called_twice),
    Failure("mixed_dtypes", "RuntimeError in a custom Function's backward: expected m1 and m2 to "
            "have the same dtype", ("custom_fwd",), custom_function),
    Failure("fill_out_of_range", "RuntimeError: value cannot be converted to type c10::Half "
            "without overflow", ("finfo_min",), fill_out_of_range),
]}


def run(name: str, fix: str | None = None, **settings) -> TrainResult:
    """Reproduce failure `name` (a key of FAILURES), or its fixed run with `fix=`."""
    if name not in FAILURES:
        raise ValueError(f"unknown failure {name!r}; accepted: {', '.join(FAILURES)}")
    return FAILURES[name].run(fix, **settings)
