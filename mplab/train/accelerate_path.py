"""Lesson 5's path, Hugging Face Accelerate: the same training, with Accelerate doing the mixed
precision (autocast inside the prepared model's forward, the GradScaler inside `backward` and
the prepared optimizer's `step`).

`train_accelerate` below is the whole method; what every path shares (data, progress, timing,
evaluation, checkpoints, the result) is `Run`'s, in run.py. Its comments' tags name the parts
of a step a line writes, and `[mplab]` mplab's bookkeeping, as in torch_path.py. Under
`accelerate launch --num_processes N [--cpu] -m mplab.train --path accelerate ...` every
process runs it and trains its share of each global batch.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from torch.utils.data import DataLoader

from .config import TrainConfig
from .order import RunOrder
from .result import TrainResult
from .run import Run, decay_groups, fused_adamw, lr_schedule

__all__ = ["MIXED_PRECISION", "train_accelerate", "fresh_accelerate"]

MIXED_PRECISION = {"fp32": "no", "fp16": "fp16", "bf16": "bf16"}  # mplab's names -> Accelerate's


def train_accelerate(config: TrainConfig, model=None, tokenizer=None,
                     on_step=None) -> TrainResult:
    """Train as `config` says and return the record; see `mplab.train.train`."""
    from accelerate import Accelerator
    from accelerate.utils import GradScalerKwargs

    with Run.start(config, "accelerate", model, tokenizer, on_step) as run, \
            fresh_accelerate():  # [mplab]
        # One object holds the mixed precision: autocast and (for fp16 on a GPU) a GradScaler
        # built from the same settings the torch path gives torch.amp.GradScaler.
        accelerator = Accelerator(
            mixed_precision=MIXED_PRECISION[config.precision],
            gradient_accumulation_steps=config.accumulation_steps,
            cpu=run.device.type == "cpu",
            kwargs_handlers=[GradScalerKwargs(**config.scaler_settings)])
        model = run.model
        # no weight decay for biases and norms, as the Trainer (lesson 6) chooses
        optimizer = torch.optim.AdamW(decay_groups(model, config.weight_decay), lr=config.lr,
                                      fused=fused_adamw(config, run.device))
        # Accelerate steps a prepared scheduler once per process at each optimizer step.
        lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_schedule(config, calls_per_step=accelerator.num_processes))
        train_dataloader = DataLoader(RunOrder(run), batch_size=config.batch_size)
        model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
            model, optimizer, train_dataloader, lr_scheduler)
        run.prepare(optimizer, lr_scheduler, accelerator.scaler,  # [mplab]
                    nullcontext(),  # evaluation: the prepared model autocasts in its forward
                    save_state=accelerator.save_state, load_state=accelerator.load_state)

        step_loss, norm = 0.0, None
        for batch in run.loader_batches(train_dataloader, skip=accelerator.skip_first_batches):
            # [accumulation] syncs the gradients on the last micro-batch only
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)  # [backward] / accumulation steps; scaled for fp16
                step_loss += loss.detach() / config.accumulation_steps
                if accelerator.sync_gradients:
                    step_loss = run.check_finite(step_loss)  # [mplab] stops it on inf/NaN
                    if config.max_grad_norm is not None:
                        # [unscale + clip] it unscales first, once per step
                        norm = accelerator.clip_grad_norm_(model.parameters(),
                                                           config.max_grad_norm)
                optimizer.step()  # [optimizer step] the last micro-batch's; skips inf/NaN
                lr_scheduler.step()  # [lr schedule] and then this does not step either
                optimizer.zero_grad()  # [zero_grad]
            if accelerator.sync_gradients:
                scaler = accelerator.scaler  # None in fp32, bf16, and fp16 on a CPU
                run.record(step_loss, skipped=optimizer.step_was_skipped,  # [mplab]
                           grad_norm=norm, scale=scaler.get_scale() if scaler else None)
                step_loss = 0.0
        return run.finish(accelerator)  # [mplab]


@contextmanager
def fresh_accelerate():
    """Accelerate keeps one AcceleratorState per process and refuses an Accelerator with
    another mixed_precision ("AcceleratorState has already been initialized and cannot be
    changed, restart your runtime"). A lesson compares precisions in one kernel, so each run
    starts and ends with a fresh state (the process group, if any, stays)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()
    try:
        yield
    finally:
        AcceleratorState._reset_state()
        GradientState._reset_state()
