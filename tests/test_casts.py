"""mplab.numerics.casts against direct torch casts (and mplab.numerics.formats): what a cast
does to a tensor, counted exactly, and the loss scale that keeps the most of it."""

import math
import warnings

import numpy as np
import pytest
import torch
from cast_reference import ALL, E4M3_OVERFLOW, LOW, SCALES, direct, edge_values, grads_like, spread

from mplab.numerics import casts as C
from mplab.numerics import formats
from mplab.numerics.histograms import format_bands


def counts(st: C.CastStats) -> dict:
    return {k: getattr(st, k) for k in ("count", "zero", "underflow", "subnormal", "normal",
                                        "overflow", "inf", "nan")}


# --- cast_stats and the fast path ---------------------------------------------------------------

@pytest.mark.parametrize("precision", ALL)
def test_cast_stats_counts_equal_direct_torch_casts_at_every_scale(precision):
    x = torch.cat([spread(20_000, seed=1), edge_values(precision),
                   torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0])])
    for scale in SCALES:
        st = C.cast_stats(x, precision, scale)
        assert counts(st) == direct(x, precision, scale), (precision, scale)
        # e4m3 has no inf: the installed torch saturates (2.13 and later) or makes NaN
        assert st.overflow_to == (formats.TORCH_E4M3_OVERFLOW if precision == "fp8_e4m3" else "inf")
        assert sum(counts(st).values()) - st.count == st.count  # every value in one class


@pytest.mark.parametrize("precision", ALL)
def test_fast_stats_from_sorted_magnitudes_agree_exactly_with_real_casts(precision):
    x = torch.cat([spread(30_000, seed=2, lo=-60, hi=30), edge_values(precision),
                   torch.tensor([math.inf, math.nan, 0.0])])
    mags = C.Magnitudes(x)
    for scale in SCALES + [2.0**-20, 2.0**40]:
        slow, fast = C.cast_stats(x, precision, scale), mags.stats(precision, scale)
        assert counts(fast) == counts(slow), (precision, scale)
        assert fast.max_rel_error == slow.max_rel_error
        assert fast.mean_rel_error == pytest.approx(slow.mean_rel_error, rel=1e-9, abs=1e-300)


@pytest.mark.parametrize("precision", ALL)
@pytest.mark.parametrize("scale", [1.0, 2.0**5, 3.0])
def test_edges_hit_exactly_through_the_scale_agree_with_real_casts(precision, scale):
    """x·scale lands exactly on each rounding edge (and one fp32 step either side)."""
    v = edge_values(precision)
    x = v / scale
    mags = C.Magnitudes(x)
    want = direct(x, precision, scale)
    assert counts(mags.stats(precision, scale)) == counts(C.cast_stats(x, precision, scale)) == want


@pytest.mark.parametrize("precision", LOW)
def test_fractions_equal_formats_round_to_value_by_value(precision):
    """An independent reference: classify each fl32(x·s) with mplab.numerics.formats' exact
    rounding."""
    f = formats.get_format(precision)
    x = torch.cat([spread(400, seed=3), edge_values(precision)])
    # overflow shows as NaN
    nan_fmt = formats.E4M3_NAN_ON_OVERFLOW if precision == "fp8_e4m3" else f
    for scale in (1.0, 2.0**12, 0.1):
        want = dict.fromkeys(("zero", "underflow", "subnormal", "normal", "overflow"), 0)
        for v, x0 in zip((x * scale).tolist(), x.tolist()):
            r = formats.round_to(v, nan_fmt)
            if x0 == 0:
                want["zero"] += 1
            elif r == 0:
                want["underflow"] += 1
            elif math.isinf(r) or math.isnan(r):
                want["overflow"] += 1
            elif abs(r) < f.min_normal:
                want["subnormal"] += 1
            else:
                want["normal"] += 1
        st = C.cast_stats(x, precision, scale)
        assert {k: getattr(st, k) for k in want} == want, (precision, scale)
        assert st.underflow_frac == want["underflow"] / x.numel()


@pytest.mark.parametrize("precision", LOW)
def test_half_the_smallest_subnormal_ties_to_zero_and_just_above_rounds_up(precision):
    f = formats.get_format(precision)
    half = torch.tensor([float(f.min_subnormal) / 2])
    above = torch.nextafter(half, torch.tensor(1.0))
    assert C.cast_stats(half, precision).underflow == 1
    st = C.cast_stats(above, precision)
    assert st.underflow == 0 and st.subnormal == 1
    assert above.to(f.dtype()).float().item() == float(f.min_subnormal)
    bands = format_bands(precision)
    assert bands[0].hi == f.emin - f.man_bits - 1 == math.log2(half.item())


def test_overflow_edges_ieee_tie_overflows_e4m3_tie_saturates_to_448():
    fp16 = torch.tensor([65504.0, 65519.99, 65520.0])
    assert [C.cast_stats(v, "fp16").overflow for v in fp16] == [0, 0, 1]
    assert torch.tensor(65520.0).half().isinf()
    above = torch.nextafter(torch.tensor(E4M3_OVERFLOW), torch.tensor(1e9)).item()  # in fp32
    e4m3 = torch.tensor([448.0, E4M3_OVERFLOW, above, 1e30])
    assert [C.cast_stats(v, "fp8_e4m3").overflow for v in e4m3] == [0, 0, 1, 1]
    # torch 2.13 and later saturate all of them; torch 2.11 and 2.12 make them NaN
    as_torch = e4m3.to(torch.float8_e4m3fn).float()
    assert (as_torch == 448).all() if formats.TORCH_E4M3_OVERFLOW == "saturate" else (
        (as_torch[:2] == 448).all() and as_torch[2:].isnan().all())
    assert format_bands("fp8_e4m3")[-1].lo_value == E4M3_OVERFLOW
    assert format_bands("fp16")[-1].lo_value == 65520.0


def test_relative_error_is_that_of_the_cast_of_the_kept_values():
    x = torch.tensor([1.0, 0.1, 1e-6, 1e-9, 0.0])  # 1e-9 underflows in fp16: not counted
    st = C.cast_stats(x, "fp16")
    v = x[:3]
    rel = ((v.half().double() - v.double()).abs() / v.double()).tolist()
    assert st.max_rel_error == pytest.approx(max(rel), rel=2**-23)  # divided in fp32
    assert st.mean_rel_error == pytest.approx(sum(rel) / 3, rel=2**-23)
    assert (st.zero, st.underflow, st.subnormal, st.normal) == (1, 1, 1, 2)


def test_empty_and_all_zero_tensors_give_zero_fractions_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for t in (torch.empty(0), torch.zeros(0, 3), torch.zeros(5)):
            for st in (C.cast_stats(t, "fp16"), C.Magnitudes(t).stats("fp16")):
                assert st.count == t.numel() and st.zero == t.numel()
                assert st.underflow_frac == st.overflow_frac == st.subnormal_frac == 0.0
                assert st.mean_rel_error == st.max_rel_error == st.max_abs == 0.0
                assert st.zero_frac == (1.0 if t.numel() else 0.0)


def test_nan_and_inf_inputs_are_counted_apart_not_as_overflow():
    x = torch.tensor([math.nan, math.inf, -math.inf, 1.0])
    for precision in LOW:
        st = C.cast_stats(x, precision)
        assert (st.nan, st.inf, st.overflow, st.normal) == (1, 2, 0, 1)
        assert st.max_abs == 1.0


def test_integer_tensors_are_converted_and_bool_complex_rejected():
    ints = torch.arange(-5, 70_000, 7)
    assert C.cast_stats(ints, "fp16") == C.cast_stats(ints.float(), "fp16")
    assert C.cast_stats(ints, "fp16").overflow == int((ints >= 65520).sum())
    assert C.cast_stats([1, 2.5, 1e-9], "fp16").underflow == 1  # lists of numbers work too
    with pytest.raises(TypeError, match="bool"):
        C.cast_stats(torch.ones(3, dtype=torch.bool), "fp16")
    with pytest.raises(TypeError, match="complex"):
        C.cast_stats(torch.ones(3, dtype=torch.complex64), "fp16")
    with pytest.raises(TypeError, match="tensor"):
        C.cast_stats("0.1", "fp16")


def test_unknown_formats_and_bad_scales_are_clear_errors():
    x = torch.ones(3)
    with pytest.raises(ValueError, match="'fp12'.*accepted.*fp16"):
        C.cast_stats(x, "fp12")
    with pytest.raises(ValueError, match="tf32.*accepted: fp32, fp16, bf16"):
        C.cast_stats(x, "tf32")
    for bad in (0, -1.0, math.inf, math.nan, 1e-60, 1e50, 2**2000):
        with pytest.raises(ValueError, match="scale"):
            C.cast_stats(x, "fp16", bad)
    for bad in ("8", None, True):
        with pytest.raises(TypeError, match="scale"):
            C.cast_stats(x, "fp16", bad)
    assert C.as_scale(0.1) == float(np.float32(0.1))  # torch multiplies by fp32(0.1)


# --- choosing a scale ---------------------------------------------------------------------------

def test_scale_sweep_is_monotone_and_matches_cast_stats():
    x = grads_like()
    sweep = C.scale_sweep([x[:20_000], x[20_000:]], "fp16")
    assert [r["scale"] for r in sweep] == [2.0**k for k in range(25)]
    under, over = sweep.column("lost (of nonzero)"), sweep.column("overflow (of nonzero)")
    assert all(a >= b for a, b in zip(under, under[1:]))
    assert all(a <= b for a, b in zip(over, over[1:]))
    assert under[0] > 0.1 and over[-1] > 0 and over[0] == 0
    for row in sweep.rows[::6]:  # every share is of the nonzero values, as torch casts them
        d = direct(x, "fp16", row["scale"])
        nonzero = d["underflow"] + d["subnormal"] + d["normal"] + d["overflow"]
        assert row["nonzero"] == nonzero
        assert (row["lost (of nonzero)"], row["subnormal (of nonzero)"],
                row["overflow (of nonzero)"]) == (d["underflow"] / nonzero,
                                                  d["subnormal"] / nonzero,
                                                  d["overflow"] / nonzero)
    assert f"{nonzero:,} nonzero values" in sweep.title


def test_good_scale_window_and_largest_safe_scale():
    x = grads_like()
    sweep = C.scale_sweep(x, "fp16")
    lo, hi = C.good_scale_window(sweep, underflow_tol=1e-3)
    by = {r["scale"]: r for r in sweep}
    assert by[lo]["lost (of nonzero)"] <= 1e-3 < by[lo / 2]["lost (of nonzero)"]
    assert by[hi]["overflow (of nonzero)"] == 0 < by[hi * 2]["overflow (of nonzero)"]
    assert C.good_scale_window(sweep, underflow_tol=0.0) is not None
    too_wide = C.scale_sweep(torch.tensor([2.0**-40, 1e4]), "fp16")  # 2^-40 needs 2^15: 1e4 can't
    assert C.good_scale_window(too_wide, underflow_tol=0.0) is None
    safe = C.largest_safe_scale(x, "fp16")
    assert safe == hi == 2.0**11  # 30 · 2^11 = 61,440 ≤ 65,504 < 122,880
    assert not (x * safe).half().isinf().any() and (x * safe * 2).half().isinf().any()
    assert C.largest_safe_scale(torch.zeros(3), "fp16") == math.inf
    assert C.largest_safe_scale(torch.tensor([1e6]), "fp16") == 2.0**-4
    with pytest.raises(ValueError, match="scale_sweep"):
        C.good_scale_window([{"scale": 1.0}])



def test_choose_scale_decides_what_the_safe_scale_loses_and_the_window_from_torch_casts():
    x = grads_like()  # 2^-34 .. 30: at 2^11 the smallest is 2^-23, an fp16 subnormal
    keeps = C.choose_scale(x, "fp16", underflow_tol=0.05)
    assert keeps.safe_scale == C.largest_safe_scale(x, "fp16") == 2.0**11
    assert not keeps.safe_loses and keeps.lost_at_safe == 0.0
    assert keeps.window == C.good_scale_window(keeps.sweep, underflow_tol=0.05)
    d = direct(x, "fp16", 1.0)
    assert keeps.lost_unscaled == d["underflow"] / (d["count"] - d["zero"]) > 0
    assert keeps.max_abs == 30.0 and keeps.precision == "fp16" and keeps.underflow_tol == 0.05
    assert str(keeps).splitlines() == [
        "The largest scale that overflows nothing is 2^11: it loses nothing.",
        f"Scales from 2^{math.log2(keeps.window[0]):g} to 2^11 lose at most 5% and overflow "
        "nothing."]

    tail = torch.cat([x, torch.full((1000,), 2.0**-40)])  # past fp16's reach at 2^11
    loses = C.choose_scale(tail, "fp16", underflow_tol=0.0)
    assert loses.safe_scale == 2.0**11 and loses.safe_loses and loses.window is None
    d = direct(tail, "fp16", 2.0**11)
    assert loses.lost_at_safe == d["underflow"] / (d["count"] - d["zero"]) == 1000 / 36_000
    # every |x| up to flushed_up_to becomes 0 at the safe scale, and the next fp32 up does not
    edge = torch.tensor(loses.flushed_up_to, dtype=torch.float32)
    above = torch.nextafter(edge, torch.tensor(1.0))
    assert (edge * 2.0**11).half() == 0 and (above * 2.0**11).half() != 0
    assert loses.binades_below == pytest.approx(math.log2(30.0 / loses.flushed_up_to))
    assert str(loses).splitlines() == [
        f"The largest scale that overflows nothing is 2^11: it still loses {1000 / 36_000:.1%}, "
        f"every gradient up to {loses.flushed_up_to:.1g}, {loses.binades_below:.0f} binades "
        "below the largest.",
        "No scale loses at most 0% without overflowing: these gradients span more binades than "
        "fp16 has."]

    nothing = C.choose_scale(torch.zeros(4), "fp16")
    assert nothing.safe_scale == math.inf and not nothing.safe_loses
    assert nothing.window == (1.0, 2.0**24)
    with pytest.raises(ValueError, match="underflow_tol"):
        C.choose_scale(x, "fp16", underflow_tol=5)


def test_fixed_scale_fit_decides_whether_a_scale_from_the_start_overflows_later_gradients():
    start = torch.tensor([1e-6, 0.5, 2.0])
    fixed = C.largest_safe_scale(start, "fp16")  # 2^14: 2 · 2^14 = 32,768 fits
    grown = C.fixed_scale_fit(C.cast_stats(start * 4, "fp16", fixed), "after 150 steps",
                              "activation gradients")
    assert grown.overflows and grown.overflow == 1 == int((start * 4 * fixed).half().isinf().sum())
    assert (grown.scale, grown.precision) == (2.0**14, "fp16")
    assert str(grown) == ("The scale that was safe at the start, 2^14, overflows 1 activation "
                          "gradients after 150 steps.")
    fits = C.fixed_scale_fit(C.cast_stats(start * 1.5, "fp16", fixed), "after 150 steps")
    assert not fits.overflows and fits.overflow == 0
    assert str(fits) == ("Here the scale from the start, 2^14, still fits after 150 steps; a "
                         "longer run's gradients may grow past it.")
    with pytest.raises(TypeError, match="CastStats"):
        C.fixed_scale_fit(start, "later")

def test_lost_frac_is_the_share_of_nonzero_values_torch_flushes_and_windows_can_use_it():
    x = grads_like()
    x[::3] = 0.0  # exact zeros lose nothing
    for precision in ("fp16", "bf16", "fp8_e5m2"):
        for scale in (1.0, 2.0**9):
            d = direct(x, precision, scale)
            nonzero = d["underflow"] + d["subnormal"] + d["normal"] + d["overflow"]
            st = C.cast_stats(x, precision, scale)
            assert st.lost_frac == d["underflow"] / nonzero
            assert st.row()["lost (of nonzero)"] == st.lost_frac
    assert C.cast_stats(torch.zeros(4), "fp16").lost_frac == 0.0
    sweep = C.scale_sweep(x, "fp16")
    lost = sweep.column("lost (of nonzero)")
    assert lost[0] == C.cast_stats(x, "fp16").lost_frac > C.cast_stats(x, "fp16").underflow_frac
    lo, hi = C.good_scale_window(sweep, underflow_tol=0.01)  # the zeros do not dilute it
    by = {r["scale"]: r for r in sweep}
    assert by[lo]["lost (of nonzero)"] <= 0.01 < by[lo / 2]["lost (of nonzero)"]
    m = C.Magnitudes(x)
    assert m.min_abs == x[x != 0].abs().min().item() and C.Magnitudes(torch.zeros(2)).min_abs == 0


# --- the rounding edges and records built on them ----------------------------------------------

@pytest.mark.parametrize("precision", LOW)
def test_rounding_edges_are_where_torch_flushes_turns_normal_and_overflows(precision):
    f = formats.get_format(precision)
    e = C.rounding_edges(precision)
    dtype = f.dtype()

    def cast(v: float) -> float:
        return torch.tensor(v, dtype=torch.float64).float().to(dtype).float().item()

    def after(v: float) -> float:
        return torch.nextafter(torch.tensor(v), torch.tensor(math.inf)).item()

    assert cast(e.zero_max) == 0 and cast(after(e.zero_max)) == float(f.min_subnormal)
    assert cast(e.normal_min) == float(f.min_normal)
    assert abs(cast(torch.nextafter(torch.tensor(e.normal_min), torch.tensor(0.0)).item())) \
        < float(f.min_normal)
    assert e.overflows(after(e.overflow_min))
    assert e.overflows(e.overflow_min) == (precision != "fp8_e4m3")  # e4m3's tie stays at 448
    assert C.rounding_edges(torch.float16) == C.rounding_edges("fp16")


def test_combined_stats_are_the_stats_of_the_tensors_joined():
    x = grads_like()
    parts = [x[:10_000], x[10_000:30_000], x[30_000:]]
    for precision, scale in (("fp16", 1.0), ("fp16", 2.0**12), ("bf16", 1.0)):
        joined = C.combined([C.cast_stats(p, precision, scale) for p in parts], precision, scale)
        whole = C.cast_stats(x, precision, scale)
        assert counts(joined) == counts(whole)
        assert joined.max_rel_error == whole.max_rel_error and joined.max_abs == whole.max_abs
        assert joined.mean_rel_error == pytest.approx(whole.mean_rel_error, rel=1e-6)
    empty = C.combined([], "fp16", 1.0)
    assert empty.count == 0 and empty.lost_frac == 0.0 and empty.precision == "fp16"


def test_every_share_in_a_row_names_its_denominator():
    x = torch.tensor([0.0, 0.0, 1e-9, 1e-6, 1.0, 1e5])  # 4 nonzero: lost, subnormal, kept, over
    st = C.cast_stats(x, "fp16", 2.0)
    assert st.nonzero_row() == {"nonzero": 4, "lost (of nonzero)": 0.25,
                                "subnormal (of nonzero)": 0.25, "overflow (of nonzero)": 0.25,
                                "max |x·scale|": 2e5}
    row = st.row()
    assert row["values"] == 6 and row["zero (of all)"] == 2 / 6
    assert {k: row[k] for k in st.nonzero_row() if k in row} == {
        k: v for k, v in st.nonzero_row().items() if k != "max |x·scale|"}
    shares = [k for k, v in row.items() if isinstance(v, float) and "error" not in k
              and k != "max |x|"]
    assert shares and all(k.endswith(("(of all)", "(of nonzero)")) for k in shares), shares
    assert "of the 4 nonzero: 25.00% lost to 0, 25.00% subnormal" in str(st)
    assert C.cast_stats(torch.zeros(3), "fp16").nonzero_row()["subnormal (of nonzero)"] == 0.0


def test_the_format_is_named_precision_like_everywhere_in_mplab():
    x = grads_like()
    st = C.cast_stats(x, precision="bf16", scale=2.0)
    assert st.precision == "bf16"
    assert counts(C.Magnitudes(x).stats(precision="bf16", scale=2.0)) == counts(st)
    assert C.scale_sweep(x, precision="fp16").rows == C.scale_sweep(x, "fp16").rows
    assert C.largest_safe_scale(x, precision="fp16") == C.largest_safe_scale(x, "fp16")
    with pytest.raises(ValueError, match="tf32 is not a storage format"):
        C.storage_format("tf32")
    assert C.scale_text(2.0**-3) == "2^-3" and C.scale_text(3.0) == "3"
    assert [m.count for m in C.magnitudes_of({"a": x[:5], "b": x[5:9]})] == [5, 4]
    assert len(C.magnitudes_of([1.0, 2.0])) == 1  # a list of numbers is one tensor
