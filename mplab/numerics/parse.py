"""Reading what a learner gives as an exact number: text ("0.1", "1/3", "2**-24", "pi"), a
Python number, a Decimal or a one-element tensor. :mod:`mplab.numerics.formats` rounds what
this reads.

    >>> parse_number("0.1")
    Fraction(1, 10)
"""

from __future__ import annotations

import math
import numbers
from decimal import Decimal
from fractions import Fraction

import torch

__all__ = ["parse_number", "exact_value", "read_number", "to_float"]

# Powers of ten or two beyond this are 0 or inf in every format; past it, skip exact bignums.
_MAX_EXPONENT = 400
_CONSTANTS = {"pi": math.pi, "π": math.pi, "e": math.e, "tau": math.tau}


def parse_number(text: str) -> float | Fraction:
    """Read a number a person typed: "0.1", "-1e-8", "65504", "1/3", "2**-24", "pi", "inf", "nan".

    Decimal text and fractions come back exact (as Fractions), constants as the nearest double.
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_number takes text, got {type(text).__name__}")
    s = text.strip().replace("−", "-").replace("_", "").replace(" ", "").lower()
    sign = -1 if s.startswith("-") else 1
    body = s.lstrip("+-") if s[:1] in "+-" else s
    if body in _CONSTANTS:
        return sign * _CONSTANTS[body]
    if body in ("inf", "infinity", "∞", "nan"):
        return sign * float(body.replace("∞", "inf"))
    try:
        if "**" in body or "^" in body:
            base, _, power = body.replace("^", "**").partition("**")
            b, k = Fraction(base), int(power)
            if abs(k) > _MAX_EXPONENT and b not in (0, 1):  # 0 or inf: skip the bignum
                return sign * (math.inf if (b > 1) == (k > 0) else 0.0)
            return sign * Fraction(base) ** int(power)
        if "/" not in body and abs(Decimal(body).adjusted()) > _MAX_EXPONENT:
            return sign * float(body)  # 1e99999999 is inf to every format: don't build 10^99999999
        value = Fraction(body)
        return -0.0 if value == 0 and sign < 0 else sign * value  # keep the sign of "-0"
    except (ValueError, ZeroDivisionError, ArithmeticError, OverflowError):
        raise ValueError(f"could not read {text!r} as a number; try forms like 0.1, -1e-8, 1/3, "
                         "2**-24, pi, inf or nan") from None


def read_number(x, exact: bool):
    """(sign, value): value a non-negative Fraction, math.inf or math.nan. ``exact=False`` reads
    a non-float as the nearest double first, as torch does with every Python number."""
    if isinstance(x, str):
        x = parse_number(x)
    if isinstance(x, torch.Tensor):
        if x.numel() != 1 or x.is_complex():
            raise TypeError(f"expected a real number, got a tensor of shape {tuple(x.shape)} "
                            f"and dtype {x.dtype}; pass one element, e.g. t[0].item()")
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, numbers.Real | Decimal):
        raise TypeError(f"expected a real number (int, float, Fraction, Decimal or numeric text), "
                        f"got {x!r} of type {type(x).__name__}")
    if not exact and not isinstance(x, float):
        x = to_float(x)  # torch sees every Python number as a double
    if isinstance(x, Decimal) and (not x.is_finite() or abs(x.adjusted()) > _MAX_EXPONENT):
        x = float(x)
    if isinstance(x, float):
        sign = math.copysign(1.0, x) < 0
        if math.isnan(x):
            return sign, math.nan
        if math.isinf(x):
            return sign, math.inf
        return sign, Fraction(abs(x))
    value = Fraction(x)
    return value < 0, abs(value)


def exact_value(x) -> tuple[bool, Fraction | float]:
    """x exactly as mplab reads it: (whether it is negative, its magnitude). The magnitude is a
    Fraction, or math.inf / math.nan. Text goes through :func:`parse_number`, a one-element
    tensor through .item(); -0.0 is (True, Fraction(0)). A TypeError for anything else."""
    return read_number(x, True)



def to_float(value) -> float:
    """float(value), but ±inf for a number beyond the doubles (10**400) instead of an error."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf
