"""Underflow, overflow and swamping: what a cast to a narrow format does to real tensors.

Lesson 2's library. Everything here is measured with torch's own casts, and the thresholds
come from :mod:`mplab.formats`, so the two agree to the bit:

- :func:`cast_stats` casts a tensor (times a loss scale) and counts what happened to it:
  already zero, underflowed to 0, landed among the subnormals, kept, overflowed.
- :func:`capture` runs one fp32 training step and keeps each layer's activations, the
  gradients flowing back into them, and the weight gradients: the values a cast would hit.
- :class:`Magnitudes` sorts a tensor's magnitudes once; after that the same counts for any
  format and scale cost a few binary searches (:meth:`Magnitudes.stats`), and exponent
  histograms (:func:`exponent_histogram`) are a few searches too. A loss scale is a shift of
  log2|x|; :func:`format_bands` gives the log2 edges where each format flushes, goes
  subnormal and overflows.
- :func:`scale_sweep`, :func:`good_scale_window` and :func:`largest_safe_scale` pick a loss scale.
- :func:`swamping_run`, :func:`running_sum` and :func:`swamp_threshold` show an update (or an
  addend) vanishing next to a big number, and why fp32 master weights fix it.
- :func:`overflow_demo` makes a feed-forward activation outgrow fp16 (66,246 > 65,504, as in
  T5) and follows the inf as it turns into NaN downstream; bf16 stays finite.

Rounding rules every count here follows (round to nearest, ties to even), for ``v = |x·scale|``
in fp32: ``v <= min_subnormal/2`` becomes 0 (exactly half the smallest subnormal ties to 0);
``v >= min_normal - min_subnormal/2`` becomes a normal number (the largest subnormal has an
odd mantissa, so that tie rounds up); ``v >= max_finite + ulp/2`` overflows (for fp8 e4m3,
whose largest mantissa is even, that tie stays at 448, so only ``v > 464`` overflows; torch
then saturates to ±448).

Every tensor is first taken as fp32 (``t.float()``: integer tensors are converted, which is
exact up to 2^24; bool and complex tensors are a TypeError), and a scale is taken as the
fp32 number torch multiplies by (``t.float() * scale`` rounds the scale to fp32 first).
Casts run on the CPU, where mplab.formats matches torch bit for bit.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from functools import cache

import numpy as np
import torch
from torch import nn

from mplab._display import Table
from mplab.formats import FloatFormat, floor_log2, get_format

__all__ = [
    "as_scale", "CastStats", "cast_stats", "Magnitudes", "Capture", "capture", "KINDS",
    "ExponentHistogram", "exponent_histogram", "Band", "format_bands", "DEFAULT_BINS",
    "lesson_capture", "SCALES", "scale_sweep", "good_scale_window", "largest_safe_scale",
    "SwampRun", "swamping_run", "RunningSum", "running_sum", "swamp_threshold",
    "OverflowDemo", "StageRecord", "overflow_demo",
]

#: Loss scales the lesson sweeps: 2^0 ... 2^24.
SCALES = tuple(2.0 ** k for k in range(25))
#: log2 edges of the default exponent histogram: bins [2^-60, 2^-59) ... [2^18, 2^19).
DEFAULT_BINS = range(-60, 20)
#: What :func:`capture` records, and the names :meth:`Capture.table` and friends accept.
KINDS = ("activations", "activation_grads", "weight_grads")

_STORAGE = "fp32, fp16, bf16, fp8_e4m3, fp8_e5m2"


# --- inputs ------------------------------------------------------------------------------------

def _storage_format(fmt) -> FloatFormat:
    """A format torch can store a tensor in (tf32 is a matmul mode, not a dtype)."""
    f = get_format(fmt)
    if f.dtype() is None:
        raise ValueError(f"{f.name} is not a storage format (no torch dtype holds it), so "
                         f"nothing can be cast to it; accepted: {_STORAGE}")
    return f


def _fp32_values(x, what: str = "values") -> torch.Tensor:
    """x as a flat fp32 CPU tensor (detached). Integer tensors are converted; bool, complex and
    non-numbers are a TypeError."""
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
    return _scale32(scale)


def _scale32(scale) -> float:
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


@dataclass(frozen=True)
class _Edges:
    """Rounding edges of a format on the magnitude v = |x·scale| (exact as doubles)."""

    zero_max: float      # v <= zero_max rounds to 0
    normal_min: float    # v >= normal_min rounds to a normal number (or beyond)
    overflow_min: float  # v >= overflow_min overflows (v > overflow_min when tie_up is False)
    tie_up: bool

    def overflows(self, v: float) -> bool:
        return v > self.overflow_min or (self.tie_up and v == self.overflow_min)


@cache
def _edges(f: FloatFormat) -> _Edges:
    half_sub = f.min_subnormal / 2
    top_ulp = Fraction(2) ** (f.emax - f.man_bits)
    return _Edges(float(half_sub), float(f.min_normal - half_sub),
                  float(f.max_finite + top_ulp / 2), bool(f.max_man_at_emax & 1))


# --- what a cast does to a tensor ---------------------------------------------------------------

@dataclass(frozen=True)
class CastStats:
    """What casting ``x * scale`` to a format did to each value of x (counts and fractions).

    Every value falls in exactly one class: ``zero`` (0 before the cast), ``underflow``
    (nonzero, 0 after), ``subnormal`` (nonzero after, below the smallest normal), ``normal``,
    ``overflow`` (finite before, past the largest finite after: ``overflow_to`` says whether
    that made ±inf, saturated at ±max as torch's fp8 e4m3 does, or NaN), ``inf`` and ``nan``
    (already so before the cast). The ``*_frac`` properties divide by ``count``; for an empty
    tensor every count is 0 and every fraction is 0.0 (not NaN).

    ``mean_rel_error`` / ``max_rel_error``: |cast − v| / |v| over the kept values (subnormal
    and normal), where v is the fp32 value ``x * scale`` that was cast (each ratio rounded
    once to fp32, the mean summed in float64); 0.0 when none were kept, None when not computed
    (``Magnitudes.stats(..., rel_error=False)``).
    ``max_abs``: the largest finite |x| before scaling (0.0 when there is none).
    """

    fmt: str
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

    def row(self) -> dict:
        """The counts as fractions of all values, for a table row."""
        return {"values": self.count, "zero": self.zero_frac, "underflow": self.underflow_frac,
                "lost (of nonzero)": self.lost_frac,
                "subnormal": self.subnormal_frac, "overflow": self.overflow_frac,
                "inf/NaN": self.inf + self.nan, "mean rel. error": self.mean_rel_error,
                "max rel. error": self.max_rel_error, "max |x|": self.max_abs}

    def __str__(self) -> str:
        to = {"inf": "→ ±inf", "saturate": "→ ±max", "nan": "→ NaN"}[self.overflow_to]
        rel = ("" if self.mean_rel_error is None else
               f"; relative error of the rest: mean {self.mean_rel_error:.3g}, "
               f"max {self.max_rel_error:.3g}")
        return (f"{self.count} values cast to {self.fmt} at scale {_scale_text(self.scale)}: "
                f"{self.zero_frac:.2%} zero already, {self.underflow_frac:.2%} underflow to 0, "
                f"{self.subnormal_frac:.2%} subnormal, {self.overflow_frac:.2%} overflow ({to}), "
                f"{self.inf + self.nan} inf/NaN already{rel}")


def _scale_text(s: float) -> str:
    m, e = math.frexp(s)
    return f"2^{e - 1}" if m == 0.5 else f"{s:g}"


def _total(stats: list[CastStats], fmt: FloatFormat, scale: float) -> CastStats:
    """Several tensors' stats as one (counts summed, relative errors weighted by kept values)."""
    counts = {k: sum(getattr(s, k) for s in stats)
              for k in ("count", "zero", "underflow", "subnormal", "normal", "overflow", "inf",
                        "nan")}
    if any(s.mean_rel_error is None for s in stats):
        mean = mx = None
    else:
        kept = sum(s.kept for s in stats)
        mean = sum(s.mean_rel_error * s.kept for s in stats) / kept if kept else 0.0
        mx = max((s.max_rel_error for s in stats), default=0.0)
    return CastStats(fmt.name, scale, **counts, overflow_to=fmt.overflow, mean_rel_error=mean,
                     max_rel_error=mx, max_abs=max((s.max_abs for s in stats), default=0.0))


def _rel_errors(v: torch.Tensor, q: torch.Tensor) -> tuple[float, float]:
    """Mean and max of |q − v| / |v| (v nonzero fp32, q its cast back in fp32); zeros for none.

    q − v is exact in fp32 (q is v rounded, so within a factor of 2 of it) and the division
    rounds once; the mean adds up in float64. Done in numpy: on the 2-core lesson machines
    torch's elementwise ops took ~4x longer here (5 M values: ~1 s vs ~0.25 s).
    """
    if not v.numel():
        return 0.0, 0.0
    vn = v.numpy()
    rel = np.abs(q.numpy() - vn)
    rel /= np.abs(vn)
    return float(rel.sum(dtype=np.float64)) / rel.size, float(rel.max())


def cast_stats(tensor, fmt, scale=1.0) -> CastStats:
    """Cast ``tensor.float() * scale`` to fmt with torch and count what happened to each value.

    fmt: "fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2" (or a FloatFormat / torch dtype).
    Integer tensors are converted to fp32 first; bool or complex tensors are a TypeError;
    an empty tensor gives all counts 0 and all fractions 0.0. Overflow in fp16, bf16, e5m2 and
    fp32 is read off the cast (it made ±inf); torch's e4m3 cast saturates, so there a value
    counts as overflowed when |x·scale| is past 464, the edge mplab.formats rounds beyond 448 at.
    """
    f = _storage_format(fmt)
    x = _fp32_values(tensor, "tensor")
    s = _scale32(scale)
    v = x * torch.tensor(s, dtype=torch.float32)  # exactly what `x * s` does in torch
    q = v.to(f.dtype()).float()
    nan_in, inf_in = x.isnan(), x.isinf()
    nonzero = ~(nan_in | inf_in | (x == 0))
    under = nonzero & (q == 0)
    if f.overflow == "inf":
        over = nonzero & q.isinf()
    else:  # the cast saturates (or, by the other convention, makes NaN): read the edge
        e, va = _edges(f), v.abs()
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

    After the sort (about 0.1 s per 5 million values) :meth:`stats` for any format and scale
    is three binary searches, exact: it finds where ``fl32(|x|·scale)`` crosses the format's
    rounding edges, so it agrees count for count with :func:`cast_stats`, which really casts.
    Only the relative errors need the kept values cast (``rel_error=True``, one pass).
    """

    def __init__(self, tensor):
        x = _fp32_values(tensor, "tensor")
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

    def stats(self, fmt, scale=1.0, *, rel_error: bool = True) -> CastStats:
        """The same record :func:`cast_stats` gives, from the sorted magnitudes.

        rel_error=False skips the one pass that casts the kept values (the errors are then None).
        """
        f = _storage_format(fmt)
        s = _scale32(scale)
        e = _edges(f)
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

    def histogram(self, bins=DEFAULT_BINS) -> ExponentHistogram:
        """Counts of log2|x| per bin [2^e_k, 2^e_k+1), by searching the powers of two."""
        edges = _bin_edges(bins)
        powers = np.array([2.0 ** int(min(max(k, -200), 200)) for k in edges]).astype(np.float32)
        idx = np.searchsorted(self.values, powers, side="left")
        return ExponentHistogram(np.diff(idx).astype(np.int64), edges, zeros=self.zero,
                                 below=int(idx[0]), above=int(self.values.size - idx[-1]),
                                 inf=self.inf, nan=self.nan)


def _parts(x, what: str = "tensors") -> list[Magnitudes]:
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
        return [Magnitudes(_fp32_values(x, what))]
    return [v if isinstance(v, Magnitudes) else Magnitudes(_fp32_values(v, what)) for v in items]


# --- exponent histograms and format bands ------------------------------------------------------

def _bin_edges(bins) -> np.ndarray:
    try:
        edges = [int(b) for b in bins]
        ok = all(float(b) == e for b, e in zip(bins, edges))
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok or len(edges) < 2 or any(b >= c for b, c in zip(edges, edges[1:])):
        raise ValueError(f"bins must be at least two increasing integers, the log2 edges of the "
                         f"bins, e.g. range(-60, 20); got {bins!r}")
    return np.array(edges, dtype=np.int64)


@dataclass(eq=False)  # holds arrays: compare fields, not records
class ExponentHistogram:
    """How many values have log2|x| in each bin [edges[k], edges[k+1]) (finite nonzero values).

    Unpacks as ``counts, edges = exponent_histogram(t)``. Values outside the bins are counted
    in ``below`` / ``above``; ``zeros``, ``inf`` and ``nan`` are counted separately.
    A loss scale s moves every value log2(s) bins right: plot ``edges + log2(s)``.
    """

    counts: np.ndarray
    edges: np.ndarray
    zeros: int = 0
    below: int = 0
    above: int = 0
    inf: int = 0
    nan: int = 0

    def __iter__(self):
        return iter((self.counts, self.edges))

    @property
    def nonzero(self) -> int:
        """Finite nonzero values, in the bins or outside them."""
        return int(self.counts.sum()) + self.below + self.above

    @property
    def total(self) -> int:
        return self.nonzero + self.zeros + self.inf + self.nan

    def __add__(self, other: ExponentHistogram) -> ExponentHistogram:
        if not np.array_equal(self.edges, other.edges):
            raise ValueError("only histograms with the same bins add up")
        return ExponentHistogram(self.counts + other.counts, self.edges,
                                 *(getattr(self, k) + getattr(other, k)
                                   for k in ("zeros", "below", "above", "inf", "nan")))


def exponent_histogram(tensor_or_tensors, bins=DEFAULT_BINS) -> ExponentHistogram:
    """Histogram of log2|x| over the finite nonzero values of one or more tensors
    (or precomputed :class:`Magnitudes`), with integer log2 edges; zeros counted apart.

        counts, edges = exponent_histogram(grad)   # counts[k]: values in [2^edges[k], 2^edges[k+1])
    """
    parts = _parts(tensor_or_tensors)
    hist = parts[0].histogram(bins)
    for p in parts[1:]:
        hist = hist + p.histogram(bins)
    return hist


@dataclass(frozen=True)
class Band:
    """A stretch of magnitudes a format treats alike, as log2 edges [lo, hi) of |x|.

    lo_value / hi_value are the magnitudes themselves; ``rule`` says how the edges round.
    """

    name: str   # "zero" (flushed), "subnormal", "normal", "overflow"
    label: str
    lo: float
    hi: float
    lo_value: float
    hi_value: float
    rule: str


def format_bands(fmt, scale=1.0) -> list[Band]:
    """Where a cast of ``x * scale`` flushes to zero, goes subnormal, stays normal, overflows:
    four bands of log2|x| (with scale 1: of the value that is cast).

    A scale s moves every edge down by log2(s): values that were flushed now land in range.
    The edges are the exact rounding edges, not the powers of two: a value just above half
    the smallest subnormal rounds *up* to it, so the zero band ends at log2(min_subnormal) − 1.
    """
    f = get_format(fmt)
    s = _scale32(scale)
    e = _edges(f)
    shift = math.log2(s)
    over = {"inf": "→ ±inf", "saturate": f"→ ±{float(f.max_finite):g}",
            "nan": "→ NaN"}[f.overflow]
    tie = "≥" if e.tie_up else ">"
    spec = [
        ("zero", "→ 0", 0.0, e.zero_max,
         f"|x·s| ≤ {e.zero_max:.4g} (half the smallest subnormal; the tie goes to 0)"),
        ("subnormal", "subnormal", e.zero_max, e.normal_min,
         "rounds to a subnormal: fewer significant bits the smaller it is"),
        ("normal", "normal", e.normal_min, e.overflow_min,
         f"full precision: {f.man_bits + 1} significant bits"),
        ("overflow", over, e.overflow_min, math.inf,
         f"|x·s| {tie} {e.overflow_min:.6g} (largest finite + half an ulp) overflows"),
    ]
    bands = []
    for name, label, lo, hi, rule in spec:
        lo2 = math.log2(lo) - shift if lo > 0 else -math.inf
        hi2 = math.log2(hi) - shift if hi < math.inf else math.inf
        bands.append(Band(name, label, lo2, hi2, lo / s, hi / s, rule))
    return bands


# --- capture from a real training step ---------------------------------------------------------

def _default_loss(model: nn.Module, batch):
    if isinstance(batch, Mapping):
        out = model(**batch)
        loss = getattr(out, "loss", None)
        if loss is None and isinstance(out, Mapping):
            loss = out.get("loss")
        if loss is None:
            raise ValueError("model(**batch) returned no loss: put the labels in the batch "
                             "(a Hugging Face model computes .loss when given labels=...) or pass "
                             "loss_fn=lambda model, batch: ...")
        return loss
    return model(batch)


def _scalar_loss(loss) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        what = (f"a tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}"
                if isinstance(loss, torch.Tensor) else f"{type(loss).__name__}")
        raise ValueError(f"the loss must be a scalar float tensor, got {what}; pass "
                         "loss_fn=lambda model, batch: <scalar loss>, e.g. "
                         "torch.nn.functional.mse_loss(model(x), y)")
    if not loss.requires_grad:
        raise ValueError("the loss does not require grad: no parameter took part in computing "
                         "it (are they frozen, or did loss_fn run under torch.no_grad()?)")
    return loss.reshape(())


def _select_layers(model: nn.Module, layers) -> list[tuple[str, nn.Module]]:
    named = list(model.named_modules())
    if layers is None:
        chosen = [(n, m) for n, m in named if next(m.parameters(recurse=False), None) is not None]
    elif isinstance(layers, type) or (isinstance(layers, tuple) and layers
                                      and all(isinstance(t, type) for t in layers)):
        chosen = [(n, m) for n, m in named if isinstance(m, layers)]
    elif callable(layers):
        chosen = [(n, m) for n, m in named if layers(n, m)]
    else:
        wanted = [layers] if isinstance(layers, str) else list(layers)
        by_name = dict(named)
        unknown = [w for w in wanted if w not in by_name]
        if unknown:
            some = [n for n, _ in named if n][:8]
            raise ValueError(f"no module named {unknown[0]!r} in the model; accepted: names from "
                             f"model.named_modules(), e.g. {some}")
        chosen = [(w, by_name[w]) for w in wanted]
    if not chosen:
        raise ValueError(f"layers={layers!r} selected no module; pass None (every module that "
                         "owns parameters), a list of names, module types, or a predicate "
                         "(name, module) -> bool")
    return [(n or "(model)", m) for n, m in chosen]


def _first_tensor(output):
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, list | tuple) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float32, copy=True)


@dataclass(eq=False)  # holds arrays: compare fields, not records
class Capture:
    """The values one fp32 training step produced, per layer, as detached fp32 CPU copies.

    activations:      module name -> its output (the first tensor, if it returns a tuple)
    activation_grads: module name -> d loss / d output (same keys, forward order; missing for
                      outputs that need no gradient)
    weight_grads:     parameter name -> its .grad (parameters of the captured modules)
    loss:             the step's loss
    layer_types:      module name -> class name

    A module run twice in one step is recorded as "name", "name (call 2)", ...
    """

    activations: dict[str, torch.Tensor]
    activation_grads: dict[str, torch.Tensor]
    weight_grads: dict[str, torch.Tensor]
    loss: float
    layer_types: dict[str, str]
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def tensors(self, kind: str = "weight_grads") -> dict[str, torch.Tensor]:
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r}; accepted: " + ", ".join(map(repr, KINDS)))
        return getattr(self, kind)

    def all(self, kind: str = "weight_grads") -> torch.Tensor:
        """Every value of one kind in one flat fp32 tensor."""
        ts = [t.reshape(-1) for t in self.tensors(kind).values()]
        return torch.cat(ts) if ts else torch.empty(0)

    def magnitudes(self, kind: str = "weight_grads") -> dict[str, Magnitudes]:
        """name -> :class:`Magnitudes`, sorted once and kept (the fast path for every scale)."""
        key = ("magnitudes", kind)
        if key not in self._cache:
            self._cache[key] = {n: Magnitudes(t) for n, t in self.tensors(kind).items()}
        return self._cache[key]

    def stats(self, fmt="fp16", scale=1.0, kind: str = "weight_grads", *,
              rel_error: bool = True) -> dict[str, CastStats]:
        """name -> :class:`CastStats` of casting that tensor times scale to fmt."""
        return {n: m.stats(fmt, scale, rel_error=rel_error)
                for n, m in self.magnitudes(kind).items()}

    def histograms(self, kind: str = "weight_grads", bins=DEFAULT_BINS
                   ) -> dict[str, ExponentHistogram]:
        """name -> :class:`ExponentHistogram` of log2|x|."""
        return {n: m.histogram(bins) for n, m in self.magnitudes(kind).items()}

    def table(self, fmt="fp16", scale=1.0, kind: str = "weight_grads", *,
              rel_error: bool = True) -> Table:
        """One row per tensor, and a last row "(all)": fractions of its values that are zero,
        underflow, land subnormal, overflow; relative error of the rest; largest |x|."""
        f = _storage_format(fmt)
        s = _scale32(scale)
        stats = self.stats(f, s, kind, rel_error=rel_error)
        rows = [{"name": n, "type": self._type_of(n, kind), **st.row()} for n, st in stats.items()]
        total = _total(list(stats.values()), f, s)
        rows.append({"name": "(all)", "type": "", **total.row()})
        to = {"inf": "±inf", "saturate": "±max", "nan": "NaN"}[f.overflow]
        return Table(rows, title=f"{kind} cast to {f.name} at scale {_scale_text(s)} "
                                 f"(fractions of each tensor's values; overflow → {to})")

    def _type_of(self, name: str, kind: str) -> str:
        module = name.rsplit(".", 1)[0] if kind == "weight_grads" else name.split(" (call")[0]
        return self.layer_types.get(module, "")

    def __repr__(self) -> str:
        n = sum(t.numel() for k in KINDS for t in self.tensors(k).values())
        return (f"Capture(loss={self.loss:.6g}; {len(self.activations)} activations, "
                f"{len(self.activation_grads)} activation grads, {len(self.weight_grads)} weight "
                f"grads; {n:,} values)")


def capture(model: nn.Module, batch, loss_fn=None, layers=None) -> Capture:
    """Run ONE forward and backward pass in fp32 and keep what each layer produced.

    model:   any nn.Module whose floating parameters are fp32 (this is the fp32 reference).
    batch:   what the model eats. loss_fn(model, batch) -> scalar loss; by default
             ``model(**batch).loss`` for a dict (Hugging Face style, labels in the batch),
             otherwise ``model(batch)``, which must then be a scalar.
    layers:  which modules to record: None (every module that owns parameters: Linear,
             Embedding, LayerNorm, ...), a list of names from model.named_modules(), a module
             type (or tuple of types), or a predicate (name, module) -> bool.

    The step runs with autocast off and grad on, in whatever mode the model is in (call
    model.train() first for dropout). The caller's model is left as it was: existing .grad
    tensors are set aside before the step and put back after it, hooks are removed, and no
    optimizer step is taken; all of this also when the step raises.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function (model, batch) -> loss, got {loss_fn!r}")
    low = sorted({str(p.dtype) for p in model.parameters()
                  if p.is_floating_point() and p.dtype != torch.float32})
    if low:
        raise ValueError(f"capture records the fp32 reference step, but the model has "
                         f"{', '.join(low)} parameters; call model.float() first")
    chosen = _select_layers(model, layers)
    params = list(model.parameters())
    saved = [p.grad for p in params]
    activations: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    calls: dict[str, int] = {}
    handles = []

    def forward_hook(name):
        def hook(module, inputs, output):
            t = _first_tensor(output)
            if t is None or not t.is_floating_point():
                return
            calls[name] = calls.get(name, 0) + 1
            key = name if calls[name] == 1 else f"{name} (call {calls[name]})"
            activations[key] = _copy(t)
            if t.requires_grad:
                def keep_grad(g, key=key):
                    grads[key] = _copy(g)
                t.register_hook(keep_grad)
        return hook

    device = next((p.device.type for p in params), "cpu")
    try:
        for p in params:
            p.grad = None
        for name, module in chosen:
            handles.append(module.register_forward_hook(forward_hook(name)))
        with torch.enable_grad(), torch.autocast(device_type=device, enabled=False):
            loss = _scalar_loss((loss_fn or _default_loss)(model, batch))
            loss.backward()
        owned = {id(p) for _, m in chosen for p in m.parameters(recurse=False)}
        weight_grads = {n: _copy(p.grad) for n, p in model.named_parameters()
                        if id(p) in owned and p.grad is not None}
    finally:
        for h in handles:
            h.remove()
        for p, g in zip(params, saved):
            p.grad = g
    types = {n: type(m).__name__ for n, m in chosen}
    return Capture(activations, {k: grads[k] for k in activations if k in grads}, weight_grads,
                   float(loss.detach()), types)


@cache
def lesson_capture(steps: int = 150, batch_size: int = 32, seed: int = 0) -> Capture:
    """The lessons' capture: the lesson model (mplab.models.lesson_model(seed=seed)) trained
    `steps` fp32 AdamW steps (lr 1e-3) on the shipped sentiment reviews, then one captured step
    on the first `batch_size` training reviews. A model part-way through training, not just
    initialised: its gradients have shrunk as its loss fell, as a real run's do.

    About 5 s on 2 CPU cores; cached, so a notebook and its exercises share one capture.
    """
    from mplab.data import batches, encode, load_dataset
    from mplab.models import lesson_model, lesson_tokenizer

    for name, v, lo in (("steps", steps, 0), ("batch_size", batch_size, 1), ("seed", seed, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an integer of at least {lo}, got {v!r}")
    ds = load_dataset("sentiment", "train")
    enc = encode(lesson_tokenizer(), ds.texts, ds.labels)
    model = lesson_model(seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    done = 0
    while done < steps:
        for batch in batches(enc, batch_size, seed=seed + done, device="cpu", by_length=True):
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            done += 1
            if done == steps:
                break
    first = next(batches(enc, batch_size, shuffle=False, device="cpu"))
    return capture(model, first)


# --- choosing a loss scale ---------------------------------------------------------------------

def scale_sweep(tensors, fmt="fp16", scales=None) -> Table:
    """For each scale (default 2^0 ... 2^24): the fraction of all values that underflow, land
    subnormal, overflow when ``x * scale`` is cast to fmt, and the largest |x·scale|.

    tensors: a tensor, a list or dict of tensors, or :class:`Magnitudes` (sorted once, then
    each scale costs a few binary searches). Underflow never rises and overflow never falls as
    the scale grows.
    """
    f = _storage_format(fmt)
    parts = _parts(tensors)
    scales = SCALES if scales is None else list(scales)
    if not scales:
        raise ValueError("scales is empty; pass positive numbers such as [2.0**k for k in "
                         "range(25)], or None for that default")
    rows = []
    for scale in scales:
        s = _scale32(scale)
        st = _total([p.stats(f, s, rel_error=False) for p in parts], f, s)
        rows.append({"scale": s, "log2 scale": math.log2(s), "zero": st.zero_frac,
                     "underflow": st.underflow_frac, "lost (of nonzero)": st.lost_frac,
                     "subnormal": st.subnormal_frac,
                     "overflow": st.overflow_frac, "max |x·scale|": st.max_abs * s})
    return Table(rows, title=f"Scale sweep: fractions of all values cast to {f.name}")


def good_scale_window(sweep, underflow_tol: float = 1e-3, overflow_tol: float = 0.0, *,
                      of_nonzero: bool = False) -> tuple[float, float] | None:
    """(lowest, highest) scale of a :func:`scale_sweep` whose underflow fraction is at most
    underflow_tol and overflow fraction at most overflow_tol (0: no overflow at all);
    None when no scale in the sweep is good. Fractions are of all values, or with
    ``of_nonzero=True`` the underflow is the share of the nonzero values lost."""
    under = "lost (of nonzero)" if of_nonzero else "underflow"
    rows = list(sweep)
    if not rows or not all(isinstance(r, Mapping) and {"scale", under, "overflow"} <= set(r)
                           for r in rows):
        raise ValueError(f"good_scale_window takes the table scale_sweep returns (rows with "
                         f"'scale', {under!r} and 'overflow')")
    for name, tol in (("underflow_tol", underflow_tol), ("overflow_tol", overflow_tol)):
        if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not 0 <= tol <= 1:
            raise ValueError(f"{name} is a fraction of values from 0 to 1, got {tol!r}")
    good = [r["scale"] for r in rows
            if r[under] <= underflow_tol and r["overflow"] <= overflow_tol]
    return (min(good), max(good)) if good else None


def largest_safe_scale(tensors, fmt="fp16") -> float:
    """The largest power of two s with s · max|x| ≤ the format's largest finite number
    (over the finite values; inf when all are zero), capped at 2^127, the largest power of two
    an fp32 scale can be. Below 1 when the values already overflow."""
    f = _storage_format(fmt)
    top = max(p.max_abs for p in _parts(tensors))
    if top == 0:
        return math.inf
    return math.ldexp(1.0, min(floor_log2(f.max_finite / Fraction(top)), 127))


# --- swamping and master weights ---------------------------------------------------------------

def _real(x, what: str) -> float:
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(float(x)):
        raise ValueError(f"{what} must be one finite number, got {x!r}")
    return float(x)


@dataclass(eq=False)  # holds arrays: compare fields, not records
class SwampRun:
    """``w ← w + update`` repeated, kept in a narrow format (or through an fp32 master copy).

    weights: the weight the model computes with after each step (steps + 1 values, as the
             format holds them); master_weights: the fp32 master copy (None without one);
    exact:   w0 + k·update in float64, what the steps should add up to;
    lost_steps / first_lost: updates that changed nothing in the stored weight (the format's
             copy without a master, the fp32 master with one), and the first such step.
    """

    fmt: str
    master: bool
    w0: float
    update: float
    weights: np.ndarray
    master_weights: np.ndarray | None
    exact: np.ndarray
    lost_steps: int
    first_lost: int | None

    @property
    def steps(self) -> int:
        return len(self.weights) - 1

    @property
    def final(self) -> float:
        return float(self.weights[-1])

    @property
    def expected(self) -> float:
        return float(self.exact[-1])

    @property
    def applied(self) -> float:
        """The fraction of the intended total change that reached the weight."""
        want = self.expected - self.w0
        return (self.final - self.w0) / want if want else 1.0

    def table(self, rows: int = 11) -> Table:
        idx = sorted({round(i * self.steps / max(rows - 1, 1)) for i in range(rows)})
        out = []
        for k in idx:
            r = {"step": k, "exact": float(self.exact[k]), f"weight ({self.fmt})":
                 float(self.weights[k])}
            if self.master_weights is not None:
                r["fp32 master"] = float(self.master_weights[k])
            r["error"] = float(self.weights[k] - self.exact[k])
            out.append(r)
        how = (f"fp32 master weights, cast to {self.fmt} for use" if self.master
               else f"weights kept in {self.fmt}")
        return Table(out, title=f"w ← w + {self.update:g} from w0 = {self.w0:g}, {how}: "
                                f"{self.lost_steps} of {self.steps} updates lost")


def swamping_run(w0, update, steps: int, fmt="fp16", master: bool = False) -> SwampRun:
    """Apply ``w ← w + update`` `steps` times and watch small updates vanish.

    master=False: the weight lives in fmt and so does the update; each step adds them in fp32
    and rounds the sum to fmt (what torch does for fp16/bf16 tensors on the CPU). Once
    |w| reaches :func:`swamp_threshold` (about 2^11·|update| in fp16, 2^8 in bf16) the sum
    rounds back to w: every later update is lost.
    master=True: an fp32 master copy takes the fp32 update; the model uses master cast to fmt.
    Nothing is lost (until fp32 itself swamps, 2^24 times further out).
    """
    f = _storage_format(fmt)
    w0f, u = _real(w0, "w0"), _real(update, "update")
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or not (
            0 <= steps <= 10**6):
        raise ValueError(f"steps must be a whole number from 0 to 1,000,000, got {steps!r}")
    steps = int(steps)
    dtype = f.dtype()
    exact = w0f + np.arange(steps + 1, dtype=np.float64) * u
    if master:
        m = np.full(steps + 1, np.float32(u), dtype=np.float32)
        m[0] = np.float32(w0f)
        np.add.accumulate(m, out=m)  # sequential fp32 sums, as an optimizer step makes them
        used = torch.from_numpy(m).to(dtype).double().numpy()
        stored, master_w = m.astype(np.float64), m.astype(np.float64)
    else:
        w = torch.tensor(w0f, dtype=torch.float32).to(dtype)
        du = torch.tensor(u, dtype=torch.float32).to(dtype).float()
        used = np.empty(steps + 1)
        used[0] = w.item()
        for k in range(1, steps + 1):
            nw = (w.float() + du).to(dtype)
            if torch.equal(nw, w):  # the same sum every step from here on: lost for good
                used[k:] = used[k - 1]
                break
            w = nw
            used[k] = w.item()
        stored, master_w = used, None
    lost = np.flatnonzero(np.diff(stored) == 0) if u != 0 else np.array([], dtype=np.int64)
    return SwampRun(f.name, master, w0f, u, used, master_w, exact, int(lost.size),
                    int(lost[0]) + 1 if lost.size else None)


def swamp_threshold(update, fmt="fp16") -> float:
    """The smallest weight magnitude at which adding `update` (same sign) changes nothing:
    the first w whose half-ulp is at least |update| (a tie rounds to w, whose last bit is 0).

    For update = 2^k it is 2^(mantissa bits + 1)·|update|: 2^11 in fp16, 2^8 in bf16; for
    other updates up to twice that. 0.0 when the update itself rounds to 0 in fmt; inf when
    no finite weight of the format is that large.
    """
    f = get_format(fmt)
    u = Fraction(abs(_real(update, "update")))
    if u <= f.min_subnormal / 2:
        return 0.0
    ceil_log2 = -floor_log2(1 / u)  # smallest k with 2^k >= u
    e = ceil_log2 + f.man_bits + 1
    return math.ldexp(1.0, e) if e <= f.emax else math.inf


@dataclass(eq=False)  # holds arrays: compare fields, not records
class RunningSum:
    """Values added one at a time into an accumulator of a narrow format, against fp32.

    partial: the narrow accumulator after each value; low: its final value; fp32: the same
    sequential sum in fp32; exact: the correctly rounded sum (math.fsum); stalled_from: the
    first value from which on the narrow sum never changed again (None if it moved at the end).
    """

    fmt: str
    n: int
    low: float
    fp32: float
    exact: float
    partial: np.ndarray
    stalled_from: int | None

    def table(self) -> Table:
        rows = [{"accumulator": name, "sum": v,
                 "rel. error": abs(v - self.exact) / abs(self.exact) if self.exact else 0.0}
                for name, v in ((self.fmt, self.low), ("fp32", self.fp32),
                                ("exact (fsum)", self.exact))]
        return Table(rows, title=f"Sum of {self.n} values, one at a time")


def running_sum(values, fmt="bf16") -> RunningSum:
    """Add the values one by one into an fmt accumulator (each sum computed in fp32 and
    rounded to fmt, with torch), and compare with fp32 and the exact sum.

    10,000 uniform(0, 1) values in bf16 stop at 256: there the spacing of bf16 numbers is 2,
    so adding anything below 1 rounds back to 256.
    """
    f = _storage_format(fmt)
    v = _fp32_values(values, "values")
    dtype = f.dtype()
    acc = torch.zeros((), dtype=dtype)
    sums = []
    for x in v:
        acc = (acc.float() + x).to(dtype)
        sums.append(acc)
    partial = torch.stack(sums).double().numpy() if sums else np.empty(0)
    fp32 = float(np.add.accumulate(v.numpy())[-1]) if v.numel() else 0.0
    moved = np.flatnonzero(np.diff(np.concatenate([[0.0], partial])) != 0)
    last = int(moved[-1]) if moved.size else -1
    stalled = last + 1 if last + 1 < v.numel() else None
    return RunningSum(f.name, v.numel(), float(partial[-1]) if v.numel() else 0.0, fp32,
                      math.fsum(v.double().tolist()), partial, stalled)


# --- overflow: an activation outgrows fp16 -----------------------------------------------------

@dataclass(frozen=True)
class StageRecord:
    """One step of the forward pass: its largest |value| in fp32 and in the format, and how
    many infs and NaNs the format's run had there."""

    stage: str
    reference_max: float
    max_finite: float
    inf: int
    nan: int


@dataclass
class OverflowDemo:
    """A feed-forward block run in fp32 and in fmt, stage by stage (see :func:`overflow_demo`)."""

    fmt: str
    simulated: bool
    stages: list[StageRecord]
    loss: float
    reference_loss: float

    @property
    def first_inf(self) -> str | None:
        return next((s.stage for s in self.stages if s.inf), None)

    @property
    def first_nan(self) -> str | None:
        return next((s.stage for s in self.stages if s.nan), None)

    @property
    def finite(self) -> bool:
        return not any(s.inf or s.nan for s in self.stages)

    def table(self) -> Table:
        rows = [{"stage": s.stage, "fp32 max |x|": s.reference_max,
                 f"{self.fmt} max finite |x|": s.max_finite, "inf": s.inf, "NaN": s.nan}
                for s in self.stages]
        how = " (simulated: fp32 arithmetic, rounded after each op)" if self.simulated else ""
        return Table(rows, title=f"Feed-forward block in {self.fmt}{how}: first inf at "
                                 f"{self.first_inf}, first NaN at {self.first_nan}")


#: The outlier the demo builds: T5's feed-forward output in fp16 (transformers #5651).
T5_ACTIVATION = 66_246.0


def _demo_block() -> dict[str, torch.Tensor]:
    """Weights of a tiny T5-like feed-forward block (d_model 8, d_ff 64) and its input.

    Token 0 is ordinary. Token 1 switches on all 64 hidden units at 32, and the output
    weights of channel 0 are 32 with a bias of 710: 64 · 32 · 32 + 710 = 66,246. Every
    weight and input is a small multiple of 1/16, exact in fp16 and bf16, so only the range
    differs between the runs.
    """
    g = torch.Generator().manual_seed(0)

    def small(*shape):
        return torch.randint(-16, 17, shape, generator=g).float() / 16

    w_in = torch.full((64, 8), 4.0)
    x = torch.stack([torch.tensor([1.0, -1.0] * 4), torch.ones(8)])  # token 0: hidden units 0
    w_out = small(8, 64)
    w_out[0] = 32.0
    b_out = torch.zeros(8)
    b_out[0] = T5_ACTIVATION - 64 * 32 * 32
    return {"x": x, "w_in": w_in, "b_in": torch.zeros(64), "w_out": w_out, "b_out": b_out,
            "ln_w": torch.ones(8), "ln_b": torch.zeros(8), "w_cls": small(3, 8),
            "b_cls": torch.zeros(3), "labels": torch.tensor([0, 2])}


def _demo_stages(p: dict[str, torch.Tensor], rnd: Callable) -> dict[str, torch.Tensor]:
    F = torch.nn.functional
    out = {}

    def keep(name, t):
        out[name] = t = rnd(t)
        return t

    x = keep("input", p["x"])
    h = keep("ff_in: x·W1ᵀ", F.linear(x, p["w_in"], p["b_in"]))
    h = keep("relu", F.relu(h))
    y = keep("ff_out: h·W2ᵀ + b2", F.linear(h, p["w_out"], p["b_out"]))
    y = keep("residual: x + ff_out", x + y)
    y = keep("layer_norm", F.layer_norm(y, (y.shape[-1],), p["ln_w"], p["ln_b"]))
    logits = keep("logits", F.linear(y, p["w_cls"], p["b_cls"]))
    keep("softmax", torch.softmax(logits, dim=-1))
    keep("loss", F.cross_entropy(logits, p["labels"]))
    return out


def overflow_demo(fmt="fp16") -> OverflowDemo:
    """Run a tiny feed-forward block (Linear → ReLU → Linear, residual, LayerNorm, classifier,
    softmax, loss) whose weights make one output reach 66,246, past fp16's 65,504 (T5's
    figure), in fp32 and in fmt, and record each stage's largest value, infs and NaNs.

    In fp16 the ff_out activation becomes inf; LayerNorm subtracts the mean (inf − inf) and
    the whole token turns NaN, then the loss of the batch. In bf16 (8 exponent bits) it stays
    finite, rounded to 66,048. fp16, bf16 and fp32 run natively in that dtype (fp16 matmuls are
    slow on a CPU; these are tiny). fp8 has no CPU arithmetic: it is simulated, fp32 arithmetic
    with every weight, input and result rounded to fp8 (e4m3 saturates at 448 instead).
    """
    f = _storage_format(fmt)
    params = _demo_block()
    ref = _demo_stages(params, lambda t: t)
    dtype = f.dtype()
    simulated = f.bits == 8
    if simulated:
        def rnd(t):
            return t if t.dtype == torch.int64 else t.to(dtype).float()
        run = _demo_stages({k: rnd(v) for k, v in params.items()}, rnd)
    else:
        cast = {k: v if v.dtype == torch.int64 else v.to(dtype) for k, v in params.items()}
        run = _demo_stages(cast, lambda t: t)
    stages = []
    for name, t in run.items():
        t = t.float()
        fin = t[t.isfinite()].abs()
        stages.append(StageRecord(name, ref[name].abs().max().item(),
                                  fin.max().item() if fin.numel() else math.nan,
                                  int(t.isinf().sum()), int(t.isnan().sum())))
    return OverflowDemo(f.name, simulated, stages, run["loss"].float().item(),
                        ref["loss"].item())
