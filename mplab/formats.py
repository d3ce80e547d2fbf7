"""Float formats as data, with exact conversions between bits and values.

Every conversion here is integer arithmetic on the exact value (no torch casts under the
hood), and agrees bit for bit with torch's own casts on CPU:

    >>> to_bits(0.1, "fp16"), round_to(0.1, "fp16")
    (11878, 0.0999755859375)

`precision` may be a :class:`FloatFormat`, its name ("fp32", "tf32", "fp16", "bf16",
"fp8_e4m3", "fp8_e5m2") or the matching torch dtype. What a format stores, explained field by
field and in tables, is :mod:`mplab.explain`.

Two behaviours of torch are matched on purpose and worth knowing:

- A Python float is a double. torch casts a double to fp16, bf16 or fp8 *through fp32*, so it
  rounds twice; the default here does the same. Pass ``exact=True`` to round the exact value of
  the input once (what a mathematician would call the nearest value).
- fp8 e4m3 (``float8_e4m3fn``) has no infinity. torch saturates an overflow to ±448 (even inf);
  ml_dtypes returns NaN. The default format matches torch; ``E4M3_NAN_ON_OVERFLOW`` is the other
  convention.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import struct
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction

import torch

__all__ = [
    "FloatFormat", "FORMATS", "get_format", "dtype_of", "parse_number", "exact_value",
    "from_bits", "to_bits", "round_to", "field_bits", "kind_of", "ulp", "next_up", "next_down",
    "E4M3_NAN_ON_OVERFLOW", "floor_log2",
]


@dataclass(frozen=True)
class FloatFormat:
    """A binary float format: 1 sign bit, `exp_bits` exponent bits, `man_bits` mantissa bits.

    `nan` is "ieee" (exponent all ones: mantissa 0 is inf, anything else NaN) or "fn" (finite
    only: the single NaN is exponent and mantissa all ones, the rest of that binade is finite).
    `overflow` says what a cast does past the largest finite value: "inf", "saturate" or "nan".
    """

    name: str
    exp_bits: int
    man_bits: int
    bias: int
    nan: str = "ieee"
    overflow: str = "inf"
    torch_dtype: str | None = None
    title: str = ""

    # --- layout -----------------------------------------------------------------------------
    @property
    def bits(self) -> int:
        return 1 + self.exp_bits + self.man_bits

    @property
    def has_inf(self) -> bool:
        return self.nan == "ieee"

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal binade (also the subnormals' scale)."""
        return 1 - self.bias

    @property
    def max_exp_field(self) -> int:
        """Largest exponent field that holds finite numbers."""
        all_ones = (1 << self.exp_bits) - 1
        return all_ones - 1 if self.nan == "ieee" else all_ones

    @property
    def emax(self) -> int:
        return self.max_exp_field - self.bias

    @property
    def max_man_at_emax(self) -> int:
        all_ones = (1 << self.man_bits) - 1
        return all_ones if self.nan == "ieee" else all_ones - 1

    # --- exact landmarks (Fractions) ---------------------------------------------------------
    @property
    def max_finite(self) -> Fraction:
        top = (1 << self.man_bits) + self.max_man_at_emax
        return top * _pow2(self.emax - self.man_bits)

    @property
    def min_normal(self) -> Fraction:
        return _pow2(self.emin)

    @property
    def min_subnormal(self) -> Fraction:
        return _pow2(self.emin - self.man_bits)

    @property
    def eps(self) -> Fraction:
        """Distance from 1 to the next larger number (not "the smallest x with 1 + x != 1")."""
        return _pow2(-self.man_bits)

    @property
    def decimal_digits(self) -> float:
        """About how many significant decimal digits the format keeps."""
        return (self.man_bits + 1) * math.log10(2)

    def dtype(self) -> torch.dtype | None:
        """The torch storage dtype, or None (tf32 is a matmul mode, not a dtype)."""
        return getattr(torch, self.torch_dtype) if self.torch_dtype else None

    def with_overflow(self, overflow: str) -> FloatFormat:
        if overflow not in ("inf", "saturate", "nan"):
            raise ValueError(f"overflow must be 'inf', 'saturate' or 'nan', got {overflow!r}")
        if overflow == "inf" and not self.has_inf:
            raise ValueError(f"{self.name} has no infinity, so it cannot overflow to inf")
        return dataclasses.replace(self, overflow=overflow)

    def __str__(self) -> str:
        return self.name


def _pow2(k: int) -> Fraction:
    return Fraction(1 << k) if k >= 0 else Fraction(1, 1 << -k)


FP32 = FloatFormat("fp32", 8, 23, 127, torch_dtype="float32", title="IEEE binary32")
TF32 = FloatFormat("tf32", 8, 10, 127, title="TensorFloat-32 (how tensor cores read fp32)")
FP16 = FloatFormat("fp16", 5, 10, 15, torch_dtype="float16", title="IEEE binary16")
BF16 = FloatFormat("bf16", 8, 7, 127, torch_dtype="bfloat16", title="bfloat16")
FP8_E4M3 = FloatFormat("fp8_e4m3", 4, 3, 7, nan="fn", overflow="saturate",
                       torch_dtype="float8_e4m3fn", title="OCP FP8 E4M3 (torch float8_e4m3fn)")
FP8_E5M2 = FloatFormat("fp8_e5m2", 5, 2, 15, torch_dtype="float8_e5m2", title="OCP FP8 E5M2")
#: e4m3 as ml_dtypes casts it: an overflow becomes NaN instead of saturating at 448.
E4M3_NAN_ON_OVERFLOW = FP8_E4M3.with_overflow("nan")

FORMATS: dict[str, FloatFormat] = {f.name: f for f in (FP32, TF32, FP16, BF16, FP8_E4M3, FP8_E5M2)}
_BY_DTYPE = {f.torch_dtype: f for f in FORMATS.values() if f.torch_dtype}


def get_format(precision) -> FloatFormat:
    """A format by name ("fp32", "tf32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2") or torch dtype."""
    if isinstance(precision, FloatFormat):
        return precision
    if isinstance(precision, torch.dtype):
        name = str(precision).removeprefix("torch.")
        if name in _BY_DTYPE:
            return _BY_DTYPE[name]
        raise ValueError(f"torch dtype {precision} is not a float format mplab knows; accepted "
                         "dtypes: " + ", ".join(f"torch.{d}" for d in _BY_DTYPE))
    if isinstance(precision, str):
        key = precision.strip().lower().replace("-", "_")
        key = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16",
               "float8_e4m3fn": "fp8_e4m3", "e4m3": "fp8_e4m3", "e5m2": "fp8_e5m2",
               "float8_e5m2": "fp8_e5m2"}.get(key, key)
        if key in FORMATS:
            return FORMATS[key]
    raise ValueError(f"unknown float format {precision!r}; accepted: "
                     + ", ".join(map(repr, FORMATS)) + " or the matching torch dtypes")


def dtype_of(precision) -> torch.dtype:
    """The torch dtype of a format name ("bf16" -> torch.bfloat16): mplab's one map from names
    to dtypes (its inverse is `get_format(dtype).name`). tf32 is a matmul mode, not a dtype."""
    f = get_format(precision)
    if f.torch_dtype is None:
        raise ValueError(f"{f.name} is not a torch dtype (it is how tensor cores read fp32: "
                         "torch.backends.cuda.matmul.allow_tf32); accepted: "
                         + ", ".join(repr(n) for n, g in FORMATS.items() if g.torch_dtype))
    return f.dtype()


def dtype_name(dtype: torch.dtype | None) -> str | None:
    """torch's name of a dtype, as records store it ("bfloat16"); None stays None."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def dtype_from_name(name: str | None) -> torch.dtype | None:
    """The inverse of `dtype_name` ("bfloat16" -> torch.bfloat16), None for None or a name
    torch has no dtype for (a record written by another torch)."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) else None


# --- turning what a learner gives into an exact value ----------------------------------------

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


def _exact(x, exact: bool):
    """(sign, value) where value is a non-negative Fraction, math.inf or math.nan."""
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
        x = _to_float(x)  # torch sees every Python number as a double
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
    return _exact(x, True)


def floor_log2(q) -> int:
    """floor(log2(q)), exactly, for a positive int or Fraction."""
    q = Fraction(q)
    return _floor_log2(q.numerator, q.denominator)


def _floor_log2(n: int, d: int) -> int:
    """floor(log2(n / d)) for positive integers."""
    e = n.bit_length() - d.bit_length()
    if (n << max(0, -e)) < (d << max(0, e)):
        e -= 1
    return e


def _nearest_fields(a: Fraction, f: FloatFormat, mode: str = "nearest") -> tuple[int, int] | None:
    """Exponent and mantissa fields of |a| rounded onto f's grid, or None when it overflows.

    mode: "nearest" (ties to even), "up" (toward +inf) or "down" (toward 0), on magnitudes.
    """
    if a == 0:
        return 0, 0
    n, d = a.numerator, a.denominator
    e = max(_floor_log2(n, d), f.emin)
    shift = f.man_bits - e  # a / 2^(e - man_bits) = n * 2^shift / d
    num, den = (n << shift, d) if shift >= 0 else (n, d << -shift)
    m, r = divmod(num, den)
    if mode == "nearest":
        if 2 * r > den or (2 * r == den and m & 1):
            m += 1
    elif mode == "up" and r:
        m += 1
    if m == 1 << (f.man_bits + 1):  # rounding carried into the next binade
        m >>= 1
        e += 1
    if m >= 1 << f.man_bits:
        exp_field, man = e + f.bias, m - (1 << f.man_bits)
    else:  # subnormal: only possible at e == emin
        exp_field, man = 0, m
    if exp_field > f.max_exp_field or (exp_field == f.max_exp_field and man > f.max_man_at_emax):
        return None
    return exp_field, man


def _nan_bits(f: FloatFormat, sign: bool, fp32_mantissa: int = 1 << 22) -> int:
    """The NaN pattern torch's CPU cast produces from an fp32 NaN with this mantissa field.

    fp32/tf32/fp16 keep the sign and the top of the payload, bf16 always gives 0xFFFF,
    fp8 gives its all-ones pattern with the sign.
    """
    if f.name == "bf16":
        return 0xFFFF
    if f.man_bits <= 3:
        return (1 << (f.bits - 1)) - 1 | (sign << (f.bits - 1))
    payload = fp32_mantissa >> (FP32.man_bits - f.man_bits)
    return _pack(f, sign, (1 << f.exp_bits) - 1, payload)


def _fp32_nan_mantissa(x) -> int:
    """The mantissa field of the fp32 NaN a double NaN becomes (quiet bit set, payload kept)."""
    if not isinstance(x, float):
        return 1 << 22
    m64 = struct.unpack("<Q", struct.pack("<d", x))[0] & ((1 << 52) - 1)
    return (1 << 22) | (m64 >> 29)


def _pack(f: FloatFormat, sign: bool, exp_field: int, man: int) -> int:
    return (sign << (f.bits - 1)) | (exp_field << f.man_bits) | man


def _special_bits(f: FloatFormat, sign: bool, value, x=None) -> int:
    """Bits for NaN (x, the input, gives its payload), inf, or a finite value that overflowed."""
    if value != value:
        return _nan_bits(f, sign, _fp32_nan_mantissa(x))
    if f.overflow == "inf":
        return _pack(f, sign, (1 << f.exp_bits) - 1, 0)
    if f.overflow == "saturate":
        return _pack(f, sign, f.max_exp_field, f.max_man_at_emax)
    return _nan_bits(f, sign)


def _check_bits(bits, f: FloatFormat) -> int:
    if isinstance(bits, bool) or not isinstance(bits, numbers.Integral):
        raise TypeError(f"a bit pattern must be an int, got {bits!r} of type {type(bits).__name__}")
    bits = int(bits)
    if not 0 <= bits < 1 << f.bits:
        raise ValueError(f"{bits} is not a {f.bits}-bit pattern of {f.name}; accepted: "
                         f"0 to {(1 << f.bits) - 1} (0x{(1 << f.bits) - 1:X})")
    return bits


def field_bits(bits: int, precision) -> tuple[int, int, int]:
    """(sign, exponent field, mantissa field) of a bit pattern."""
    f = get_format(precision)
    bits = _check_bits(bits, f)
    return (bits >> (f.bits - 1), (bits >> f.man_bits) & ((1 << f.exp_bits) - 1),
            bits & ((1 << f.man_bits) - 1))


def _kind(f: FloatFormat, exp_field: int, man: int) -> str:
    top = (1 << f.exp_bits) - 1
    if f.nan == "ieee" and exp_field == top:
        return "inf" if man == 0 else "nan"
    if f.nan == "fn" and exp_field == top and man == (1 << f.man_bits) - 1:
        return "nan"
    if exp_field == 0:
        return "zero" if man == 0 else "subnormal"
    return "normal"


def kind_of(bits: int, precision) -> str:
    """What a bit pattern is in the format: "zero", "subnormal", "normal", "inf" or "nan"."""
    f = get_format(precision)
    _, exp_field, man = field_bits(bits, f)
    return _kind(f, exp_field, man)


def _fields_value(f: FloatFormat, exp_field: int, man: int) -> Fraction:
    if exp_field == 0:
        return man * _pow2(f.emin - f.man_bits)
    return ((1 << f.man_bits) + man) * _pow2(exp_field - f.bias - f.man_bits)


def _decode(bits: int, f: FloatFormat) -> tuple[bool, str, Fraction | float]:
    sign, exp_field, man = field_bits(bits, f)
    kind = _kind(f, exp_field, man)
    if kind == "nan":
        return bool(sign), kind, math.nan
    if kind == "inf":
        return bool(sign), kind, math.inf
    return bool(sign), kind, _fields_value(f, exp_field, man)


def _to_float(value) -> float:
    """float(value), but ±inf for a number beyond the doubles (10**400) instead of an error."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _as_float(sign: bool, value) -> float:
    v = _to_float(value)
    return -v if sign else v


def from_bits(bits: int, precision) -> float:
    """The exact value a bit pattern stands for (NaN for NaN patterns, -0.0 for negative zero)."""
    f = get_format(precision)
    sign, _, value = _decode(bits, f)
    return _as_float(sign, value)


def _via_fp32(sign: bool, value, f: FloatFormat):
    # torch turns a double into fp16/bf16/fp8 by way of fp32: round there first.
    if f is FP32 or f.bits >= 32 or not isinstance(value, Fraction):
        return value
    fields = _nearest_fields(value, FP32)
    return math.inf if fields is None else _fields_value(FP32, *fields)


def to_bits(x, precision, *, exact: bool = False) -> int:
    """The bit pattern a cast of x to this format produces (round to nearest, ties to even).

    Matches torch's CPU cast: overflow to inf (fp16, bf16, e5m2) or saturation at ±448 (e4m3),
    subnormals kept, a double rounded through fp32 first unless ``exact=True``.
    """
    f = get_format(precision)
    sign, value = _exact(x, exact)
    if not exact:
        value = _via_fp32(sign, value, f)
    if not isinstance(value, Fraction):
        return _special_bits(f, sign, value, x)
    fields = _nearest_fields(value, f)
    if fields is None:
        return _special_bits(f, sign, math.inf)
    return _pack(f, sign, *fields)


def round_to(x, precision, *, exact: bool = False) -> float:
    """The value x has after a cast to this format."""
    f = get_format(precision)
    return from_bits(to_bits(x, f, exact=exact), f)


def ulp(x, precision) -> float:
    """Spacing of the format's numbers around x: 2^(e − man_bits) with e = floor(log2|x|),
    clamped to the format's exponent range (so the subnormal spacing below the normals,
    the top binade's spacing above the largest finite). NaN for inf or NaN."""
    f = get_format(precision)
    _, value = _exact(x, True)
    if not isinstance(value, Fraction):
        return math.nan
    e = f.emin if value == 0 else min(max(_floor_log2(value.numerator, value.denominator), f.emin),
                                      f.emax)
    return float(_pow2(e - f.man_bits))


def _step(x, f: FloatFormat, up: bool) -> float:
    sign, value = _exact(x, True)
    if value != value:
        return math.nan
    if value == math.inf:
        if sign == up:  # -inf stepping up, or +inf stepping down: the largest finite
            return _as_float(sign, f.max_finite) if f.has_inf else math.nan
        return _as_float(sign, value)
    if value == 0:
        return _as_float(not up, f.min_subnormal)
    away = sign != up  # a step up from a negative number moves toward zero
    if away:
        fields = _nearest_fields(value, f, "down")
        if fields is not None and _fields_value(f, *fields) == value:
            fields = (fields[0], fields[1] + 1) if fields[1] < (1 << f.man_bits) - 1 else (
                fields[0] + 1, 0)
            if (fields[0] > f.max_exp_field
                    or (fields[0] == f.max_exp_field and fields[1] > f.max_man_at_emax)):
                fields = None
        else:
            fields = _nearest_fields(value, f, "up")
        if fields is None:
            return _as_float(sign, math.inf) if f.has_inf else math.nan
        return _as_float(sign, _fields_value(f, *fields))
    if value > f.max_finite:
        return _as_float(sign, f.max_finite)
    fields = _nearest_fields(value, f, "down")
    if _fields_value(f, *fields) == value:
        exp_field, man = fields
        fields = (exp_field, man - 1) if man else (exp_field - 1, (1 << f.man_bits) - 1)
    return _as_float(sign, _fields_value(f, *fields))  # may be a zero of x's sign


def next_up(x, precision) -> float:
    """The smallest number of the format greater than x (inf past the largest finite,
    NaN for fp8 e4m3, which has no inf)."""
    return _step(x, get_format(precision), up=True)


def next_down(x, precision) -> float:
    """The largest number of the format less than x."""
    return _step(x, get_format(precision), up=False)
