"""What a format stores for a number, explained: field by field, in tables and in words.

    print(decompose(65504, "fp16"))     # the stored bits, the formula they give, the error
    format_table()                      # range and precision of every format
    compare([0.1, 1e-8], ["fp16", "bf16"])
    exact_decimal(round_to(0.1, "fp32"))   # '0.100000001490116119384765625'

Every figure comes from :mod:`mplab.numerics.formats`' exact arithmetic; this module only arranges
it for a reader. `precision` is a format name, a FloatFormat or a torch dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import ROUND_DOWN, Context, Decimal
from fractions import Fraction

from mplab._display import Table
from mplab.numerics.formats import (
    FORMATS,
    exact_value,
    field_bits,
    from_bits,
    get_format,
    kind_of,
    to_bits,
    ulp,
)

__all__ = ["Decomposed", "decompose", "format_table", "compare", "exact_decimal", "cast_note",
           "stored_row"]


@dataclass(frozen=True)
class Decomposed:
    """What a format stores for x, field by field, and what it costs in accuracy."""

    x: float
    precision: str
    bits: int
    sign: int
    exponent: int
    mantissa: int
    kind: str
    value: float
    abs_error: float
    rel_error: float
    exp_bits: int
    man_bits: int
    bias: int
    signed: bool = True

    @property
    def bit_string(self) -> str:
        """Sign, exponent and mantissa fields separated by spaces, e.g. '0 01111 0000000000';
        a field the format lacks (e8m0's sign and mantissa) shows as '-'."""
        s = format(self.bits, f"0{int(self.signed) + self.exp_bits + self.man_bits}b")
        if not self.signed:
            s = "-" + s
        return f"{s[0]} {s[1:1 + self.exp_bits]} {s[1 + self.exp_bits:] or '-'}"

    def formula(self) -> str:
        """The value as the format computes it from its fields."""
        sign = "-" if self.sign else "+"
        if self.kind == "nan":
            return "NaN (a reserved pattern: no value)"
        if self.kind == "inf":
            return f"{sign}inf (exponent all ones, mantissa all zeros)"
        if self.kind == "zero":
            return f"{sign}0 (exponent and mantissa all zeros)"
        frac = Fraction(self.mantissa, 1 << self.man_bits)
        if self.kind == "normal" and not self.man_bits:  # e8m0: a power of two, nothing else
            return f"2^({self.exponent} − {self.bias}) = 2^{self.exponent - self.bias}"
        if self.kind == "normal":
            e = self.exponent - self.bias
            return (f"{sign}1.{self.bit_string.split()[2]}₂ × 2^({self.exponent} − {self.bias}) = "
                    f"{sign}{float(1 + frac)!r} × 2^{e}")
        return (f"{sign}0.{self.bit_string.split()[2]}₂ × 2^(1 − {self.bias}) = "
                f"{sign}{float(frac)!r} × 2^{1 - self.bias}  (subnormal: no hidden 1)")

    def __str__(self) -> str:
        width = int(self.signed) + self.exp_bits + self.man_bits
        lines = [
            f"{self.x!r} in {self.precision}",
            f"  bits      {self.bit_string}   (0x{self.bits:0{(width + 3) // 4}X})",
            f"  sign      {self.sign}  → {'-' if self.sign else '+'}",
            f"  exponent  {self.bit_string.split()[1]}₂ = {self.exponent}",
            f"  mantissa  {self.bit_string.split()[2]}₂ = {self.mantissa}",
            f"  value     {self.formula()}",
            f"  stored    {self.value!r}  ({self.kind})",
            f"  error     {self.abs_error:+.6g} absolute, {self.rel_error:.3g} relative",
        ]
        return "\n".join(lines)

    __repr__ = __str__


def decompose(x, precision, *, exact: bool = False) -> Decomposed:
    """Cast x to the format and explain the result field by field (``exact`` as in
    :func:`mplab.numerics.formats.to_bits`)."""
    f = get_format(precision)
    bits = to_bits(x, f, exact=exact)
    sign, exp_field, man = field_bits(bits, f)
    value = from_bits(bits, f)
    x_sign, x_exact = exact_value(x)
    x_float = _as_float(x_sign, x_exact)
    if isinstance(x_exact, Fraction) and math.isfinite(value):
        err = Fraction(value) - (-x_exact if x_sign else x_exact)
        abs_error = float(err)
        rel_error = float(abs(err) / x_exact) if x_exact else 0.0
    elif math.isinf(value) and isinstance(x_exact, Fraction):
        abs_error, rel_error = math.copysign(math.inf, value), math.inf
    elif math.isnan(value) and not math.isnan(x_float):
        abs_error = rel_error = math.nan
    else:  # inf stays inf, NaN stays NaN: nothing was lost
        abs_error = rel_error = 0.0 if value == x_float or value != value else math.nan
    return Decomposed(x_float, f.name, bits, sign, exp_field, man, kind_of(bits, f), value,
                      abs_error, rel_error, f.exp_bits, f.man_bits, f.bias, f.signed)


def _as_float(negative: bool, magnitude) -> float:
    """The double of a magnitude and sign; ±inf past the doubles (10**400)."""
    try:
        v = float(magnitude)
    except OverflowError:
        v = math.inf
    return -v if negative else v




def format_table(precisions=None) -> Table:
    """Range and precision of each format, one row each, computed from the fields."""
    rows = []
    for f in (get_format(x) for x in (precisions or FORMATS)):
        rows.append({
            "format": f.name,
            "bits (s/e/m)": f"{f.bits} ({int(f.signed)}/{f.exp_bits}/{f.man_bits})",
            "bias": f.bias,
            "largest finite": float(f.max_finite),
            "smallest normal": float(f.min_normal),
            "smallest subnormal": float(f.min_subnormal),
            "eps": float(f.eps),
            "decimal digits": round(f.decimal_digits, 1),
            "inf": "yes" if f.has_inf else "no",
            "overflow": {"inf": "→ inf", "saturate": "→ ±max", "nan": "→ NaN"}[f.overflow],
            "torch dtype": f"torch.{f.torch_dtype}" if f.torch_dtype else (
                "(matmul mode)" if f.name == "tf32" else "(none)"),
        })
    return Table(rows, title="Float formats: range and precision")


def compare(values, precisions=("fp16", "bf16")) -> Table:
    """What each format stores for each value, and the relative error it costs (one row a value)."""
    rows = []
    for x in values:
        row = {"x": x}
        for name in precisions:
            d = decompose(x, name)
            row[f"{d.precision} stores"] = d.value
            row[f"{d.precision} rel. error"] = d.rel_error
        rows.append(row)
    return Table(rows, title="Stored value and relative error per format")


# --- a stored value in words --------------------------------------------------------------------

def exact_decimal(v: float, max_digits: int = 30) -> str:
    """Every binary float is a finite decimal: v's, digit for digit, cut to max_digits
    significant digits (marked with …)."""
    if not math.isfinite(v) or v == 0:
        return repr(v)
    exact = Decimal(v)
    context = Context(prec=max_digits, rounding=ROUND_DOWN)
    d = context.plus(exact)
    cut = d != exact
    d = d.normalize(context)
    text = format(d, "f") if -7 <= d.adjusted() < 16 else format(d, "e")
    return text + ("…" if cut else "")


def cast_note(x: float, d: Decomposed, precision) -> str:
    """What the cast of x to the format did, in words, when it did more than round
    (d: :func:`decompose` of x, or of a pattern a learner made); "" otherwise."""
    f = get_format(precision)
    if math.isnan(x) and f.nan == "none":
        return "no NaN in this format: became a zero (as ml_dtypes casts it)"
    if not math.isfinite(x):
        return ""
    if not f.signed and (x < 0 or x == 0):
        return ("no sign: the magnitude was kept" if x < 0 else
                "no zero: became the smallest value")
    if x != 0 and d.kind == "zero":
        return "underflow: became 0"
    if d.kind == "inf":
        return "overflow: became inf"
    if d.kind == "nan":
        return "overflow: became NaN"
    if abs(x) > f.max_finite:
        return "overflow: saturated at the largest finite"
    if d.kind == "subnormal":
        return "subnormal: fewer significant bits"
    return ""


def stored_row(x: float, d: Decomposed, precision) -> dict:
    """What a cast of x to the format stored (d: its :func:`decompose`, or a pattern a learner
    made), as one row of the precision explorer's table: the stored value digit for digit,
    its kind, errors, the spacing of the format's numbers there (NaN for inf and NaN), the bit
    pattern and :func:`cast_note`."""
    f = get_format(precision)
    return {"format": f.name, "stored value, exactly": exact_decimal(d.value), "kind": d.kind,
            "abs. error": d.abs_error, "rel. error": d.rel_error,
            "spacing here (ulp)": ulp(d.value, f) if math.isfinite(d.value) else math.nan,
            "bits": d.bits, "note": cast_note(x, d, f)}
