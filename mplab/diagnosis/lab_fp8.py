"""The failure lab's FP8 runs in a loop of your own: a model converted to fp8 Linears (torchao's
`convert_to_float8_training`, or mplab's `convert_to_qdq`), trained by a plain loop with a
`Recorder` watching; the Recorder's `StepLog` finds the fp8 Linears and records what their casts
did (`mplab.train.fp8_watch`), so `mplab.diagnose` reads these runs as it reads mplab's own.

    result = fp8_zero_amax()                    # NaN from step 2: a scale from an amax of 0
    fixed = fp8_zero_amax(fix="amax_floor")     # amax clamped to 1e-12 first, as torchao does
    result = fp8_loop("rowwise")                # torchao's rowwise recipe, healthy

torchao's Float8Linear runs emulated (`emulate=True`: the casts as on a GPU, the matmuls in
fp32 of the dequantised values), so every run here trains on a CPU.
"""

from __future__ import annotations

import dataclasses

import torch

from mplab.diagnosis.lab_runs import LR, lab_batches, lab_model
from mplab.hardware import resolve_device
from mplab.lowbit.qdq import QDQ_RECIPES, QDQRecipe, convert_to_qdq, fp8_filter
from mplab.lowbit.quantize import EPS, load_torchao
from mplab.train import Recorder, TrainResult

__all__ = ["FP8_LOOP_RECIPES", "float8_model", "fp8_zero_amax", "fp8_loop"]

#: The recipes `fp8_loop` trains with, and what each casts the output gradients to.
FP8_LOOP_RECIPES = {
    "tensorwise": "torchao: e5m2, one scale per tensor",
    "rowwise": "torchao: e4m3, a power-of-two scale per row",
    "rowwise_with_gw_hp": "torchao: e4m3 per row; the weight gradient from bf16/fp32 values",
    "e4m3_grads": "torchao tensorwise with e4m3 output gradients (scaled from the amax)",
    "mplab": "mplab's QDQLinear: e5m2, one scale per tensor (torchao's tensorwise, bit for bit)",
    "e4m3_unscaled": "mplab's QDQLinear: e4m3 at scale 1, the recipe that flushes gradients",
}


def float8_model(model: torch.nn.Module, recipe: str = "tensorwise") -> torch.nn.Module:
    """`model` with torchao's Float8Linear (emulated) for every Linear `fp8_filter` accepts:
    `recipe` is torchao's name, or "e4m3_grads" (tensorwise, the output gradients in e4m3)."""
    load_torchao()
    from torchao.float8 import CastConfig, Float8LinearConfig, convert_to_float8_training

    if recipe == "e4m3_grads":
        config = Float8LinearConfig(
            cast_config_grad_output=CastConfig(target_dtype=torch.float8_e4m3fn))
    else:
        config = Float8LinearConfig.from_recipe_name(recipe)
    config = dataclasses.replace(config, emulate=True)
    return convert_to_float8_training(model, config=config, module_filter_fn=fp8_filter)


def fp8_zero_amax(fix=None, steps=20, device="cpu") -> TrainResult:
    """FP8 casts written as papers write the scale, max / amax, with no floor under amax, on a
    model whose new classifier head starts at 0 (so it predicts 50/50 until it learns, as
    LoRA's B and DiT's adaLN-Zero start at 0). The first backward pass sends exactly 0 to every
    layer below the head: amax 0, scale inf, and each cast of those zeros 0 * inf = NaN, from
    which the weights are NaN after one step. The fix clamps amax to 1e-12 first, as torchao
    does (its Float8Linear is the other fix): the scale is huge, and the cast gives 0."""
    if fix == "torchao":
        load_torchao()  # quietly, before transformers imports it loading the model
    device = resolve_device(device)
    model = lab_model().to(device)
    torch.nn.init.zeros_(model.classifier.weight)  # a head that starts neutral
    if fix == "torchao":
        float8_model(model, "tensorwise")  # torchao's casts: amax clamped to 1e-12
    else:
        floor = EPS if fix == "amax_floor" else 0.0  # the fix: a floor under amax
        convert_to_qdq(model, QDQRecipe(amax_floor=floor))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    with Recorder(model, optimizer) as rec:
        for batch in lab_batches(steps, device=device):
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            rec.step(loss)
        return rec.finish()


def fp8_loop(recipe="tensorwise", fix=None, steps=12, device="cpu") -> TrainResult:
    """The lab model trained with an fp8 recipe of `FP8_LOOP_RECIPES` by a plain loop:
    torchao's recipes (and "e4m3_grads") through Float8Linear, mplab's through QDQLinear.
    `fix="scaled_e5m2"` makes the broken one ("e4m3_unscaled") mplab's scaled recipe; the
    others have nothing to fix."""
    if recipe not in FP8_LOOP_RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; accepted: "
                         f"{', '.join(map(repr, FP8_LOOP_RECIPES))}")
    if recipe not in QDQ_RECIPES:
        load_torchao()  # quietly, before transformers imports it loading the model
    device = resolve_device(device)
    model = lab_model().to(device)
    if recipe in QDQ_RECIPES:
        fixed = "mplab" if fix == "scaled_e5m2" else recipe  # the fix: scaled e5m2 gradients
        convert_to_qdq(model, QDQ_RECIPES[fixed])
    else:
        float8_model(model, recipe)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    with Recorder(model, optimizer, label=f"fp8 {recipe} in a loop of your own") as rec:
        for batch in lab_batches(steps, device=device):
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            rec.step(loss)
        return rec.finish()
