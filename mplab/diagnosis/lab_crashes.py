"""The failure lab's runs that crash (lesson 7): each loop raises the error people report,
on the lab model, and runs clean with its fix. :mod:`mplab.diagnosis.lab` names each by its
cause (`CRASHES`); `mplab.diagnose(err)` reads the error.

    from mplab.diagnosis import lab
    try:
        lab.CRASHES["scaler_called_twice"].run()
    except RuntimeError as err:
        print(mplab.diagnose(err))      # unscale_ twice: where, and the fix
"""

from __future__ import annotations

import torch

from mplab.diagnosis.lab_runs import LR, lab_batches, lab_model
from mplab.hardware import resolve_device
from mplab.train import Recorder, TrainResult

__all__ = ["fp16_weights_scaled", "scaler_called_twice", "custom_function", "fill_out_of_range"]


def fp16_weights_scaled(fix=None, steps=4, device="cpu") -> TrainResult:
    """fp16 weights (a model made .half(), or LoRA adapters created in the base model's fp16)
    trained under a GradScaler: scaler.step unscales first, and refuses fp16 gradients."""
    device = resolve_device(device)
    model = lab_model().to(device)
    if fix != "fp32_weights":
        model.half()  # the bug: the weights that train are fp16
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    autocast = torch.autocast(device.type, dtype=torch.float16)
    scaler = torch.amp.GradScaler(device.type)
    with Recorder(model, optimizer, scaler=scaler, autocast=autocast) as rec:
        for batch in lab_batches(steps, device=device):
            with autocast:
                loss = model(**batch).loss
            scaler.scale(loss).backward()
            scaler.step(optimizer)  # ValueError on fp16 gradients
            scaler.update()
            optimizer.zero_grad()
            rec.step(loss)
        return rec.finish()


def scaler_called_twice(fix=None, steps=4, device="cpu", micro_batches=2) -> TrainResult:
    """Gradient accumulation that unscales inside the micro-batch loop: the second unscale_
    before update() raises."""
    device = resolve_device(device)
    model = lab_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    autocast = torch.autocast(device.type, dtype=torch.float16)
    scaler = torch.amp.GradScaler(device.type)
    batches_ = lab_batches(steps * micro_batches, device=device)
    with Recorder(model, optimizer, scaler=scaler, autocast=autocast, max_grad_norm=1.0) as rec:
        for _ in range(steps):
            for _ in range(micro_batches):
                with autocast:
                    loss = model(**next(batches_)).loss / micro_batches
                scaler.scale(loss).backward()
                if fix != "unscale_once":
                    scaler.unscale_(optimizer)  # the bug: once per micro-batch
            if fix == "unscale_once":
                scaler.unscale_(optimizer)  # the fix: once, after the last backward
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            rec.step(loss * micro_batches, grad_norm=norm)
        return rec.finish()


class _HandLinear(torch.autograd.Function):
    """A Linear written as an autograd Function, as custom kernels are, that autocast knows
    nothing about: its backward runs outside autocast on what the forward saved."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return x @ weight.t() + bias

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad @ weight, grad.flatten(0, -2).t() @ x.flatten(0, -2), grad.flatten(0, -2).sum(0)


class _AmpHandLinear(_HandLinear):
    """The same Function, told about autocast: its forward runs in fp32 (cast_inputs), and so
    does its backward."""

    forward = staticmethod(torch.amp.custom_fwd(_HandLinear.forward, device_type="cpu",
                                                cast_inputs=torch.float32))
    backward = staticmethod(torch.amp.custom_bwd(_HandLinear.backward, device_type="cpu"))


class _FunctionHead(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear, function):
        super().__init__()
        self.linear, self.function = linear, function

    def forward(self, x):
        return self.function.apply(x, self.linear.weight, self.linear.bias)


def custom_function(fix=None, steps=4) -> TrainResult:
    """The classifier head as a custom autograd Function under bf16 autocast: the forward's
    matmul autocasts, the backward meets a bf16 gradient and an fp32 weight and raises."""
    model = lab_model()
    function = _AmpHandLinear if fix == "custom_fwd" else _HandLinear
    model.classifier = _FunctionHead(model.classifier, function)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    with Recorder(model, optimizer, autocast=autocast) as rec:
        for batch in lab_batches(steps):
            with autocast:
                loss = model(**batch).loss
            loss.backward()  # RuntimeError in _HandLinear.backward
            optimizer.step()
            optimizer.zero_grad()
            rec.step(loss)
        return rec.finish()


def fill_out_of_range(fix=None, steps=4) -> TrainResult:
    """A loss that masks the classes a review may not have, filling them with -1e9 as many
    attention masks do: the logits autocast made fp16 cannot hold it."""
    model = lab_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    autocast = torch.autocast("cpu", dtype=torch.float16)
    scaler = torch.amp.GradScaler("cpu")
    with Recorder(model, optimizer, scaler=scaler, autocast=autocast) as rec:
        for batch in lab_batches(steps):
            with autocast:
                logits = model(input_ids=batch["input_ids"],
                               attention_mask=batch["attention_mask"]).logits
                allowed = torch.ones_like(logits, dtype=torch.bool)  # every class, here
                fill = torch.finfo(logits.dtype).min if fix == "finfo_min" else -1e9
                logits = logits.masked_fill(~allowed, fill)  # RuntimeError with -1e9 in fp16
            loss = torch.nn.functional.cross_entropy(logits.float(), batch["labels"])
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            rec.step(loss)
        return rec.finish()
