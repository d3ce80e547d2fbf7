"""A model of limited-precision accumulation inside an FP8 GEMM, and of the fix.

The DeepSeek-V3 technical report (arXiv 2412.19437, section 3.3.2, "Increasing Accumulation
Precision") reports that the accumulation precision of FP8 GEMM on NVIDIA H800 GPUs is "limited
to retaining around 14 bits", well below fp32's 24, and that the error grows with the inner
dimension K. Their fix: every N_C = 128 elements of K, the tensor cores' partial sum is promoted
(added) into an fp32 accumulator on the CUDA cores, and the partial sum starts again.

This is a *model* of that hardware, not the hardware. NVIDIA does not document how the tensor
core's adder aligns, rounds or groups its inputs, nor whether the report's "14 bits" counts the
implicit leading bit. Here the running sum keeps ``acc_bits`` significant bits (implicit 1
included, fp32's exponent range) after *every single addition*, in K order: each addition is an
fp32 add whose result is then cut to ``acc_bits`` (a narrow register behind an fp32 adder;
rounding the exact sum once instead would differ only when the fp32 rounding carries across an
``acc_bits`` boundary, which is rare). A real tensor core adds several products per instruction
before it rounds, so this model rounds more often than the hardware: it shows the mechanism and
the fix, it does not predict a GPU's numbers.

    round_mantissa(x, bits, mode)                   keep `bits` significant bits, exactly
    accumulate_gemm(a, b, acc_bits=, promote_every=)   a GEMM with that running sum
    accumulation_error(K_values)                    relative error against K, as a Table
    plot_accumulation(table)                        that table on log-log axes
"""

from __future__ import annotations

import torch
from matplotlib.figure import Figure

from mplab._display import Table

__all__ = ["MODES", "round_mantissa", "accumulate_gemm", "accumulation_error",
           "plot_accumulation"]

MODES = ("nearest", "toward_zero")
DEFAULT_KS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_EXP = 0x7F800000  # fp32's exponent field
#: The float64 reference is exact up to here: a product of two e4m3 values is a multiple of
#: 2**-18 below 2**18, so every partial sum of K <= 2**16 of them is a multiple of 2**-18 below
#: 2**34, which float64's 53 bits hold exactly, in any order of addition.
MAX_K = 1 << 16


def _check_tensor(x, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of dtype torch.float32; "
                        f"got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise TypeError(f"{name} must have dtype torch.float32; got {x.dtype} (cast with "
                        ".float(): every fp8, fp16 and bf16 value is exact in float32)")


def _check_int(value, name: str, low: int, high: int | None = None, what: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int{what}; got {value!r} ({type(value).__name__})")
    if value < low or (high is not None and value > high):
        span = f"from {low} to {high}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an int {span}{what}; got {value}")


def _check_bits(bits, name: str) -> None:
    _check_int(bits, name, 1, 24, " (significant bits, the implicit leading 1 included: "
               "24 is fp32, 11 is fp16, 8 is bf16)")


def _check_mode(mode) -> None:
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}; got {mode!r}")


def _masks(bits):
    """(bits to clear, mask that keeps the rest, half an ulp minus one) for int or int tensor."""
    drop = 24 - bits
    return drop, ~((1 << drop) - 1), ((1 << drop) >> 1) - 1


def _round_bits(x, drop, keep, half_m1, nearest: bool, one_bit):
    """Round float32 `x` on its bit pattern. The pattern is sign | magnitude and the magnitude
    grows with the value, so adding half an ulp and clearing low bits rounds to nearest, and a
    carry out of the significand steps the exponent (up to inf, as IEEE overflow does).
    Subnormals need nothing special: their field is already a multiple of the fixed quantum."""
    i = x.view(torch.int32)
    if nearest:
        lsb = (i >> drop) & 1  # the last kept bit: ties go where it becomes 0 (to even)
        if one_bit is not False:  # bits=1: the kept significand is the implicit 1, always odd
            lsb = torch.where(one_bit & ((i & _EXP) != 0), 1, lsb)
        # clamp: with nothing dropped (drop=0) the bias must be 0, not -1
        r = (i + (half_m1 + lsb).clamp_(min=0)) & keep
    else:
        r = i & keep  # truncation: clear the dropped bits, toward zero
    # inf and NaN pass through (rounding could turn a NaN's payload into inf)
    return torch.where((i & _EXP) == _EXP, i, r).view(torch.float32)


def round_mantissa(x: torch.Tensor, bits: int, mode: str = "nearest") -> torch.Tensor:
    """`x` (float32) with its significand kept to `bits` bits, the implicit leading 1 included
    (24 returns fp32 itself, 8 is bf16's precision), exponent range of fp32 unchanged.

    mode "nearest" rounds to nearest, ties to even; "toward_zero" truncates. Exact (integer
    operations on the bits). Inf and NaN pass through; a value past the largest finite one
    rounds to inf in "nearest" mode. Subnormals are rounded exactly as the narrower format's own
    subnormals (gradual underflow at fp32's smallest exponent, 2**-149 * 2**(24 - bits) apart),
    which is what a bf16 cast does; the largest can round up into the smallest normal. With
    bits=1 every normal significand is odd, so a tie goes up in magnitude (as ml_dtypes rounds
    to e8m0)."""
    _check_tensor(x, "x")
    _check_bits(bits, "bits")
    _check_mode(mode)
    x = x.detach()
    if bits == 24:
        return x.clone()
    return _round_bits(x, *_masks(bits), mode == "nearest", bits == 1)


def _accumulate(a, b, bits, mode: str, promote_every, promote=None):
    """a (..., M, K) @ b (..., K, N), the running sum rounded to `bits` (an int, or an int32
    tensor broadcasting against the output) after every addition. Every `promote_every`
    elements the partial sum goes into an fp32 accumulator: everywhere, or where `promote`."""
    masks = _masks(bits)
    one_bit = (bits == 1) if bool((torch.as_tensor(bits) == 1).any()) else False
    shape = torch.broadcast_shapes(torch.as_tensor(bits).shape, a.shape[:-1] + b.shape[-1:])
    partial = torch.zeros(shape)
    acc = torch.zeros(shape) if promote_every else None
    for k in range(a.shape[-1]):
        # fp32 product: exact for fp8 inputs (4 + 4 significant bits fit in 24)
        p = a[..., k, None] * b[..., k, None, :]
        partial = _round_bits(partial + p, *masks, mode == "nearest", one_bit)
        if promote_every and (k + 1) % promote_every == 0:
            if promote is None:
                acc, partial = acc + partial, torch.zeros(shape)
            else:
                acc = acc + torch.where(promote, partial, 0.0)
                partial = torch.where(promote, 0.0, partial)
    # acc holds 0 where nothing was promoted, and 0 + partial is exact
    return partial if acc is None else acc + partial


def accumulate_gemm(a: torch.Tensor, b: torch.Tensor, *, acc_bits: int = 14,
                    promote_every: int | None = None,
                    mode: str = "toward_zero") -> torch.Tensor:
    """a (M, K) @ b (K, N) in float32, with the running sum over K kept to `acc_bits`
    significant bits after every addition, in K order (see the module docstring: a model).

    With `promote_every=n`, every n elements the partial sum is added into an fp32 accumulator
    (an ordinary fp32 add) and restarts at 0, as DeepSeek-V3 does with n = N_C = 128.
    acc_bits=24 without promotion is a plain sequential fp32 sum. Products are fp32 products:
    exact when the inputs are fp8 values. mode "toward_zero" (the default) assumes an adder
    that drops the bits it cannot keep; "nearest" rounds them, ties to even."""
    _check_tensor(a, "a")
    _check_tensor(b, "b")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"a must be (M, K) and b (K, N) with the same K; got a "
                         f"{tuple(a.shape)} and b {tuple(b.shape)}")
    _check_bits(acc_bits, "acc_bits")
    if promote_every is not None:
        _check_int(promote_every, "promote_every", 1, what=" or None (never promote)")
    _check_mode(mode)
    return _accumulate(a.detach(), b.detach(), acc_bits, mode, promote_every)


def _pct(e: float) -> str:
    return f"{100 * e:.3g} %"


def accumulation_error(K_values=DEFAULT_KS, *, M: int = 8, N: int = 8, acc_bits: int = 14,
                       promote_every: int = 128, mode: str = "toward_zero",
                       seed: int = 0) -> Table:
    """One row per K: the relative error (Frobenius norm of the difference over that of the
    exact product) of fp32 sequential accumulation, of an `acc_bits` running sum, and of that
    sum promoted into fp32 every `promote_every` elements, for random e4m3 matrices (M, K) and
    (K, N), fresh for every K. The reference is the float64 product, exact here (see MAX_K)."""
    Ks = list(K_values) if isinstance(K_values, (list, tuple, range)) else None
    if not Ks:
        raise ValueError(f"K_values must be a non-empty list or tuple of ints from 1 to {MAX_K}; "
                         f"got {K_values!r}")
    for K in Ks:
        _check_int(K, "each K", 1, MAX_K, " (the float64 reference is exact up to 2**16)")
    _check_int(M, "M", 1)
    _check_int(N, "N", 1)
    _check_bits(acc_bits, "acc_bits")
    _check_int(promote_every, "promote_every", 1)
    _check_mode(mode)
    _check_int(seed, "seed", 0)

    # Every K padded with zeros to the longest, so one loop over K runs them all: adding 0 to an
    # already rounded sum changes nothing, and a zero partial sum promotes as 0.
    g = torch.Generator().manual_seed(seed)
    a = torch.zeros(len(Ks), M, max(Ks))
    b = torch.zeros(len(Ks), max(Ks), N)
    for j, K in enumerate(Ks):
        a[j, :, :K] = torch.randn(M, K, generator=g).to(torch.float8_e4m3fn).float()
        b[j, :K] = torch.randn(K, N, generator=g).to(torch.float8_e4m3fn).float()
    exact = a.double() @ b.double()
    # three lanes side by side: fp32, acc_bits, acc_bits promoted
    lane = (3, 1, 1, 1)
    bits = torch.tensor([24, acc_bits, acc_bits], dtype=torch.int32).view(lane)
    promote = torch.tensor([False, False, True]).view(lane)
    out = _accumulate(a, b, bits, mode, promote_every, promote).double()
    err = ((out - exact).norm(dim=(-2, -1)) / exact.norm(dim=(-2, -1))).tolist()

    low, high = f"{acc_bits}-bit", f"{acc_bits}-bit + fp32 every {promote_every}"
    rows = [{"K": K, "fp32": e32, low: e_low, high: e_high}
            for K, e32, e_low, e_high in zip(Ks, *err)]
    at = next((r for r in rows if r["K"] == 4096), max(rows, key=lambda r: r["K"]))
    note = (f"A model of the hardware, not the hardware: the running sum keeps {acc_bits} "
            f"significant bits after every addition ({mode.replace('_', ' ')}); DeepSeek-V3 "
            f"reports about 14 bits on H800 tensor cores. At K={at['K']} the {acc_bits}-bit "
            f"running sum is off by {_pct(at[low])}; promotion into fp32 every "
            f"{promote_every} elements brings it to {_pct(at[high])}; plain fp32 "
            f"accumulation is off by {_pct(at['fp32'])}.")
    first, last = min(rows, key=lambda r: r["K"]), max(rows, key=lambda r: r["K"])
    if last["K"] > first["K"]:
        note += (f" From K={first['K']} to K={last['K']} the unpromoted error goes from "
                 f"{_pct(first[low])} to {_pct(last[low])}, the promoted one from "
                 f"{_pct(first[high])} to {_pct(last[high])}.")
    title = f"relative error of a {acc_bits}-bit running sum against K (model)"
    return Table(rows, title=title, note=note)


def plot_accumulation(table: Table, pyplot: bool = True) -> Figure:
    """The table of :func:`accumulation_error` as a log-log plot, one line per method: made by
    pyplot so a notebook shows it, or with ``pyplot=False`` one pyplot does not hold."""
    if not isinstance(table, Table):
        raise TypeError(f"table must be the Table accumulation_error returns; "
                        f"got {type(table).__name__}")
    if "K" not in table.columns or len(table.columns) < 2:
        raise ValueError(f"table needs a 'K' column and at least one error column; "
                         f"got columns {table.columns}")
    if pyplot:
        import matplotlib.pyplot as plt

        fig = plt.figure(figsize=(6.4, 4.2), layout="constrained")
    else:
        fig = Figure(figsize=(6.4, 4.2), layout="constrained")
    ax = fig.add_subplot()
    Ks = table.column("K")
    for name in table.columns:
        if name != "K":  # zero errors (exact sums) are left off the log axis
            pts = [(K, e) for K, e in zip(Ks, table.column(name)) if e > 0]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set(xlabel="K (length of each dot product)", ylabel="relative error (Frobenius)",
           title=(table.title + "\n" if table.title else "")
           + "a model of the hardware, not the hardware")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return fig
