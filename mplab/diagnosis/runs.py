"""The checks of a training record, in order of harm: each reads the run's own numbers and the
codes other modules recorded (the audit's fallbacks, the stop reason, the path), never their
words, and declares the causes it can name."""

from __future__ import annotations

import math
import statistics

import torch

from mplab.numerics.formats import dtype_name
from mplab.train.result import OWN_LOOP, TrainResult

from .findings import SEVERITIES, Diagnosis, Finding, emits
from .fp8 import FP8_CHECKS, fp8_made_nan
from .origins import ORIGIN_CAUSES, crossed_words, origin, scale_stuck, stale_grads
from .reading import fallback, finite, loss_drop, loss_words, median, setting, trailing_skips

__all__ = ["diagnose_run", "RUN_CHECKS"]


def diagnose_run(result: TrainResult) -> Diagnosis:
    """Every check of a training record, worst first (see mplab.diagnosis)."""
    findings: list[Finding] = []
    for check in _CHECKS:
        for found in check(result):
            same = next((f for f in findings if f.name == found.name), None)
            if same is None:
                findings.append(found)
            else:  # two checks saw the same cause: one finding, with both's evidence
                same.evidence += [e for e in found.evidence if e not in same.evidence]
    if not any(f.severity == "broken" for f in findings):
        findings += _stalled(result)
    order = {s: i for i, s in enumerate(SEVERITIES)}
    findings.sort(key=lambda f: order[f.severity])  # stable: the checks' order within a kind
    steps = len(result.losses)
    done = f"{steps} step{'s' * (steps != 1)}"
    if result.stop_reason:  # the step that stopped it recorded no loss
        done = f"stopped at step {steps + 1}" + (f" after {done}" if steps else "")
    # what the run is: its label (a lab run's failure, a Recorder's label=), else its path
    # (mplab.train's torch/accelerate/trainer, or "own loop" for a Recorder's)
    label = result.config.get("label") or result.path
    run = f"{label} / {result.precision} on {result.device}, {result.model}, {done}"
    return Diagnosis(run, findings)


def _bypassed(r: TrainResult) -> list[tuple[int, dict]]:
    """(iteration, calls) where the loss was scaled but scaler.step() never ran."""
    return [(i + 1, c) for i, c in enumerate(r.scaler_calls)
            if c.get("scale", 0) > 0 and c.get("step", 0) == 0]


# ---- the checks, in order of harm -------------------------------------------------------------

@emits("fp16_overflow", "diverged", *ORIGIN_CAUSES)
def _non_finite(r: TrainResult) -> list[Finding]:
    bad = [i + 1 for i, v in enumerate(r.losses) if not math.isfinite(v)]
    stopped = r.stop_reason == "non_finite_loss"
    if not bad and not stopped or _bypassed(r) or fp8_made_nan(r):  # each its own cause
        return []
    began = origin(r)  # where the first inf/NaN began, if the layers' watch saw it
    if began is not None:
        return began
    step = bad[0] if bad else len(r.losses) + 1
    evidence = [f"step {step}: the loss is not finite"
                + (f" (and {len(bad) - 1} more steps after)" if len(bad) > 1 else "")
                + ("; the step before was finite" if step == 2
                   else f"; the {step - 1} steps before were finite" if step > 2
                   else ": the very first loss, before any update")]
    fp16 = r.precision == "fp16" and r.compute_dtype in (None, torch.float16)
    if not fp16:
        seen = finite(r.losses)
        if seen:
            evidence.append(f"the loss rose from {min(seen):.4g} to {max(seen[-5:]):.4g} "
                            "before it broke")
        lr = r.config.get("lr")
        return [Finding("diverged", "broken",
                        f"in {r.precision} the range is fp32's, so a non-finite loss means the "
                        "weights themselves diverged", evidence + crossed_words(r),
                        f"lower the learning rate{f' (lr={lr:g})' if lr else ''} or clip "
                        "gradients (max_grad_norm)")]
    if r.scales:
        evidence.append("the GradScaler could not help: it scales gradients, and this value "
                        "overflowed in the forward pass, before any gradient")
    if not bad and r.losses:
        evidence.append(f"the steps before were healthy (last loss {r.losses[-1]:.4f}): an "
                        "activation grew past fp16's largest value, 65504, as in T5")
    return [Finding("fp16_overflow", "broken",
                    "an activation in the forward pass exceeded fp16's largest value (65504) "
                    "and became inf; the next normalization or softmax made it NaN",
                    evidence,
                    "train in bf16 (fp32's exponent range, so the same activation fits), or "
                    "keep the block that overflows in fp32, an fp32 island: `with "
                    "torch.autocast(device, enabled=False): h = block(h.float())`. "
                    "mplab.amp.trace shows the largest activation of each layer")]


@emits("scaler_bypassed")
def _scaler_bypass(r: TrainResult) -> list[Finding]:
    bypassed = _bypassed(r)
    if not bypassed or len(bypassed) < len(r.scaler_calls) / 2:
        return []
    first, c = bypassed[0]
    scale = r.config.get("init_scale")
    times = f"{scale:g}× (the scale)" if isinstance(scale, (int, float)) else "the scale times"
    evidence = [f"in {len(bypassed)} of {len(r.scaler_calls)} iterations the loss was scaled "
                f"but scaler.step() never ran (iteration {first}: scale {c.get('scale', 0)}×, "
                f"unscale_ {c.get('unscale_', 0)}×, step {c.get('step', 0)}×, update "
                f"{c.get('update', 0)}×): nothing divided the gradients by the scale again"]
    bad = [i + 1 for i, v in enumerate(r.losses) if not math.isfinite(v)]
    # Adam divides by the gradient's own running size, so the scale cancels from its update
    adam = str(r.config.get("optimizer") or "").endswith(("Adam", "AdamW", "Adamax"))
    if adam:
        cause = (f"optimizer.step() ran on the scaled gradients: {r.config['optimizer']} "
                 "divides each update by the gradient's own running size, so the scale "
                 "cancelled and the updates looked normal, but steps whose gradients "
                 "overflowed were not skipped: their inf/NaN went into its moments and the "
                 "weights")
    else:
        cause = ("optimizer.step() ran on the scaled gradients: every update was the scale "
                 "times too large, and steps with inf/NaN gradients were not skipped")
    if bad:
        evidence.append(f"step {bad[0]}: the loss is not finite; " + (
            "an overflowed gradient reached the weights unskipped" if adam else
            f"the optimizer took steps {times} too large, and an inf gradient was never "
            "skipped"))
    return [Finding("scaler_bypassed", "broken", cause, evidence,
                    "after scaler.scale(loss).backward(), step through the scaler: "
                    "scaler.step(optimizer) (it unscales, and skips a step with inf/NaN), then "
                    "scaler.update(); never optimizer.step() directly")]


@emits("diverged")
def _rising(r: TrainResult) -> list[Finding]:
    """A finite loss whose last quarter lies above twice its first value: diverging."""
    losses = r.losses
    if len(losses) < 8 or not all(map(math.isfinite, losses)):
        return []
    k = max(2, len(losses) // 4)
    later = statistics.median(losses[-k:])
    if later <= 2 * losses[0]:
        return []
    lr = r.config.get("lr")
    return [Finding("diverged", "broken",
                    "the loss climbed instead of falling: the updates are too large for the "
                    "model, whatever the precision",
                    [f"the loss went from {losses[0]:.4g} at step 1 to {later:.4g} (the median "
                     f"of the last {k} steps)"] + crossed_words(r),
                    f"lower the learning rate{f' (lr={lr:g})' if lr else ''}, use a warm-up, "
                    "or clip gradients (max_grad_norm)")]


@emits("scale_collapse")
def _scale_collapse(r: TrainResult) -> list[Finding]:
    tail = trailing_skips(r)
    if not r.scales or tail < 8 or r.scales[-1] >= 1:
        return []
    start = len(r.losses) - tail + 1
    last = r.scales[-1]
    backoff = setting(r, "backoff_factor", 0.5)
    evidence = [f"the last {tail} steps (from step {start}) were all skipped: the weights have "
                "not changed since",
                f"the scale fell to {last:.3g} (from {max(r.scales):.6g})"]
    if last > 0 and 0 < backoff < 1:
        to_zero = math.ceil(math.log(last / 2**-149) / -math.log(backoff))
        evidence.append(f"at ×{backoff:g} per step it reaches 0 (below fp32's smallest "
                        f"number, 2^-149) in about {to_zero} more steps: torch's GradScaler "
                        "has no lower bound (pytorch issue #99640)")
    elif last == 0:
        evidence.append("the scale is 0: every scaled gradient is 0, or NaN where 0 × inf")
    seen = finite(r.losses[start - 1:])
    if seen:
        evidence.append(f"the loss stayed finite ({seen[-1]:.4f}): the forward pass is fine; "
                        "the gradients are inf/NaN at any scale, so no scale can fix them")
    return [Finding("scale_collapse", "broken",
                    "the gradients were non-finite at every step, whatever the scale, so the "
                    "scaler skipped every step and backed the scale off each time",
                    evidence,
                    "find where the gradients become NaN: run one step under "
                    "`torch.autograd.set_detect_anomaly(True)`. A usual cause is a log, sqrt "
                    "or division of 0 inside torch.where: the branch not taken still gets a "
                    "gradient, and 0 × inf = NaN; give it a safe input (`torch.where(ok, x, 1)` "
                    "first). And put a floor under the scale: stop, or reset it, when "
                    "scaler.get_scale() < 1")]


@emits("extra_update", "accumulation_scaler")
def _scaler_calls(r: TrainResult) -> list[Finding]:
    calls = r.scaler_calls
    if calls:
        extra = [(i + 1, c) for i, c in enumerate(calls) if c.get("update", 0) > 1]
        if not extra:
            return []
        first, c = extra[0]
        counted = (f"in {len(extra)} of {len(calls)} iterations update() ran more than once "
                   f"(iteration {first}: unscale_ {c['unscale_']}×, step {c['step']}×, update "
                   f"{c['update']}×)")
        if c.get("step", 0) > 1 and c["update"] >= c["step"]:
            return [Finding(
                "extra_update", "broken",
                "update() ran after each optimizer's step instead of once per iteration: the "
                "scale backs off twice per overflow and grows twice as fast, and the second "
                "optimizer's gradients are unscaled by a scale they were not scaled with",
                [counted] + _scale_jumps(r),
                "call scaler.step(opt) for every optimizer, then scaler.update() once, at the "
                "end of the iteration")]
        return [Finding(
            "accumulation_scaler", "broken",
            "the scaler's unscale_/update ran on micro-batches that do not step: each update() "
            "starts a new scale, and the gradients already unscaled are unscaled again at the "
            "real step (divided by the scale twice), so all but the last micro-batch vanish",
            [counted, "an optimizer step over several micro-batches needs one unscale_, one "
             "step and one update"],
            "during accumulation only backward(scaler.scale(loss)) runs per micro-batch; call "
            "unscale_ (to clip), step and update only when the optimizer steps (with "
            "Accelerate: `if accelerator.sync_gradients:`)")]
    jumps = _scale_jumps(r)
    if not jumps:
        return []
    return [Finding("extra_update", "warning",
                    "the scale changed by more than one backoff or growth in one iteration, "
                    "which happens when update() runs more than once per iteration (or "
                    "several scalers share a loss)", jumps,
                    "call scaler.update() once per iteration, after every scaler.step(opt)")]


def _scale_jumps(r: TrainResult) -> list[str]:
    backoff = setting(r, "backoff_factor", 0.5)
    growth = setting(r, "growth_factor", 2.0)
    for i in range(1, len(r.scales)):
        before, after = r.scales[i - 1], r.scales[i]
        if before <= 0 or after <= 0:
            continue
        ratio = after / before
        if ratio < backoff * 0.99 or ratio > growth * 1.01:
            return [f"iteration {i + 1}: the scale went from {before:g} to {after:g} (×{ratio:g})"
                    f", more than one ×{backoff:g} backoff or ×{growth:g} growth"]
    return []


@emits("clip_before_unscale")
def _clip_before_unscale(r: TrainResult) -> list[Finding]:
    if not r.scales or not r.grad_norms:
        return []
    pairs = [(n, s) for n, s in zip(r.grad_norms, r.scales) if math.isfinite(n) and s > 0]
    if not pairs:
        return []
    norm = statistics.median(n for n, _ in pairs)
    scale = statistics.median(s for _, s in pairs)
    per_scale = statistics.median(n / s for n, s in pairs)
    # A true gradient norm thousands of times 1 is a diverging run; one that is a plain
    # multiple of the scale is a norm of the scaled gradients.
    if scale < 256 or norm < 1000 or per_scale > 100:
        return []
    max_norm = r.config.get("max_grad_norm")
    # What the optimizer received, where the layers' watch read it: clipped before unscale_,
    # max_norm / scale; clipped after, about min(norm, max_norm). A true norm of thousands (a
    # loss summed over tokens) is not the scaled one.
    applied = median(finite((r.numerics or {}).get("applied_norms") or []))
    if applied is not None and isinstance(max_norm, (int, float)) \
            and applied > 4 * max_norm / scale:
        return []
    evidence = [f"the median gradient norm before clipping is {norm:.4g}, {per_scale:.3g} × "
                f"the median scale ({scale:g}): the norm of the scaled gradients"]
    if isinstance(max_norm, (int, float)):
        evidence.append(f"so clip_grad_norm_(max_norm={max_norm:g}) cut every step: after "
                        f"unscaling, the update used gradients of norm about "
                        f"{max_norm / scale:.2g} instead of {per_scale:.3g}")
    words = loss_words(r)
    return [Finding("clip_before_unscale", "broken",
                    "clip_grad_norm_ ran on the scaled gradients: the threshold was compared "
                    "with the gradients times the scale, so every step was clipped far below "
                    "its true size", evidence + ([words] if words else []),
                    "call scaler.unscale_(optimizer) right before clip_grad_norm_ (scaler.step "
                    "then does not unscale again)")]


@emits("no_scaler")
def _no_scaler(r: TrainResult) -> list[Finding]:
    # mplab.train's paths always scale fp16; only a loop of one's own can leave it out
    scaled = bool(r.scales) or r.path != OWN_LOOP or r.config.get("scaler") is not None
    if r.precision != "fp16" or r.compute_dtype not in (None, torch.float16) or scaled:
        return []
    if r.compute_dtype is None and r.audit is not None and r.audit.compute_dtype is None:
        return []
    zeros = median(r.zero_grad_fractions)
    evidence = []
    if zeros is not None:
        evidence.append(f"in a typical step {zeros:.1%} of the gradient entries were exactly 0 "
                        "(fp16 flushes anything below 2^-24 ≈ 6e-8 to 0); an fp32 run has "
                        "almost none outside the embedding tables")
    words = loss_words(r)
    if words:
        evidence.append(words)
    broken = zeros is not None and zeros > 0.05
    return [Finding("no_scaler", "broken" if broken else "warning",
                    "fp16 gradients without a GradScaler: small gradients underflow to 0 and "
                    "their updates are lost" + ("" if broken else
                                                " (this run lost few so far, but it can)"),
                    evidence,
                    "use a GradScaler: `scaler = torch.amp.GradScaler(device)`, "
                    "`scaler.scale(loss).backward()`, `scaler.step(optimizer)`, "
                    "`scaler.update()`; or train in bf16, whose range needs no scaling")]


@emits("fp16_ignored", "autocast_off")
def _ignored(r: TrainResult) -> list[Finding]:
    found = []
    said = fallback(r, "fp16_ignored")
    if said:
        found.append(Finding("fp16_ignored", "warning",
                             "fp16 was asked for, but it was silently ignored: this was an "
                             "fp32 run", [said],
                             "on a CPU ask for bf16 (with bf16 units) or fp32; fp16 needs a "
                             "GPU, where the same flag works"))
    said = fallback(r, "autocast_off", "autocast_inactive")
    if said:
        found.append(Finding("autocast_off", "warning",
                             "autocast did not act on the forward pass, so the run was fp32",
                             [said],
                             "build the autocast for the device the model is on, "
                             "`torch.autocast(device.type, dtype=...)`, with a dtype it "
                             "supports there, and run the forward pass inside it"))
    return found


@emits("no_units")
def _no_units(r: TrainResult) -> list[Finding]:
    ran = dtype_name(r.compute_dtype)
    if r.has_units is not False or r.compute_dtype is None or ran == "float32" \
            or r.precision == "fp32":
        return []
    evidence = [f"the matmuls ran in {ran} on {r.device_name or r.device}, which has no "
                f"{r.precision} arithmetic units: torch converts to fp32 and back around every "
                "small block of work"]
    if r.matmul_slowdown is not None:
        evidence.append(f"before the run, a 256x256 matmul took {r.matmul_slowdown:.0f}× as "
                        f"long in {r.precision} as in fp32 on one thread of this CPU")
    step = r.steady_step_seconds
    if step is not None:
        evidence.append(f"a steady step took {step * 1e3:.1f} ms")
    return [Finding("no_units", "warning",
                    f"{r.precision} runs correctly here, but slower than fp32 would",
                    evidence,
                    "train in fp32 on this CPU; bf16 pays off on CPUs with AVX-512-BF16 or "
                    "AMX (mplab.hardware.describe() says which this is) and fp16 on GPUs; "
                    "`python -m mplab.bench --quick` measures it")]


@emits("pure_low_precision", "compensated_weights")
def _low_weights(r: TrainResult) -> list[Finding]:
    weights = dtype_name(r.param_dtype)
    if r.param_dtype is None or weights == "float32":
        return []
    rounding = r.config.get("rounding")
    unchanged = median(r.unchanged_weight_fractions)
    if rounding in ("kahan", "stochastic"):
        how = ("a Kahan compensation buffer keeps what rounding took" if rounding == "kahan"
               else "stochastic rounding keeps each update in expectation")
        return [Finding("compensated_weights", "note",
                        f"the weights are {weights}, but the optimizer's update is computed in "
                        f"fp32 and {how}, so small updates are not lost",
                        [f"a typical step left {unchanged:.1%} of the stored weights as they "
                         "were; that is expected here, not lost work"] if unchanged else [],
                        "")]
    evidence = []
    if unchanged is not None:
        evidence.append(f"in a typical step {unchanged:.1%} of the {weights} weights did not "
                        f"change: their updates were smaller than half a {weights} ulp and "
                        "were rounded away (swamping)")
    state = dtype_name(r.optimizer_state_dtype)
    if state and state != "float32":
        evidence.append(f"the optimizer's states are {state} too: Adam's running averages "
                        "lose the small values they exist to keep")
    words = loss_words(r)
    if words:
        evidence.append(words)
    broken = unchanged is not None and unchanged > 0.25
    return [Finding("pure_low_precision", "broken" if broken else "warning",
                    f"the weights are stored in {weights} (a checkpoint loaded as saved, or "
                    f"model.to({weights})): every update is rounded to {weights}, so updates "
                    "much smaller than the weight are lost", evidence,
                    "keep fp32 master weights (model.float(), or load_pretrained(..., "
                    "dtype=torch.float32), with autocast for the speed); or keep bf16 weights "
                    "and compensate: mplab.numerics.bf16_updates.LowPrecisionUpdate(optimizer, "
                    "rounding='kahan') "
                    "(+2 bytes a weight) or rounding='stochastic' with a seed (+0 bytes)")]


@emits("frequent_skips", "scale_calibrating")
def _skips(r: TrainResult) -> list[Finding]:
    skipped, n = r.skipped_steps, len(r.losses)
    if not skipped or not r.scales or trailing_skips(r) >= 8:
        return []
    early = [s for s in skipped if s <= 20]
    if len(skipped) - len(early) > max(2, 0.05 * n):
        late = len(skipped) - len(early)
        return [Finding("frequent_skips", "warning",
                        "the gradients overflowed fp16 again and again after the scale had "
                        "settled", [f"{late} of the {n} steps after step 20 were skipped "
                                    f"(scale now {r.scales[-1]:g})"],
                        "some gradient is near fp16's limit: look for a loss computed in fp16 "
                        "or a small eps, or use bf16")]
    return [Finding("scale_calibrating", "note",
                    "the first skipped steps are the scale finding its level from init_scale: "
                    "normal", [f"skipped: steps {', '.join(map(str, early[:8]))}"
                               f"{' …' if len(early) > 8 else ''}; the scale settled at "
                               f"{r.scales[-1]:g}"], "")]


@emits("scaler_with_bf16")
def _bf16_scaler(r: TrainResult) -> list[Finding]:
    said = fallback(r, "scaler_with_bf16")
    return [Finding("scaler_with_bf16", "note", "bf16 needs no loss scaling", [said],
                    "drop the GradScaler for bf16")] if said else []


@emits("stalled")
def _stalled(r: TrainResult) -> list[Finding]:
    drop = loss_drop(r.losses)  # short runs are all noise: judge 100 steps or more
    if len(r.losses) < 100 or drop is None or drop >= 0.01 or trailing_skips(r) >= 8:
        return []
    return [Finding("stalled", "warning", "the loss did not fall: no precision problem was "
                    "found to explain it", [loss_words(r)],
                    "check the learning rate and the data; compare with an fp32 run "
                    "(TrainResult.versus)")]


#: The checks of a training record, in order of harm; `_stalled` runs after them when none
#: found the run broken. `_bench` reads a bench record.
_CHECKS = (_scaler_bypass, stale_grads, _non_finite, _rising, _scale_collapse, scale_stuck,
           _scaler_calls, _clip_before_unscale, _no_scaler, *FP8_CHECKS, _ignored, _low_weights,
           _skips, _no_units, _bf16_scaler)
RUN_CHECKS = (*_CHECKS, _stalled)
