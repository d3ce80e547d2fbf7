"""Lesson 4's path, plain PyTorch: autocast around the forward, a GradScaler around the rest.

`train_torch` below is the whole method; what every path shares (data, progress, timing,
evaluation, checkpoints, the result) is `Run`'s, in run.py. A comment's tag in brackets names
the part of a training step its line writes (`compare.STEPS`); `[mplab]` marks mplab's own
bookkeeping, the same on every path (lessons 5 and 6 measure the paths by these tags).
"""

from __future__ import annotations

import torch

from mplab.amp.scaler import GradScaler as MplabGradScaler
from mplab.numerics.formats import dtype_of

from .config import TrainConfig
from .ranks import Traffic, counting_hook
from .result import TrainResult
from .run import Run, decay_groups, fused_adamw, lr_schedule
from .watch import StepCounter

__all__ = ["train_torch"]


def train_torch(config: TrainConfig, model=None, tokenizer=None, on_step=None) -> TrainResult:
    """Train as `config` says and return the record; see `mplab.train.train`."""
    with Run.start(config, "torch", model, tokenizer, on_step) as run:  # [mplab]
        model, device = run.model, run.device
        # Mixed precision is two objects, each switched off by construction rather than by
        # `if`s in the loop: autocast (off in fp32) and a GradScaler (on for fp16 only: bf16
        # has fp32's exponent range and needs none, lesson 3).
        autocast = torch.autocast(device.type, dtype=dtype_of(config.precision),  # [autocast]
                                  enabled=config.precision != "fp32")
        GradScaler = MplabGradScaler if config.scaler == "mplab" else torch.amp.GradScaler
        scaler = GradScaler(device.type, enabled=config.precision == "fp16",
                            **config.scaler_settings)
        # no weight decay for biases and norms, as the Trainer (lesson 6) chooses
        optimizer = torch.optim.AdamW(decay_groups(model, config.weight_decay), lr=config.lr,
                                      fused=fused_adamw(config, device))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(config))
        net = _distributed(model, run)
        run.prepare(optimizer, scheduler, scaler, autocast)  # [mplab]
        stepped = StepCounter(optimizer)

        for batch in run.batches():
            loss = 0.0
            for micro, sync in run.micro_batches(batch, net):  # [accumulation]
                with sync:
                    with autocast:  # [autocast]
                        micro_loss = net(**micro).loss / config.accumulation_steps
                    # [loss scaling] [backward] outside autocast
                    scaler.scale(micro_loss).backward()
                loss += micro_loss.detach()
            loss = run.check_finite(loss)  # [mplab] stops the run on inf/NaN, saying why
            norm = None
            if config.max_grad_norm is not None:
                # [unscale + clip] the true gradients, not the scaled ones
                scaler.unscale_(optimizer)
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
            scaler.step(optimizer)  # [optimizer step] unscales; skips it on an inf/NaN
            scaler.update()  # [scaler update] back off after an inf, grow after clean runs
            run.report_ranks()  # [mplab] under torchrun: each rank's bytes and all-reduces
            optimizer.zero_grad(set_to_none=True)  # [zero_grad]
            skipped = not stepped.stepped()
            if not skipped:
                scheduler.step()  # [lr schedule] it counts real updates
            run.record(loss, skipped=skipped, grad_norm=norm,  # [mplab]
                       scale=scaler.get_scale() if scaler.is_enabled() else None)
        stepped.remove()
        return run.finish()  # [mplab]


def _distributed(model: torch.nn.Module, run: Run):
    """DistributedDataParallel under torchrun (gloo on a CPU, NCCL on GPUs); else the model.

    Its gradient all-reduce runs through a comm hook that counts what each bucket sends
    (`ranks.counting_hook`, into `run.traffic`): fp32 (the same all-reduce as DDP's own), or
    `comm_hook`'s bf16 / fp16 compress hook, which casts each bucket down for the trip."""
    config = run.config
    if run.procs.world_size == 1:
        if config.comm_hook:
            run.warn(f"comm_hook={config.comm_hook!r} is unused: one process all-reduces "
                     "nothing; start several with torchrun --nproc_per_node N")
        return model
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    index = run.device.index
    net = DistributedDataParallel(model, device_ids=[index] if index is not None else None)
    hook = {None: None, "bf16": default_hooks.bf16_compress_hook,
            "fp16": default_hooks.fp16_compress_hook}[config.comm_hook]
    if config.watch or hook is not None:
        run.traffic = Traffic()
        net.register_comm_hook(None, counting_hook(run.traffic, hook))
    return net
