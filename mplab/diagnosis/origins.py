"""Where a run's first inf/NaN began, read from what mplab.train.layers recorded
(`TrainResult.numerics`), and the causes that only the layers' record can tell apart: an
activation that overflowed fp16, a fill constant out of range, an eps that rounds to 0 (in a
norm or in Adam), a loss computed in fp16, an optimizer step that overflowed, gradients
never zeroed, and a scale stuck below 1."""

from __future__ import annotations

import math
import statistics

from mplab.numerics.formats import get_format
from mplab.train.result import TrainResult

from .findings import Finding, emits
from .reading import loss_words, trailing_skips

__all__ = ["ORIGIN_CAUSES", "harmful", "origin", "layer_series", "crossed_words", "stale_grads",
           "scale_stuck"]

#: The causes `origin` can name, besides fp16_overflow and diverged.
ORIGIN_CAUSES = ("fill_out_of_range", "eps_underflow", "fp16_loss", "step_overflow",
                 "no_scaler")
_PHASES = ("forward", "loss", "backward", "step")
_FILL_SIDE = 2.0 ** 10  # a fill's other side: ordinary values, nowhere near an overflow
_LOW = ("float16", "bfloat16")
# optimizers whose update divides by sqrt(a running square) + eps
_DIVIDING = ("Adam", "AdamW", "NAdam", "RAdam", "Adamax", "SparseAdam", "Adagrad", "RMSprop",
             "Adadelta")


def _rounds_to_zero(value: float, dtype: str) -> bool:
    return dtype in _LOW and 0 < value < float(get_format(dtype).min_subnormal) / 2


def harmful(r: TrainResult) -> list[tuple[str, dict]]:
    """The first non-finite values that harmed the run, earliest first: a gradient's only
    where no scaler skipped its step (skipping it is the scaler's job)."""
    first = (r.numerics or {}).get("first") or {}
    found = [(phase, e) for phase, e in first.items() if phase in _PHASES
             and isinstance(e, dict) and isinstance(e.get("step"), int)
             and not (phase == "backward" and e["step"] in r.skipped_steps)]
    return sorted(found, key=lambda pe: (pe[1]["step"], _PHASES.index(pe[0])))


def layer_series(r: TrainResult, module: str, phase: str = "forward",
                 field: str = "amax") -> list[tuple[int, float]]:
    """(step, value) of one module's sampled figure (a key of mplab.train.layers.LAYER_FIELDS)."""
    rows = (r.numerics or {}).get("layers") or []
    return [(row["step"], row[field]) for row in rows
            if row.get("module") == module and row.get("phase") == phase and field in row]


def _series_words(r: TrainResult, module: str) -> list[str]:
    series = [(s, v) for s, v in layer_series(r, module) if math.isfinite(v)]
    if len(series) < 2:
        return []
    shown = series if len(series) <= 5 else series[:2] + series[-3:]
    return [f"{module}'s largest |output|, sampled: "
            + ", ".join(f"{v:,.4g} at step {s}" for s, v in shown)]


def crossed_words(r: TrainResult) -> list[str]:
    """The first module output that passed fp16's largest value, in words (for a run in bf16
    or fp32, where it fits: what would overflow in fp16); [] where none did."""
    crossed = (r.numerics or {}).get("over_fp16") or {}
    if not crossed:
        return []
    module, step = min(crossed.items(), key=lambda kv: kv[1])
    others = len(crossed) - 1
    return [f"{module}'s output passed 65,504 (fp16's largest) at step {step}"
            + (f", and {others} other module{'s' * (others != 1)}' later or with it"
               if others else "")]


def _where(e: dict) -> str:
    return f"{e['module']} ({e['kind']}, {e['dtype']})"


def origin(r: TrainResult) -> list[Finding] | None:
    """The cause of the run's first harmful inf/NaN, from where it began; None where the
    record cannot say (a run recorded without the layers' watch, or nothing non-finite)."""
    found = harmful(r)
    if not found:
        return None
    phase, e = found[0]
    at = f"step {e['step']}"
    if phase == "step":
        return _step(r, e, at)
    if phase == "loss":
        if e.get("dtype") != "float16" or not e.get("outputs_finite"):
            return None
        return [Finding("fp16_loss", "broken",
                        "the loss was computed in fp16 from finite model outputs: an exp or a "
                        "sum in it passed 65504 (or a probability underflowed to 0 and its log "
                        "is -inf), where the same computation in fp32 fits",
                        [f"{at}: every module's output was finite, the loss ({e.get('value')}) "
                         "was not, and it was an fp16 tensor"],
                        "compute the loss in fp32 from the logits: `loss_fn(logits.float(), "
                        "labels)`, and prefer a fused, stable loss (F.cross_entropy, "
                        "F.log_softmax) to exp/softmax/log written by hand; under autocast "
                        "compute it inside the autocast block, where torch runs losses in fp32")]
    if phase == "backward":
        if r.precision == "fp16" and r.config.get("scaler") is None and not r.scales:
            return [Finding("no_scaler", "broken",
                            "a gradient overflowed fp16 in the backward pass and, with no "
                            "GradScaler to skip the step, the optimizer wrote inf/NaN into "
                            "the weights",
                            [f"{at}: the gradient of {_where(e)}'s output was the first "
                             "non-finite value; the forward pass and the loss were finite"],
                            "use a GradScaler (`scaler = torch.amp.GradScaler(device)`, "
                            "`scaler.scale(loss).backward()`, `scaler.step(optimizer)`, "
                            "`scaler.update()`): it skips a step with inf/NaN gradients and "
                            "lowers the scale; or train in bf16")]
        return None
    return _forward(r, e, at)


def _forward(r: TrainResult, e: dict, at: str) -> list[Finding] | None:
    low, lo, hi = e["dtype"] in _LOW, e["min"], e["max"]
    eps, kind = e.get("eps"), str(e.get("kind", ""))
    if eps is not None and "norm" in kind.lower() and e.get("input_finite", True) \
            and _rounds_to_zero(eps, e["dtype"]):
        fmt = get_format(e["dtype"])
        return [Finding("eps_underflow", "broken",
                        f"{e['module']} computes in {fmt.name}, where its eps ({eps:g}) "
                        f"rounds to 0 (the smallest {fmt.name} number is "
                        f"{float(fmt.min_subnormal):.3g}): a row whose mean square is 0 (a "
                        "padded or zeroed row, or tiny values whose squares underflow) is "
                        "divided by sqrt(0)",
                        [f"{at}: {_where(e)} was the first module whose output held inf/NaN, "
                         "and its input was finite"],
                        "compute the norm in fp32 (`x.float()` inside it, then cast back: "
                        "what LlamaRMSNorm does); under autocast torch's own layer_norm "
                        "already runs in fp32. Raising eps is not enough in fp16: at a zero "
                        "row the backward's eps^-1.5 / 2 passes 65504 for any eps below 1e-3")]
    one_sided = math.isinf(lo) != math.isinf(hi) and not (math.isnan(lo) or math.isnan(hi))
    other = abs(hi if math.isinf(lo) else lo)
    before = e.get("peak_before")
    if low and one_sided and other < _FILL_SIDE and (before is None or before < _FILL_SIDE):
        fmt = get_format(e["dtype"])
        sign = "-" if math.isinf(lo) else "+"
        return [Finding("fill_out_of_range", "broken",
                        f"a constant past {fmt.name}'s range ({float(fmt.max_finite):.5g}) was "
                        f"added or filled into {e['module']}'s output (an attention or "
                        f"logits mask of -1e9, or torch.finfo(torch.float32).min): it became "
                        f"{sign}inf, and 0 × inf or inf - inf made NaN downstream",
                        [f"{at}: {_where(e)} was the first module whose output held inf: only "
                         f"{sign}inf, while its finite values stay below {other:.4g}"
                         + (f" (below {before:.4g} on the steps before)" if before else "")
                         + ", so no value grew into it"],
                        "take the fill value from the tensor's own dtype: "
                        "`torch.finfo(x.dtype).min` (or a moderate -1e4 in fp16), or apply "
                        "the mask in fp32")]
    if r.precision != "fp16" or e["dtype"] != "float16":
        return None  # fp32's range: the weights themselves diverged (runs.py says so)
    before_losses = [v for v in r.losses[:e["step"] - 1] if math.isfinite(v)]
    if len(before_losses) >= 3 and max(before_losses[-3:]) > 4 * before_losses[0]:
        lr = r.config.get("lr")
        return [Finding("diverged", "broken",
                        "the loss climbed before anything overflowed: the weights diverged, "
                        "and their growing activations then passed fp16's largest value",
                        [f"the loss went from {before_losses[0]:.4g} at step 1 to "
                         f"{max(before_losses[-3:]):.4g} by step {len(before_losses)}",
                         f"{at}: {_where(e)} was the first module whose output held "
                         "inf/NaN"],
                        f"lower the learning rate"
                        f"{f' (lr={lr:g})' if isinstance(lr, (int, float)) else ''}, use a "
                        "warm-up, or clip gradients (max_grad_norm); bf16 would only move the "
                        "overflow later")]
    evidence = [f"{at}: {_where(e)} was the first module whose output held inf/NaN "
                f"(min {lo:.4g}, max {hi:.4g})"
                + (f"; its largest |output| on the steps before was {before:,.4g}"
                   if before else "; at the first step, with no earlier value to compare")]
    evidence += _series_words(r, e["module"])
    if "input_finite" in e and e["input_finite"] is False:
        evidence.append(f"{e['module']}'s input was already inf/NaN: the overflow happened "
                        "in the operation just before it (a residual add, a matmul outside "
                        "a module)")
    return [Finding("fp16_overflow", "broken",
                    "an activation in the forward pass exceeded fp16's largest value (65504) "
                    "and became inf; the next normalization or softmax made it NaN",
                    evidence,
                    f"train in bf16 (fp32's exponent range, so the same activation fits), or "
                    f"keep the block that overflows ({e['module']}) in fp32, an fp32 island: "
                    f"`with torch.autocast(device, enabled=False): h = block(h.float())`. "
                    f"mplab.amp.trace shows the largest activation of each layer")]


def _step(r: TrainResult, e: dict, at: str) -> list[Finding]:
    state = r.optimizer_state_dtype
    state = str(state).replace("torch.", "") if state is not None else None
    optimizer = str(r.config.get("optimizer") or "")
    eps = r.config.get("eps")
    eps = eps if isinstance(eps, (int, float)) else 1e-8 if optimizer in _DIVIDING else None
    evidence = [f"{at}: the gradient of {e['parameter']} was finite (largest |value| "
                f"{e['grad_amax']:.4g}) and so was the weight before the step "
                f"(largest {e['weight_amax_before']:.4g}); after optimizer.step() it held "
                "inf/NaN"]
    if optimizer in _DIVIDING and state and eps is not None and _rounds_to_zero(eps, state):
        fmt = get_format(state)
        return [Finding("eps_underflow", "broken",
                        f"{optimizer}'s states are {fmt.name}, where its eps ({eps:g}) rounds to "
                        f"0: where a gradient's square underflowed (below "
                        f"{float(fmt.min_subnormal):.3g}), the update divides by sqrt(0) + 0",
                        evidence + [f"the optimizer's states are {state}"],
                        "keep fp32 master weights and optimizer states (model.float() with "
                        "autocast for the speed); if the weights must stay fp16, use an eps "
                        "fp16 holds (1e-4, as pure-fp16 recipes do) or an optimizer that keeps "
                        "its states in fp32")]
    if eps == 0 and optimizer in _DIVIDING:
        return [Finding("step_overflow", "broken",
                        f"the optimizer step itself made the weights NaN from finite gradients: "
                        f"{optimizer} divides by sqrt(v) + eps, and with eps=0 a weight whose "
                        "gradient has been 0 at every step so far (an embedding row no batch "
                        "used, a dead unit) gets 0 / 0",
                        evidence + [f"{optimizer}'s eps is 0"],
                        "give the optimizer an eps above 0 (torch's default, 1e-8; 1e-4 where "
                        "its states are fp16)")]
    weights = str(r.param_dtype).replace("torch.", "") if r.param_dtype is not None else "?"
    lr = r.config.get("lr")
    return [Finding("step_overflow", "broken",
                    f"the optimizer step itself made the weights non-finite: the update, "
                    f"computed from finite gradients, overflowed the weights' format "
                    f"({weights}) or divided by 0", evidence,
                    "keep fp32 master weights (model.float(), autocast for the speed), whose "
                    "range holds the update; check the learning rate"
                    + (f" (lr={lr:g})" if isinstance(lr, (int, float)) else "")
                    + ", the optimizer's eps, and a loss summed rather than averaged, which "
                    "makes every gradient as large as the batch")]


@emits("stale_grads")
def stale_grads(r: TrainResult) -> list[Finding]:
    stale = (r.numerics or {}).get("stale_grads") or []
    checked = len(r.losses) - 1 - len(r.skipped_steps)  # steps after a step that stepped
    if len(stale) < 3 or len(stale) < 0.5 * checked:
        return []
    evidence = [f"at {len(stale)} of the {max(checked, len(stale))} steps after the first, the "
                f"backward added its gradients to the last step's, still held (steps "
                f"{', '.join(map(str, stale[:6]))}{' …' if len(stale) > 6 else ''}): "
                "nothing zeroed them between optimizer steps"]
    words = loss_words(r)
    return [Finding("stale_grads", "broken",
                    "the gradients were never zeroed: each backward adds to the sum of every "
                    "gradient before it, so step n moves the weights by all n gradients at "
                    "once and the run drifts or diverges", evidence + ([words] if words else []),
                    "call optimizer.zero_grad() once per optimizer step (before the backward, "
                    "or right after optimizer.step(); with gradient accumulation, only after "
                    "the step)")]


@emits("scale_stuck")
def scale_stuck(r: TrainResult) -> list[Finding]:
    if len(r.scales) < 20 or trailing_skips(r) >= 8:
        return []  # all skipped at the end is a collapse (scale_collapse)
    half = len(r.scales) // 2
    if statistics.median(r.scales[half:]) >= 1:
        return []
    late = [s for s in r.skipped_steps if s > half]
    evidence = [f"over the last {len(r.scales) - half} steps the loss scale stayed below 1 "
                f"(median {statistics.median(r.scales[half:]):.3g}), and {len(late)} of them "
                "were skipped: the gradients overflowed fp16 even shrunk by the scale"]
    back = ((r.numerics or {}).get("first") or {}).get("backward")
    if isinstance(back, dict) and back.get("module"):
        evidence.append(f"the first gradient to overflow was that of {_where(back)}'s output, "
                        f"at step {back['step']}")
    evidence.append("with the scale below 1, small gradients underflow too: the run learns "
                    "from neither end")
    return [Finding("scale_stuck", "broken",
                    "a part of the backward pass computes in fp16 where its forward ran in "
                    "fp32 (an fp32 island whose backward torch.compile or a custom autograd "
                    "Function runs in fp16), or its gradients are truly past fp16's range: no "
                    "loss scale can fit them",
                    evidence,
                    "make the backward of that part run in fp32: decorate a custom Function "
                    "with @torch.amp.custom_fwd(device_type=..., cast_inputs=torch.float32) "
                    "and @torch.amp.custom_bwd(device_type=...), or compile the model without "
                    "the island (and check the compiled backward's dtypes with mplab.amp.trace); "
                    "or train in bf16, whose range fits the gradients")]
