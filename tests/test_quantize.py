"""mplab's recipes below 16 bits against the libraries users run: torch's casts, ml_dtypes,
torchao 0.18 (float8 training's casts, to_mx, nvfp4_quantize) and torch._scaled_mm, compared
bit for bit (codes and scales as integers, dequantised values as floats with NaN equal to NaN)
on random tensors, adversarial ones and the lesson model's own captured tensors."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from mplab.fixtures import lesson_capture
from mplab.lowbit import microscaling as M
from mplab.lowbit import quantize as Q

pytest.importorskip("torchao", reason="needs torchao, which is not installed")
TORCHAO = Q.load_torchao()
from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8  # noqa: E402
from torchao.float8.float8_utils import amax_to_scale  # noqa: E402
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402
from torchao.prototype.mx_formats.constants import DTYPE_FP6_E2M3, DTYPE_FP6_E3M2  # noqa: E402
from torchao.prototype.mx_formats.kernels import unpack_uint4  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx  # noqa: E402
from torchao.prototype.mx_formats.nvfp4_tensor import (  # noqa: E402
    NVFP4Tensor,
    nvfp4_quantize,
    per_tensor_amax_to_scale,
)

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
MX_DTYPES = {**FP8, "fp6_e2m3": DTYPE_FP6_E2M3, "fp6_e3m2": DTYPE_FP6_E3M2,
             "fp4_e2m1": torch.float4_e2m1fn_x2}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit: integers equal; floats equal with their signs, NaN matching NaN."""
    if a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    both_nan = a.isnan() & b.isnan()
    return bool((both_nan | ((a == b) & (a.signbit() == b.signbit()))).all())


def test_same_catches_a_one_ulp_change():
    x = torch.randn(1000)
    q = M.mx(x.reshape(10, 100)[:, :96].contiguous(), "fp8_e4m3")
    bumped = q.codes.clone()
    bumped[3, 7] += 1  # one ulp of e4m3
    assert same(q.codes, q.codes) and not same(q.codes, bumped)
    nudged = q.dequantized.clone()
    nudged[0, 0] = torch.nextafter(nudged[0, 0], torch.tensor(math.inf))
    assert not same(q.dequantized, nudged)


def adversarial() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    t = {"random": torch.randn(64, 256, generator=g) * torch.logspace(-8, 4, 256),
         "zeros": torch.zeros(4, 64), "powers of two": torch.ldexp(
             torch.ones(4, 64), torch.randint(-20, 20, (4, 64), generator=g))}
    sub = torch.full((4, 64), 1e-40)
    sub[1] *= -1
    sub[2, 3] = 3e-39
    t["subnormals"] = sub
    huge = torch.randn(4, 64, generator=g)
    huge[0, 5], huge[1, 7] = 1e30, 65504 * 8  # one huge value in a block
    t["one huge value"] = huge
    inf = torch.randn(4, 64, generator=g)
    inf[0, 3], inf[2, 0] = math.inf, -math.inf
    t["inf"] = inf
    nan = torch.randn(4, 64, generator=g)
    nan[1, 9] = math.nan
    t["nan"] = nan
    return t


@pytest.fixture(scope="module")
def model_tensors() -> dict[str, torch.Tensor]:
    """The lesson model's own tensors from one captured step, those whose last side is a
    multiple of 32 (every one of its linears)."""
    cap = lesson_capture()
    kinds = {"activation": cap.activations, "activation grad": cap.activation_grads,
             "weight grad": cap.weight_grads, "weight": cap.weights}
    out = {}
    for kind, tensors in kinds.items():
        for name, t in tensors.items():
            t = t.reshape(-1, t.shape[-1]) if t.dim() > 1 else t.reshape(1, -1)
            if t.shape[-1] % 32 == 0 and t.numel() >= 64:
                out[f"{kind} {name}"] = t.contiguous()
    assert len(out) >= 20, sorted(out)
    return out


# --- the element cast -----------------------------------------------------------------------

def edge_values() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20000, generator=g) * torch.logspace(-12, 6, 20000)
    specials = torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0, 1e-45, 3.4e38])
    return torch.cat([x, specials])


@pytest.mark.parametrize("name, dtype", [
    ("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2),
    ("fp8_e4m3fnuz", torch.float8_e4m3fnuz), ("fp8_e5m2fnuz", torch.float8_e5m2fnuz),
    ("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_round_to_format_is_torchs_cast(name, dtype):
    x = edge_values()
    assert same(Q.round_to_format(x, name), x.to(dtype).float())
    if dtype.itemsize == 1:
        assert same(Q.encode(Q.round_to_format(x, name), name), x.to(dtype).view(torch.uint8))


@pytest.mark.parametrize("name, md", [("fp4_e2m1", "float4_e2m1fn"),
                                      ("fp6_e2m3", "float6_e2m3fn"),
                                      ("fp6_e3m2", "float6_e3m2fn")])
def test_round_to_format_is_ml_dtypes_cast_below_8_bits(name, md):
    finite = edge_values()
    finite = finite[torch.isfinite(finite)]  # fp4 and fp6 have no inf and no NaN
    ref = finite.numpy().astype(getattr(ml_dtypes, md))
    assert same(Q.round_to_format(finite, name), torch.from_numpy(ref.astype(np.float32)))
    assert torch.equal(Q.encode(Q.round_to_format(finite, name), name),
                       torch.from_numpy(ref.view(np.uint8).copy()))


# --- fp8: tensorwise, rowwise, blocks ------------------------------------------------------

def torchao_fp8(x, dtype, *, dim=None, power_of_2=False):
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    t = hp_tensor_and_scale_to_float8(x, amax_to_scale(amax, dtype, power_of_2), dtype,
                                      axiswise_dim=dim)
    return t._data.view(torch.uint8), t._scale, t.to_original_precision()


@pytest.mark.parametrize("name", FP8)
def test_tensorwise_and_rowwise_are_torchaos_float8_casts(name, model_tensors):
    for label, x in {**adversarial(), **model_tensors}.items():
        if not torch.isfinite(x).all():
            continue  # float8 training's amax of inf makes every scale 0: not a recipe case
        codes, s, deq = torchao_fp8(x, FP8[name])
        q = Q.tensorwise(x, name)
        assert same(q.codes, codes) and same(q.dequantized, deq), label
        assert same(q.scale, s.reciprocal()), label
        codes, s, deq = torchao_fp8(x, FP8[name], dim=-1, power_of_2=True)
        q = Q.rowwise(x, name)
        assert same(q.codes, codes) and same(q.dequantized, deq), label


@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
def test_blocks_are_torchaos_cast_per_tile(block):
    x = adversarial()["random"].repeat(2, 1)
    q = Q.blockwise(x, block)
    bm, bk = block
    assert q.scale.shape == (x.shape[0] // bm, x.shape[1] // bk)
    for i in range(0, x.shape[0], bm):
        for j in range(0, x.shape[1], bk):
            codes, s, deq = torchao_fp8(x[i:i + bm, j:j + bk].contiguous(), torch.float8_e4m3fn)
            assert same(q.codes[i:i + bm, j:j + bk], codes)
            assert same(q.dequantized[i:i + bm, j:j + bk], deq)
            assert same(q.scale[i // bm, j // bk], s.reciprocal())


def test_a_scale_per_block_keeps_what_one_per_tensor_flushes():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 256, generator=g) * 1e-3
    x[0, 0] = 1e4  # one outlier
    assert Q.tensorwise(x).flushed > 0.2
    assert Q.blockwise(x, (1, 128)).flushed < 0.01
    assert M.mx(x, "fp8_e4m3").flushed < 0.01


# --- MX and NVFP4 ---------------------------------------------------------------------------

def torchao_mx(x, name, mode):
    scale, data = to_mx(x, MX_DTYPES[name], 32, ScaleCalculationMode(mode))
    codes = (unpack_uint4(data.view(torch.uint8)) if name == "fp4_e2m1"
             else data.view(torch.uint8)).reshape(x.shape)
    return scale.view(torch.uint8), codes, to_dtype(data, scale, MX_DTYPES[name], 32,
                                                     torch.float32)


@pytest.mark.parametrize("mode", M.MX_MODES)
@pytest.mark.parametrize("name", M.MX_ELEMENTS)
def test_mx_is_torchaos_to_mx_bit_for_bit(name, mode, model_tensors):
    for label, x in {**adversarial(), **model_tensors}.items():
        scales, codes, deq = torchao_mx(x, name, mode)
        q = M.mx(x, name, mode=mode)
        assert same(q.scale_codes, scales), label
        assert same(q.dequantized, deq), label
        # torchao's fp4/fp6 cast has no NaN (nor has the format): a NaN element's code is what
        # its arithmetic leaves; mplab gives ml_dtypes' pattern. The block's scale is NaN in
        # both, so both dequantise the block to NaN.
        kept = ~q.scaled.isnan() if name.startswith(("fp4", "fp6")) else slice(None)
        assert same(q.codes[kept], codes[kept]), label


def test_rceil_takes_the_exact_ceiling_where_torchaos_cpu_path_rounds_log2():
    """The named difference: amax / 448 just above 2^-40; float32 log2 rounds it to -40."""
    x = torch.randn(1, 32, generator=torch.Generator().manual_seed(0)) * 2.0 ** -40
    x[0, 0] = 448 * 2.0 ** -40 * (1 + 2.0 ** -23)
    scales, codes, _ = torchao_mx(x, "fp8_e4m3", "rceil")
    q = M.mx(x, "fp8_e4m3", mode="rceil")
    assert scales.item() - 127 == -40 and q.scale_codes.item() - 127 == -39
    assert codes[0, 0].item() == 126 and q.values[0, 0].item() == 224.0  # 448 there, saturated
    assert q.saturated == 0


@pytest.mark.parametrize("tensor_scale", [False, True])
def test_nvfp4_is_torchaos_bit_for_bit(tensor_scale, model_tensors):
    for label, x in {**adversarial(), **model_tensors}.items():
        ts = per_tensor_amax_to_scale(x.abs().amax()) if tensor_scale else None
        scales, data = nvfp4_quantize(x, 16, ts)
        q = M.nvfp4(x, tensor_scale=tensor_scale)
        assert same(q.scale_codes, scales.view(torch.uint8)), label
        kept = ~q.scaled.isnan()
        codes = unpack_uint4(data.view(torch.uint8)).reshape(x.shape)
        assert same(q.codes[kept], codes[kept]), label
        deq = NVFP4Tensor(data, scales, 16, torch.float32, per_tensor_scale=ts).dequantize(
            torch.float32)
        assert same(q.dequantized, deq), label


def test_bytes_per_value_count_the_scales():
    x = torch.randn(64, 256)
    assert M.mx(x, "fp8_e4m3").bytes_per_value == 1 + 1 / 32
    assert M.mx(x, "fp4_e2m1").bytes_per_value == 0.5 + 1 / 32
    assert M.nvfp4(x).bytes_per_value == 0.5 + 1 / 16 + 4 / x.numel()
    assert Q.tensorwise(x).bytes_per_value == 1 + 4 / x.numel()
    assert Q.rowwise(x).bytes_per_value == 1 + 4 / 256


# --- scaled matmuls -------------------------------------------------------------------------

@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_scaled_mm_is_torchs_on_the_cpu(recipe, out_dtype):
    """torch 2.13's CPU _scaled_mm dequantises each operand in fp32, then multiplies. (A CPU
    build that routes fp8 to oneDNN kernels could round differently: this test would say.)"""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 256, generator=g) * 3, torch.randn(96, 256, generator=g)
    qa, qb = getattr(Q, recipe)(a), getattr(Q, recipe)(b)
    a8 = qa.codes.view(torch.float8_e4m3fn)
    b8 = qb.codes.view(torch.float8_e4m3fn)
    sa = qa.scale if recipe == "tensorwise" else qa.scale.reshape(-1, 1)
    sb = qb.scale if recipe == "tensorwise" else qb.scale.reshape(1, -1)
    ref = torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    assert same(Q.scaled_mm(qa, qb, out_dtype), ref)


# --- delayed scaling ------------------------------------------------------------------------

def test_delayed_scaling_uses_earlier_steps_amax_and_saturates_on_a_jump():
    d = Q.DelayedScaling(history_len=3, algo="max", margin=1)
    steps = [torch.full((8,), v) for v in (1.0, 2.0, 1.0, 1.0, 1.0, 40.0)]
    qs = [d.quantize(x) for x in steps]
    assert qs[0].scale.item() == 1.0  # no history yet: Transformer Engine starts at 1
    # step 3's scale came from max(1, 2, 1) = 2 with one bit of margin: 448 / 2 / 2
    assert qs[3].scale.item() == pytest.approx(1 / (448 / 2 / 2))
    # by step 5 the 2 has left the 3-step history: scale 448 / 1 / 2, and 40 * 224 > 448
    assert qs[5].scale.item() == pytest.approx(1 / 224) and qs[5].saturated == 1.0
    assert all(q.saturated == 0 for q in qs[:5])
    recent = Q.DelayedScaling(history_len=3, algo="most_recent")
    for x in steps[:3]:
        recent.quantize(x)
    assert recent.scale.item() == pytest.approx(448.0)  # from the last amax, 1


@pytest.mark.parametrize("call, match", [
    (lambda: Q.tensorwise([1.0, 2.0]), "floating-point torch tensor, got list"),
    (lambda: Q.tensorwise(torch.ones(4), "e8m0"), "not an element format"),
    (lambda: Q.blockwise(torch.ones(100, 100), (1, 128)), "multiples of the block"),
    (lambda: M.mx(torch.ones(4, 33)), "multiple of the block"),
    (lambda: M.mx(torch.ones(4, 32), "fp16"), "MX elements are"),
    (lambda: M.mx(torch.ones(4, 32), mode="nearest"), "mode must be one of"),
    (lambda: M.mx(torch.ones(4, 32, dtype=torch.float64)), "float32 or bfloat16"),
    (lambda: M.nvfp4(torch.ones(4, 32), block=32), "NVFP4's block is 16"),
    (lambda: Q.DelayedScaling(algo="mean"), "algo must be 'max' or 'most_recent'"),
])
def test_bad_input_says_what_is_accepted(call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call()


def test_the_gpu_fp8_benchmark_says_when_there_is_nothing_to_measure():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_fp8_gpu.py"
    said = subprocess.run([sys.executable, str(script), "--sizes", "256"], capture_output=True,
                          text=True, check=True).stdout
    if not torch.cuda.is_available():
        assert "nothing to measure" in said
    assert "bench_fp8_gpu.py" in (script.parent / "gpu_check.sh").read_text()
