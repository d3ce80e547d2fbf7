"""What a cast to a narrow format does to a tensor: what flushes to 0, what overflows.

    st = cast_stats(grad, "fp16", scale=2**10)    # counts: zero, underflow, subnormal, ...
    st.lost_frac                                  # share of the nonzero values flushed to 0
    mags = Magnitudes(grad)                       # sorted once: any format and scale is cheap
    sweep = scale_sweep(mags, "fp16")             # every loss scale 2^0 ... 2^24, shares of
                                                  # the nonzero values (as every share here)
    good_scale_window(sweep), largest_safe_scale(mags, "fp16")
    choose_scale(mags, "fp16", underflow_tol=0.05)  # the safe scale, the window, in words

Everything here is measured with torch's own casts, and the edges come from
:mod:`mplab.numerics.formats`' exact arithmetic, so the two agree to the bit. The rounding rules
every count follows (round to nearest, ties to even) are :class:`RoundingEdges`.

Every tensor is first taken as fp32 (``t.float()``: integer tensors are converted, which is
exact up to 2^24; bool and complex tensors are a TypeError), and a scale is taken as the
fp32 number torch multiplies by (``t.float() * scale`` rounds the scale to fp32 first).
Casts run on the CPU, where mplab.numerics.formats matches torch bit for bit.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
import torch

from mplab._display import Table
from mplab.numerics.formats import FloatFormat, floor_log2, get_format

__all__ = [
    "as_scale", "storage_format", "fp32_values", "scale_text", "RoundingEdges",
    "rounding_edges", "CastStats", "cast_stats", "combined", "Magnitudes", "magnitudes_of",
    "SCALES", "scale_sweep", "good_scale_window", "largest_safe_scale", "ScaleChoice",
    "choose_scale", "FixedScaleFit", "fixed_scale_fit",
]

#: Loss scales the lesson sweeps: 2^0 ... 2^24.
SCALES = tuple(2.0 ** k for k in range(25))

_STORAGE = "fp32, fp16, bf16, fp8_e4m3, fp8_e5m2"


# --- reading the inputs -------------------------------------------------------------------------

def storage_format(precision) -> FloatFormat:
    """The format of `precision`, which must be one torch can store a tensor in (tf32 is a
    matmul mode, not a dtype: a ValueError saying so)."""
    f = get_format(precision)
    if f.dtype() is None:
        raise ValueError(f"{f.name} is not a storage format (no torch dtype holds it), so "
                         f"nothing can be cast to it; accepted: {_STORAGE}")
    return f


def fp32_values(x, what: str = "values") -> torch.Tensor:
    """x as a flat fp32 CPU tensor (detached): a tensor, an array or a list of numbers.
    Integer tensors are converted; bool, complex and non-numbers are a TypeError naming
    `what`."""
    if isinstance(x, np.ndarray | list | tuple) or (
            isinstance(x, numbers.Real) and not isinstance(x, bool)):
        try:
            x = torch.as_tensor(np.asarray(x))
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"{what}: could not read {type(x).__name__} as numbers; pass a tensor "
                            "or a list of numbers") from None
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a tensor (or an array or list of numbers), got "
                        f"{type(x).__name__}")
    if x.dtype == torch.bool or x.is_complex():
        raise TypeError(f"{what} must hold real numbers, got a {x.dtype} tensor; accepted: float "
                        "tensors of any precision, and integer tensors (converted to fp32)")
    return x.detach().to("cpu", torch.float32).reshape(-1)


def as_scale(scale) -> float:
    """The number torch really multiplies an fp32 tensor by for this scale: the scale rounded to
    fp32. A ValueError unless that is a positive finite number (a TypeError for a non-number)."""
    if isinstance(scale, torch.Tensor) and scale.numel() == 1:
        scale = scale.item()
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a positive number such as 1.0 or 2**16, got {scale!r} of "
                        f"type {type(scale).__name__}")
    try:
        s = float(scale)
    except OverflowError:  # an int past every double, e.g. 2**2000
        s = math.inf
    if math.isfinite(s):
        with np.errstate(over="ignore"):
            s = float(np.float32(s))
    if not (0 < s < math.inf):
        raise ValueError(f"scale must be a positive finite number that fp32 can hold (2^-149 to "
                         f"about 3.4e38), such as 1.0 or 2**16; got {scale!r}")
    return s


def scale_text(s: float) -> str:
    """A scale as a reader wants it: "2^10" for a power of two, else the number."""
    m, e = math.frexp(s)
    return f"2^{e - 1}" if m == 0.5 else f"{s:g}"


# --- where a cast changes what it does ----------------------------------------------------------

@dataclass(frozen=True)
class RoundingEdges:
    """The rounding edges of a format on the magnitude v = |x·scale| (each exact as a double).

    Round to nearest, ties to even: ``v <= zero_max`` becomes 0 (exactly half the smallest
    subnormal ties to 0); ``v >= normal_min`` becomes a normal number or more (the largest
    subnormal has an odd mantissa, so that tie rounds up); ``v >= overflow_min`` overflows.
    Where the largest mantissa is even (fp8 e4m3, whose top is 448) the tie at overflow_min
    stays finite (``tie_up`` False): only v > 464 overflows, and torch saturates it to ±448.
    """

    zero_max: float
    normal_min: float
    overflow_min: float
    tie_up: bool

    def overflows(self, v: float) -> bool:
        return v > self.overflow_min or (self.tie_up and v == self.overflow_min)


def rounding_edges(precision) -> RoundingEdges:
    """Where a cast to the format flushes to 0, turns normal and overflows: half the smallest
    subnormal, the smallest normal less that, the largest finite plus half its ulp."""
    return _edges(get_format(precision))


@functools.cache
def _edges(f: FloatFormat) -> RoundingEdges:
    half_sub = f.min_subnormal / 2
    top_ulp = Fraction(2) ** (f.emax - f.man_bits)
    return RoundingEdges(float(half_sub), float(f.min_normal - half_sub),
                         float(f.max_finite + top_ulp / 2), bool(f.max_man_at_emax & 1))


# --- what a cast does to a tensor ---------------------------------------------------------------

@dataclass(frozen=True)
class CastStats:
    """What casting ``x * scale`` to a format did to each value of x (counts and fractions).

    Every value falls in exactly one class: ``zero`` (0 before the cast), ``underflow``
    (nonzero, 0 after), ``subnormal`` (nonzero after, below the smallest normal), ``normal``,
    ``overflow`` (finite before, past the largest finite after: ``overflow_to`` says whether
    that made ±inf, saturated at ±max as torch's fp8 e4m3 does, or NaN), ``inf`` and ``nan``
    (already so before the cast). The ``*_frac`` properties divide by ``count`` (all values);
    ``lost_frac`` and :meth:`of_nonzero` by ``nonzero``, the denominator the lesson's tables
    and figures use. For an empty tensor every count is 0 and every fraction is 0.0 (not NaN).

    ``mean_rel_error`` / ``max_rel_error``: |cast − v| / |v| over the kept values (subnormal
    and normal), where v is the fp32 value ``x * scale`` that was cast (each ratio rounded
    once to fp32, the mean summed in float64); 0.0 when none were kept, None when not computed
    (``Magnitudes.stats(..., rel_error=False)``).
    ``max_abs``: the largest finite |x| before scaling (0.0 when there is none).
    """

    precision: str
    scale: float
    count: int
    zero: int
    underflow: int
    subnormal: int
    normal: int
    overflow: int
    inf: int
    nan: int
    overflow_to: str
    mean_rel_error: float | None
    max_rel_error: float | None
    max_abs: float

    def _frac(self, n: int) -> float:
        return n / self.count if self.count else 0.0

    @property
    def zero_frac(self) -> float:
        return self._frac(self.zero)

    @property
    def underflow_frac(self) -> float:
        return self._frac(self.underflow)

    @property
    def subnormal_frac(self) -> float:
        return self._frac(self.subnormal)

    @property
    def normal_frac(self) -> float:
        return self._frac(self.normal)

    @property
    def overflow_frac(self) -> float:
        return self._frac(self.overflow)

    @property
    def inf_frac(self) -> float:
        return self._frac(self.inf)

    @property
    def nan_frac(self) -> float:
        return self._frac(self.nan)

    @property
    def kept(self) -> int:
        """Values that came through as nonzero finite numbers (subnormal + normal)."""
        return self.subnormal + self.normal

    @property
    def nonzero(self) -> int:
        """Finite nonzero values before the cast."""
        return self.underflow + self.subnormal + self.normal + self.overflow

    @property
    def lost_frac(self) -> float:
        """The share of the nonzero values that the cast flushed to 0 (the paper's measure:
        zeros that were zeros anyway are not lost); 0.0 when there are none."""
        return self.underflow / self.nonzero if self.nonzero else 0.0

    def of_nonzero(self, n: int) -> float:
        """n as a share of the nonzero values (0.0 when there are none): the denominator of
        every share this module reports except ``zero (of all)``."""
        return n / self.nonzero if self.nonzero else 0.0

    def nonzero_row(self) -> dict:
        """The nonzero values and the shares of them lost to 0, landing subnormal and
        overflowing, and the largest |x·scale|: what the cast did to the values that count.
        Each share's name says its denominator."""
        return {"nonzero": self.nonzero, "lost (of nonzero)": self.lost_frac,
                "subnormal (of nonzero)": self.of_nonzero(self.subnormal),
                "overflow (of nonzero)": self.of_nonzero(self.overflow),
                "max |x·scale|": self.max_abs * self.scale}

    def row(self) -> dict:
        """A table row: the values, the share of all of them that were 0 already, then the
        :meth:`nonzero_row` shares (of the nonzero values, the same ones the figures draw), the
        inf/NaN count, the relative errors of the kept values and the largest |x| before
        scaling."""
        shares = self.nonzero_row()
        del shares["max |x·scale|"]
        return {"values": self.count, "zero (of all)": self.zero_frac, **shares,
                "inf/NaN": self.inf + self.nan, "mean rel. error": self.mean_rel_error,
                "max rel. error": self.max_rel_error, "max |x|": self.max_abs}

    def __str__(self) -> str:
        to = {"inf": "→ ±inf", "saturate": "→ ±max", "nan": "→ NaN"}[self.overflow_to]
        rel = ("" if self.mean_rel_error is None else
               f"; relative error of the rest: mean {self.mean_rel_error:.3g}, "
               f"max {self.max_rel_error:.3g}")
        return (f"{self.count} values cast to {self.precision} at scale "
                f"{scale_text(self.scale)}: {self.zero_frac:.2%} of them zero already, "
                f"{self.inf + self.nan} inf/NaN already; of the {self.nonzero} nonzero: "
                f"{self.lost_frac:.2%} lost to 0, {self.of_nonzero(self.subnormal):.2%} "
                f"subnormal, {self.of_nonzero(self.overflow):.2%} overflow ({to}){rel}")


def combined(stats: list[CastStats], precision, scale) -> CastStats:
    """Several tensors' stats (all cast to one format at one scale) as one: counts summed,
    relative errors weighted by the kept values. An empty list gives all counts 0."""
    f, s = get_format(precision), as_scale(scale)
    counts = {k: sum(getattr(st, k) for st in stats)
              for k in ("count", "zero", "underflow", "subnormal", "normal", "overflow", "inf",
                        "nan")}
    if any(st.mean_rel_error is None for st in stats):
        mean = mx = None
    else:
        kept = sum(st.kept for st in stats)
        mean = sum(st.mean_rel_error * st.kept for st in stats) / kept if kept else 0.0
        mx = max((st.max_rel_error for st in stats), default=0.0)
    return CastStats(f.name, s, **counts, overflow_to=f.overflow, mean_rel_error=mean,
                     max_rel_error=mx, max_abs=max((st.max_abs for st in stats), default=0.0))


def _rel_errors(v: torch.Tensor, q: torch.Tensor) -> tuple[float, float]:
    """Mean and max of |q − v| / |v| (v nonzero fp32, q its cast back in fp32); zeros for none.

    q − v is exact in fp32 (q is v rounded, so within a factor of 2 of it) and the division
    rounds once; the mean adds up in float64. Done in numpy: on the 2-core lesson machines
    torch's elementwise ops took several times longer here (benchmarks/RECORDS.md).
    """
    if not v.numel():
        return 0.0, 0.0
    vn = v.numpy()
    rel = np.abs(q.numpy() - vn)
    rel /= np.abs(vn)
    return float(rel.sum(dtype=np.float64)) / rel.size, float(rel.max())


def cast_stats(tensor, precision, scale=1.0) -> CastStats:
    """Cast ``tensor.float() * scale`` to the format with torch and count what happened to
    each value.

    precision: "fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2" (or a FloatFormat / torch dtype).
    Integer tensors are converted to fp32 first; bool or complex tensors are a TypeError;
    an empty tensor gives all counts 0 and all fractions 0.0. Overflow in fp16, bf16, e5m2 and
    fp32 is read off the cast (it made ±inf); torch's e4m3 cast saturates, so there a value
    counts as overflowed when |x·scale| is past 464, the edge mplab.numerics.formats rounds
    beyond 448 at.
    """
    f = storage_format(precision)
    x = fp32_values(tensor, "tensor")
    s = as_scale(scale)
    v = x * torch.tensor(s, dtype=torch.float32)  # exactly what `x * s` does in torch
    q = v.to(f.dtype()).float()
    nan_in, inf_in = x.isnan(), x.isinf()
    nonzero = ~(nan_in | inf_in | (x == 0))
    under = nonzero & (q == 0)
    if f.overflow == "inf":
        over = nonzero & q.isinf()
    else:  # the cast saturates (or, by the other convention, makes NaN): read the edge
        e, va = rounding_edges(f), v.abs()
        past = (va >= e.overflow_min) if e.tie_up else (va > e.overflow_min)
        over = nonzero & past
    kept = nonzero & ~under & ~over
    sub = kept & (q.abs() < float(f.min_normal))
    mean, mx = _rel_errors(v[kept].contiguous(), q[kept].contiguous())
    finite = x[~(nan_in | inf_in)]
    n_sub, n_kept = int(sub.sum()), int(kept.sum())
    return CastStats(
        f.name, s, count=x.numel(), zero=int((x == 0).sum()), underflow=int(under.sum()),
        subnormal=n_sub, normal=n_kept - n_sub, overflow=int(over.sum()), inf=int(inf_in.sum()),
        nan=int(nan_in.sum()), overflow_to=f.overflow, mean_rel_error=mean, max_rel_error=mx,
        max_abs=finite.abs().max().item() if finite.numel() else 0.0)


# --- sorted magnitudes: the fast path ----------------------------------------------------------

class Magnitudes:
    """The magnitudes of a tensor's finite nonzero values, sorted once (fp32), plus counts of
    zeros, infs and NaNs: everything a cast's outcome depends on.

    After the sort (once, benchmarks/RECORDS.md) :meth:`stats` for any format and scale
    is three binary searches, exact: it finds where ``fl32(|x|·scale)`` crosses the format's
    rounding edges, so it agrees count for count with :func:`cast_stats`, which really casts.
    Only the relative errors need the kept values cast (``rel_error=True``, one pass).
    """

    def __init__(self, tensor):
        x = fp32_values(tensor, "tensor")
        a = np.sort(x.abs().numpy())  # zeros first, then finite values, inf, NaN last
        self.count = int(a.size)
        self.zero = int(np.searchsorted(a, 0.0, side="right"))
        finite_end = int(np.searchsorted(a, np.float32(np.inf), side="left"))
        inf_end = int(np.searchsorted(a, np.float32(np.inf), side="right"))
        self.inf = inf_end - finite_end
        self.nan = self.count - inf_end
        #: The sorted magnitudes of the finite nonzero values (float32, ascending).
        self.values = a[self.zero:finite_end]

    @property
    def max_abs(self) -> float:
        return float(self.values[-1]) if self.values.size else 0.0

    @property
    def min_abs(self) -> float:
        """The smallest finite nonzero magnitude (0.0 when there is none)."""
        return float(self.values[0]) if self.values.size else 0.0

    def __len__(self) -> int:
        return self.count

    def __repr__(self) -> str:
        return (f"Magnitudes({self.count} values: {self.values.size} finite nonzero, "
                f"{self.zero} zero, {self.inf} inf, {self.nan} NaN)")

    def _first(self, s: float, crossed: Callable[[float], bool]) -> int:
        """Index of the first value whose fl32(|x|·s) has crossed (crossed is monotone)."""
        v, s32 = self.values, np.float32(s)
        lo, hi = 0, v.size
        with np.errstate(over="ignore", under="ignore"):
            while lo < hi:
                mid = (lo + hi) // 2
                if crossed(float(v[mid] * s32)):
                    hi = mid
                else:
                    lo = mid + 1
        return lo

    def stats(self, precision, scale=1.0, *, rel_error: bool = True) -> CastStats:
        """The same record :func:`cast_stats` gives, from the sorted magnitudes.

        rel_error=False skips the one pass that casts the kept values (the errors are then None).
        """
        f = storage_format(precision)
        s = as_scale(scale)
        e = rounding_edges(f)
        i_sub = self._first(s, lambda p: p > e.zero_max)
        i_normal = self._first(s, lambda p: p >= e.normal_min)
        i_over = self._first(s, e.overflows)
        mean = mx = None
        if rel_error:
            with np.errstate(over="ignore", under="ignore"):
                v = torch.from_numpy(self.values[i_sub:i_over] * np.float32(s))
            mean, mx = _rel_errors(v, v.to(f.dtype()).float())
        return CastStats(
            f.name, s, count=self.count, zero=self.zero, underflow=i_sub,
            subnormal=i_normal - i_sub, normal=i_over - i_normal,
            overflow=self.values.size - i_over, inf=self.inf, nan=self.nan,
            overflow_to=f.overflow, mean_rel_error=mean, max_rel_error=mx, max_abs=self.max_abs)


def magnitudes_of(x, what: str = "tensors") -> list[Magnitudes]:
    """A tensor, a Magnitudes, or a list/tuple/dict of them, as a list of Magnitudes
    (a list of plain numbers is one tensor)."""
    if isinstance(x, Magnitudes):
        return [x]
    if isinstance(x, Mapping):
        items = list(x.values())
    elif isinstance(x, list | tuple) and x and not all(
            isinstance(v, numbers.Real) and not isinstance(v, bool) for v in x):
        items = list(x)
    else:
        return [Magnitudes(fp32_values(x, what))]
    return [v if isinstance(v, Magnitudes) else Magnitudes(fp32_values(v, what)) for v in items]


# --- choosing a loss scale ---------------------------------------------------------------------

def scale_sweep(tensors, precision="fp16", scales=None) -> Table:
    """For each scale (default 2^0 ... 2^24): the shares of the nonzero values lost to 0,
    landing subnormal and overflowing when ``x * scale`` is cast to the format (the same
    denominator as :meth:`CastStats.nonzero_row` and the histograms' summaries), and the
    largest |x·scale|.

    tensors: a tensor, a list or dict of tensors, or :class:`Magnitudes` (sorted once, then
    each scale costs a few binary searches). The lost share never rises and the overflow share
    never falls as the scale grows.
    """
    f = storage_format(precision)
    parts = magnitudes_of(tensors)
    scales = SCALES if scales is None else list(scales)
    if not scales:
        raise ValueError("scales is empty; pass positive numbers such as [2.0**k for k in "
                         "range(25)], or None for that default")
    rows = []
    for scale in scales:
        s = as_scale(scale)
        st = combined([p.stats(f, s, rel_error=False) for p in parts], f, s)
        rows.append({"scale": s, "log2 scale": math.log2(s), **st.nonzero_row()})
    n = rows[0]["nonzero"]
    return Table(rows, title=f"Scale sweep: shares of the {n:,} nonzero values cast to {f.name}")


#: The columns of a :func:`scale_sweep` that :func:`good_scale_window` reads.
_LOST, _OVER = "lost (of nonzero)", "overflow (of nonzero)"


def good_scale_window(sweep, underflow_tol: float = 1e-3,
                      overflow_tol: float = 0.0) -> tuple[float, float] | None:
    """(lowest, highest) scale of a :func:`scale_sweep` that loses at most underflow_tol of
    the nonzero values to 0 and overflows at most overflow_tol of them (0: none at all);
    None when no scale in the sweep is good. Both are shares of the nonzero values, the
    sweep's own denominator."""
    rows = list(sweep)
    if not rows or not all(isinstance(r, Mapping) and {"scale", _LOST, _OVER} <= set(r)
                           for r in rows):
        raise ValueError(f"good_scale_window takes the table scale_sweep returns (rows with "
                         f"'scale', {_LOST!r} and {_OVER!r})")
    for name, tol in (("underflow_tol", underflow_tol), ("overflow_tol", overflow_tol)):
        if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not 0 <= tol <= 1:
            raise ValueError(f"{name} is a share of the nonzero values, from 0 to 1, got {tol!r}")
    good = [r["scale"] for r in rows if r[_LOST] <= underflow_tol and r[_OVER] <= overflow_tol]
    return (min(good), max(good)) if good else None


def largest_safe_scale(tensors, precision="fp16") -> float:
    """The largest power of two s with s · max|x| ≤ the format's largest finite number
    (over the finite values; inf when all are zero), capped at 2^127, the largest power of two
    an fp32 scale can be. Below 1 when the values already overflow."""
    f = storage_format(precision)
    top = max(p.max_abs for p in magnitudes_of(tensors))
    if top == 0:
        return math.inf
    return math.ldexp(1.0, min(floor_log2(f.max_finite / Fraction(top)), 127))


# --- the choice, decided and said --------------------------------------------------------------

@dataclass(frozen=True)
class ScaleChoice:
    """What loss scale a set of gradients allows in a format (:func:`choose_scale`).

    ``safe_scale`` is :func:`largest_safe_scale`; ``safe_loses`` whether it still flushes
    nonzero values to 0: ``lost_at_safe`` of them, every |x| up to ``flushed_up_to``,
    ``binades_below`` binades under the largest |x| (``max_abs``). ``window`` is
    :func:`good_scale_window` of ``sweep`` at ``underflow_tol`` (None: no scale loses that
    little without overflowing). ``lost_unscaled``: the share flushed at scale 1. Every share
    is of the nonzero values. Printed, the two decisions in words.
    """

    precision: str
    underflow_tol: float
    lost_unscaled: float
    max_abs: float
    safe_scale: float
    lost_at_safe: float
    flushed_up_to: float
    safe_loses: bool
    window: tuple[float, float] | None
    sweep: Table = field(repr=False, compare=False)

    @property
    def binades_below(self) -> float:
        """log2(max_abs / flushed_up_to): how far under the largest |x| the losses reach."""
        return math.log2(self.max_abs / self.flushed_up_to) if self.flushed_up_to else 0.0

    def __str__(self) -> str:
        safe = f"The largest scale that overflows nothing is {scale_text(self.safe_scale)}: "
        safe += (f"it still loses {self.lost_at_safe:.1%}, every gradient up to "
                 f"{self.flushed_up_to:.1g}, {self.binades_below:.0f} binades below the largest."
                 if self.safe_loses else "it loses nothing.")
        tol = f"{self.underflow_tol:.0%}"
        if self.window is None:
            return (f"{safe}\nNo scale loses at most {tol} without overflowing: these gradients "
                    f"span more binades than {self.precision} has.")
        low, high = map(scale_text, self.window)
        return f"{safe}\nScales from {low} to {high} lose at most {tol} and overflow nothing."


def _lost(parts: list[Magnitudes], f: FloatFormat, scale: float) -> float:
    return combined([p.stats(f, scale, rel_error=False) for p in parts], f, scale).lost_frac


def choose_scale(tensors, precision="fp16", underflow_tol: float = 1e-3,
                 scales=None) -> ScaleChoice:
    """The loss scale these tensors allow (a tensor, a list or dict of them, or Magnitudes):
    the :func:`scale_sweep` over ``scales``, its :func:`good_scale_window` at ``underflow_tol``
    (overflowing nothing), the :func:`largest_safe_scale` and what it still loses to 0."""
    f = storage_format(precision)
    parts = magnitudes_of(tensors)
    sweep = scale_sweep(parts, f, scales)
    window = good_scale_window(sweep, underflow_tol=underflow_tol)
    safe = largest_safe_scale(parts, f)
    finite = math.isfinite(safe)  # inf: every value is 0, nothing to lose
    lost = _lost(parts, f, safe) if finite else 0.0
    return ScaleChoice(f.name, underflow_tol, _lost(parts, f, 1.0),
                       max(p.max_abs for p in parts), safe, lost,
                       rounding_edges(f).zero_max / safe if finite else 0.0, lost > 0, window,
                       sweep)


@dataclass(frozen=True)
class FixedScaleFit:
    """A loss scale fixed once, safe on the gradients at the start, against later gradients
    (:func:`fixed_scale_fit`): ``overflows`` whether it overflows any of them, ``overflow`` how
    many. ``when`` and ``what`` name the later values ("after 150 steps", "activation
    gradients"). Printed, the decision in words."""

    precision: str
    scale: float
    overflow: int
    overflows: bool
    when: str
    what: str

    def __str__(self) -> str:
        scale = scale_text(self.scale)
        if self.overflows:
            return (f"The scale that was safe at the start, {scale}, overflows {self.overflow:,} "
                    f"{self.what} {self.when}.")
        return (f"Here the scale from the start, {scale}, still fits {self.when}; a longer run's "
                "gradients may grow past it.")


def fixed_scale_fit(later: CastStats, when: str = "later",
                    what: str = "gradients") -> FixedScaleFit:
    """Whether a fixed scale still fits, from the later gradients' :func:`cast_stats` at it
    (``cast_stats(later_grads, "fp16", scale)``): it does while nothing overflows."""
    if not isinstance(later, CastStats):
        raise TypeError(f"fixed_scale_fit takes the CastStats of the later values at the fixed "
                        f"scale (cast_stats(values, precision, scale)), got "
                        f"{type(later).__name__}")
    return FixedScaleFit(later.precision, later.scale, later.overflow, later.overflow > 0,
                         when, what)
