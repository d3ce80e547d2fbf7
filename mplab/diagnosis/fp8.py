"""The checks of an FP8 run's record: what its casts did to the values they were given
(`config["fp8"]`, written by mplab.train.fp8's recipes, and for any model that trains through
torchao's Float8Linear or mplab's QDQLinear, in mplab's paths or a loop of your own, by
`mplab.train.fp8_watch.FP8Watch`)."""

from __future__ import annotations

import math

from mplab.numerics.formats import get_format
from mplab.train.result import TrainResult

from .findings import Finding, emits
from .reading import loss_words, median

__all__ = ["FP8_CHECKS", "FLUSHED_MASS", "fp8_made_nan"]

#: The share of the output gradients' magnitude (sum of |g|) a typical step's casts may flush
#: to 0 and still be healthy, where the watch records it. Measured on the lab model (12 steps):
#: torchao's tensorwise recipe flushes 46 % of the nonzero values but 7e-11 of the magnitude
#: (values 2^32 below the amax: a softmax's near-zero weights), e4m3 gradients scaled from the
#: amax 69 % but 6e-7; mplab's e4m3 at scale 1 flushes 92 % and 65 % of the magnitude.
FLUSHED_MASS = 0.05


def _flushed_lost(fp8: dict) -> tuple[float, float | None, bool]:
    """(median share of nonzero values flushed, of the magnitude where recorded, too many?)."""
    flushed = median(fp8.get("grad_flushed", [])) or 0.0
    mass = median(fp8.get("grad_flushed_mass", []))
    return flushed, mass, (mass > FLUSHED_MASS if mass is not None else flushed > 0.5)


def _scaling_fix(fp8: dict, fmt: str) -> str:
    """What would keep the flushed values, for the recipe the run used: torchao's tensorwise
    recipe casts gradients to e5m2, its rowwise ones to e4m3 with a scale per row."""
    scaling = fp8.get("grad_scaling")
    if scaling == "none":
        return ("scale each gradient tensor into the format's range before the cast (scale = "
                "max / amax, as mplab.lowbit.quantize.tensorwise and torchao's Float8Linear do), "
                "and cast gradients to fp8_e5m2, whose range reaches 2^-16 where e4m3's stops "
                "at 2^-9 (mplab.train.fp8.fp8_run('mplab'), torchao's 'tensorwise' recipe), or "
                "give each row its own scale and keep e4m3 (torchao's 'rowwise' recipes)")
    if "e4m3" in fmt and scaling == "tensorwise":
        return ("the scale already comes from the amax, but e4m3 spans only 2^17 below it: cast "
                "the output gradients to fp8_e5m2 (2^32 below it), as torchao's 'tensorwise' "
                "recipe does, or give each row its own scale (its 'rowwise' recipes, e4m3)")
    if scaling == "tensorwise":
        return ("the scale already comes from the amax, and e5m2 spans 2^32 below it: give each "
                "row its own scale (torchao's 'rowwise' recipe, e4m3 with a scale per row), or "
                "keep the layers whose gradients span the widest range in bf16 "
                "(convert_to_float8_training's module_filter_fn)")
    return ("each row already has its own scale: cast the output gradients to fp8_e5m2 "
            "(torchao's rowwise recipes use e4m3; a Float8LinearConfig with "
            "CastConfig(scaling_granularity=AXISWISE, target_dtype=torch.float8_e5m2) for "
            "cast_config_grad_output), or keep those layers in bf16 (module_filter_fn)")


@emits("fp8_grad_scale")
def _fp8_grads(r: TrainResult) -> list[Finding]:
    """What the casts recorded per step (config["fp8"]): much of the output gradients flushed
    to 0, or some past the format's largest. Scaled from each tensor's amax, a cast saturates
    nothing and flushes only values far below the amax (padding's, on the lesson model: about
    14 % of them; the unscaled e4m3 recipe flushes 99 %). Where the watch recorded the share of
    the gradients' magnitude flushed (`grad_flushed_mass`), that decides: a softmax's weights
    2^32 below the amax may be half the values and none of the gradient."""
    fp8 = r.config.get("fp8")
    if not isinstance(fp8, dict):
        return []
    flushed, mass, low = _flushed_lost(fp8)
    saturated = median(fp8.get("grad_saturated", [])) or 0.0
    fmt, high = str(fp8.get("grad_format")), saturated >= 1e-4
    if not (low or high):
        return []
    evidence, fixes, lost = [], [], []
    recipe = fp8.get("recipe")
    if low:
        lost.append("below its smallest value, so they became 0")
        zeros = median(r.zero_grad_fractions)
        evidence.append(f"in a typical step the cast flushed {flushed:.1%} of the output "
                        f"gradients' nonzero values to 0"
                        + (f", {mass:.1%} of their magnitude (sum of |g|)" if mass is not None
                           else "")
                        + (f", and {zeros:.1%} of the gradient entries were exactly 0 when the "
                           "optimizer stepped" if zeros else ""))
        if fp8.get("grad_scaling") == "none":
            least = float(get_format(fmt).min_subnormal)
            evidence.append(f"they were cast to {fmt} at scale 1, and its smallest value is "
                            f"{least:.3g}: the gradients of a loss averaged over a batch are "
                            "mostly smaller, so the cast layers learned only from the few that "
                            "were not; layers left in high precision (a classifier) still "
                            "learn, so the loss falls, but later than a scaled recipe's")
        elif recipe:
            evidence.append(f"the recipe ({recipe}) scaled them {fp8.get('grad_scaling')} "
                            f"from the amax, into {fmt}")
        fixes.append(_scaling_fix(fp8, fmt))
    if high:
        lost.append("past its largest, so they were clamped")
        evidence.append(f"in a typical step {saturated:.2%} of the output-gradient values were "
                        f"past {fmt}'s largest value and were clamped to it")
        fixes.append("take the scale from the step's own amax (tensorwise or rowwise), or keep "
                     "headroom: a longer amax history and a margin (mplab.lowbit.quantize."
                     "DelayedScaling(history_len=16, margin=1))")
    words = loss_words(r)
    return [Finding("fp8_grad_scale", "broken" if low or saturated > 0.01 else "warning",
                    f"the output gradients were cast to {fmt} at a scale that put them "
                    + " and ".join(lost), evidence + ([words] if words else []),
                    "; and ".join(fixes))]


def fp8_made_nan(r: TrainResult) -> dict | None:
    """Where an fp8 cast of an all-zero tensor (or row) made the run's first inf/NaN: the
    watch's `nan_from_cast` record when the module's amax was 0 in that step, else None.
    `_non_finite` (mplab.diagnosis.runs) stands aside for it: the cause is the scale."""
    fp8 = r.config.get("fp8")
    made = fp8.get("nan_from_cast") if isinstance(fp8, dict) else None
    return made if isinstance(made, dict) and made.get("zero_amax") else None


_ROLES = {"grad_output": "output gradient", "input": "input", "weight": "weight"}


@emits("fp8_zero_amax")
def _fp8_zero_amax(r: TrainResult) -> list[Finding]:
    """A cast whose amax was 0 made inf/NaN: scale = max / amax with no floor under amax is
    inf, and 0 * inf = NaN (torchao clamps amax to 1e-12 first, so its scale is huge but
    finite and the cast gives 0). Zero amaxes alone are no harm: a rowwise recipe meets them
    in every step where rows get no gradient (all tokens but [CLS] in a classifier's last
    layer), and a layer below a zero-initialised head gets none at step 1."""
    made = fp8_made_nan(r)
    if made is None:
        return []
    fp8, step, module = r.config["fp8"], made["step"], made["module"]
    counts = [c for c in fp8.get("zero_amax", []) if isinstance(c, int)]
    rows = fp8.get("grad_scaling") == "rowwise"
    tensors = " and ".join(_ROLES.get(t, t) for t in made["zero_amax"])
    floor = fp8.get("amax_floor")
    evidence = [f"step {step}: {module}'s {tensors} had amax 0 ("
                + ("whole rows of 0" if rows else "all 0") + f"), and in its {made['phase']} "
                "pass its casts made inf/NaN from finite inputs, weights and gradients"]
    first = fp8.get("zero_amax_first")
    if isinstance(first, dict) and (first.get("module"), first.get("step")) != (module, step):
        evidence.append(f"the first cast with amax 0 was {first['module']}'s "
                        f"{_ROLES.get(first.get('tensor'), first.get('tensor'))} at step "
                        f"{first['step']} ({first['count']} of {first['of']})")
    if counts:
        evidence.append(f"casts with amax 0 in {sum(1 for c in counts if c)} of {len(counts)} "
                        f"steps ({max(counts)} at most in one step, tensors or rows)")
    if isinstance(floor, (int, float)) and floor == 0:
        evidence.append("the recipe puts no floor under amax (amax_floor 0), so the scale "
                        "max / amax was inf, and 0 * inf = NaN")
    bad = [i + 1 for i, v in enumerate(r.losses) if not math.isfinite(v)]
    if bad or r.stop_reason == "non_finite_loss":
        at = bad[0] if bad else len(r.losses) + 1
        evidence.append(f"the loss is not finite from step {at}: the NaN reached every weight "
                        "through the gradients and the optimizer's step")
    return [Finding("fp8_zero_amax", "broken",
                    "an fp8 scale was taken from an amax of 0: max / 0 = inf, and the cast of "
                    "the tensor's zeros gave 0 * inf = NaN",
                    evidence,
                    "clamp amax before dividing: scale = max / max(amax, 1e-12), as torchao's "
                    "amax_to_scale does (mplab.lowbit.quantize.EPS, QDQRecipe's amax_floor), "
                    "or skip the cast of an all-zero tensor (its cast is 0 at any finite "
                    "scale); with a scale per row the floor keeps rows of 0 (padding, tokens "
                    "the loss never reads) at 0. An all-zero tensor is normal: a head or "
                    "LoRA's B initialised to 0 sends exactly 0 back at the first step")]


#: The FP8 checks, in order of harm (mplab.diagnosis.runs runs them among its own).
FP8_CHECKS = (_fp8_zero_amax, _fp8_grads)
