"""mplab.lowbit.accumulator: exact rounding of significands, the limited running sum of a GEMM, the
sweep over K and its plot. References are torch's casts, ml_dtypes, Fractions and Python loops."""

import io
import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from mplab._display import Table
from mplab.lowbit.accumulator import (
    MODES,
    accumulate_gemm,
    accumulation_error,
    plot_accumulation,
    round_mantissa,
)


def from_bits(ints) -> torch.Tensor:
    return torch.from_numpy(np.asarray(ints, dtype=np.uint64).astype(np.uint32).view(np.float32))


def bits_of(x: torch.Tensor) -> list[int]:
    return (x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF).tolist()


def sample(n: int = 20_000, seed: int = 0) -> torch.Tensor:
    """Uniform over fp32 bit patterns (subnormals, huge values, inf and NaN all occur), values
    spread over many binades, and edge cases."""
    rng = np.random.default_rng(seed)
    by_bits = from_bits(rng.integers(0, 1 << 32, n, dtype=np.uint64))
    spread = torch.from_numpy(
        (rng.choice([-1, 1], n) * 2.0 ** rng.uniform(-140, 127, n)).astype(np.float32))
    edges = [0.0, -0.0, math.inf, -math.inf, math.nan, 1.0, -1.0, 1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8,
             1 + 2.0 ** -8 + 2.0 ** -20, 2.0 ** -126, 2.0 ** -149, 2.0 ** -126 - 2.0 ** -149,
             -(2.0 ** -126 - 2.0 ** -149), 3.4028235e38, -3.4028235e38, 3.3895314e38, 65504.0]
    return torch.cat([by_bits, spread, torch.tensor(edges, dtype=torch.float32)])


def ties(bits: int, n: int = 2_000, seed: int = 1) -> torch.Tensor:
    """Random finite fp32 values set exactly halfway between two `bits`-bit neighbours."""
    drop = 24 - bits
    ints = np.random.default_rng(seed).integers(0, 1 << 32, n, dtype=np.uint64)
    ints = np.where(ints & 0x7F800000 == 0x7F800000, ints ^ (1 << 23), ints)  # exponent 254
    ints = (ints >> drop << drop) | (1 << (drop - 1))
    return from_bits(ints)


def same(got: torch.Tensor, want: torch.Tensor):
    """Equal bit for bit, NaNs only as NaNs (their payloads may differ)."""
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    g, w = got[~nan], want[~nan]
    bad = (g.view(torch.int32) != w.view(torch.int32)).nonzero().flatten()[:5].tolist()
    assert not bad, [(w[i].item(), g[i].item()) for i in bad]


def test_8_bits_to_nearest_is_torch_bf16_cast_bit_for_bit():
    x = torch.cat([sample(), ties(8)])
    same(round_mantissa(x, 8), x.to(torch.bfloat16).float())


def test_11_bits_to_nearest_is_torch_fp16_cast_inside_fp16_normal_range():
    x = torch.cat([sample(), ties(11)])
    inside = torch.isfinite(x) & (x.abs() >= 2.0 ** -14) & (x.abs() <= 65504)
    x = x[inside]
    assert len(x) > 3000
    same(round_mantissa(x, 11), x.to(torch.float16).float())


def exact_round(v: float, bits: int, mode: str) -> float:
    """`v` kept to `bits` significant bits with fp32's exponent range, on Fractions."""
    if not math.isfinite(v) or v == 0:
        return v
    f = abs(Fraction(v))
    e = f.numerator.bit_length() - f.denominator.bit_length()
    e -= Fraction(2) ** e > f  # now 2**e <= f < 2**(e+1)
    quantum = Fraction(2) ** (max(e, -126) - bits + 1)  # fixed below the smallest normal
    q = f / quantum
    n = math.floor(q) if mode == "toward_zero" else round(q)  # round(): ties to even
    r = n * quantum
    return math.copysign(math.inf if r >= 2 ** 128 else float(r), v)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bits", range(1, 25))
def test_every_width_and_mode_matches_an_exact_fraction_reference(bits, mode):
    x = sample(400, seed=bits)
    if bits < 24:
        x = torch.cat([x, ties(bits, 200, seed=bits)])
    want = torch.tensor([exact_round(v, bits, mode) for v in x.tolist()], dtype=torch.float32)
    same(round_mantissa(x, bits, mode), want)


def test_one_bit_to_nearest_rounds_like_ml_dtypes_e8m0():
    # With 1 bit every normal significand is odd, so "ties to even" has to be read as
    # IEEE does on the integer significand: a tie goes up in magnitude. ml_dtypes agrees.
    x = sample(5000)
    x = x[torch.isfinite(x) & (x >= 2.0 ** -126) & (x < 2.0 ** 127)]
    want = torch.from_numpy(x.numpy().astype(ml_dtypes.float8_e8m0fnu).astype(np.float32))
    same(round_mantissa(x, 1), want)
    assert round_mantissa(torch.tensor([1.5, 3.0, 0.75]), 1).tolist() == [2.0, 4.0, 1.0]


@pytest.mark.parametrize("mode", MODES)
def test_inf_and_nan_pass_through_and_24_bits_is_a_copy(mode):
    x = from_bits([0x7F800000, 0xFF800000, 0x7F800001, 0xFFC00000, 0x7FBFFFFF])
    for bits in (1, 8, 14, 23):
        out = round_mantissa(x, bits, mode)
        assert bits_of(out[:2]) == bits_of(x[:2]) and torch.isnan(out[2:]).all(), (bits, out)
    y = torch.randn(100)
    out = round_mantissa(y, 24, mode)
    assert torch.equal(out, y) and out.data_ptr() != y.data_ptr()


def test_truncation_moves_toward_zero_and_subnormals_round_on_their_fixed_grid():
    x = torch.tensor([1.99, -1.99, 2.0 ** -126 - 2.0 ** -149, 3 * 2.0 ** -149])
    assert round_mantissa(x, 2, "toward_zero").tolist() == [1.5, -1.5, 2.0 ** -127, 0.0]
    # the largest subnormal rounds up into the smallest normal
    assert round_mantissa(x[2:3], 8).item() == 2.0 ** -126


def fp8(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(torch.float8_e4m3fn).float()


def python_gemm(a, b, bits=24, promote_every=None, mode="toward_zero"):
    """One output at a time, one k at a time: numpy float32 scalars and exact_round."""
    a, b = a.numpy(), b.numpy()
    out = np.zeros((a.shape[0], b.shape[1]), dtype=np.float32)
    for i in range(a.shape[0]):
        for j in range(b.shape[1]):
            acc = partial = np.float32(0)
            for k in range(a.shape[1]):
                s = partial + a[i, k] * b[k, j]  # float32 product and sum
                partial = np.float32(exact_round(float(s), bits, mode))
                if promote_every and (k + 1) % promote_every == 0:
                    acc, partial = acc + partial, np.float32(0)
            out[i, j] = acc + partial
    return torch.from_numpy(out)


def test_24_bits_without_promotion_is_a_sequential_fp32_sum():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(3, 257, generator=g), torch.randn(257, 4, generator=g) * 1e3
    got = accumulate_gemm(a, b, acc_bits=24)
    assert torch.equal(got, python_gemm(a, b))
    # and it is not what a float64 product rounded once gives: the order of rounding shows
    assert not torch.equal(got, (a.double() @ b.double()).float())


@pytest.mark.parametrize("mode", MODES)
def test_limited_sum_with_promotion_matches_a_python_loop(mode):
    a, b = fp8((2, 300), 4), fp8((300, 3), 5)
    for bits, n in [(14, 128), (14, None), (5, 7)]:
        got = accumulate_gemm(a, b, acc_bits=bits, promote_every=n, mode=mode)
        assert torch.equal(got, python_gemm(a, b, bits, n, mode)), (bits, n)


def test_promotion_after_every_element_is_plain_fp32_for_fp8_inputs():
    # partial = round(0 + product) = product: an fp8 product has 8 significant bits at most
    a, b = fp8((4, 500), 6), fp8((500, 5), 7)
    assert torch.equal(accumulate_gemm(a, b, acc_bits=8, promote_every=1),
                       accumulate_gemm(a, b, acc_bits=24))


@pytest.fixture(scope="module")
def table():
    return accumulation_error()


def test_the_unpromoted_error_grows_with_K_and_promotion_holds_it_at_one_block(table):
    K = table.column("K")
    fp32, low, high = (table.column(c) for c in table.columns[1:])
    assert K == [128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    assert all(x < y for x, y in zip(low, low[1:])), low
    assert low[-1] > 50 * low[0]
    at = K.index(4096)
    assert high[0] == low[0]  # K=128: one block, promotion changes nothing
    # promoted every 128, K=4096 is 32 blocks added in fp32: about one block's error, far
    # below the unpromoted one, and still far above fp32's (14 bits, not 24, inside a block)
    assert high[at] < 2 * low[0] and high[at] < low[at] / 10
    assert fp32[at] < high[at] / 100
    assert max(high) < 3 * min(high)  # flat in K


def test_truncation_is_much_worse_than_rounding_to_nearest():
    kw = dict(K_values=(4096,), M=4, N=4)
    cut, near = accumulation_error(**kw), accumulation_error(mode="nearest", **kw)
    assert cut[0]["14-bit"] > 5 * near[0]["14-bit"]
    assert cut[0]["fp32"] == near[0]["fp32"]


def test_the_note_carries_the_measured_numbers(table):
    row = table[table.column("K").index(4096)]
    for name in table.columns[1:]:
        assert f"{100 * row[name]:.3g} %" in table.note, (name, table.note)
    assert "K=4096" in table.note and "model of the hardware, not the hardware" in table.note
    other = accumulation_error(K_values=(128, 4096), seed=1)
    assert other.note != table.note and "From K=128 to K=4096" in other.note
    assert "K=16384" in accumulation_error(K_values=(16384, 128), M=2, N=2).note  # no 4096


def test_rows_are_data_and_the_reference_is_exact(table):
    assert isinstance(table, Table) and len(table) == 8
    assert all(isinstance(v, float) for r in table for k, v in r.items() if k != "K")
    assert table.column("fp32")[0] == 0.0  # K=128: the fp32 sum of fp8 products is exact here


def test_plot_has_one_log_log_line_per_method(table):
    fig = plot_accumulation(table)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert ax.get_xscale() == ax.get_yscale() == "log"
    assert [ln.get_label() for ln in ax.get_lines()] == table.columns[1:]
    fig.savefig(io.BytesIO(), format="png")  # renders without pyplot


@pytest.mark.parametrize("call, error, words", [
    (lambda: round_mantissa(torch.ones(2), 0), ValueError, ["bits", "1 to 24", "got 0"]),
    (lambda: round_mantissa(torch.ones(2), 25), ValueError, ["1 to 24", "got 25"]),
    (lambda: round_mantissa(torch.ones(2), 8.0), TypeError, ["int", "8.0"]),
    (lambda: round_mantissa(torch.ones(2), True), TypeError, ["int", "True"]),
    (lambda: round_mantissa(torch.ones(2), 8, "up"), ValueError, ["'nearest'", "'up'"]),
    (lambda: round_mantissa(torch.ones(2, dtype=torch.float64), 8), TypeError,
     ["torch.float32", "torch.float64"]),
    (lambda: round_mantissa(torch.ones(2, dtype=torch.int32), 8), TypeError, ["torch.int32"]),
    (lambda: round_mantissa([1.0], 8), TypeError, ["torch.Tensor", "list"]),
    (lambda: accumulate_gemm(torch.ones(3, 4), torch.ones(5, 2)), ValueError,
     ["(3, 4)", "(5, 2)", "same K"]),
    (lambda: accumulate_gemm(torch.ones(4), torch.ones(4, 2)), ValueError, ["(M, K)", "(4,)"]),
    (lambda: accumulate_gemm(torch.ones(2, 2), torch.ones(2, 2, dtype=torch.bfloat16)),
     TypeError, ["b", "torch.bfloat16"]),
    (lambda: accumulate_gemm(torch.ones(2, 2), torch.ones(2, 2), acc_bits=30), ValueError,
     ["acc_bits", "got 30"]),
    (lambda: accumulate_gemm(torch.ones(2, 2), torch.ones(2, 2), promote_every=0), ValueError,
     ["promote_every", "got 0"]),
    (lambda: accumulate_gemm(torch.ones(2, 2), torch.ones(2, 2), mode="nearest_even"),
     ValueError, ["'toward_zero'", "'nearest_even'"]),
    (lambda: accumulation_error(()), ValueError, ["K_values", "()"]),
    (lambda: accumulation_error((128, 1 << 20)), ValueError, ["65536", str(1 << 20)]),
    (lambda: accumulation_error((128,), promote_every=None), TypeError, ["promote_every"]),
    (lambda: plot_accumulation({"K": [1]}), TypeError, ["Table", "dict"]),
    (lambda: plot_accumulation(Table([{"x": 1}])), ValueError, ["'K'", "['x']"]),
])
def test_bad_input_says_what_was_given_and_what_is_accepted(call, error, words):
    with pytest.raises(error) as info:
        call()
    assert all(w in str(info.value) for w in words), str(info.value)
