"""Lesson 9's formats (fp8 FNUZ, fp6, fp4, the e8m0 scale): every bit pattern, and casts on the
values where rounding decides (each midpoint and its neighbours), against ml_dtypes and torch."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from mplab.numerics import formats

ML_DTYPES = {"fp8_e4m3fnuz": "float8_e4m3fnuz", "fp8_e5m2fnuz": "float8_e5m2fnuz",
             "fp6_e3m2": "float6_e3m2fn", "fp6_e2m3": "float6_e2m3fn",
             "fp4_e2m1": "float4_e2m1fn", "e8m0": "float8_e8m0fnu",
             "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def same(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b and math.copysign(1, a) == math.copysign(1, b)


@pytest.mark.parametrize("name", ML_DTYPES)
def test_every_pattern_means_what_ml_dtypes_and_torch_say(name):
    f = formats.get_format(name)
    patterns = np.arange(1 << f.bits, dtype=np.uint8)
    ref = patterns.view(getattr(ml_dtypes, ML_DTYPES[name])).astype(np.float64)
    ours = [formats.from_bits(int(p), f) for p in patterns]
    assert all(same(a, float(b)) for a, b in zip(ours, ref))
    if f.torch_dtype:
        by_torch = torch.from_numpy(patterns).view(f.dtype()).double().tolist()
        assert all(same(a, b) for a, b in zip(ours, by_torch))


def probes(f: formats.FloatFormat) -> np.ndarray:
    """fp32 values where a cast's rounding decides: every value of the format, each midpoint
    between neighbours and the fp32 numbers either side of it, past the top, specials."""
    pos = sorted({abs(formats.from_bits(p, f)) for p in range(1 << f.bits)} - {math.nan})
    pos = [v for v in pos if not math.isnan(v)]
    out = {0.0, math.inf, math.nan, 1e-45, pos[1] / 2, pos[1] / 4, 3.4e38}
    for a, b in zip(pos, pos[1:]):
        m = np.float32((a + b) / 2)
        out |= {a, b, float(m), float(np.nextafter(m, np.float32(0))),
                float(np.nextafter(m, np.float32(np.inf)))}
    with np.errstate(over="ignore"):
        out |= {pos[-1] * 1.01, pos[-1] * 1.1, pos[-1] * 2}
        xs = np.array(sorted(out), dtype=np.float32)
    return np.concatenate([xs, -xs])


@pytest.mark.parametrize("name", [n for n in formats.LOW_BIT_FORMATS if n != "e8m0"])
def test_casts_round_as_ml_dtypes_and_torch_do(name):
    f = formats.get_format(name)
    xs = probes(f)
    ours = np.array([formats.to_bits(float(x), f) for x in xs])
    by_ml = xs.astype(getattr(ml_dtypes, ML_DTYPES[name])).view(np.uint8)
    assert (ours == by_ml).all(), xs[ours != by_ml][:5]
    if f.torch_dtype:
        by_torch = torch.from_numpy(xs).to(f.dtype()).view(torch.uint8).numpy()
        assert (ours == by_torch).all(), xs[ours != by_torch][:5]


def test_e8m0_casts_as_torch_does_and_ml_dtypes_does_not():
    xs = probes(formats.E8M0)
    ours = np.array([formats.to_bits(float(x), formats.E8M0) for x in xs])
    by_torch = torch.from_numpy(xs).to(torch.float8_e8m0fnu).view(torch.uint8).numpy()
    assert (ours == by_torch).all(), xs[ours != by_torch][:5]
    by_ml = xs.astype(ml_dtypes.float8_e8m0fnu).view(np.uint8)
    # ml_dtypes makes zero and every negative number NaN; torch keeps the magnitude
    assert formats.to_bits(0.0, "e8m0") == 0 and by_ml[xs == 0].tolist() == [255, 255]
    assert formats.to_bits(-2.0, "e8m0") == 128 == formats.to_bits(2.0, "e8m0")
    positive = (xs > 0) & np.isfinite(xs) & (xs >= 2.0**-126)
    assert (ours[positive] == by_ml[positive]).all()


@pytest.mark.parametrize("name, top, smallest", [
    ("fp4_e2m1", 6.0, 0.5), ("fp6_e2m3", 7.5, 0.125), ("fp6_e3m2", 28.0, 0.0625),
    ("fp8_e4m3fnuz", 240.0, 2.0**-10), ("fp8_e5m2fnuz", 57344.0, 2.0**-17),
    ("e8m0", 2.0**127, 2.0**-127)])
def test_landmarks_are_ml_dtypes_finfo(name, top, smallest):
    f = formats.get_format(name)
    info = ml_dtypes.finfo(getattr(ml_dtypes, ML_DTYPES[name]))
    assert float(f.max_finite) == float(info.max) == top
    assert float(f.min_subnormal) == smallest
    assert f.bits == info.bits


def test_specials_of_each_convention():
    assert formats.kind_of(0x80, "fp8_e4m3fnuz") == "nan"
    assert formats.kind_of(0x00, "fp8_e4m3fnuz") == "zero"
    assert formats.to_bits(-0.0, "fp8_e4m3fnuz") == 0  # FNUZ has no -0
    assert formats.to_bits(1e9, "fp8_e5m2fnuz") == 0x80  # an overflow is NaN, as torch casts
    assert formats.kind_of(0xFF, "e8m0") == "nan" and formats.kind_of(0, "e8m0") == "normal"
    assert [formats.kind_of(p, "fp4_e2m1") for p in (0, 1, 2, 7)] == ["zero", "subnormal", "normal",
                                                                 "normal"]
    assert formats.to_bits(math.inf, "fp4_e2m1") == 0b0111  # no inf: saturates at 6
    assert formats.field_bits(127, "e8m0") == (0, 127, 0)
    with pytest.raises(ValueError, match="fp4_e2m1 is not a torch dtype"):
        formats.dtype_of("fp4")
    assert formats.get_format(torch.float8_e8m0fnu) is formats.E8M0
    assert formats.get_format("float4_e2m1fn") is formats.FP4_E2M1


def test_explain_reads_the_formats_without_a_sign_or_a_nan():
    from mplab.numerics.explain import cast_note, decompose

    d = decompose(3.0, "e8m0")
    assert d.bit_string == "- 10000001 -" and d.formula() == "2^(129 − 127) = 2^2"
    assert d.value == float(torch.tensor(3.0).to(torch.float8_e8m0fnu).float())
    assert "no sign" in cast_note(-2.0, decompose(-2.0, "e8m0"), "e8m0")
    assert "no zero" in cast_note(0.0, decompose(0.0, "e8m0"), "e8m0")
    assert "no NaN" in cast_note(math.nan, decompose(math.nan, "fp4"), "fp4")
    assert decompose(1.0, "fp4").bit_string == "0 01 0"
