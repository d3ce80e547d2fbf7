"""Microscaling, from scratch: a scale per small block of elements, as MXFP8, MXFP4 and NVFP4
store a tensor.

    q = mx(x, "fp8_e4m3")              # MXFP8: 32 elements share one E8M0 scale (a power of 2)
    q = mx(x, "fp4_e2m1", mode="rceil")  # MXFP4, the scale rounded up from amax / max instead
    q = nvfp4(x)                       # NVFP4: 16 fp4 elements per E4M3 scale, times one fp32
                                       # scale for the tensor
    q.scale_codes, q.values, q.dequantized, q.sqnr_db

The OCP MX spec's scale is 2^(floor(log2 amax) - emax), emax the element format's largest
exponent ("floor"); "ceil" rounds that exponent up when amax is not a power of two, "even"
first rounds amax to the element's precision, "rceil" is 2^ceil(log2(amax / max)), cuBLAS's
rule for MXFP8. Everything equals torchao 0.18's ``to_mx`` and ``nvfp4_quantize`` bit for bit,
data and scales, including what torchao does at the edges (named where it is done), with one
difference on purpose: "rceil" here takes the exact ceiling of log2, where torchao's CPU path
rounds log2 to float32 first, so a block whose amax / max lies just above a power of two gets
a scale one binade lower there (the GPU instruction torchao uses when compiled is exact).
"""

from __future__ import annotations

import math

import torch

from mplab.lowbit.quantize import (
    Quantized,
    abs_max,
    element_format,
    encode,
    round_to_format,
    scale_and_cast,
)
from mplab.numerics.formats import FP8_E4M3, FloatFormat

__all__ = ["mx", "nvfp4", "MX_ELEMENTS", "MX_MODES", "mx_scale_exponent"]

MX_ELEMENTS = ("fp8_e4m3", "fp8_e5m2", "fp6_e2m3", "fp6_e3m2", "fp4_e2m1")
MX_MODES = ("floor", "rceil", "ceil", "even")
_F32_MIN_NORMAL = 2.0 ** -126


def _blocks(x, block: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.bfloat16):
        got = f"a tensor of {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{name} takes a float32 or bfloat16 tensor, got {got}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    if x.dim() < 1 or x.shape[-1] % block:
        raise ValueError(f"{name} needs the last dimension to be a multiple of the block "
                         f"({block}); got shape {tuple(x.shape)}")
    x = x.float()
    return x, x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def mx_scale_exponent(amax: torch.Tensor, precision="fp8_e4m3", mode: str = "floor"):
    """The unbiased E8M0 exponent each block's scale takes from its amax (int32), before the
    bias: -127 to 127, with 128 standing for NaN. Exact integer work on the float's exponent."""
    f = element_format(precision)
    if mode not in MX_MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, MX_MODES))}, got {mode!r}")
    a = amax.float()
    emax = math.floor(math.log2(f.max_finite))  # the element's largest power of two
    if mode == "floor":  # floor(log2 amax) is its exponent field less the bias, as read here:
        # amax 0 or an fp32 subnormal (field 0) as 2^-127, inf (field 255) as 2^128
        e = (a.view(torch.int32) >> 23) - 127  # a negative amax: below -127, clamped to it
        k = (e.masked_fill_(torch.isinf(a), 128) - emax).clamp_(-127, 128)
        return k.masked_fill_(torch.isnan(a), 128)
    finite = torch.isfinite(a) & (a > 0)
    safe = torch.where(finite, a, 1.0)
    if mode == "rceil":
        d = safe / float(f.max_finite)  # float32, as the hardware divides
        m, e = torch.frexp(d)
        k = e - (m == 0.5).to(e.dtype)  # the exact ceil(log2 d)
        k = torch.where(finite, k.clamp(-127, 127), -127)
        k = torch.where(torch.isinf(a), 127, k)  # torchao: an inf amax gives 254, 2^127
        return torch.where(torch.isnan(a), 128, k)
    m, e = torch.frexp(safe)  # safe = m 2^e, m in [0.5, 1)
    e = e - 1  # floor(log2 safe)
    if mode == "ceil":
        e = e + (m != 0.5).to(e.dtype)
    else:  # "even": amax first rounded to the element's mantissa, half up
        e = e + (m >= 1 - 2.0 ** -(f.man_bits + 2)).to(e.dtype)
    # amax 0 or an fp32 subnormal reads as 2^-127, inf as 2^128: the float's exponent field
    e = torch.where(finite & (a >= _F32_MIN_NORMAL), e, -127)
    e = torch.where(torch.isinf(a), 128, e)
    k = (e - emax).clamp(-127, 128)
    return torch.where(torch.isnan(a), 128, k)


def mx(x: torch.Tensor, precision="fp8_e4m3", *, block: int = 32,
       mode: str = "floor") -> Quantized:
    """x (float32 or bfloat16, last dimension a multiple of `block`) in an MX format: each
    `block` consecutive elements of the last dimension share one E8M0 scale."""
    f = element_format(precision)
    if f.name not in MX_ELEMENTS:
        raise ValueError(f"MX elements are {', '.join(MX_ELEMENTS)}; got {f.name}")
    x, blocks = _blocks(x, block, "mx")
    amax = abs_max(blocks, -1)  # NaN when the block holds a NaN
    k = mx_scale_exponent(amax, f, mode)
    codes = (k + 127).to(torch.uint8)  # 0xFF: NaN
    scale = torch.ldexp(torch.ones_like(amax), k.clamp(max=127))
    if mode == "rceil":
        # torchao multiplies by 2^-k, except: NaN stays NaN, a scale of 2^-127 multiplies by 1
        rcp = torch.ldexp(torch.ones_like(amax), -k.clamp(max=127))
        rcp = torch.where(codes == 0, 1.0, rcp)
        rcp = torch.where(codes == 255, math.nan, rcp)
    else:
        # torchao divides by 2^k as a float32 made from the exponent bits: 0xFF is inf, and the
        # smallest, 2^-127 (0x00), is raised to 2^-126 (the smallest normal) first. Times 2^-k
        # is the same bits (2^-k is exact, 1 / inf is 0) and a faster pass than a division.
        div = (codes.to(torch.int32) << 23).view(torch.float32).clamp_(min=_F32_MIN_NORMAL)
        rcp = div.reciprocal_()
    scale = torch.where(codes == 255, math.nan, scale)
    scaled, values, dequantized = scale_and_cast(blocks, rcp, f, scale)
    shape = x.shape
    return Quantized(f"MXFP{f.bits} ({f.name}, {mode})", f, x, scaled.reshape(shape),
                     values.reshape(shape), scale.squeeze(-1), dequantized.reshape(shape),
                     (1,) * (x.dim() - 1) + (block,), scale_bits=8,
                     scale_codes=codes.squeeze(-1))


def _e4m3(v: torch.Tensor) -> torch.Tensor:
    return round_to_format(v, FP8_E4M3)


def nvfp4(x: torch.Tensor, *, tensor_scale: bool = True, block: int = 16) -> Quantized:
    """x (float32 or bfloat16, 2-D or 3-D, last dimension a multiple of 16) in NVFP4: 16 fp4
    elements per block, each block's scale an E4M3 number; with `tensor_scale`, the E4M3 scales
    are themselves scaled by one fp32 number for the tensor, amax / (448 * 6), so the largest
    block scale lands at E4M3's top. As torchao computes it, multiplying by reciprocals."""
    if block != 16:
        raise ValueError(f"NVFP4's block is 16 elements, got block={block!r}")
    f: FloatFormat = element_format("fp4_e2m1")
    x, blocks = _blocks(x, block, "nvfp4")
    if x.dim() not in (2, 3):
        raise ValueError(f"nvfp4 takes a 2-D or 3-D tensor, got shape {tuple(x.shape)}")
    amax = abs_max(blocks, -1)
    block_scale = amax / 6.0
    tiny, top8 = float(FP8_E4M3.min_normal), float(FP8_E4M3.max_finite)
    if tensor_scale:
        ts = abs_max(x) / (top8 * 6.0)
        e4m3 = _e4m3((block_scale / ts).clamp(tiny, top8))
        reciprocal = (1.0 / ts) / e4m3
        scale = ts * e4m3
    else:
        ts = None
        e4m3 = _e4m3(block_scale.clamp(tiny, top8))
        reciprocal = 1.0 / e4m3
        scale = e4m3
    scaled, values, dequantized = scale_and_cast(blocks, reciprocal, f, scale)
    shape = x.shape
    return Quantized(f"NVFP4{' (with tensor scale)' if tensor_scale else ''}", f, x,
                     scaled.reshape(shape), values.reshape(shape), scale.squeeze(-1),
                     dequantized.reshape(shape), (1,) * (x.dim() - 1) + (block,),
                     scale_bits=8, scale_codes=encode(e4m3, FP8_E4M3).squeeze(-1),
                     tensor_scale=ts)
