"""The failure lab's runs that only the layers' record tells apart (mplab.train.layers): where
the first inf/NaN began, and gradients never zeroed. Each is a plain loop on the lab model
with a `Recorder` watching, and `fix=` switches on the lines that repair it (see
:mod:`mplab.diagnosis.lab`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mplab.hardware import resolve_device
from mplab.train import Recorder, TrainResult

from .lab_runs import LR, lab_autocast, lab_batches, lab_model

__all__ = ["fp16_loss", "adam_eps", "adam_eps_zero", "MaskedHead", "masked_entropy",
           "stale_grads", "scale_stuck", "Fp16Backward"]


def fp16_loss(fix=None, steps=20, device="auto", logit_scale=30.0) -> TrainResult:
    """A cosine classifier with the logit scale CosFace and ArcFace use (30), its softmax
    written by hand after the autocast block: its operands are the model's fp16 outputs, so
    exp(30 × cos) passes 65504 wherever a cosine passes 0.37, and inf / inf is NaN."""
    device = resolve_device(device)
    model = lab_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    autocast, scaler = lab_autocast("fp16", device), torch.amp.GradScaler(device.type)
    with Recorder(model, optimizer, scaler=scaler, autocast=autocast) as rec:
        for batch in lab_batches(steps, device=device):
            labels = batch.pop("labels")
            with autocast:
                pooled = model.bert(**batch).pooler_output
                cosines = F.normalize(pooled, dim=-1) @ F.normalize(model.classifier.weight,
                                                                     dim=-1).T
            if fix == "fp32_loss":
                cosines = cosines.float()  # the fix: the loss computed in fp32
            scores = (logit_scale * cosines).exp()
            loss = -(scores.gather(1, labels[:, None]).squeeze(1) / scores.sum(1)).log().mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            rec.step(loss)
        return rec.finish()


def adam_eps(fix=None, steps=10, device="auto") -> TrainResult:
    """The whole model in fp16 (`model.half()`, as a checkpoint loaded in fp16 is) trained
    with Adam: its states are fp16 too, where eps=1e-8 rounds to 0, so wherever a gradient's
    square underflows the update is m / 0."""
    device = resolve_device(device)
    model = lab_model().to(device)
    autocast = scaler = None
    if fix == "fp32_master":  # the fix: fp32 weights and states, fp16 compute
        autocast, scaler = lab_autocast("fp16", device), torch.amp.GradScaler(device.type)
    else:
        model.half()
    eps = 1e-4 if fix == "eps" else 1e-8  # the other fix: an eps fp16 holds
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, eps=eps)
    with Recorder(model, optimizer, scaler=scaler, autocast=autocast) as rec:
        for batch in lab_batches(steps, device=device):
            with autocast or torch.autocast(device.type, enabled=False):
                loss = model(**batch).loss
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            optimizer.zero_grad()
            rec.step(loss)
        return rec.finish()


def adam_eps_zero(fix=None, steps=12, device="auto") -> TrainResult:
    """bf16 autocast and AdamW with eps=0 (set so that updates are "exact"): a weight whose
    gradient has been 0 at every step so far (an embedding row no batch used) gets
    m / sqrt(v) = 0 / 0 = NaN from the optimizer step itself, its gradient finite."""
    device = resolve_device(device)
    model = lab_model().to(device)
    eps = 1e-8 if fix == "default_eps" else 0.0  # the fix: torch's default eps
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=eps)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    with Recorder(model, optimizer, autocast=autocast) as rec:
        for batch in lab_batches(steps, device=device):
            with autocast:
                loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            rec.step(loss)
        return rec.finish()


class MaskedHead(torch.nn.Module):
    """The lab model's classifier, with the classes a review may not take masked out by
    adding `fill` to their logits (a constraint mask, as in constrained decoding)."""

    def __init__(self, classifier: torch.nn.Module, fill: float):
        super().__init__()
        self.classifier, self.fill = classifier, fill

    def forward(self, pooled, allowed):
        logits = self.classifier(pooled)
        return logits + (1 - allowed.to(logits.dtype)) * self.fill  # in the logits' dtype


def masked_entropy(fix=None, steps=20, device="auto") -> TrainResult:
    """fp16 autocast and a class mask of -1e9 added to the logits inside the head (fp16 there,
    so -inf), with an entropy bonus: a masked class's probability is 0 and its log -inf, and
    0 × -inf is NaN. Every fourth review may take only its own label."""
    device = resolve_device(device)
    model = lab_model().to(device)
    fill = torch.finfo(torch.float16).min if fix == "finfo_min" else -1e9  # the fix
    model.masked_head = MaskedHead(model.classifier, fill)  # a part of the model: watched
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    autocast, scaler = lab_autocast("fp16", device), torch.amp.GradScaler(device.type)
    with Recorder(model, optimizer, scaler=scaler, autocast=autocast) as rec:
        for batch in lab_batches(steps, device=device):
            labels = batch.pop("labels")
            allowed = torch.ones(len(labels), 2, device=device)
            allowed[::4] = F.one_hot(labels[::4], 2).float()
            with autocast:
                logits = model.masked_head(model.bert(**batch).pooler_output, allowed)
                log_p = logits.float().log_softmax(-1)
                entropy = -(log_p.exp() * log_p).sum(-1).mean()
                loss = F.cross_entropy(logits, labels) - 0.01 * entropy
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            rec.step(loss)
        return rec.finish()


def stale_grads(fix=None, steps=30, device="auto") -> TrainResult:
    """bf16 autocast, SGD, and no `zero_grad()`: each backward adds to every gradient before
    it, so each step's update follows the sum of all the batches so far."""
    device = resolve_device(device)
    model = lab_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    with Recorder(model, optimizer, autocast=autocast) as rec:
        for batch in lab_batches(steps, device=device):
            with autocast:
                loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            if fix == "zero_grad":
                optimizer.zero_grad()  # the fix: start each step's gradients from 0
            rec.step(loss)
        return rec.finish()


class Fp16Backward(torch.autograd.Function):
    """What a compiled fp32 island can do to its backward: the forward runs in fp32 as
    asked, the backward in fp16 (`.half()` here stands for the compiler's choice). The island
    multiplies by `gain`, so its backward's fp16 product is `gain` times its gradient."""

    @staticmethod
    def forward(ctx, x, gain):
        ctx.gain = gain
        return x.float() * gain

    @staticmethod
    def backward(ctx, grad):
        return (grad.half() * ctx.gain).to(grad.dtype), None


def scale_stuck(fix=None, steps=40, device="auto") -> TrainResult:
    """fp16 with a GradScaler, and a head that divides the logits by a temperature of 1e-7 in
    fp32 and multiplies it back in an fp32 island whose backward runs in fp16: that backward
    holds the gradient times 10^7, which passes 65504 unless the scale is below about 0.2.
    The scaler backs the scale off below 1 and keeps it there, skipping whenever it grows."""
    device = resolve_device(device)
    model = lab_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    autocast, scaler = lab_autocast("fp16", device), torch.amp.GradScaler(device.type)
    with Recorder(model, optimizer, scaler=scaler, autocast=autocast) as rec:
        for batch in lab_batches(steps, device=device):
            labels = batch.pop("labels")
            with autocast:
                cooled = model(**batch).logits.float() * 1e-7
                if fix == "fp32_backward":
                    logits = cooled * 1e7  # the fix: autograd's own fp32 backward
                else:
                    logits = Fp16Backward.apply(cooled, 1e7)
                loss = F.cross_entropy(logits, labels)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            rec.step(loss)
        return rec.finish()
