"""Lesson 1, float formats: the exercises.

    from mplab.exercises import lesson1 as ex
    ex.check("1.1", answer); ex.hint("1.1"); ex.solution("1.1")

Every reference answer is computed by :mod:`mplab.numerics.formats`; the wrong answers a learner is
likely to give (a forgotten bias, the reserved exponent, the smallest *normal*) are computed
from the same fields, so each gets its own explanation.
"""

from __future__ import annotations

import math
import random

from mplab.exercises.framework import (
    Exercise,
    Incorrect,
    Lesson,
    as_number,
    call,
    grade_seed,
)
from mplab.numerics.explain import decompose
from mplab.numerics.formats import FORMATS, field_bits, from_bits, get_format

__all__ = ["check", "hint", "solution", "exercise_cells", "cells", "task_markdown",
           "EXERCISES", "LESSON"]

FP16 = get_format("fp16")


def _same(got: float, want: float, rel: float = 0.0) -> bool:
    """Equal within a relative tolerance (0: exactly)."""
    return got == want or (rel > 0 and math.isfinite(want) and abs(got - want) <= rel * abs(want))


def _first_match(got: float, mistakes: list[tuple[float, str]], rel: float = 0.0) -> str | None:
    return next((why for value, why in mistakes if _same(got, value, rel)), None)


# --- 1.1 decode a bit pattern by hand ---------------------------------------------------------

P11 = 0b1_10010_1010000000


def _check_1_1(answer) -> str | None:
    got = as_number(answer)
    want = from_bits(P11, FP16)
    if got == want:
        return None
    sign, exponent, mantissa = field_bits(P11, FP16)
    s, frac = (-1) ** sign, mantissa / 2**FP16.man_bits
    mistakes = [
        (-want, "Look at the sign bit again: the first of the 16 bits is the sign, and here it "
                "is set."),
        (s * frac * 2.0 ** (exponent - FP16.bias),
         "You left out the hidden leading 1: a normal number's significand is 1.mantissa, "
         "so the 10 stored bits are only the part after the binary point."),
        (s * (1 + frac) * 2.0**exponent,
         "The exponent field is stored with a bias: subtract fp16's bias from it before "
         "using it as a power of two."),
        (s * (1 + frac) * 2.0 ** (exponent - 127),
         "That bias belongs to fp32 (and bf16). fp16 has a 5-bit exponent, so its bias is "
         "smaller: 2^(5-1) - 1."),
        (s * (1 + mantissa) * 2.0 ** (exponent - FP16.bias),
         "The mantissa is a fraction, not an integer: its 10 bits sit after the binary point, "
         "so divide the field by 2^10."),
    ] + [(s * (1 + frac) * 2.0 ** (exponent - FP16.bias + d),
          "Off by a factor of two: check the bias (2^(5-1) - 1 for fp16) and the exponent "
          "field's value.") for d in (-1, 1)]
    why = _first_match(got, mistakes)
    if why is None and _first_match(-got, mistakes):  # two slips: this one and the sign
        why = _first_match(-got, mistakes) + " And look at the sign bit again."
    return (why or "Not the number this pattern stores. Split the 16 bits into sign (1), "
            "exponent (5) and mantissa (10), then check each step: the sign, the hidden 1, "
            "the bias.") + " (Compared exactly: a bit pattern stands for one exact number.)"


# --- 1.2 fp16's largest finite value ----------------------------------------------------------

def _check_1_2(answer) -> str | None:
    got = as_number(answer)
    want = float(FP16.max_finite)
    if got == want:
        return None
    top = (1 << FP16.exp_bits) - 1  # the all-ones exponent field
    all_ones_mantissa = 2 - 2.0**-FP16.man_bits
    reserved = ("An exponent field of all ones (11111) is reserved for inf and NaN, so no finite "
                "number uses it: the largest finite number lives one binade lower.")
    mistakes = [
        (2.0**16 - 1, "65535 is the largest 16-bit unsigned integer, not a float. A float "
                      "splits its 16 bits into sign, exponent and mantissa, so its largest "
                      "value comes from the largest usable exponent and mantissa fields."),
        (all_ones_mantissa * 2.0 ** (top - FP16.bias), reserved),
        (2.0 ** (top - FP16.bias), reserved),
        (2.0 ** (top - 1 - FP16.bias), "The exponent is right, but the mantissa can be all ones "
                                       "too: the significand can be just under 2, not 1."),
        (all_ones_mantissa * 2.0 ** (top - 2 - FP16.bias),
         "Off by one binade: the exponent field is 5 bits, and only the all-ones field is "
         "reserved."),
        (math.inf, "Infinity is what comes after the largest finite number; the question asks "
                   "for the largest number that is still finite."),
    ] + [(float(f.max_finite), f"That is {f.name}'s largest finite value; this asks for fp16's, "
                               "which has fewer exponent bits.")
         for f in FORMATS.values() if f is not FP16]
    why = _first_match(got, mistakes)
    if why is None and got < 0:
        why = "Largest means the most positive value: flip the sign bit off."
    if why is None:
        why = ("fp16 stores a larger finite number than that." if got < want else
               "Too large: fp16 cannot hold that as a finite number.")
        why += " Make the exponent and mantissa fields as large as a finite number allows."
    return why + " (Compared exactly: the largest finite value is one exact number.)"


# --- 1.3 the smallest positive fp16 number ----------------------------------------------------

REL_1_3 = 1e-3


def _check_1_3(answer) -> str | None:
    got = as_number(answer)
    want = float(FP16.min_subnormal)
    if _same(got, want, REL_1_3):
        return None
    mistakes = [
        (float(FP16.min_normal), "That is the smallest *normal* fp16 number. Below it, an "
                                 "exponent field of 0 switches to subnormals: no hidden 1, so "
                                 "the numbers keep going down toward zero."),
        (float(FP16.eps), "That is fp16's epsilon, the gap between 1 and the next number up: a "
                          "measure of precision near 1, not the smallest number."),
        (2.0**-FP16.bias, "An exponent field of 0 does not mean 2^(0 - bias) with a hidden 1: it "
                          "marks the subnormals, whose significand is 0.mantissa."),
        (0.0, "Zero is not positive: the question asks for the smallest number above zero."),
    ] + [(float(value), f"That is {f.name}'s {what}; this asks for fp16's.")
         for f in FORMATS.values() if f is not FP16
         for what, value in (("smallest subnormal", f.min_subnormal),
                             ("smallest normal", f.min_normal))]
    why = _first_match(got, mistakes, REL_1_3)
    if why is None and got < 0:
        why = "The question asks for the smallest *positive* number."
    elif why is None and abs(got - want) <= 0.05 * want:
        why = ("Close, but not within the tolerance: give more significant digits, or write it "
               "as a power of two, 2**k.")
    elif why is None and got < want:
        why = "fp16 cannot store a positive number that small: a cast rounds it to zero."
    elif why is None:
        why = ("fp16 holds smaller positive numbers than that: go below the normal numbers "
               "and think about what the smallest mantissa can be.")
    return why + f" (Compared with a relative tolerance of {REL_1_3:g}.)"


# --- 1.4 range vs precision: fp16 or bf16? ----------------------------------------------------

# The lesson's compare() table shows the rule on values far from fp16's range edges; these sit
# near the edges (or among fp16's subnormals), so no row answers one: each needs comparing with
# fp16's limits first. 60000 and 0.0001 are the traps: large, or small, yet still fp16 normals.
NUMBERS_1_4 = (0.0001, 60000.0, 1e-06, 123456.0, 2e-08)
CHOICES = ("fp16", "bf16")


def _error(x: float, fmt: str) -> float:
    return abs(decompose(x, fmt).abs_error)  # inf when the cast overflows


def better_format(x: float) -> str:
    """The format whose cast of x lands closer to x."""
    return min(CHOICES, key=lambda fmt: _error(x, fmt))


def _why_1_4(x: float) -> str:
    """Why one of the two formats holds x better, as a question that points at the concept."""
    loser = decompose(x, "fp16" if better_format(x) == "bf16" else "bf16")
    if loser.kind == "inf":
        return (f"{x!r}: extra mantissa bits only help a number a format can hold at all. "
                "Compare it with each format's largest finite value: range, not precision.")
    if loser.kind == "zero":
        return (f"{x!r}: compare it with each format's smallest positive number. A number below "
                "a format's range is not stored with any precision: range, not precision.")
    if loser.kind == "subnormal":
        return (f"{x!r}: it is below one format's smallest normal number, where subnormals keep "
                "fewer and fewer significant bits. Range eats precision there.")
    return (f"{x!r} is a normal number in both formats: check it against each format's limits. "
            "Range does not decide it, so precision does. Which format keeps more mantissa bits?")


def _choice(value) -> str | None:
    try:
        name = get_format(value).name
    except (ValueError, TypeError):
        return None
    return name if name in CHOICES else None


def _check_1_4(answer) -> str | None:
    if not isinstance(answer, dict):
        raise Incorrect(f"Give a dict mapping each number to \"fp16\" or \"bf16\", like the "
                        f"starter's; got a {type(answer).__name__}.")
    missing = [x for x in NUMBERS_1_4 if x not in answer]
    if missing:
        return "Answer every number; missing: " + ", ".join(map(repr, missing)) + "."
    blank = [x for x in NUMBERS_1_4 if answer[x] is ...]
    if blank:
        return "Still blank: " + ", ".join(map(repr, blank)) + ". Choose \"fp16\" or \"bf16\"."
    unknown = [(x, answer[x]) for x in NUMBERS_1_4 if _choice(answer[x]) is None]
    if unknown:
        return "; ".join(f"{x!r}: {v!r} is not one of the choices" for x, v in unknown) + \
            ". Accepted: \"fp16\" or \"bf16\"."
    wrong = [x for x in NUMBERS_1_4 if _choice(answer[x]) != better_format(x)]
    if not wrong:
        return None
    return (f"{len(wrong)} of {len(NUMBERS_1_4)} are not right yet:\n"
            + "\n".join("- " + _why_1_4(x) for x in wrong))


# --- 1.5 a general decoder --------------------------------------------------------------------

PUBLIC_1_5 = [("fp16", [0x3C00, 0xC000, 0x3555, 0x7BFF, 0x0400, 0x0000, 0x8000, 0x0001,
                        0x03FF, 0x7C00, 0xFC00, 0x7E00])]


def _hidden_patterns(seed: int | None = None) -> list[tuple[str, list[int]]]:
    rng = random.Random(grade_seed() if seed is None else seed)  # afresh for each grading run
    bf16_specials = [0x0001, 0x007F, 0x8001, 0x0080, 0x7F7F, 0x7F80, 0xFF80, 0x7FC0, 0xFFFF,
                     0x8000]
    return [("fp8_e5m2", list(range(256))),
            ("bf16", bf16_specials + rng.sample(range(1 << 16), 300))]


def _kind_advice(fmt, bits: int, got, want: float) -> str:
    """The concept behind one pattern, by the case its exponent field selects."""
    _, exponent, mantissa = field_bits(bits, fmt)
    if exponent == (1 << fmt.exp_bits) - 1 and mantissa == 0:
        return ("An exponent field of all ones with a zero mantissa is infinity (its sign from "
                "the sign bit).")
    if exponent == (1 << fmt.exp_bits) - 1:
        return ("An exponent field of all ones with a nonzero mantissa is NaN (float('nan'); "
                "test for it with math.isnan, since NaN != NaN).")
    if exponent == 0 and mantissa == 0:
        return ("All-zero exponent and mantissa is zero, and it keeps its sign: with the sign "
                "bit set it is -0.0 (math.copysign(1, x) tells the two apart).")
    if exponent == 0:
        return ("This is a subnormal (exponent field 0, mantissa not 0): there is no hidden 1, "
                "and the exponent is fixed at 1 - bias (not 0 - bias).")
    if got == -want:
        return "Look at the sign bit: the top bit set means negative."
    return ("A normal number (exponent field neither all zeros nor all ones) is "
            "(-1)^sign x 1.mantissa x 2^(exponent - bias): check the hidden 1, the bias and "
            "that the mantissa is a fraction.")


def _decode_matches(decode, patterns: list[tuple[str, list[int]]]) -> str | None:
    for name, bit_list in patterns:
        fmt = get_format(name)
        for bits in bit_list:
            args = (bits, fmt.exp_bits, fmt.man_bits, fmt.bias)
            shown = f"decode({bits:#0{2 + (fmt.bits + 3) // 4}x}, {args[1]}, {args[2]}, {args[3]})"
            got = call(decode, *args, what=shown)
            if got is None:
                return f"{shown} returned None: is a return statement missing?"
            if isinstance(got, str):
                return f"{shown} returned text ({got!r:.40}); return the value as a float."
            got = as_number(got, what=f"what {shown} returned")
            want = from_bits(bits, fmt)
            right = (math.isnan(got) if math.isnan(want) else
                     got == want and math.copysign(1, got) == math.copysign(1, want))
            if not right:
                pattern = format(bits, f"0{fmt.bits}b")
                pattern = f"{pattern[0]} {pattern[1:1 + fmt.exp_bits]} {pattern[1 + fmt.exp_bits:]}"
                return (f"{shown}, the {name} pattern {pattern}, gave {got!r}. "
                        + _kind_advice(fmt, bits, got, want)
                        + " (Compared exactly, with the sign of zero and NaN as NaN.)")
    return None


def _trials_1_5(seed: int) -> list[tuple]:
    """The calls the hidden check makes, in its order."""
    return [(bits, fmt.exp_bits, fmt.man_bits, fmt.bias) for name, bit_list in
            _hidden_patterns(seed) for fmt in [get_format(name)] for bits in bit_list]


def _check_1_5(decode) -> str | None:
    return _decode_matches(decode, PUBLIC_1_5)


def _hidden_1_5(decode) -> str | None:
    return _decode_matches(decode, _hidden_patterns())


# --- the exercises ----------------------------------------------------------------------------

# The formats the prompt names, from the formats themselves (tf32 is a matmul mode, no dtype).
_IEEE = [f.name for f in FORMATS.values() if f.has_inf and f.dtype() is not None]
_IEEE_1_5 = ", ".join(_IEEE[:-1]) + " and " + _IEEE[-1]
_NOT_IEEE_1_5 = " or ".join(f"`{f.name}` (torch's {f.torch_dtype}, section 2)"
                            for f in FORMATS.values() if not f.has_inf)
_PUBLIC_NAMES_1_5 = " and ".join(name for name, _ in PUBLIC_1_5)
_HIDDEN_NAMES_1_5 = " and ".join(name for name, _ in _hidden_patterns())
_DICT_1_4 = "{" + ", ".join(f"{x!r}: ..." for x in NUMBERS_1_4) + "}"
_ANSWER_1_4 = "{" + ", ".join(f'{x!r}: "{better_format(x)}"' for x in NUMBERS_1_4) + "}"

EXERCISES = {e.id: e for e in [
    Exercise(
        id="1.1", title="Decode an fp16 pattern by hand",
        prompt="What number does the fp16 bit pattern `1 10010 1010000000` (sign, exponent, "
               "mantissa) stand for? Work it out by hand from the three fields, and give the "
               "exact value.",
        comment="the fp16 pattern 1 10010 1010000000 is which number? (exact)",
        body="answer = ...  # a number, e.g. -2.5 or 2**-3",
        key="sign, exponent, mantissa = 0b1, 0b10010, 0b1010000000\n"
            "answer = (-1)**sign * (1 + mantissa / 2**10) * 2.0**(exponent - 15)  # bias 15",
        check=_check_1_1,
        hints=(
            "An fp16 pattern is three fields: 1 sign bit, 5 exponent bits, 10 mantissa bits. "
            "The exponent is stored with a bias, and a normal number has a hidden leading 1 in "
            "front of the mantissa.",
            "print(mplab.numerics.explain.decompose(-1.5, \"fp16\")) shows the fields of a number "
            "you know and the formula that turns them back into its value; "
            "get_format(\"fp16\").bias is the bias.",
            "sign = 1, exponent = 0b10010 = 18, mantissa = 0b1010000000 = 640, so the value is "
            "(-1)^1 x (1 + 640/1024) x 2^(18 - bias).",
        )),
    Exercise(
        id="1.2", title="fp16's largest finite value",
        prompt="65535, the largest 16-bit unsigned integer, is a common wrong guess for fp16's "
               "largest value. Work out the real largest finite fp16 value from its fields (5 "
               "exponent bits, 10 mantissa bits, bias 15), remembering which exponent field is "
               "reserved (section 2), and give the exact value.",
        comment="fp16's largest finite value, from its fields (exact)",
        body="answer = ...  # a number",
        key="# exponent 11111 is reserved for inf/NaN, so the largest is 0 11110 1111111111\n"
            "answer = (2 - 2**-10) * 2.0**(0b11110 - 15)",
        check=_check_1_2,
        hints=(
            "Largest finite: the exponent field as large as it can be while still meaning a "
            "number, and the mantissa as large as it can be.",
            "The all-ones exponent field is reserved for inf and NaN. "
            "mplab.numerics.formats.from_bits(pattern, \"fp16\") decodes a pattern, so you can "
            "test a guess like from_bits(0b0_11110_0000000000, \"fp16\").",
            "The pattern is 0 11110 1111111111: (1 + 1023/1024) x 2^(30 - 15).",
        )),
    Exercise(
        id="1.3", title="The smallest positive fp16 number",
        prompt="Below the smallest *normal* number, subnormals keep going. What is the "
               "smallest positive number fp16 can hold? A decimal or a power of two (`2**k`) "
               f"is fine: it is checked with a relative tolerance of {REL_1_3:g}.",
        comment=f"the smallest positive fp16 number (relative tolerance {REL_1_3:g})",
        body="answer = ...  # a number; 2**k notation is fine",
        key="# a subnormal: exponent 00000, mantissa 0000000001 -> 0.0000000001 x 2^(1 - 15)\n"
            "answer = 2**-10 * 2.0**(1 - 15)",
        check=_check_1_3,
        hints=(
            "The smallest normal number has exponent field 1. Below it, exponent field 0 gives "
            "the subnormals: no hidden 1, evenly spaced all the way down to zero.",
            "A subnormal is 0.mantissa x 2^(1 - bias). "
            "mplab.numerics.formats.from_bits(bits, \"fp16\") decodes any pattern, and "
            "get_format(\"fp16\") has .bias and .man_bits.",
            "Exponent field 00000 and the smallest nonzero mantissa, 0000000001: that is "
            "2^-10 x 2^(1 - 15).",
        )),
    Exercise(
        id="1.4", title="Range vs precision: fp16 or bf16?",
        prompt="For each of the numbers " + ", ".join(f"`{x!r}`" for x in NUMBERS_1_4)
               + ", say which of `\"fp16\"` and `\"bf16\"` stores it more precisely (with the "
               "smaller error). Think about range first, then precision, and check your "
               "reasoning in the explorer afterwards, not before.",
        comment="which format stores each number more precisely, \"fp16\" or "
                "\"bf16\"?",
        body=f"answer = {_DICT_1_4}",
        key="# in both ranges: more mantissa bits win; out of fp16's range (or in its\n"
            "# subnormals): bf16's wider exponent wins\n"
            f"answer = {_ANSWER_1_4}",
        check=_check_1_4,
        hints=(
            "Range (how large and how small, set by the exponent bits) against precision (how "
            "many significant bits, set by the mantissa): fp16 has 5 exponent and 10 mantissa "
            "bits, bf16 8 and 7.",
            "mplab.numerics.formats.round_to(x, \"fp16\") and round_to(x, \"bf16\") give the "
            "stored values; compare abs(stored - x). get_format(fmt).max_finite, .min_normal and "
            ".min_subnormal give each range.",
            "Inside both normal ranges, the format with more mantissa bits wins. A number past "
            "fp16's largest finite value (inf), below its smallest subnormal (0), or among its "
            "subnormals (few bits left) is held better by bf16, whose range matches fp32's.",
        )),
    Exercise(
        id="1.5", title="A general decoder", points=2,
        prompt="Write `decode(bits, exp_bits, man_bits, bias)`: the value, as a float, of the "
               "bit pattern `bits` (an int) in an IEEE-style format with `exp_bits` exponent "
               "bits, `man_bits` mantissa bits and that `bias`; fp16's 1.0 is "
               "`decode(0x3C00, 5, 10, 15)`. IEEE-style: the all-ones exponent field holds no "
               "numbers (mantissa 0 is an infinity, any other mantissa NaN), as in "
               + _IEEE_1_5 + "; not " + _NOT_IEEE_1_5 + ", whose all-ones exponent holds "
               "numbers. Cover every case: normal numbers, subnormals, zeros with their "
               "sign (`-0.0`), infinities and NaN. The check compares it with "
               "`mplab.numerics.formats.from_bits` on " + _PUBLIC_NAMES_1_5 + " patterns; the "
               "grader also tries " + _HIDDEN_NAMES_1_5 + ".",
        comment="decode an IEEE-style pattern (normals, subnormals, +-0, +-inf, NaN)",
        body="def decode(bits, exp_bits, man_bits, bias):\n"
             "    return ...  # the value, as a float",
        key="def decode(bits, exp_bits, man_bits, bias):\n"
            "    sign = -1.0 if (bits >> (exp_bits + man_bits)) & 1 else 1.0\n"
            "    exponent = (bits >> man_bits) & ((1 << exp_bits) - 1)\n"
            "    mantissa = bits & ((1 << man_bits) - 1)\n"
            "    if exponent == (1 << exp_bits) - 1:  # all ones: reserved for inf and NaN\n"
            "        return sign * float(\"inf\") if mantissa == 0 else float(\"nan\")\n"
            "    if exponent == 0:  # zero and subnormals: no hidden 1, exponent 1 - bias\n"
            "        return sign * mantissa * 2.0**(1 - bias - man_bits)\n"
            "    return sign * (1 + mantissa / 2**man_bits) * 2.0**(exponent - bias)",
        arg='decode',
        check=_check_1_5, hidden=_hidden_1_5, trials=_trials_1_5,
        hints=(
            "The exponent field picks one of five cases: all ones is inf (mantissa 0) or NaN; "
            "all zeros is zero or a subnormal; anything else is a normal number. Each has its "
            "own formula, and the sign bit applies to all but NaN.",
            "Fields come out with shifts and masks: bits >> man_bits, & ((1 << exp_bits) - 1), "
            "bits & ((1 << man_bits) - 1). float(\"inf\"), float(\"nan\") and 2.0**k do the rest; "
            "mplab.numerics.formats.from_bits(bits, \"fp16\") is the reference to test against.",
            "normal: sign x (1 + mantissa / 2**man_bits) x 2**(exponent - bias); zero and "
            "subnormal: sign x mantissa / 2**man_bits x 2**(1 - bias); all-ones exponent: "
            "sign x inf if mantissa == 0 else NaN. Use sign = -1.0 or 1.0 so zero keeps its "
            "sign.",
        )),
]}

LESSON = Lesson(1, list(EXERCISES.values()))
check, hint, solution, exercise_cells, cells, task_markdown = LESSON.functions()
