"""FP8 scaling recipes, from scratch: what a tensor becomes when training keeps it in 8 bits.

    q = tensorwise(x)                 # one scale for the tensor (torchao's Float8 "tensorwise")
    q = rowwise(x)                    # one per row, rounded down to a power of two ("rowwise")
    q = blockwise(x, (1, 128))        # DeepSeek-V3's 1x128 activation tiles; (128, 128) weights
    d = DelayedScaling(history_len=16, algo="max", margin=0)  # Transformer Engine's recipe
    q = d.quantize(x)                 # the scale comes from earlier steps' amax, not this one's
    q.dequantized, q.sqnr_db, q.flushed, q.saturated
    scaled_mm(tensorwise(a), tensorwise(b))   # as torch._scaled_mm computes it on the CPU

Each recipe returns a :class:`Quantized`: the element codes (bit patterns), their values, the
scales, what the values dequantise to, and what the recipe did to the tensor. The element cast
is :func:`round_to_format`, written here with tensor arithmetic (no torch float8 cast inside) and
equal bit for bit to torch's casts and to ml_dtypes'. The scales follow torchao 0.18's float8
training code (``amax_to_scale``: ``max / clamp(amax, 1e-12)`` in float64, then float32; the
tensor times the scale, clamped, cast; dequantised as values / scale), so the results equal
torchao's bit for bit. Microscaling (MXFP8, MXFP4, NVFP4) is :mod:`mplab.lowbit.microscaling`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mplab._optional import require
from mplab.numerics.formats import FloatFormat, get_format, to_bits

__all__ = ["Quantized", "round_to_format", "scale_and_cast", "abs_max", "encode",
           "tensorwise", "rowwise", "blockwise", "DelayedScaling", "scaled_mm", "element_format",
           "load_torchao", "EPS"]

#: torchao's floor on amax before dividing by it (float8_utils.EPS).
EPS = 1e-12


def load_torchao():
    """Import torchao quietly: on a CPU its import logs a warning per CUDA extension it cannot
    load, and torch warns once about an enum it registers; neither matters here."""
    import logging
    import warnings

    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        require("torchao", "torchao's recipes (and mplab's comparisons with them)")
        import torchao
        import torchao.float8
        import torchao.prototype.mx_formats.mx_tensor  # noqa: F401
        import torchao.prototype.mx_formats.nvfp4_tensor  # noqa: F401
    return torchao


def element_format(precision) -> FloatFormat:
    """A format elements can be stored in (e8m0 is only a scale: it has no sign and no zero)."""
    f = get_format(precision)
    if not f.signed or f.bits > 16 or f.name == "tf32":
        raise ValueError(f"{f.name} is not an element format below 16 bits; accepted: "
                         "fp8_e4m3, fp8_e5m2, fp8_e4m3fnuz, fp8_e5m2fnuz, fp6_e3m2, fp6_e2m3, "
                         "fp4_e2m1, fp16, bf16")
    return f


def _float_tensor(x, name: str = "x") -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = f"a tensor of {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{name} must be a floating-point torch tensor, got {got}")
    return x.float()


#: Elements one slab of a cast holds on a CPU (1 MiB of float32): the cast's passes over a
#: slab stay in cache, where the same passes over a whole large tensor go to memory each time.
#: A GPU takes the tensor as one slab.
SLAB = 1 << 18


def _slab(x: torch.Tensor) -> int:
    return SLAB if x.device.type == "cpu" else max(1, x.numel())


@torch.no_grad()  # rounding has no gradient to give; the slabs' out= ops refuse autograd
def round_to_format(x: torch.Tensor, precision, *, saturate: bool = False) -> torch.Tensor:
    """x (as float32) rounded to the nearest value of the format, ties to even, an overflow as
    the format's cast does it: inf (e5m2, fp16), the largest finite (e4m3, fp6, fp4) or NaN
    (the FNUZ formats). Subnormals are kept. Bit for bit torch's cast where torch has one.
    `saturate` clamps to +-max_finite whatever the format's overflow: what the recipes do
    before their cast (clamping after the rounding gives the same bits: the largest finite
    is on the grid, and the rounding never moves a value past a grid point).

    The rounding is float32's own: adding C = 2^23 x (the format's spacing at |x|) leaves |x|
    no significand bits below that spacing, so the addition rounds them off, ties to even, and
    subtracting C again is exact. C is |x|'s power of two (its exponent bits, raised to the
    format's smallest normal binade, where the subnormals' spacing holds), the 2^23 the adds'
    alpha: seven passes, run a `SLAB` at a time, many times faster than frexp/ldexp arithmetic.
    bf16 keeps float32's range, where C would overflow: it works in float64 (2^52 x spacing)."""
    f = element_format(precision)
    x = _float_tensor(x)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    flat, into, slab = x.reshape(-1), out.view(-1), _slab(x)
    scratch = torch.empty(min(slab, flat.numel()), dtype=torch.int32, device=x.device)
    for i in range(0, flat.numel(), slab):
        _round_into(flat[i:i + slab], into[i:i + slab], f, saturate, scratch)
    return out


def _round_into(x: torch.Tensor, out: torch.Tensor, f: FloatFormat, saturate: bool,
                scratch: torch.Tensor) -> torch.Tensor:
    """round_to_format of a contiguous float32 slab into `out` (its shape), C in `scratch`
    (int32, at least as many elements)."""
    wide = f.emax + 1 + 23 - f.man_bits > 127
    if wide:
        r = x.double().abs_()
        c = (r.view(torch.int64) & (0x7FF << 52)).view(torch.float64)
    else:
        r = torch.abs(x, out=out)
        c = torch.bitwise_and(r.view(torch.int32), 0x7F800000,
                              out=scratch[:x.numel()].view(x.shape)).view(torch.float32)
    # c: 2^floor(log2 |x|), 0 below the normals; the clamp past the format's top binade
    # (where everything overflows anyway) keeps C finite
    c.clamp_(2.0 ** f.emin, 2.0 ** (f.emax + 1))
    alpha = 2.0 ** ((52 if wide else 23) - f.man_bits)
    r = r.add_(c, alpha=alpha).sub_(c, alpha=alpha)
    r = out.copy_(r) if wide else r
    top = float(f.max_finite)
    if saturate or f.overflow == "saturate":
        r.clamp_(max=top)  # inf included; NaN stays NaN
    else:
        r.masked_fill_(r > top, math.nan if f.overflow == "nan" else math.inf)
    r.copysign_(x)  # -0 and NaN's sign included
    if f.nan == "fnuz":  # FNUZ has no -0
        r.masked_fill_(r == 0, 0.0)
    return r


@torch.no_grad()
def scale_and_cast(x: torch.Tensor, times: torch.Tensor, precision, back: torch.Tensor, *,
                   divide: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A recipe's three tensors from float32 x: `scaled` = x * times; `values`, that rounded to
    the format and clamped to +-max_finite (round_to_format(scaled, saturate=True)); and
    `dequantized` = values * back (values / back with `divide`). `times` and `back` broadcast
    against x, each one value or one per index of x's first dimension (a scale per row, or
    per block or tile laid along it). Bit for bit what the three expressions give, computed
    a slab of rows at a time: the cast's passes then run in cache, faster on a large tensor
    than over the whole of it (benchmarks/RECORDS.md)."""
    f = element_format(precision)
    x = _float_tensor(x)
    if x.dim() == 0:
        return tuple(t.reshape(()) for t in scale_and_cast(x.reshape(1), times, f, back,
                                                           divide=divide))
    scaled, values, dequantized = (torch.empty_like(x, memory_format=torch.contiguous_format)
                                   for _ in range(3))
    n = x.shape[0]
    row = x.numel() // n if n else 0
    rows = max(1, _slab(x) // max(1, row))  # rows per slab
    scratch = torch.empty(min(rows * row, x.numel()), dtype=torch.int32, device=x.device)
    back_op = torch.div if divide else torch.mul

    def part(t, at):  # a scale's rows for the slab, or the one scale for all
        return t[at] if t.dim() == x.dim() and t.shape[0] == n else t

    for i in range(0, n, rows):
        at = slice(i, i + rows)
        torch.mul(x[at], part(times, at), out=scaled[at])
        _round_into(scaled[at], values[at], f, True, scratch)
        back_op(values[at], part(back, at), out=dequantized[at])
    return scaled, values, dequantized


def abs_max(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """x.abs().amax(dim, keepdim=True) (the whole tensor's for dim None), bit for bit, as
    max(max x, -min x): two reductions cost less than the copy |x| would be. Where that is
    NaN, x.abs().amax itself: the bits of the NaN it returns (its sign) depend on which of
    torch's reduction kernels ran, and torchao's recipes call that one."""
    if dim is None:
        m = torch.maximum(x.amax(), x.amin().neg_())
    else:
        m = torch.maximum(x.amax(dim, keepdim=True), x.amin(dim, keepdim=True).neg_())
    if m.isnan().any():
        return x.abs().amax() if dim is None else x.abs().amax(dim, keepdim=True)
    return m.abs_()  # -0 as +0


def encode(values: torch.Tensor, precision) -> torch.Tensor:
    """The bit patterns (uint8, or int32 past 8 bits) of values already on the format's grid
    (what :func:`round_to_format` returns)."""
    f = element_format(precision)
    v = _float_tensor(values, "values")
    a = v.abs()
    _, exp = torch.frexp(a)
    e = exp - 1
    normal = a >= float(f.min_normal)
    man_normal = torch.ldexp(a, (f.man_bits - e).clamp(max=120)) - (1 << f.man_bits)
    man = torch.where(normal, man_normal, a / float(f.min_subnormal))
    code = torch.where(normal, (e + f.bias) << f.man_bits, 0) + man.nan_to_num(0).to(torch.int32)
    sign = torch.signbit(v) & ~((a == 0) & (f.nan == "fnuz"))  # FNUZ has no -0
    code = code | (sign.to(torch.int32) << (f.bits - 1))
    for special, mask in ((math.inf, torch.isinf(v) & ~sign), (-math.inf, torch.isinf(v) & sign)):
        if mask.any():
            code = torch.where(mask, to_bits(special, f), code)
    nan = torch.isnan(v)
    if nan.any():
        code = torch.where(nan & sign, to_bits(-math.nan, f), code)
        code = torch.where(nan & ~sign, to_bits(math.nan, f), code)
    return code.to(torch.uint8) if f.bits <= 8 else code


@dataclass(frozen=True, eq=False)
class Quantized:
    """A tensor as a recipe stores it.

    `values` are the elements (float32 values on `format`'s grid) and `codes` their bit patterns;
    `scale` is what a scaled GEMM multiplies an element by (broadcast over its block);
    `dequantized` is what the recipe gives back (as its library computes it); `scaled` is the
    tensor in the format's units before the cast, so what fell below the format's smallest
    value or past its largest can be counted. `block` is the shape one scale covers.
    """

    recipe: str
    format: FloatFormat
    source: torch.Tensor
    scaled: torch.Tensor
    values: torch.Tensor
    scale: torch.Tensor
    dequantized: torch.Tensor
    block: tuple[int, ...]
    scale_bits: int = 32
    scale_codes: torch.Tensor | None = None
    tensor_scale: torch.Tensor | None = None

    @property
    def codes(self) -> torch.Tensor:
        return encode(self.values, self.format)

    @property
    def bytes_per_value(self) -> float:
        """Element bits plus the scales' bits, shared over the values each covers, in bytes."""
        scale_bits = self.scale_bits * self.scale.numel() + 32 * (self.tensor_scale is not None)
        return (self.format.bits + scale_bits / self.source.numel()) / 8

    @property
    def sqnr_db(self) -> float:
        """Signal to quantisation noise: 10 log10(sum x^2 / sum (x - dequantized)^2), in dB
        (inf when nothing was lost), over the finite values."""
        x = self.source.double()
        finite = torch.isfinite(x) & torch.isfinite(self.dequantized)
        noise = (x - self.dequantized.double())[finite].pow(2).sum().item()
        signal = x[finite].pow(2).sum().item()
        if noise == 0:
            return math.inf
        return 10 * math.log10(signal / noise) if signal else -math.inf

    @property
    def flushed(self) -> float:
        """Share of the nonzero values that became 0."""
        nonzero = self.source != 0
        return ((self.values == 0) & nonzero).sum().item() / max(1, nonzero.sum().item())

    @property
    def saturated(self) -> float:
        """Share of the nonzero values whose scaled magnitude was past the format's largest
        finite by more than rounding takes back (half its spacing there): those the clamp cut
        (or that became inf/NaN where the format overflows so). A scale rounded to fp32 can put
        amax a hair past the top; that is not counted."""
        f = self.format
        past = self.scaled.abs() > float(f.max_finite) + 2.0 ** (f.emax - f.man_bits - 1)
        return past.sum().item() / max(1, (self.source != 0).sum().item())


def _fp8_recipe(x: torch.Tensor, amax: torch.Tensor, f: FloatFormat, power_of_2: bool,
                eps: float = EPS):
    """torchao's float8 cast: s = max / clamp(amax, eps) (float64, then float32), optionally
    rounded down to a power of two; x * s clamped to +-max and cast; dequantised as values / s.
    With eps 0 an amax of 0 gives s = inf, and 0 * inf = NaN: the cast without torchao's floor."""
    s = (float(f.max_finite) / amax.double().clamp(min=eps)).float()
    if power_of_2:
        s = torch.exp2(torch.floor(torch.log2(s)))
    return (*scale_and_cast(x, s, f, s, divide=True), s)


def _finish(recipe, f, x, scaled, values, dequantized, s, block) -> Quantized:
    return Quantized(recipe, f, x, scaled, values, s.reciprocal(), dequantized, block)


def tensorwise(x: torch.Tensor, precision="fp8_e4m3", *, amax=None,
               power_of_2: bool = False, eps: float = EPS) -> Quantized:
    """One scale for the whole tensor, from its amax (or `amax` given: a delayed or calibrated
    one), floored at `eps` (torchao's; 0: no floor). torchao's Float8 "tensorwise" recipe."""
    f = element_format(precision)
    x = _float_tensor(x)
    amax = abs_max(x) if amax is None else torch.as_tensor(amax, dtype=torch.float32)
    return _finish("tensorwise", f, x, *_fp8_recipe(x, amax, f, power_of_2, _eps(eps)),
                   tuple(x.shape))


def _eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps >= 0:
        raise ValueError(f"eps must be a number of at least 0, got {eps!r}")
    return float(eps)


def rowwise(x: torch.Tensor, precision="fp8_e4m3", *, dim: int = -1,
            power_of_2: bool = True, eps: float = EPS) -> Quantized:
    """One scale per slice along `dim` (a row of a (M, K) input for dim=-1), rounded down to a
    power of two, as torchao's "rowwise" recipe does; each amax floored at `eps`."""
    f = element_format(precision)
    x = _float_tensor(x)
    if x.dim() < 1:
        raise ValueError("rowwise scaling needs a tensor of at least one dimension, got a scalar")
    amax = abs_max(x, dim)
    block = [1] * x.dim()
    block[dim] = x.shape[dim]
    return _finish(f"rowwise (dim {dim})", f, x,
                   *_fp8_recipe(x, amax, f, power_of_2, _eps(eps)), tuple(block))


def blockwise(x: torch.Tensor, block=(1, 128), precision="fp8_e4m3") -> Quantized:
    """One scale per `block` tile of a 2-D tensor: (1, 128) for activations and (128, 128) for
    weights, DeepSeek-V3's recipe (torchao's blockwise_fp8_training reference casts)."""
    f = element_format(precision)
    x = _float_tensor(x)
    if (not isinstance(block, tuple | list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"block must be two positive ints (rows, columns), got {block!r}")
    if x.dim() != 2 or x.shape[0] % block[0] or x.shape[1] % block[1]:
        raise ValueError(f"blockwise scaling needs a 2-D tensor whose sides are multiples of the "
                         f"block {tuple(block)}; got shape {tuple(x.shape)}")
    (m, k), (bm, bk) = x.shape, block
    tiles = x.reshape(m // bm, bm, k // bk, bk)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
    scaled, values, dequantized, s = _fp8_recipe(tiles, amax, f, False)
    return Quantized(f"block {bm}x{bk}", f, x, scaled.reshape(m, k), values.reshape(m, k),
                     s.reshape(m // bm, k // bk).reciprocal(), dequantized.reshape(m, k),
                     (bm, bk))


class DelayedScaling:
    """Transformer Engine's delayed scaling: each step's scale comes from the amax of earlier
    steps, kept in a history of `history_len`, reduced by `algo` ("max" over the history or
    "most_recent"), with `margin` (scale / 2^margin) for headroom. A step's own amax joins the
    history after it is cast, so a step whose values jump past the history saturates.

    As ``DelayedScaling`` computes it: scale = (fp8_max / amax) / 2^margin, kept as it was
    while the history's amax is 0 or not finite; the first scale is 1.
    """

    def __init__(self, history_len: int = 16, algo: str = "max", margin: int = 0,
                 precision="fp8_e4m3"):
        if isinstance(history_len, bool) or not isinstance(history_len, int) or history_len < 1:
            raise ValueError(f"history_len must be a positive int, got {history_len!r}")
        if algo not in ("max", "most_recent"):
            raise ValueError(f"algo must be 'max' or 'most_recent', got {algo!r}")
        if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
            raise ValueError(f"margin must be a non-negative int, got {margin!r}")
        self.history_len, self.algo, self.margin = history_len, algo, margin
        self.format = element_format(precision)
        self.history: list[float] = []  # most recent first
        self.scale = torch.tensor(1.0)

    def quantize(self, x: torch.Tensor) -> Quantized:
        """Cast x with the current scale, then record its amax and update the scale."""
        x = _float_tensor(x)
        f, top = self.format, float(self.format.max_finite)
        s = self.scale
        scaled, values, dequantized = scale_and_cast(x, s, f, s, divide=True)
        q = Quantized(f"delayed ({self.algo}, {self.history_len}, margin {self.margin})", f, x,
                      scaled, values, s.reciprocal(), dequantized, tuple(x.shape))
        self.history = [x.abs().amax().item(), *self.history][: self.history_len]
        amax = max(self.history) if self.algo == "max" else self.history[0]
        if amax > 0 and math.isfinite(amax):
            self.scale = torch.tensor((top / amax) / 2.0 ** self.margin, dtype=torch.float32)
        return q


def scaled_mm(a: Quantized, b: Quantized, out_dtype=torch.float32) -> torch.Tensor:
    """a (M, K) times b (N, K) transposed, as ``torch._scaled_mm(a8, b8.t(), scale_a, scale_b)``
    computes it on the CPU: each operand's elements times its scale in fp32, an fp32 matmul,
    then the cast to out_dtype. Takes tensorwise scales, or rowwise ones (a per row of a, b per
    row of b)."""
    for name, q in (("a", a), ("b", b)):
        if not isinstance(q, Quantized) or q.values.dim() != 2:
            raise TypeError(f"{name} must be a 2-D Quantized (tensorwise or rowwise), got "
                            f"{type(q).__name__}")
        if q.scale.numel() not in (1, q.values.shape[0]):
            raise ValueError(f"{name}'s scales ({tuple(q.scale.shape)}) are neither one per "
                             f"tensor nor one per row of {tuple(q.values.shape)}")
    sb = b.scale.reshape(-1, 1) if b.scale.numel() > 1 else b.scale
    return ((a.values * a.scale) @ (b.values * sb).t()).to(out_dtype)
