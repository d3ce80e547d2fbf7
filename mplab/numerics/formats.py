"""Float formats as data, with exact conversions between bits and values.

Every conversion here is integer arithmetic on the exact value (no torch casts under the
hood), and agrees bit for bit with torch's own casts on CPU:

    >>> to_bits(0.1, "fp16"), round_to(0.1, "fp16")
    (11878, 0.0999755859375)

`precision` may be a :class:`FloatFormat`, its name ("fp32", "tf32", "fp16", "bf16",
"fp8_e4m3", "fp8_e5m2") or the matching torch dtype. What a format stores, explained field by
field and in tables, is :mod:`mplab.numerics.explain`.

Two behaviours of torch are matched on purpose and worth knowing:

- A Python float is a double. torch casts a double to fp16, bf16 or fp8 *through fp32*, so it
  rounds twice; the default here does the same. Pass ``exact=True`` to round the exact value of
  the input once (what a mathematician would call the nearest value).
- fp8 e4m3 (``float8_e4m3fn``) has no infinity. torch 2.13 and later saturate an overflow to
  ±448 (even inf); torch before 2.13 and ml_dtypes return NaN. The default format matches the
  torch installed (``TORCH_E4M3_OVERFLOW`` says which it does); ``E4M3_SATURATING`` and
  ``E4M3_NAN_ON_OVERFLOW`` are the two conventions by name.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import struct
from dataclasses import dataclass
from fractions import Fraction

import torch

from mplab.numerics.parse import exact_value, parse_number, read_number, to_float

__all__ = [
    "FloatFormat", "FORMATS", "get_format", "dtype_of", "parse_number", "exact_value",
    "from_bits", "to_bits", "round_to", "field_bits", "kind_of", "ulp", "next_up", "next_down",
    "E4M3_NAN_ON_OVERFLOW", "E4M3_SATURATING", "TORCH_E4M3_OVERFLOW", "floor_log2",
    "LOW_BIT_FORMATS", "ALL_FORMATS", "dtype_name",
    "dtype_from_name", "FP32", "TF32", "FP16", "BF16", "FP8_E4M3", "FP8_E5M2", "FP8_E4M3FNUZ",
    "FP8_E5M2FNUZ", "FP6_E3M2", "FP6_E2M3", "FP4_E2M1", "E8M0",
]


@dataclass(frozen=True)
class FloatFormat:
    """A binary float format: a sign bit (unless `signed` is False), `exp_bits` exponent bits,
    `man_bits` mantissa bits.

    `nan` says where the specials are: "ieee" (exponent all ones: mantissa 0 is inf, anything
    else NaN), "fn" (finite only: the one NaN is exponent and mantissa all ones, the rest of that
    binade is finite), "fnuz" (finite, no negative zero: the pattern of -0 is the one NaN) or
    "none" (every pattern a number: fp4 and fp6). `overflow` says what a cast does past the
    largest finite value: "inf", "saturate" or "nan". `subnormals=False` makes exponent field 0
    an ordinary binade (e8m0, whose smallest value is 2^-127 and which has no zero).
    """

    name: str
    exp_bits: int
    man_bits: int
    bias: int
    nan: str = "ieee"
    overflow: str = "inf"
    torch_dtype: str | None = None
    title: str = ""
    signed: bool = True
    subnormals: bool = True

    # --- layout -----------------------------------------------------------------------------
    @property
    def bits(self) -> int:
        return self.signed + self.exp_bits + self.man_bits

    @property
    def has_inf(self) -> bool:
        return self.nan == "ieee"

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal binade (also the subnormals' scale)."""
        return (1 if self.subnormals else 0) - self.bias

    @property
    def max_exp_field(self) -> int:
        """Largest exponent field that holds finite numbers."""
        all_ones = (1 << self.exp_bits) - 1
        # e8m0 ("fn" with no mantissa): the all-ones binade is only its NaN
        return all_ones - 1 if self.nan == "ieee" or (self.nan == "fn" and not self.man_bits) \
            else all_ones

    @property
    def emax(self) -> int:
        return self.max_exp_field - self.bias

    @property
    def max_man_at_emax(self) -> int:
        all_ones = (1 << self.man_bits) - 1
        return all_ones - 1 if self.nan == "fn" and self.man_bits else all_ones

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
        """The smallest positive value (the smallest normal where there are no subnormals)."""
        return _pow2(self.emin - (self.man_bits if self.subnormals else 0))

    @property
    def eps(self) -> Fraction:
        """Distance from 1 to the next larger number (not "the smallest x with 1 + x != 1")."""
        return _pow2(-self.man_bits)

    @property
    def decimal_digits(self) -> float:
        """About how many significant decimal digits the format keeps."""
        return (self.man_bits + 1) * math.log10(2)

    def dtype(self) -> torch.dtype | None:
        """The torch storage dtype, or None (tf32 is a matmul mode, not a dtype; torch keeps
        fp4 only packed two to a byte, and fp6 not at all)."""
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
#: What the installed torch makes of an e4m3 overflow: "saturate" (±448, torch 2.13 and later)
#: or "nan" (torch 2.11 and 2.12, as ml_dtypes). Asked of torch itself, once.
TORCH_E4M3_OVERFLOW = ("saturate" if torch.tensor(1e6).to(torch.float8_e4m3fn).float().item()
                       == 448 else "nan")
FP8_E4M3 = FloatFormat("fp8_e4m3", 4, 3, 7, nan="fn", overflow=TORCH_E4M3_OVERFLOW,
                       torch_dtype="float8_e4m3fn", title="OCP FP8 E4M3 (torch float8_e4m3fn)")
FP8_E5M2 = FloatFormat("fp8_e5m2", 5, 2, 15, torch_dtype="float8_e5m2", title="OCP FP8 E5M2")
#: e4m3 as ml_dtypes (and torch before 2.13) casts it: an overflow becomes NaN.
E4M3_NAN_ON_OVERFLOW = FP8_E4M3.with_overflow("nan")
#: e4m3 as torch 2.13 and later cast it: an overflow saturates at ±448.
E4M3_SATURATING = FP8_E4M3.with_overflow("saturate")
# Below 8 bits and the scale formats (lesson 9). Casts follow torch where torch has the dtype and
# ml_dtypes where it has not (fp4 and fp6 saturate: the formats have no inf and no NaN).
FP8_E4M3FNUZ = FloatFormat("fp8_e4m3fnuz", 4, 3, 8, nan="fnuz", overflow="nan",
                           torch_dtype="float8_e4m3fnuz", title="FP8 E4M3 FNUZ (AMD MI300)")
FP8_E5M2FNUZ = FloatFormat("fp8_e5m2fnuz", 5, 2, 16, nan="fnuz", overflow="nan",
                           torch_dtype="float8_e5m2fnuz", title="FP8 E5M2 FNUZ (AMD MI300)")
FP6_E3M2 = FloatFormat("fp6_e3m2", 3, 2, 3, nan="none", overflow="saturate",
                       title="OCP MX FP6 E3M2")
FP6_E2M3 = FloatFormat("fp6_e2m3", 2, 3, 1, nan="none", overflow="saturate",
                       title="OCP MX FP6 E2M3")
FP4_E2M1 = FloatFormat("fp4_e2m1", 2, 1, 1, nan="none", overflow="saturate",
                       title="OCP MX FP4 E2M1 (MXFP4, NVFP4)")
#: The MX block scale: a power of two, 2^-127 to 2^127, no sign, no zero; 0xFF is NaN. A cast
#: follows torch's float8_e8m0fnu (the sign dropped, round half up); ml_dtypes differs (lesson 9).
E8M0 = FloatFormat("e8m0", 8, 0, 127, nan="fn", overflow="nan", torch_dtype="float8_e8m0fnu",
                   title="OCP MX E8M0 scale (torch float8_e8m0fnu)", signed=False,
                   subnormals=False)

#: The formats of the course (lessons 1-8): 32 bits down to fp8.
FORMATS: dict[str, FloatFormat] = {f.name: f for f in (FP32, TF32, FP16, BF16, FP8_E4M3, FP8_E5M2)}
#: Lesson 9's: fp8's AMD variants, fp6, fp4 and the MX scale.
LOW_BIT_FORMATS: dict[str, FloatFormat] = {f.name: f for f in (
    FP8_E4M3FNUZ, FP8_E5M2FNUZ, FP6_E3M2, FP6_E2M3, FP4_E2M1, E8M0)}
ALL_FORMATS: dict[str, FloatFormat] = {**FORMATS, **LOW_BIT_FORMATS}
_BY_DTYPE = {f.torch_dtype: f for f in ALL_FORMATS.values() if f.torch_dtype}
_ALIASES = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16",
            "float8_e4m3fn": "fp8_e4m3", "e4m3": "fp8_e4m3", "e5m2": "fp8_e5m2",
            "float8_e5m2": "fp8_e5m2", "float8_e4m3fnuz": "fp8_e4m3fnuz",
            "float8_e5m2fnuz": "fp8_e5m2fnuz", "fp4": "fp4_e2m1", "float4_e2m1fn": "fp4_e2m1",
            "e2m1": "fp4_e2m1", "float6_e2m3fn": "fp6_e2m3", "float6_e3m2fn": "fp6_e3m2",
            "e2m3": "fp6_e2m3", "e3m2": "fp6_e3m2", "float8_e8m0fnu": "e8m0", "e8m0fnu": "e8m0"}


def get_format(precision) -> FloatFormat:
    """A format by name ("fp32", "tf32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", or one of
    lesson 9's: "fp8_e4m3fnuz", "fp8_e5m2fnuz", "fp6_e3m2", "fp6_e2m3", "fp4_e2m1", "e8m0")
    or torch dtype."""
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
        key = _ALIASES.get(key, key)
        if key in ALL_FORMATS:
            return ALL_FORMATS[key]
    raise ValueError(f"unknown float format {precision!r}; accepted: "
                     + ", ".join(map(repr, ALL_FORMATS)) + " or the matching torch dtypes")


def dtype_of(precision) -> torch.dtype:
    """The torch dtype of a format name ("bf16" -> torch.bfloat16): mplab's one map from names
    to dtypes (its inverse is `get_format(dtype).name`). tf32 is a matmul mode, not a dtype."""
    f = get_format(precision)
    if f.torch_dtype is None:
        why = ("it is how tensor cores read fp32: torch.backends.cuda.matmul.allow_tf32"
               if f is TF32 else "torch has no unpacked dtype for it")
        raise ValueError(f"{f.name} is not a torch dtype ({why}); accepted: "
                         + ", ".join(repr(n) for n, g in ALL_FORMATS.items() if g.torch_dtype))
    return f.dtype()


def dtype_name(dtype: torch.dtype | None) -> str | None:
    """torch's name of a dtype, as records store it ("bfloat16"); None stays None."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def dtype_from_name(name: str | None) -> torch.dtype | None:
    """The inverse of `dtype_name` ("bfloat16" -> torch.bfloat16), None for None or a name
    torch has no dtype for (a record written by another torch)."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) else None


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
    if f.nan == "fnuz":
        return 1 << (f.bits - 1)
    if f.nan == "none":  # no NaN to give: ml_dtypes gives a zero, of the other sign
        return (not sign) << (f.bits - 1)
    if not f.signed:
        return (1 << f.bits) - 1
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
    if f.nan == "fnuz" and exp_field == man == 0:
        sign = False  # no -0: that pattern is the NaN
    return (sign and f.signed) << (f.bits - 1) | (exp_field << f.man_bits) | man


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
    return (bits >> (f.bits - 1) if f.signed else 0,
            (bits >> f.man_bits) & ((1 << f.exp_bits) - 1), bits & ((1 << f.man_bits) - 1))


def _kind(f: FloatFormat, exp_field: int, man: int, sign: int = 0) -> str:
    top = (1 << f.exp_bits) - 1
    if f.nan == "fnuz" and sign and exp_field == man == 0:
        return "nan"
    if f.nan == "ieee" and exp_field == top:
        return "inf" if man == 0 else "nan"
    if f.nan == "fn" and exp_field == top and man == (1 << f.man_bits) - 1:
        return "nan"
    if exp_field == 0 and f.subnormals:
        return "zero" if man == 0 else "subnormal"
    return "normal"


def kind_of(bits: int, precision) -> str:
    """What a bit pattern is in the format: "zero", "subnormal", "normal", "inf" or "nan"."""
    f = get_format(precision)
    sign, exp_field, man = field_bits(bits, f)
    return _kind(f, exp_field, man, sign)


def _fields_value(f: FloatFormat, exp_field: int, man: int) -> Fraction:
    if exp_field == 0 and f.subnormals:
        return man * _pow2(f.emin - f.man_bits)
    return ((1 << f.man_bits) + man) * _pow2(exp_field - f.bias - f.man_bits)


def _decode(bits: int, f: FloatFormat) -> tuple[bool, str, Fraction | float]:
    sign, exp_field, man = field_bits(bits, f)
    kind = _kind(f, exp_field, man, sign)
    if kind == "nan":
        return bool(sign), kind, math.nan
    if kind == "inf":
        return bool(sign), kind, math.inf
    return bool(sign), kind, _fields_value(f, exp_field, man)


def _as_float(sign: bool, value) -> float:
    v = to_float(value)
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
    sign, value = read_number(x, exact)
    if f is E8M0:
        return _e8m0_bits(value)
    if not exact:
        value = _via_fp32(sign, value, f)
    if not isinstance(value, Fraction):
        return _special_bits(f, sign, value, x)
    fields = _nearest_fields(value, f)
    if fields is None:
        return _special_bits(f, sign, math.inf)
    return _pack(f, sign, *fields)


def _e8m0_bits(value) -> int:
    """torch's cast to float8_e8m0fnu, read off c10's Float8_e8m0fnu.h: the sign is dropped, the
    fp32 exponent field kept and rounded up when the mantissa is at least one half (a tie rounds
    down only from an fp32 subnormal); NaN, inf and a carry past 2^127 give 0xFF (NaN)."""
    fields = _nearest_fields(value, FP32) if isinstance(value, Fraction) else None
    if fields is None:
        return 0xFF
    exponent, man = fields
    guard, rest = man >> 22 & 1, man & ((1 << 22) - 1)
    return exponent + (guard and (rest > 0 or exponent > 0))


def round_to(x, precision, *, exact: bool = False) -> float:
    """The value x has after a cast to this format."""
    f = get_format(precision)
    return from_bits(to_bits(x, f, exact=exact), f)


def ulp(x, precision) -> float:
    """Spacing of the format's numbers around x: 2^(e − man_bits) with e = floor(log2|x|),
    clamped to the format's exponent range (so the subnormal spacing below the normals,
    the top binade's spacing above the largest finite). NaN for inf or NaN."""
    f = get_format(precision)
    _, value = read_number(x, True)
    if not isinstance(value, Fraction):
        return math.nan
    e = f.emin if value == 0 else min(max(_floor_log2(value.numerator, value.denominator), f.emin),
                                      f.emax)
    return float(_pow2(e - f.man_bits))


def _step(x, f: FloatFormat, up: bool) -> float:
    sign, value = read_number(x, True)
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
