"""Where values sit on the log2 axis, and where a format's bands are on it.

    counts, edges = exponent_histogram(grad)   # counts[k]: values in [2^edges[k], 2^edges[k+1])
    data_bins(grads)                           # the bins that hold every one of their values
    format_bands("fp16", scale=2**10)          # log2 edges where fp16 flushes, goes subnormal, ...

A loss scale s is a shift of log2|x| by log2(s): it moves every value of a histogram that many
bins right, or, the same thing, every edge of a format's bands that far left. The counts come
from :class:`mplab.numerics.casts.Magnitudes` (sorted once, then a few binary searches), the
edges from :func:`mplab.numerics.casts.rounding_edges`, exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mplab.numerics.casts import Magnitudes, as_scale, magnitudes_of, rounding_edges
from mplab.numerics.formats import get_format

__all__ = ["EMPTY_BINS", "data_bins", "ExponentHistogram", "exponent_histogram", "Band",
           "format_bands"]

#: The bins of a histogram with no finite nonzero value to place: [2^-60, 2^-59) ... [2^18, 2^19).
EMPTY_BINS = range(-60, 20)


def _floor_log2(v: float) -> int:
    """floor(log2 v) for a finite v > 0, exact (math.log2 rounds near powers of two)."""
    return math.frexp(v)[1] - 1


def data_bins(tensors) -> range:
    """The integer log2 edges of the fewest unit bins that hold every finite nonzero value of
    one or more tensors (or :class:`~mplab.numerics.casts.Magnitudes`): from floor(log2 min|x|) to
    floor(log2 max|x|) + 1. :data:`EMPTY_BINS` when there is no such value."""
    parts = [m for m in magnitudes_of(tensors) if m.values.size]
    if not parts:
        return EMPTY_BINS
    lo = min(_floor_log2(m.min_abs) for m in parts)
    hi = max(_floor_log2(m.max_abs) for m in parts)
    return range(lo, hi + 2)


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


def _histogram(m: Magnitudes, edges: np.ndarray) -> ExponentHistogram:
    """Counts of log2|x| per bin [2^e_k, 2^e_k+1), by searching the powers of two."""
    with np.errstate(over="ignore"):  # 2^128 and up are inf in fp32: above every finite value
        powers = np.array([2.0 ** int(min(max(k, -200), 200)) for k in edges]).astype(np.float32)
    idx = np.searchsorted(m.values, powers, side="left")
    return ExponentHistogram(np.diff(idx).astype(np.int64), edges, zeros=m.zero,
                             below=int(idx[0]), above=int(m.values.size - idx[-1]),
                             inf=m.inf, nan=m.nan)


def exponent_histogram(tensor_or_tensors, bins=None) -> ExponentHistogram:
    """Histogram of log2|x| over the finite nonzero values of one or more tensors
    (or precomputed :class:`~mplab.numerics.casts.Magnitudes`), with integer log2 edges; zeros
    counted apart. bins: the edges, e.g. range(-60, 20); None (the default) for :func:`data_bins`,
    which leave no value outside.

        counts, edges = exponent_histogram(grad)   # counts[k]: values in [2^edges[k], 2^edges[k+1])
    """
    parts = magnitudes_of(tensor_or_tensors)
    edges = _bin_edges(data_bins(parts) if bins is None else bins)
    hist = _histogram(parts[0], edges)
    for p in parts[1:]:
        hist = hist + _histogram(p, edges)
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


def format_bands(precision, scale=1.0) -> list[Band]:
    """Where a cast of ``x * scale`` flushes to zero, goes subnormal, stays normal, overflows:
    four bands of log2|x| (with scale 1: of the value that is cast).

    A scale s moves every edge down by log2(s): values that were flushed now land in range.
    The edges are the exact rounding edges, not the powers of two: a value just above half
    the smallest subnormal rounds *up* to it, so the zero band ends at log2(min_subnormal) − 1.
    """
    f = get_format(precision)
    s = as_scale(scale)
    e = rounding_edges(f)
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
