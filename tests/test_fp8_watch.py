"""mplab.train.fp8_watch: what the fp8 casts of a step did, for torchao's Float8Linear and mplab's
QDQLinear alike, checked against torchao's own casts and mplab's counter; the record it writes
through StepLog (a Recorder's loop), and what mplab.diagnose reads in it: fp8_grad_scale and
fp8_zero_amax, and quiet on healthy runs."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics

import pytest
import torch

from mplab.diagnosis import diagnose
from mplab.diagnosis.fp8 import FLUSHED_MASS, fp8_made_nan
from mplab.diagnosis.lab_fp8 import FP8_LOOP_RECIPES, float8_model, fp8_loop, fp8_zero_amax
from mplab.lowbit import qdq
from mplab.lowbit.quantize import EPS, load_torchao, rowwise, tensorwise
from mplab.plots import learned_share
from mplab.train import Recorder, TrainResult
from mplab.train.fp8_watch import FP8Watch, fp8_linears
from mplab.train.watch import StepLog

pytestmark = pytest.mark.filterwarnings("ignore")


def tiny(zero_last: bool = False) -> torch.nn.Sequential:
    """Two fp8-able Linear(64, 64) and a head (64 -> 2: left in fp32 by fp8_filter)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 2))
    if zero_last:  # a head that starts neutral: the layers below get exactly 0 at step 1
        torch.nn.init.zeros_(model[4].weight)
    return model


def train(model, steps: int = 3, *, scale: float = 1.0, spread: bool = False) -> TrainResult:
    """A plain loop with a Recorder; `scale` multiplies the loss (moves the gradients);
    `spread` the inputs' rows by 0.1 to 1000, so some samples' predictions are sure and their
    gradients tiny: the output gradients span many powers of two, and casts flush some."""
    gen = torch.Generator().manual_seed(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Recorder(model, optimizer) as rec:
        for _ in range(steps):
            x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 2, (32,), generator=gen)
            if spread:
                x = x * torch.logspace(-1, 3, 32)[:, None]
            loss = torch.nn.functional.cross_entropy(model(x), y) * scale
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            rec.step(loss)
        return rec.finish()


def torchao_config(recipe: str):
    load_torchao()
    from torchao.float8 import Float8LinearConfig

    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)


def float8(recipe: str, **kwargs) -> torch.nn.Module:
    return float8_model(tiny(**kwargs), recipe)


# ---- what it finds and writes -----------------------------------------------------------------

def test_no_fp8_linear_no_watch_and_no_record():
    assert FP8Watch.of(tiny()) is None
    assert FP8Watch.of(qdq.convert_to_qdq(tiny(), qdq.QDQ_RECIPES["bf16"])) is None  # 16 bits
    with pytest.raises(ValueError, match="no fp8 Linear"):
        FP8Watch(tiny())
    assert "fp8" not in train(tiny(), steps=2).config


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_torchao_settings_are_read_from_each_modules_config(recipe):
    model = float8(recipe)
    (name, _, library, found, casts), *rest = fp8_linears(model)
    assert (name, library, found, len(rest)) == ("0", "torchao", recipe, 1)  # not the head
    rows = recipe != "tensorwise"
    assert casts["grad_output"].format.name == ("fp8_e4m3" if rows else "fp8_e5m2")
    assert casts["grad_output"].scaling == ("rowwise" if rows else "tensorwise")
    assert casts["weight"].power_of_2 is rows and casts["input"].floor == EPS
    fp8 = train(model, steps=2).config["fp8"]
    assert fp8["library"] == "torchao" and fp8["recipe"] == f"torchao {recipe}"
    assert fp8["grad_format"] == casts["grad_output"].format.name
    assert fp8["grad_scaling"] == casts["grad_output"].scaling and fp8["amax_floor"] == EPS
    for key in ("grad_flushed", "grad_flushed_mass", "grad_saturated", "zero_amax"):
        assert len(fp8[key]) == 2, key
    assert fp8["nan_from_cast"] is None


def test_the_record_survives_json_and_the_hooks_go_with_the_recorder():
    model = float8("rowwise")
    result = train(model, steps=2)
    back = TrainResult.from_dict(json.loads(json.dumps(result.as_dict())))
    assert back.config["fp8"] == result.config["fp8"]
    assert diagnose(back).names == diagnose(result).names
    hooked = [m for m in model.modules() if m._forward_hooks or m._forward_hooks_with_kwargs]
    assert not hooked and all(not p._backward_hooks for p in model.parameters())


# ---- against the casts themselves -------------------------------------------------------------

def grads_seen(model) -> list[torch.Tensor]:
    """The output gradients each fp8 Linear is given, as a hook of our own sees them."""
    seen = []

    def keep(module, args, out):
        out.register_hook(lambda g: seen.append(g.detach().reshape(-1, g.shape[-1]).clone()))
    for _, m, *_ in fp8_linears(model):
        m.register_forward_hook(keep)
    return seen


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "e4m3_grads"])
def test_flushed_shares_are_what_torchaos_own_cast_flushes(recipe):
    """torchao's hp_tensor_to_float8_dynamic, given the gradients the watch saw: the nonzero
    values its fp8 data holds as 0, over all layers, are the watch's share, exactly."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    model = float8(recipe)
    seen = grads_seen(model)
    fp8 = train(model, steps=1, spread=True).config["fp8"]
    config = model[0].config
    cast = config.cast_config_grad_output
    flushed = nonzero = 0
    for g in seen:
        rows = cast.scaling_granularity is ScalingGranularity.AXISWISE
        q = hp_tensor_to_float8_dynamic(
            g, cast.target_dtype, LinearMMConfig(), scaling_granularity=cast.scaling_granularity,
            axiswise_dim=-1 if rows else None,
            round_scales_to_power_of_2=config.round_scales_to_power_of_2)
        flushed += ((q._data.float() == 0) & (g != 0)).sum().item()
        nonzero += (g != 0).sum().item()
    assert fp8["grad_flushed"] == [flushed / nonzero] and fp8["grad_saturated"] == [0.0]
    assert 0.01 < flushed / nonzero < 0.2  # measured: 4.7 % (tensorwise) to 6.9 % (e4m3)


@pytest.mark.parametrize("recipe", ["mplab", "e4m3_unscaled"])
def test_on_mplabs_recipes_the_watch_counts_what_mplabs_counter_does(recipe):
    """QDQLinear's own GradCasts (what mplab.train.fp8 records) and the watch, step by step."""
    counter = qdq.GradCasts()
    model = qdq.convert_to_qdq(tiny(), qdq.QDQ_RECIPES[recipe], counter)
    gen, counted = torch.Generator().manual_seed(1), []
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Recorder(model, optimizer) as rec:
        for _ in range(3):
            x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 2, (32,), generator=gen)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            rec.step(loss)
            counted.append(counter.take())
        fp8 = rec.finish().config["fp8"]
    assert fp8["recipe"] == ("mplab" if recipe == "mplab" else f"mplab {recipe}")
    assert fp8["grad_scaling"] == qdq.QDQ_RECIPES[recipe].grad_scaling
    assert fp8["grad_flushed"] == pytest.approx([f for f, _ in counted], rel=1e-12, abs=0)
    assert fp8["grad_saturated"] == [s for _, s in counted] == [0.0] * 3
    if recipe == "e4m3_unscaled":
        assert min(fp8["grad_flushed"]) > 0.5


def test_saturation_is_counted_past_the_formats_largest():
    """e4m3 at scale 1: gradients past 448 are clamped, as Quantized.saturated counts them."""
    model = qdq.convert_to_qdq(tiny(), qdq.QDQ_RECIPES["e4m3_unscaled"])
    seen = grads_seen(model)
    fp8 = train(model, steps=1, scale=1e6).config["fp8"]
    qs = [tensorwise(g, "fp8_e4m3", amax=448.0) for g in seen]
    past = sum(q.saturated * (q.source != 0).sum().item() for q in qs)
    assert fp8["grad_saturated"][0] == pytest.approx(past / sum(g.numel() for g in seen))
    assert fp8["grad_saturated"][0] > 0.01


# ---- amax 0 ----------------------------------------------------------------------------------

def test_torchao_and_mplab_scale_an_all_zero_tensor_alike_and_finite():
    """Measured: torchao 0.18 clamps amax to 1e-12 (float8_utils.EPS) before max / amax, so an
    all-zero tensor's scale is 448 / 1e-12 (e4m3), rounded down to 2^48 per row in the rowwise
    recipe, and its cast is 0; mplab.lowbit.quantize the same, bit for bit. Without the floor
    (eps=0) the scale is inf and the cast NaN."""
    load_torchao()
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale

    x = torch.randn(4, 64)
    x[1] = 0
    theirs = tensor_to_scale(torch.zeros(4, 64), torch.float8_e4m3fn)
    q = tensorwise(torch.zeros(4, 64))
    assert torch.equal((1 / q.scale).float(), theirs) and theirs.item() == pytest.approx(4.48e14)
    assert torch.equal(q.dequantized, torch.zeros(4, 64))
    theirs = tensor_to_scale(x, torch.float8_e4m3fn, axiswise_dim=-1,
                             scaling_granularity=ScalingGranularity.AXISWISE,
                             round_scales_to_power_of_2=True)
    q = rowwise(x)
    assert torch.equal((1 / q.scale).reshape(-1), theirs.reshape(-1))
    assert theirs[1].item() == 2.0 ** 48 and torch.equal(q.dequantized[1], torch.zeros(64))
    assert tensorwise(torch.zeros(4, 64), eps=0).dequantized.isnan().all()
    assert rowwise(x, eps=0).dequantized[1].isnan().all()
    assert not rowwise(x, eps=0).dequantized[0].isnan().any()
    with pytest.raises(ValueError, match="eps"):
        tensorwise(x, eps=-1.0)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_zero_amax_is_counted_per_tensor_or_per_row_and_harmless_with_torchaos_floor(recipe):
    model = float8(recipe, zero_last=True)  # layer 2's output gradient all 0 at step 1
    fp8 = train(model, steps=2).config["fp8"]
    rows = 32 if recipe == "rowwise" else 1  # a batch of 32: 32 rows of 0, or one tensor
    # at step 1 both fp8 layers get exactly 0 (the head's weight is 0; GELU's slope at 0 too)
    assert fp8["zero_amax"][0] == 2 * rows and fp8["zero_amax"][1] == 0
    assert fp8["zero_amax_first"] == {"step": 1, "module": "2", "tensor": "grad_output",
                                      "count": rows, "of": rows}
    assert fp8["nan_from_cast"] is None and fp8["grad_flushed"][0] is None  # nothing nonzero
    result = train(float8(recipe, zero_last=True), steps=6)
    assert all(map(math.isfinite, result.losses))
    assert not any(name.startswith("fp8") for name in diagnose(result).names)


def test_without_a_floor_the_nan_is_traced_to_the_cast_of_zeros():
    recipe = qdq.QDQRecipe(amax_floor=0.0)
    backward = train(qdq.convert_to_qdq(tiny(zero_last=True), recipe), steps=3)
    assert backward.config["fp8"]["nan_from_cast"] == {
        "step": 1, "module": "2", "phase": "backward", "zero_amax": ["grad_output"]}
    assert math.isfinite(backward.losses[0]) and math.isnan(backward.losses[1])
    assert backward.config["fp8"]["amax_floor"] == 0.0
    model = tiny()
    torch.nn.init.zeros_(model[2].weight)  # an fp8 layer itself at 0: its forward cast
    forward = train(qdq.convert_to_qdq(model, recipe), steps=2)
    assert forward.config["fp8"]["nan_from_cast"] == {
        "step": 1, "module": "2", "phase": "forward", "zero_amax": ["weight"]}
    assert fp8_made_nan(forward) == forward.config["fp8"]["nan_from_cast"]
    assert "fp8_zero_amax" in diagnose(forward)
    fine = train(qdq.convert_to_qdq(tiny(zero_last=True), qdq.QDQ_RECIPES["mplab"]), steps=3)
    assert fp8_made_nan(fine) is None and all(map(math.isfinite, fine.losses))


def test_steplog_writes_the_step_that_stopped_a_run_too():
    model = qdq.convert_to_qdq(tiny(zero_last=True), qdq.QDQRecipe(amax_floor=0.0))
    result = TrainResult("torch", "fp32", "cpu", "tiny")
    log = StepLog(result, model)
    assert log.fp8 is not None
    model(torch.randn(8, 64)).sum().backward()
    log.stopped(math.nan)
    log.remove()
    assert result.config["fp8"]["nan_from_cast"]["step"] == 1 and log.fp8 is None


# ---- diagnose, on the lab model in a loop of your own -----------------------------------------

@functools.cache
def zero_amax_run(fix=None) -> TrainResult:
    return fp8_zero_amax(fix=fix)


def test_diagnose_names_fp8_zero_amax_with_its_evidence_and_fix():
    found = diagnose(zero_amax_run())
    assert "fp8_zero_amax" in found, found
    finding = next(f for f in found.findings if f.name == "fp8_zero_amax")
    text = " ".join(finding.evidence)
    assert finding.severity == "broken" and "bert.pooler.dense" in text and "step 1" in text
    assert "amax_floor 0" in text and "not finite from step 2" in text
    assert "1e-12" in finding.fix and "skip the cast" in finding.fix
    assert diagnose(zero_amax_run().as_dict()).names == found.names


def test_the_zero_amax_run_is_named_by_its_cause_first():
    assert diagnose(zero_amax_run()).cause == "fp8_zero_amax"


@pytest.mark.parametrize("fix", ["amax_floor", "torchao"])
def test_the_zero_amax_fixes_learn_and_are_quiet(fix):
    run = zero_amax_run(fix)
    assert run.config["fp8"]["zero_amax"][0] > 0  # the zeros are still there, and harmless
    assert learned_share(run.losses) >= 0.25, run.losses
    assert diagnose(run).ok, diagnose(run)


@pytest.mark.parametrize("recipe", [r for r in FP8_LOOP_RECIPES if r != "e4m3_unscaled"])
def test_healthy_fp8_loops_are_quiet(recipe):
    """torchao's tensorwise recipe flushes some 46 % of the lab model's nonzero output-gradient
    values (a peaked softmax's, 2^32 below the amax), e4m3 gradients some 69 %: none of their
    magnitude to speak of, so neither is a scale that does not fit."""
    run = fp8_loop(recipe)
    fp8 = run.config["fp8"]
    assert statistics.median(fp8["grad_flushed_mass"]) < FLUSHED_MASS / 1000
    assert diagnose(run).ok, diagnose(run)


def test_a_badly_scaled_own_loop_is_named_and_its_fix_fits_the_recipe():
    found = diagnose(fp8_loop("e4m3_unscaled"))
    assert found.cause == "fp8_grad_scale", found
    finding = found.findings[0]
    assert "scale 1" in " ".join(finding.evidence) and "magnitude" in " ".join(finding.evidence)
    assert "fp8_e5m2" in finding.fix and "'tensorwise' recipe" in finding.fix
    assert diagnose(fp8_loop("e4m3_unscaled", fix="scaled_e5m2")).ok


def record(**fp8) -> TrainResult:
    return TrainResult("own loop", "fp32", "cpu", "m", losses=[0.7 - 0.01 * i for i in range(12)],
                       config={"fp8": {"grad_saturated": [0.0] * 12, **fp8}})


def test_the_flushed_magnitude_decides_where_recorded_and_the_fix_names_the_recipe():
    many = {"grad_flushed": [0.7] * 12}
    assert diagnose(record(grad_format="fp8_e5m2", grad_scaling="tensorwise", **many)).cause \
        == "fp8_grad_scale"  # a record without the magnitude: the count decides, as before
    assert diagnose(record(grad_format="fp8_e5m2", grad_scaling="tensorwise",
                           grad_flushed_mass=[1e-6] * 12, **many)).ok
    lost = {**many, "grad_flushed_mass": [0.3] * 12}
    rows = diagnose(record(grad_format="fp8_e4m3", grad_scaling="rowwise",
                           recipe="torchao rowwise", **lost)).findings[0]
    assert "rowwise recipes use e4m3" in rows.fix and "torchao rowwise" in str(rows.evidence)
    e4m3 = diagnose(record(grad_format="fp8_e4m3", grad_scaling="tensorwise", **lost))
    assert "fp8_e5m2" in e4m3.findings[0].fix and "'tensorwise' recipe" in e4m3.findings[0].fix
    e5m2 = diagnose(record(grad_format="fp8_e5m2", grad_scaling="tensorwise", **lost))
    assert "'rowwise' recipe" in e5m2.findings[0].fix and "e4m3" in e5m2.findings[0].fix
