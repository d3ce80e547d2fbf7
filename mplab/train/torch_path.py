"""Lesson 4's loop in plain PyTorch: autocast around the forward, a GradScaler around the rest.

The heart of it, as the course writes it (`ctx` is a null context in fp32, and the scaler is
disabled unless the precision is fp16, so one loop runs all three precisions):

    with ctx:                                           # torch.autocast(device_type, dtype)
        outputs = model(input_ids, labels=labels)
        loss = outputs.loss
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)                          # only to clip: clip the real gradients
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    scaler.step(optimizer)                              # skipped if a gradient is inf/NaN
    scaler.update()
    optimizer.zero_grad()

Around it: gradient accumulation (the loss divided by the number of micro-batches, one
optimizer step per group), DDP under torchrun, periodic evaluation, checkpoints that resume
bit for bit, and a guard that stops on a non-finite loss.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch
from tqdm.auto import tqdm

from mplab import data

from .common import (
    LOW_DTYPES,
    MatmulDtypeProbe,
    NonFiniteLossError,
    Processes,
    TrainWarning,
    accuracy,
    check_precision,
    device_name,
    encoded_splits,
    global_batches,
    load_model,
    low_precision_cost,
    model_inputs,
    non_finite_message,
    peak_memory,
    reset_peak_memory,
    synchronize,
)
from .config import TrainConfig
from .result import TrainResult

CHECKPOINT_FORMAT = 1


def train_torch(config: TrainConfig, model=None, tokenizer=None, on_step=None) -> TrainResult:
    """Train as `config` says and return the record; see `mplab.train.train`."""
    procs = Processes.start(config.device)
    try:
        cuda = [procs.device.index or 0] if procs.device.type == "cuda" else []
        # The run seeds torch's RNG for itself and leaves the caller's state as it was.
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(config.seed)
            return _train(config, procs, model, tokenizer, on_step)
    finally:
        procs.close()


def _train(config: TrainConfig, procs: Processes, model, tokenizer, on_step) -> TrainResult:
    start = time.perf_counter()
    device = procs.device
    check_precision(config.precision, device)
    per_process = config.batch_size * config.accumulation_steps
    global_size = per_process * procs.world_size
    train_set = data.load_dataset(config.dataset, "train")
    if len(train_set) < global_size:
        raise ValueError(f"one optimizer step takes {global_size} reviews (batch_size "
                         f"{config.batch_size} x accumulation_steps {config.accumulation_steps}"
                         f" x {procs.world_size} processes), more than the {len(train_set)} "
                         f"in {config.dataset!r}; use a smaller batch")
    model, tokenizer, name = load_model(config, train_set.num_labels, model, tokenizer)
    train_enc, test_enc = encoded_splits(config, tokenizer, train_set)
    model.to(device).train()

    result = TrainResult(
        path="torch", precision=config.precision, device=str(device), model=name,
        steps=config.steps, parameters=sum(p.numel() for p in model.parameters()),
        world_size=procs.world_size, global_batch_size=global_size,
        device_name=device_name(device), config=config.as_dict())
    for note in _setting_notes(config, device):
        _warn(result, note, procs)

    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr,
                                  weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(config))
    scaler = _scaler(config, device)
    dtype = LOW_DTYPES.get(config.precision)
    ctx = nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)
    net = model
    if procs.world_size > 1:
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model, device_ids=[device.index] if device.index is not None
                                      else None)

    step, epoch, position = 0, 0, 0
    if config.resume:
        saved = _load_checkpoint(config, model, optimizer, scheduler, scaler, device, result)
        if saved is None:
            _warn(result, f"resume: no checkpoint in {config.checkpoint_dir!r} yet, so the run "
                  "starts at step 0", procs)
        else:
            step, epoch, position = saved
            result.resumed_from = step

    stream = global_batches(train_enc, global_size, config, device, epoch, position)
    resume_at = (epoch, position)  # the next batch to train on, as a checkpoint records it
    probe = MatmulDtypeProbe(model)
    accumulate = config.accumulation_steps
    first, last = procs.rank * per_process, (procs.rank + 1) * per_process
    samples = tokens = 0
    train_seconds = 0.0
    reset_peak_memory(device)
    bar = tqdm(total=config.steps, initial=step, desc=f"{config.precision} on {device.type}",
               disable=not (config.progress and procs.main), unit="step")
    try:
        while step < config.steps:
            epoch, index, batch = next(stream)
            resume_at = (epoch, index + 1)
            tick = time.perf_counter()
            # This process's rows of the global batch (DistributedSampler-like), in micro-batches.
            mine = {key: value[first:last] for key, value in batch.items()}
            loss_sum = torch.zeros((), device=device)
            for i in range(accumulate):
                micro = {key: value[i * config.batch_size:(i + 1) * config.batch_size]
                         for key, value in mine.items()}
                # DDP all-reduces gradients in backward; only the last micro-batch needs to.
                sync = nullcontext() if net is model or i == accumulate - 1 else net.no_sync()
                with sync:
                    with ctx:
                        outputs = net(micro["input_ids"], labels=micro["labels"],
                                      **model_inputs(micro, config))
                        loss = outputs.loss
                    scaler.scale(loss / accumulate).backward()
                loss_sum += loss.detach().float()
            # One host sync per step: the record needs the number and the guard needs to look.
            loss_value = procs.mean(loss_sum / accumulate).item()
            if not math.isfinite(loss_value):
                message = non_finite_message(step + 1, loss_value, config.precision, config.lr,
                                             result.losses)
                result.stopped = message
                _finish(result, start, train_seconds, samples, tokens, device, probe)
                raise NonFiniteLossError(message, result)

            if config.max_grad_norm is not None:
                scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
                result.grad_norms.append(norm.item())
            scale = scaler.get_scale()
            scaler.step(optimizer)  # with fp16: skipped if any gradient is inf/NaN
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if scaler.is_enabled():
                result.scales.append(scaler.get_scale())
                if result.scales[-1] < scale:  # the scale backs off only after a skipped step
                    result.skipped_steps.append(step)
            if not (result.skipped_steps and result.skipped_steps[-1] == step):
                scheduler.step()  # the schedule counts real updates
            synchronize(device)
            train_seconds += time.perf_counter() - tick
            samples += global_size
            tokens += batch["input_ids"].numel()
            result.losses.append(loss_value)
            bar.set_postfix(_postfix(result), refresh=False)
            bar.update()

            if test_enc is not None and config.eval_every and step % config.eval_every == 0:
                result.eval_history.append((step, accuracy(model, test_enc, config, device,
                                                           ctx)))
            if config.save_every and step % config.save_every == 0 and step < config.steps:
                _save_checkpoint(config, model, optimizer, scheduler, scaler, device, result,
                                 (step, *resume_at), procs)
            if on_step is not None:
                on_step(step, result)
    finally:
        bar.close()
        probe.remove()

    if test_enc is not None:
        if not result.eval_history or result.eval_history[-1][0] != step:
            result.eval_history.append((step, accuracy(model, test_enc, config, device, ctx)))
        result.eval_accuracy = result.eval_history[-1][1]
    if config.checkpoint_dir:
        _save_checkpoint(config, model, optimizer, scheduler, scaler, device, result,
                         (step, *resume_at), procs)
    _finish(result, start, train_seconds, samples, tokens, device, probe)
    if (dtype is not None and result.compute_dtype is not None
            and result.compute_dtype != dtype):
        _warn(result, f"asked for {config.precision}, but the matmuls ran in "
              f"{result.compute_dtype}: autocast did not act", procs)
    return result


def lr_schedule(config: TrainConfig):
    """Linear warm-up over `warmup_steps`, then (for "linear") a linear decay to 5 % of lr."""
    def factor(s: int) -> float:
        warm = min(1.0, (s + 1) / config.warmup_steps) if config.warmup_steps else 1.0
        if config.schedule == "constant":
            return warm
        return warm * max(0.05, 1 - s / config.steps)
    return factor


def _scaler(config: TrainConfig, device: torch.device):
    """A GradScaler that is on for fp16 only: bf16 has fp32's range and needs none."""
    enabled = config.precision == "fp16"
    if enabled and config.scaler == "mplab":
        from mplab.scaler import GradScaler  # the from-scratch twin, lesson 3

        return GradScaler(device.type, enabled=True)
    return torch.amp.GradScaler(device.type, enabled=enabled)


def _setting_notes(config: TrainConfig, device: torch.device) -> list[str]:
    notes = []
    cost = low_precision_cost(config.precision, device)
    if cost:
        notes.append(cost)
    if config.scaler != "torch" and config.precision != "fp16":
        notes.append(f"scaler={config.scaler!r} is unused: only fp16 needs a GradScaler, "
                     f"{config.precision} runs without one")
    if not config.attention_mask and not config.by_length:
        notes.append("no attention mask and by_length=False: the model attends to the [PAD] "
                     "tokens of the shorter reviews in each batch, which costs accuracy (about "
                     "0.73 instead of 0.93 on the lesson data); pass the mask or batch by "
                     "length")
    return notes


def _warn(result: TrainResult, message: str, procs: Processes) -> None:
    result.warnings.append(message)
    if procs.main:
        warnings.warn(message, TrainWarning, stacklevel=5)  # at the caller of train()


def _postfix(result: TrainResult) -> dict:
    out = {"loss": f"{result.losses[-1]:.4f}"}
    if result.scales:
        out["scale"] = f"{result.scales[-1]:g}"
    return out


def _finish(result: TrainResult, start: float, train_seconds: float, samples: int,
            tokens: int, device: torch.device, probe: MatmulDtypeProbe) -> None:
    result.compute_dtype = probe.dtype if probe.dtype is not None else result.compute_dtype
    result.seconds = time.perf_counter() - start
    result.train_seconds = train_seconds
    if train_seconds > 0:
        result.samples_per_s = samples / train_seconds
        result.tokens_per_s = tokens / train_seconds
    result.peak_memory_bytes, result.peak_memory_kind = peak_memory(device)


# ---- checkpoints ----------------------------------------------------------------------------

_RECORD = ("losses", "scales", "skipped_steps", "grad_norms", "eval_history")


def _save_checkpoint(config, model, optimizer, scheduler, scaler, device, result, where,
                     procs: Processes) -> None:
    """Everything the next step depends on, written by rank 0 (all ranks hold the same)."""
    if procs.main:
        step, epoch, position = where
        rng = {"torch": torch.get_rng_state()}
        if device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(device)
        state = {"format": CHECKPOINT_FORMAT, "config": config.as_dict(), "step": step,
                 "epoch": epoch, "position": position, "model": model.state_dict(),
                 "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                 "scaler": scaler.state_dict(), "rng": rng,
                 "record": {key: list(getattr(result, key)) for key in _RECORD}}
        path = config.checkpoint_path
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        torch.save(state, partial)
        os.replace(partial, path)  # a run killed while saving leaves the last good checkpoint
    procs.barrier()


def _load_checkpoint(config, model, optimizer, scheduler, scaler, device,
                     result) -> tuple[int, int, int] | None:
    """Restore a checkpoint into the run; (step, epoch, position), or None if there is none."""
    path: Path = config.checkpoint_path
    if not path.is_file():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not an mplab.train checkpoint (format "
                         f"{state.get('format')!r}, expected {CHECKPOINT_FORMAT})")
    changed = config.differences(state["config"])
    if changed:
        listed = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
        raise ValueError(f"cannot resume from {path}: the run's settings changed ({listed}). "
                         "A resumed run must be the same run; use the checkpoint's settings, "
                         "or another checkpoint_dir to start afresh")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if scaler.is_enabled():
        scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng"]["torch"])
    if device.type == "cuda" and "cuda" in state["rng"]:
        torch.cuda.set_rng_state(state["rng"]["cuda"], device)
    for key in _RECORD:
        setattr(result, key, [tuple(v) if key == "eval_history" else v
                              for v in state["record"][key]])
    return state["step"], state["epoch"], state["position"]
