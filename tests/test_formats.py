"""mplab.numerics.formats against torch's casts: every 8- and 16-bit pattern, 10^5+ random fp32
values."""

import math
from decimal import Decimal
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch

from mplab.numerics import formats

#: The torch release installed, (major, minor): where casts differ by release
TORCH_RELEASE = tuple(int(part) for part in torch.__version__.split(".")[:2])

LOW = ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def torch_bits(values_fp32: torch.Tensor, fmt: str) -> list[int]:
    """Bit patterns torch's CPU cast produces, as non-negative ints."""
    dtype = formats.get_format(fmt).dtype()
    out = values_fp32.to(dtype).view(INT_VIEW[dtype.itemsize]).to(torch.int64)
    return (out & ((1 << (8 * dtype.itemsize)) - 1)).tolist()


def all_patterns(fmt: str) -> torch.Tensor:
    """Every pattern of a format as a tensor of that dtype."""
    f = formats.get_format(fmt)
    ints = torch.arange(1 << f.bits, dtype=torch.int64)
    if f.bits == 16:
        ints = torch.where(ints >= 1 << 15, ints - (1 << 16), ints)
    return ints.to(INT_VIEW[f.bits // 8]).view(f.dtype())


def fp32_from_bits(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.astype(np.uint32).view(np.float32).copy())


@pytest.mark.parametrize("fmt", LOW)
def test_from_bits_matches_torch_for_every_pattern(fmt):
    expected = all_patterns(fmt).to(torch.float64).tolist()
    for bits, want in enumerate(expected):
        got = formats.from_bits(bits, fmt)
        if math.isnan(want):
            assert math.isnan(got), (fmt, hex(bits))
        else:
            assert got == want and math.copysign(1, got) == math.copysign(1, want), (fmt, hex(bits))


@pytest.mark.parametrize("fmt", LOW)
def test_to_bits_of_every_representable_value_matches_torch(fmt):
    values = all_patterns(fmt).to(torch.float32)
    expected = torch_bits(values, fmt)
    for v, want in zip(values.tolist(), expected):
        assert formats.to_bits(v, fmt) == want, (fmt, v)


def random_fp32(n: int, seed: int = 0) -> torch.Tensor:
    """Uniform over bit patterns (so subnormals, huge values, inf and NaN all occur) plus values
    spread over the low formats' ranges, exact ties and the overflow edges."""
    rng = np.random.default_rng(seed)
    by_bits = fp32_from_bits(rng.integers(0, 1 << 32, n, dtype=np.uint64))
    log_uniform = torch.from_numpy(
        (rng.choice([-1, 1], n) * 2.0 ** rng.uniform(-30, 20, n)).astype(np.float32))
    specials = [0.0, -0.0, math.inf, -math.inf, math.nan, 65504, 65519.99, 65520, 65536, 448,
                449, 464, 465, 480, 500, 57344, 61440, 61441, 2.0 ** -24, 2.0 ** -25,
                2.0 ** -25 * 1.0000001, 3 * 2.0 ** -26, 2.0 ** -149, 3.4028235e38, 2.0 ** -133,
                2.0 ** -134, 2.0 ** -9, 2.0 ** -10, 2.0 ** -16, 2.0 ** -17]
    return torch.cat([by_bits, log_uniform, torch.tensor(specials, dtype=torch.float32)])


def ties(fmt: str) -> torch.Tensor:
    """Midpoints between neighbouring values of a format, all exact in fp32."""
    v = all_patterns(fmt).to(torch.float64)
    v = torch.sort(v[torch.isfinite(v)]).values
    mid = ((v[1:] + v[:-1]) / 2).to(torch.float32)
    return mid[mid.to(torch.float64) == (v[1:] + v[:-1]) / 2]


@pytest.mark.parametrize("fmt", LOW)
def test_to_bits_of_random_fp32_matches_torch(fmt):
    values = torch.cat([random_fp32(10_000, seed=1), ties(fmt)])  # every tie: the hard cases
    expected = torch_bits(values, fmt)
    mismatches = [(v, formats.to_bits(v, fmt), want) for v, want in zip(values.tolist(), expected)
                  if formats.to_bits(v, fmt) != want]
    assert not mismatches, mismatches[:5]


def test_to_bits_fp32_matches_torch_on_random_doubles():
    rng = np.random.default_rng(2)
    doubles = np.concatenate([rng.standard_normal(20_000) * 10.0 ** rng.integers(-45, 39, 20_000),
                              [2.0 ** -150, 2.0 ** -150 * 1.5, 3.4028235677973366e38, 1e39]])
    expected = torch.tensor(doubles, dtype=torch.float64).to(torch.float32).view(torch.int32)
    for x, want in zip(doubles.tolist(), expected.tolist()):
        assert formats.to_bits(x, "fp32") == want & 0xFFFFFFFF, x


def test_a_python_float_is_cast_through_fp32_like_torch_and_exact_rounds_once():
    # 1 + 2^-11 + 2^-40 is just above an fp16 tie, but its fp32 rounding lands on the tie.
    x = 1 + 2.0 ** -11 + 2.0 ** -40
    by_torch = torch.tensor([x], dtype=torch.float64).half().item()
    assert formats.round_to(x, "fp16") == by_torch == 1.0
    assert formats.round_to(x, "fp16", exact=True) == 1 + 2.0 ** -10


def test_e4m3_overflow_is_the_installed_torchs_and_ml_dtypes_gives_nan():
    """torch 2.13 and later saturate an e4m3 overflow at ±448; torch 2.11 and 2.12 give NaN,
    as ml_dtypes does. mplab's default e4m3 is the installed torch's, bit for bit."""
    values = [449.0, 464.0, 470.0, 500.0, 1e9, math.inf, -500.0]
    saturates = TORCH_RELEASE >= (2, 13)
    assert formats.TORCH_E4M3_OVERFLOW == ("saturate" if saturates else "nan")
    got = [formats.round_to(v, "fp8_e4m3") for v in values]
    torchs = torch.tensor(values).to(torch.float8_e4m3fn).float().tolist()
    assert np.array_equal(got, torchs, equal_nan=True)
    if saturates:
        assert got[2:] == [448.0, 448.0, 448.0, 448.0, -448.0]
    else:
        assert all(math.isnan(v) for v in got[2:])
    assert got[:2] == [448.0, 448.0]  # 464 is the tie, rounded to the even 448 by both rules
    assert formats.round_to(500.0, formats.E4M3_SATURATING) == 448.0
    ocp = [formats.round_to(v, formats.E4M3_NAN_ON_OVERFLOW) for v in values[:5]]
    reference = np.array(values[:5], dtype=np.float32).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.array(ocp), reference.astype(np.float64))


def test_format_fields_match_torch_finfo():
    for fmt in LOW + ["fp32"]:
        f, info = formats.get_format(fmt), torch.finfo(formats.get_format(fmt).dtype())
        assert float(f.max_finite) == info.max
        assert float(f.min_normal) == info.tiny  # finfo's "tiny" is the smallest *normal*
        assert float(f.eps) == info.eps
        assert f.bits == info.bits
        assert formats.from_bits(1, fmt) == float(f.min_subnormal)


def test_tf32_keeps_ten_mantissa_bits_and_fp32_range():
    assert formats.round_to(1 + 2.0 ** -11, "tf32") == 1.0  # tie to even
    assert formats.round_to(1 + 3 * 2.0 ** -11, "tf32") == 1 + 2.0 ** -9
    assert formats.round_to(3e38, "tf32") == pytest.approx(3e38, rel=2 ** -10)
    assert formats.to_bits(1.0, "tf32") == 127 << 10


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "tf32"])
def test_next_up_and_down_walk_the_format_in_order(fmt):
    f = formats.get_format(fmt)
    x, seen = -float(f.max_finite), []
    while x < float(f.max_finite) and len(seen) < 300:
        seen.append(x)
        nxt = formats.next_up(x, fmt)
        assert nxt > x and formats.next_down(nxt, fmt) == x or (
            x == 0 and nxt == formats.from_bits(1, fmt))
        x = nxt
    if f.bits == 8:  # walked all finite values, less the extra zero
        finite = {formats.from_bits(b, fmt) for b in range(256)
                  if math.isfinite(formats.from_bits(b, fmt))}
        assert len(seen) + 1 == len(finite)


def test_neighbours_of_values_between_grid_points_and_at_the_edges():
    above = formats.from_bits(formats.to_bits(0.1, "fp16") + 1, "fp16")
    assert formats.next_up(0.1, "fp16") == above
    # 0.1 rounds down in fp16
    assert formats.next_down(0.1, "fp16") == formats.round_to(0.1, "fp16")
    assert formats.next_up(65504, "fp16") == math.inf
    assert math.isnan(formats.next_up(448, "fp8_e4m3"))  # e4m3 has no infinity
    assert formats.next_down(1e9, "fp16") == 65504
    assert formats.next_up(0, "bf16") == 2.0 ** -133
    assert formats.next_down(2.0 ** -24, "fp16") == 0.0


def test_ulp_is_the_spacing_in_each_binade():
    assert formats.ulp(1.0, "fp16") == 2.0 ** -10
    assert formats.ulp(1.0, "bf16") == 2.0 ** -7
    assert formats.ulp(1000.0, "fp16") == 0.5
    assert formats.ulp(1e-9, "fp16") == 2.0 ** -24  # subnormal spacing
    assert formats.ulp(65504, "fp16") == 32.0
    rng = np.random.default_rng(3)
    for v in (rng.standard_normal(2000) * 2.0 ** rng.integers(-30, 14, 2000)).tolist():
        # numpy's spacing is the reference: the gap from a stored value to the next one out
        half, single = formats.round_to(v, "fp16"), formats.round_to(v, "fp32")
        assert formats.ulp(half, "fp16") == abs(float(np.spacing(np.float16(half)))), v
        assert formats.ulp(single, "fp32") == abs(float(np.spacing(np.float32(single)))), v


def test_accepts_the_ways_a_learner_writes_numbers():
    assert formats.round_to("0.1", "fp16") == formats.round_to(0.1, "fp16")
    assert formats.round_to(Fraction(1, 3), "bf16") == torch.tensor(1 / 3).bfloat16().item()
    assert formats.round_to(Decimal("65504"), "fp16") == 65504
    assert formats.round_to(np.float32(0.5), "fp8_e5m2") == 0.5
    assert formats.round_to(torch.tensor([2.5]), "fp16") == 2.5
    assert formats.parse_number("2**-24") == Fraction(1, 2 ** 24)
    assert formats.parse_number("-pi") == -math.pi
    assert math.copysign(1, formats.parse_number("-0")) == -1
    assert formats.to_bits("-0", "fp16") == 0x8000
    assert formats.get_format(torch.bfloat16) is formats.get_format("bf16")


@pytest.mark.parametrize("bad, error, words", [
    ("abc", ValueError, "'abc'"), (None, TypeError, "None"), (1 + 2j, TypeError, "complex"),
    (True, TypeError, "bool"), ([1.0], TypeError, "list"), (torch.ones(3), TypeError, "shape"),
])
def test_bad_values_say_what_was_given_and_what_is_accepted(bad, error, words):
    with pytest.raises(error) as info:
        formats.to_bits(bad, "fp16")
    assert words in str(info.value)


def test_bad_formats_and_bit_patterns_are_named_in_the_error():
    with pytest.raises(ValueError, match="'fp12'.*accepted.*'fp16'"):
        formats.get_format("fp12")
    with pytest.raises(ValueError, match="torch.int32"):
        formats.get_format(torch.int32)
    with pytest.raises(ValueError, match="65536 is not a 16-bit pattern.*0 to 65535"):
        formats.from_bits(65536, "fp16")
    with pytest.raises(ValueError, match="-1"):
        formats.from_bits(-1, "fp8_e4m3")
    with pytest.raises(TypeError, match="1.5"):
        formats.from_bits(1.5, "fp16")


@pytest.mark.timeout(10)
@pytest.mark.parametrize("huge", ["1e99999999", "-1e-99999999", "2**99999", "2**-99999", "1e400",
                                  10 ** 400, -(10 ** 400), Decimal("1e99999999")])
def test_numbers_beyond_every_format_are_quick_zeros_or_infinities(huge):
    # a learner typing 1e99999999 must not make the kernel build a 100-million-digit integer
    value = formats.round_to(huge, "fp32", exact=True)
    assert value in (0.0, math.inf, -math.inf)
    assert formats.round_to(huge, "fp16") == value


def test_kind_of_and_exact_value_read_patterns_and_numbers_exactly():
    assert [formats.kind_of(b, "fp16") for b in (0x0000, 0x0001, 0x3C00, 0x7C00, 0x7E00)] == [
        "zero", "subnormal", "normal", "inf", "nan"]
    assert formats.kind_of(0x7F, "fp8_e4m3") == "nan"
    assert formats.kind_of(0x7E, "fp8_e4m3") == "normal"
    assert formats.exact_value("0.1") == (False, Fraction(1, 10))
    assert formats.exact_value(-0.0) == (True, Fraction(0))
    assert formats.exact_value(float("-inf")) == (True, math.inf)
    assert formats.exact_value(torch.tensor([2.5])) == (False, Fraction(5, 2))


def test_the_format_argument_is_called_precision_and_positional_use_still_works():
    assert formats.round_to(0.1, precision="fp16") == formats.round_to(0.1, "fp16")
    assert formats.to_bits(0.1, precision="bf16") == formats.to_bits(0.1, "bf16")
    assert formats.from_bits(0x3C00, precision="fp16") == 1.0
    assert formats.ulp(1.0, precision="fp16") == 2.0**-10
    assert formats.next_up(1.0, precision="fp16") == 1 + 2.0**-10
    assert formats.dtype_of(precision="bf16") is torch.bfloat16
    assert formats.get_format(precision="fp16").name == "fp16"
