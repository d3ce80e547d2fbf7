"""Lesson 4's path, plain PyTorch: autocast around the forward, a GradScaler around the rest.

`train_torch` below is the whole method; what every path shares (data, progress, timing,
evaluation, checkpoints, the result) is `Run`'s, in run.py.
"""

from __future__ import annotations

import torch

from mplab.formats import dtype_of
from mplab.scaler import GradScaler as MplabGradScaler

from .config import TrainConfig
from .result import TrainResult
from .run import Run, StepCounter, lr_schedule


def train_torch(config: TrainConfig, model=None, tokenizer=None, on_step=None) -> TrainResult:
    """Train as `config` says and return the record; see `mplab.train.train`."""
    with Run.start(config, "torch", model, tokenizer, on_step) as run:
        model, device = run.model, run.device
        # Mixed precision is two objects, each switched off by construction rather than by
        # `if`s in the loop: autocast (off in fp32) and a GradScaler (on for fp16 only: bf16
        # has fp32's exponent range and needs none, lesson 3).
        autocast = torch.autocast(device.type, dtype=dtype_of(config.precision),
                                  enabled=config.precision != "fp32")
        GradScaler = MplabGradScaler if config.scaler == "mplab" else torch.amp.GradScaler
        scaler = GradScaler(device.type, enabled=config.precision == "fp16",
                            **config.scaler_settings)
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr,
                                      weight_decay=config.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(config))
        net = _distributed(model, run)
        run.prepare(optimizer, scheduler, scaler, autocast)
        stepped = StepCounter(optimizer)

        for batch in run.batches():
            loss = 0.0
            for micro, sync in run.micro_batches(batch, net):  # gradient accumulation
                with sync:
                    with autocast:
                        micro_loss = net(**micro).loss / config.accumulation_steps
                    scaler.scale(micro_loss).backward()  # backward outside autocast
                loss += micro_loss.detach()
            loss = run.check_finite(loss)  # stops the run, with the likely cause, on inf/NaN
            norm = None
            if config.max_grad_norm is not None:
                scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
            scaler.step(optimizer)  # unscales, and skips the step if a gradient is inf/NaN
            scaler.update()  # the next scale: back off after an inf, grow after a clean run
            optimizer.zero_grad(set_to_none=True)
            skipped = not stepped.stepped()
            if not skipped:
                scheduler.step()  # the schedule counts real updates
            run.record(loss, skipped=skipped, grad_norm=norm,
                       scale=scaler.get_scale() if scaler.is_enabled() else None)
        stepped.remove()
        return run.finish()


def _distributed(model: torch.nn.Module, run: Run):
    """DistributedDataParallel under torchrun (gloo on a CPU, NCCL on GPUs); else the model."""
    if run.procs.world_size == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    index = run.device.index
    return DistributedDataParallel(model, device_ids=[index] if index is not None else None)
