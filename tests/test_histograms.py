"""mplab.numerics.histograms: exponent histograms counted against torch.frexp, and the bands of a
format at their exact rounding edges."""

import math

import numpy as np
import pytest
import torch
from cast_reference import spread

from mplab.numerics import histograms as H
from mplab.numerics.casts import Magnitudes


def test_exponent_histogram_counts_floor_log2_and_zeros_apart():
    x = torch.cat([spread(10_000, seed=4, lo=-70, hi=25), torch.tensor([math.nan, math.inf])])
    hist = H.exponent_histogram(x, bins=range(-60, 20))
    counts, edges = hist  # unpacks as (counts, edges)
    nz = x[x.isfinite() & (x != 0)]
    exps = (torch.frexp(nz.abs()).exponent - 1).numpy()  # floor(log2|x|), exact
    assert list(edges) == list(range(-60, 20))
    want = np.array([(exps == e).sum() for e in range(-60, 19)])
    assert np.array_equal(counts, want)
    assert hist.zeros == int((x == 0).sum()) and (hist.inf, hist.nan) == (1, 1)
    assert hist.below == int((exps < -60).sum()) and hist.above == int((exps >= 19).sum())
    assert hist.total == x.numel()
    parts = H.exponent_histogram([x[:5000], x[5000:]], bins=range(-60, 20))
    assert np.array_equal(parts.counts, counts)
    assert H.exponent_histogram(torch.tensor([2.0**-149, 1.0]), bins=[-150, -148, 0, 1]).counts \
        .tolist() == [1, 0, 1]


def test_by_default_the_bins_hold_every_value_from_the_smallest_to_the_largest():
    # past the old fixed bins (2^-60 .. 2^19) at both ends, as the lesson's gradients are
    x = torch.cat([spread(10_000, seed=4, lo=-70, hi=25), torch.tensor([0.0, 2.0**-81])])
    nz = x[x != 0].abs()
    exps = torch.frexp(nz).exponent - 1  # floor(log2|x|), exact
    bins = H.data_bins(x)
    assert bins[0] == int(exps.min()) == -81 and bins[-1] == int(exps.max()) + 1 > 19
    hist = H.exponent_histogram(x)
    assert list(hist.edges) == list(bins) and hist.below == hist.above == 0
    assert hist.counts.sum() == nz.numel() and hist.counts[0] >= 1 and hist.counts[-1] >= 1
    both = H.data_bins([x[:100], Magnitudes(x[100:])])  # one set of bins for several tensors
    assert both == bins
    extremes = torch.tensor([2.0**-149, 3e38])  # fp32's smallest subnormal and near its top
    assert H.exponent_histogram(extremes).counts.sum() == 2
    assert H.data_bins(torch.zeros(3)) == H.EMPTY_BINS

def test_an_empty_tensor_has_an_empty_histogram_and_magnitudes_histogram_alike():
    assert H.exponent_histogram(torch.empty(0)).nonzero == 0
    x = spread(5000, seed=6)
    a, b = H.exponent_histogram(x), H.exponent_histogram(Magnitudes(x))
    assert np.array_equal(a.counts, b.counts) and a.zeros == b.zeros


def test_bad_bins_are_a_clear_error():
    for bad in ([3, 1], [0.5, 1.5], [1], "abc"):
        with pytest.raises(ValueError, match="bins"):
            H.exponent_histogram(torch.ones(3), bins=bad)


def test_format_bands_move_down_by_log2_of_the_scale():
    base, scaled = H.format_bands("fp16"), H.format_bands("fp16", 2.0**10)
    assert [b.name for b in base] == ["zero", "subnormal", "normal", "overflow"]
    assert base[0].hi == -25 and base[1].hi < -14 < base[1].hi + 0.001
    for a, b in zip(base, scaled):
        assert b.hi == a.hi - 10 or a.hi == math.inf
    assert H.format_bands("bf16")[0].hi == -134
