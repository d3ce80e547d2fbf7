"""Lesson 2, underflow, overflow and swamping: the exercises.

    from mplab.exercises import lesson2 as ex
    ex.check("2.1", answer); ex.hint("2.1"); ex.solution("2.1")

Every reference answer is computed by :mod:`mplab.numerics.casts` and :mod:`mplab.numerics.failures`
with torch's own casts; 2.2 and 2.3 are about the lesson's captured step
(:func:`mplab.fixtures.lesson_capture`, the same one the notebook looks at), so the answers are this
model's, not a textbook's.
"""

from __future__ import annotations

import functools
import math

import torch

from mplab.exercises.answers import code_names, stood_in
from mplab.exercises.framework import (
    Exercise,
    Incorrect,
    Lesson,
    as_number,
    call,
    grade_seed,
    in_order,
)
from mplab.fixtures import lesson_capture
from mplab.numerics.casts import CastStats, Magnitudes, cast_stats, largest_safe_scale
from mplab.numerics.failures import swamping_run
from mplab.numerics.formats import dtype_of, get_format, ulp

__all__ = ["check", "hint", "solution", "exercise_cells", "cells", "task_markdown",
           "EXERCISES", "LESSON"]

FP16 = get_format("fp16")


def _power_of_two(x: float) -> bool:
    return x > 0 and math.isfinite(x) and math.frexp(x)[0] == 0.5


def _scale_answer(answer) -> float:
    got = as_number(answer)
    if not got > 0 or not math.isfinite(got):
        raise Incorrect(f"A loss scale is a positive finite number such as 2**10; got {got!r}.")
    return got


# --- 2.1 the smallest scale that saves a gradient ---------------------------------------------

G_2_1 = 3e-9


def _smallest(kept: str) -> float:
    """The smallest 2^k that makes G_2_1 · 2^k a `kept` ("normal" or nonzero) fp16 value."""
    for k in range(64):
        st = cast_stats(torch.tensor([G_2_1]), FP16, 2.0**k)
        if st.normal or (kept == "nonzero" and st.subnormal):
            return 2.0**k
    raise AssertionError("no scale up to 2^63 keeps the gradient")  # cannot happen for 3e-9


def _check_2_1(answer) -> str | None:
    got = _scale_answer(answer)
    want = _smallest("normal")
    if got == want:
        return None
    if got == math.log2(want):
        return "That looks like the exponent k; give the scale itself, 2**k."
    if not _power_of_two(got):
        return ("Give a power of two: multiplying by 2^k only adds k to the exponent, so the "
                "scaling itself is exact (any other factor rounds every value once more).")
    if got == _smallest("nonzero"):
        return ("At that scale the gradient no longer flushes to 0, but it lands among the "
                "subnormals, where it keeps only a few significant bits. The question asks for "
                "a normal number: look at fp16's smallest *normal* value.")
    if got < want:
        return (f"Too small: {G_2_1:g} × that scale is still below fp16's smallest normal "
                "number.")
    return ("That works, but a smaller power of two does too: the question asks for the "
            "smallest, which leaves the most headroom below overflow.")


# --- 2.2 the largest scale that does not overflow ---------------------------------------------

def _activation_grads() -> list[Magnitudes]:
    return list(lesson_capture().magnitudes("activation_grads").values())


def _check_2_2(answer) -> str | None:
    got = _scale_answer(answer)
    mags = _activation_grads()
    want = largest_safe_scale(mags, FP16)
    top = max(m.max_abs for m in mags)
    if got == want:
        return None
    if not _power_of_two(got):
        return ("Give a power of two: a scale of 2^k only shifts exponents, so it adds no "
                "rounding error of its own.")
    if got > want:
        return (f"At that scale the largest activation gradient, about {top:.3g}, becomes "
                f"{top * got:,.0f}, past fp16's largest finite value: it overflows to inf "
                "and the step would be skipped.")
    return ("Safe, but a larger power of two is safe too, and every doubling saves another "
            "binade of small gradients from underflow.")


# --- 2.3 the layer that still loses most at the safe scale -----------------------------------

def safe_scale() -> float:
    """2.2's answer: the largest power of two that overflows no activation gradient in fp16."""
    return largest_safe_scale(_activation_grads(), FP16)


def _layer_stats(scale: float) -> dict[str, CastStats]:
    return lesson_capture().stats(FP16, scale, "activation_grads", rel_error=False)


def worst_layer(scale: float | None = None) -> str:
    """The layer whose activation gradient loses the largest share of its nonzero values to
    fp16 at `scale` (default: :func:`safe_scale`, what 2.3 asks)."""
    stats = _layer_stats(safe_scale() if scale is None else scale)
    return max(stats, key=lambda n: stats[n].lost_frac)


def _check_2_3(answer) -> str | None:
    if not isinstance(answer, str):
        raise Incorrect(f"Give the layer's name as a string, e.g. \"classifier\"; got "
                        f"{answer!r:.60}.")
    scale = safe_scale()
    stats = _layer_stats(scale)
    name = answer.strip()
    if name not in stats:
        return (f"{name!r} is not one of the captured layers. Their names are the keys of "
                "cap.activation_grads, e.g. " + ", ".join(map(repr, list(stats)[:3])) + ".")
    want = worst_layer()
    if name == want:
        return None
    if name == worst_layer(1.0):
        return ("That is the layer that loses most with no loss scale, as in the table at "
                "scale 1. The question is about the largest safe scale (2.2's answer): at that "
                "scale every gradient has moved up, each layer by the same number of binades, "
                "and the layers whose values reach furthest down are the ones still losing. "
                "Measure the shares again at that scale.")
    if name == max(stats, key=lambda n: stats[n].underflow):
        return ("That layer loses the most values in number, but it is also one of the "
                "largest. The question asks for the largest *share* of a layer's nonzero "
                "values.")
    if name == max(stats, key=lambda n: stats[n].underflow_frac):
        return ("Divide by the layer's nonzero values, not all of them: a gradient that was "
                "exactly 0 before the cast is not lost by it.")
    return (f"At the largest safe scale {name} loses {stats[name].lost_frac:.2%} of its nonzero "
            "values; another layer loses a larger share.")


# --- 2.4 is this update swamped? --------------------------------------------------------------

#: Not 1 + 1e-4 in fp16 or fp32: the lesson's swamping runs and demo show those just above.
CASES_2_4 = ((1.0, 3e-4, "fp16"), (1.0, 1e-3, "fp16"), (1.0, 1e-3, "bf16"),
             (2048.0, 1.0, "fp16"), (0.01, 1e-5, "fp16"), (1e4, 1e-4, "fp32"))


def is_swamped(w: float, update: float, precision: str) -> bool:
    """Whether w + update, rounded to the format, is w again (torch's cast decides)."""
    return swamping_run(w, update, 1, precision).lost_steps == 1


def _why_2_4(w: float, update: float, precision: str) -> str:
    stored = swamping_run(w, 0.0, 0, precision).final
    return (f"{(w, update, precision)}: next to {stored:g}, {precision}'s numbers are "
            f"{ulp(stored, precision):.3g} "
            f"apart, and the sum rounds to the nearest one. Compare the update with half that "
            "spacing (a tie rounds to the neighbour with an even last bit).")


def _check_2_4(answer) -> str | None:
    if not isinstance(answer, dict):
        raise Incorrect("Give a dict mapping each (w, update, format) case to True (the update "
                        f"is lost) or False, like the starter's; got a {type(answer).__name__}.")
    missing = [c for c in CASES_2_4 if c not in answer or answer[c] is ...]
    if missing:
        return "Answer every case; still missing: " + ", ".join(map(repr, missing)) + "."
    bad = [c for c in CASES_2_4 if not isinstance(answer[c], bool)]
    if bad:
        return "; ".join(f"{c!r}: {answer[c]!r} is not True or False" for c in bad) + "."
    wrong = [c for c in CASES_2_4 if answer[c] != is_swamped(*c)]
    if not wrong:
        return None
    return (f"{len(wrong)} of {len(CASES_2_4)} are not right yet:\n"
            + "\n".join("- " + _why_2_4(*c) for c in wrong))


# --- 2.5 measure the loss yourself ------------------------------------------------------------

#: The dtypes grading tries 2.5 in (the public checks use fp16 only).
HIDDEN_DTYPES_2_5 = tuple(dtype_of(name) for name in ("fp16", "bf16", "fp8_e5m2", "fp8_e4m3"))


def _tensors(seed: int, n: int = 4000) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logs = torch.rand(n, generator=g, dtype=torch.float64) * 60 - 45  # 2^-45 .. 2^15
    signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    t = (signs * torch.exp2(logs)).float()
    t[torch.rand(n, generator=g) < 0.3] = 0.0  # gradients hold many exact zeros
    return [t, t.reshape(40, -1)]


TOL_2_5 = 1e-6  # a share computed in fp32 (tensor / tensor) is off by up to ~1e-7

PUBLIC_2_5 = [(t, torch.float16, s) for t in _tensors(0) for s in (1.0, 2.0**10)]


def _hidden_2_5(seed: int | None = None) -> list[tuple[torch.Tensor, torch.dtype, float]]:
    tie = float(FP16.min_subnormal) / 2  # exactly half the smallest subnormal: ties to 0
    edge = torch.tensor([tie, -tie, tie * 1.0000001, 0.0, 3.0])
    drawn = _tensors(grade_seed() if seed is None else seed)  # afresh for each grading run
    return ([(t, d, s) for t in drawn for d in HIDDEN_DTYPES_2_5 for s in (1.0, 2.0**7)]
            + [(edge, torch.float16, 1.0), (torch.zeros(5), torch.float16, 1.0),
               (torch.tensor([1e-9, float("inf"), float("nan"), 2.0]), torch.float16, 1.0),
               (torch.arange(-3, 4, dtype=torch.int32), torch.float16, 1.0)])


def reference_lost_fraction(t: torch.Tensor, dtype: torch.dtype, scale: float) -> float:
    return cast_stats(t, dtype, scale).lost_frac


def _describe(t: torch.Tensor) -> str:
    return f"a {t.dtype} tensor of shape {tuple(t.shape)}" + (
        f" {t.tolist()}" if t.numel() <= 6 else "")


#: mplab's own measurement (the lesson calls it above 2.5): a call to it is not the exercise.
_LIBRARY_2_5 = frozenset({"cast_stats", "lost_frac", "underflow_frac", "Magnitudes"})
_POISONED_2_5 = -1.0  # the share the poisoned measurement gives (a share is never negative)


def _poisoned_cast_stats(tensor, precision, scale=1.0):  # runs as casts.cast_stats
    # nonzero = -1 + 2 = 1, kept = 2: every share read off it, or counted from it, is -1
    return CastStats("poisoned", 1.0, count=1, zero=0, underflow=-1, subnormal=0, normal=2,
                     overflow=0, inf=0, nan=0, overflow_to="inf", mean_rel_error=None,
                     max_rel_error=None, max_abs=0.0)


def _poisoned_stats(self, precision, scale=1.0, *, rel_error=True):  # as Magnitudes.stats
    return cast_stats(None, precision, scale)  # the poisoned one, while it stands in


def _poisoned_first(self, s, crossed):  # runs as Magnitudes._first, the counts' search
    return -1


#: While the learner's function runs, mplab's measurement gives poisoned results however it is
#: reached: an answer that relies on it fails on its outputs (its names only choose the message).
_POISONS_2_5 = ((cast_stats, _poisoned_cast_stats), (Magnitudes.stats, _poisoned_stats),
                (Magnitudes._first, _poisoned_first))


def _lost_fraction(fn, t, dtype, scale, what: str):
    """The learner's share for one case, with mplab's own measurement poisoned meanwhile."""
    with stood_in(fn, _POISONS_2_5):
        return call(fn, t.clone(), dtype, scale, what=what)


def _trial_2_5(case, fn) -> None:
    _lost_fraction(fn, *case, what="lost_fraction")


def _trials_2_5(seed: int) -> list:
    """The hidden calls, as the kernel records them for the grader: each under the poison."""
    return [functools.partial(_trial_2_5, case) for case in _hidden_2_5(seed)]


def _uses_library(fn, got: float) -> str | None:
    """The message for wrong outputs that came from mplab's measurement (poisoned) or from a
    function whose code names it (its nested functions' too); None for other wrong outputs."""
    if got == _POISONED_2_5 or code_names(fn) & _LIBRARY_2_5:
        return ("Your function uses mplab's own measurement (cast_stats, its CastStats or "
                "Magnitudes), which is what this exercise asks you to write (while it is "
                "checked, that measurement gives wrong numbers): count with torch's cast and "
                "comparisons instead.")
    return None


def _lost_matches(fn, cases) -> str | None:
    for t, dtype, scale in cases:
        shown = f"lost_fraction(<{_describe(t)}>, {dtype}, {scale:g})"
        got = _lost_fraction(fn, t, dtype, scale, shown)
        if got is None:
            return f"{shown} returned None: is a return statement missing?"
        got = as_number(got, what=f"what {shown} returned")
        want = reference_lost_fraction(t, dtype, scale)  # the real measurement, after the call
        if abs(got - want) <= TOL_2_5:
            continue
        library = _uses_library(fn, got)
        if library:
            return library
        if math.isnan(got):
            return (f"{shown} returned NaN. A tensor with no nonzero finite values has lost "
                    "none of them: return 0.0 there.")
        zeros = t.float() == 0
        of_all = cast_stats(t, dtype, scale).underflow_frac
        if abs(got - of_all) <= TOL_2_5 and bool(zeros.any()):
            why = ("that is a share of all values; divide by the nonzero finite ones "
                   "(the zeros were zero before the cast).")
        elif got > want:
            why = ("too many counted as lost: only values that were nonzero (and finite) "
                   "before the cast and are 0 after it count; an inf or NaN is not lost.")
        else:
            why = ("too few counted as lost: multiply in fp32 first (t.float() * scale), "
                   "then cast with .to(dtype), and compare with 0.")
        return f"{shown} gave {got:.6g}: {why} (Compared within {TOL_2_5:g}.)"
    return None


def _check_2_5(fn) -> str | None:
    return _lost_matches(fn, PUBLIC_2_5)


def _hidden_check_2_5(fn) -> str | None:
    return _lost_matches(fn, _hidden_2_5())


# --- the exercises ----------------------------------------------------------------------------

_DICT_2_4 = "{\n" + "".join(f"    {c!r}: ...,\n" for c in CASES_2_4) + "}"
_ANSWER_2_4 = "{\n" + "".join(f"    {c!r}: {is_swamped(*c)},\n" for c in CASES_2_4) + "}"

EXERCISES = {e.id: e for e in in_order([
    Exercise(
        id="2.1", title="The smallest scale that saves a gradient",
        prompt=f"A gradient of {G_2_1:g} flushes to 0 in fp16. What is the smallest loss scale "
               "2^k that makes it a **normal** fp16 number, with all 11 of its significant "
               "bits? Give the scale itself (such as `2**5`), not k.",
        comment=f"the smallest 2**k that makes {G_2_1:g} * 2**k a normal fp16 number",
        body="answer = ...  # a scale, e.g. 2**5",
        key="# fp16's smallest normal is 2**-14; 3e-9 is about 2**-28.3, so 15 binades are "
            "missing\n"
            f"answer = 2.0 ** math.ceil(math.log2(2**-14 / {G_2_1!r}))",
        check=_check_2_1,
        hints=(
            "Multiplying by 2^k moves a number k binades up. Below fp16's smallest normal "
            "number, values are subnormal (few bits) or flushed to 0.",
            "formats.get_format(\"fp16\").min_normal is the smallest normal value; math.log2 tells "
            "how many binades apart two numbers are.",
            "You need 3e-9 × 2^k ≥ 2^-14: k = ceil(log2(2^-14 / 3e-9)).",
        )),
    Exercise(
        id="2.2", title="The largest scale that does not overflow",
        prompt="Scaling too far overflows: keep scale × max|g| at or below fp16's largest "
               "finite value, 65504 (values below 65520 still round down to it; from 65520 "
               "on they become inf, so 65504 is the safe bound). For this capture's activation "
               "gradients "
               "(`cap.all(\"activation_grads\")` holds them all in one tensor), which is the "
               "largest power of two you can scale them by without any of them overflowing?",
        comment="the largest 2**k for which no activation gradient overflows fp16",
        body="answer = ...  # a scale, e.g. 2**5",
        key="top = cap.all(\"activation_grads\").abs().max().item()\n"
            "answer = 2.0 ** math.floor(math.log2(65504 / top))",
        check=_check_2_2,
        hints=(
            "Only the largest magnitude can overflow first: scale × max|g| must stay at or "
            "below fp16's largest finite value.",
            "cap.all(\"activation_grads\") is every activation gradient in one tensor; "
            ".abs().max() gives the largest magnitude, formats.get_format(\"fp16\").max_finite the "
            "limit.",
            "answer = 2 ** floor(log2(65504 / max|g|)).",
        )),
    Exercise(
        id="2.3", title="The layer that still loses most",
        prompt="Even the largest safe scale (2.2's answer) leaves some activation gradients "
               "below fp16's range. At that scale, which layer's activation gradient still "
               "loses the **largest share** of its nonzero values to fp16 underflow? Give its "
               "name as it appears in `cap.activation_grads`.",
        comment="the layer losing the largest share of its nonzero values at 2.2's scale",
        body="answer = ...  # a layer name (a string)",
        key="top = cap.all(\"activation_grads\").abs().max().item()\n"
            "scale = 2.0 ** math.floor(math.log2(65504 / top))  # 2.2's answer\n"
            "stats = cap.stats(\"fp16\", scale, \"activation_grads\")\n"
            "answer = max(stats, key=lambda name: stats[name].lost_frac)",
        check=_check_2_3,
        hints=(
            "Compare layers by a share, not a count: values lost to 0 divided by the values "
            "that were nonzero before the cast, with every gradient multiplied by the scale "
            "from 2.2.",
            "cap.stats(\"fp16\", scale, \"activation_grads\") maps each layer to its "
            "CastStats at that scale; it has .underflow, .nonzero and .lost_frac. "
            "cap.table(\"fp16\", scale, \"activation_grads\") shows them all.",
            "scale = 2.2's answer; max(stats, key=lambda name: stats[name].lost_frac).",
        )),
    Exercise(
        id="2.4", title="Is the update swamped?",
        prompt=f"For each of the {len(CASES_2_4)} cases in the cell below, a tuple (weight "
               "`w`, `update`, the format the weight is kept in), predict whether the update "
               "is lost: `True` if `w + update`, stored in that format, is just `w` again, "
               "else `False`. As torch adds two fp16 (or bf16) tensors on a CPU: `w` and "
               "`update` are each stored in the format, added in fp32, and the sum rounded "
               "back to the format. A sum that falls exactly halfway between two numbers of the "
               "format (a tie) rounds to the one whose last mantissa bit is 0, the even one, "
               "as IEEE rounding does. Work it out first, then test your guesses with torch.",
        comment="True if w + update, kept in the format, rounds back to w",
        body=f"answer = {_DICT_2_4}",
        key="# lost when |update| <= half the spacing of the format's numbers at w\n"
            "# (exactly half: a tie, which rounds to the even neighbour, w here)\n"
            f"answer = {_ANSWER_2_4}",
        check=_check_2_4,
        hints=(
            "A sum is rounded to the nearest number the format holds. Near w those numbers are "
            "one ulp apart, so an update smaller than half an ulp rounds straight back to w.",
            "formats.ulp(w, \"fp16\") gives the spacing at w. fp16 has 10 mantissa bits (ulp(1) = "
            "2^-10), bf16 7 (2^-7), fp32 23.",
            "Lost if |update| < ulp(w)/2; at exactly ulp(w)/2 it is a tie, and ties go to the "
            "neighbour whose last bit is 0. Test yourself: (torch.tensor(w, dtype=...) + "
            "update) == w.",
        )),
    Exercise(
        id="2.5", title="Measure the loss yourself", points=2,
        prompt="Write the measurement behind this lesson's tables yourself: "
               "`lost_fraction(t, dtype, scale)`. Its three arguments: `t` is a tensor of "
               "gradients, in float32 in the check (the grader also passes an int32 one); "
               f"`dtype` is the torch dtype to cast to, a dtype object such as "
               f"`{HIDDEN_DTYPES_2_5[0]}`, not a name like \"fp16\"; `scale` is a Python "
               "float. Three steps, each in a stated dtype: convert `t` to float32 "
               "(`t.float()`); multiply that float32 tensor by `scale`, still in float32; cast "
               "the float32 product to `dtype` with torch's own cast (`.to(dtype)`). Return "
               "the share (from 0 to 1) of the values that were nonzero and finite in "
               "`t.float()`, before scaling and casting, that are 0 after the cast to `dtype`; "
               "return 0.0 when there are none. The check uses `dtype` = "
               f"`{HIDDEN_DTYPES_2_5[0]}`; the grader also tries "
               + ", ".join(f"`{d}`" for d in HIDDEN_DTYPES_2_5[1:])
               + " and awkward tensors.",
        comment="the share of t's nonzero finite values that (t.float() * scale).to(dtype) "
                "flushes to 0",
        body="def lost_fraction(t, dtype, scale):\n"
             "    return ...  # a float from 0 to 1",
        key="def lost_fraction(t, dtype, scale):\n"
            "    x = t.float()                            # t's values, in float32\n"
            "    alive = (x != 0) & torch.isfinite(x)     # nonzero finite before the cast\n"
            "    n = int(alive.sum())\n"
            "    if n == 0:\n"
            "        return 0.0\n"
            "    lost = alive & ((x * scale).to(dtype) == 0)  # ... and 0 after it\n"
            "    return int(lost.sum()) / n",
        arg='lost_fraction',
        check=_check_2_5, hidden=_hidden_check_2_5,
        trials=_trials_2_5,  # the calls it makes: (t, dtype, scale)
        hints=(
            "Three steps: scale in fp32, find the values that were nonzero and finite, count "
            "how many of those the cast turns into 0.",
            "x = t.float(); torch.isfinite(x), x != 0 and (x * scale).to(dtype) == 0 are "
            "boolean tensors; & combines them and .sum() counts.",
            "alive = (x != 0) & torch.isfinite(x); lost = alive & ((x * scale).to(dtype) == 0); "
            "return lost.sum() / alive.sum() as a float, or 0.0 when alive.sum() is 0.",
        )),
])}

LESSON = Lesson(2, list(EXERCISES.values()))
check, hint, solution, exercise_cells, cells, task_markdown = LESSON.functions()
