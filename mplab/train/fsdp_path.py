"""Lesson 8's path, FSDP2: every process holds a shard of the fp32 weights, and the mixed
precision is a policy per sharded module rather than autocast.

`fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype, reduce_dtype))` on each
transformer block and on the whole model: before a block's forward (and again in backward) its
fp32 shards are all-gathered and cast to `param_dtype`, so the block computes in bf16 / fp16
throughout; after its backward the gradients are cast to `reduce_dtype` and reduce-scattered,
each rank keeping the sum of its shard, which AdamW steps in fp32. `train_fsdp` is the whole
method; tags in brackets name the parts of a step as in torch_path.py. Under
`torchrun --nproc_per_node N -m mplab.train --path fsdp` each process trains its share of every
batch; alone, it is FSDP2 over a group of one.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch

from mplab.amp.scaler import GradScaler as MplabGradScaler
from mplab.numerics.formats import dtype_of

from .config import TrainConfig
from .ranks import CommWatch, transformer_blocks
from .result import TrainResult
from .run import Run, decay_groups, fused_adamw, lr_schedule
from .watch import StepCounter

__all__ = ["train_fsdp"]


def train_fsdp(config: TrainConfig, model=None, tokenizer=None, on_step=None) -> TrainResult:
    """Train as `config` says and return the record; see `mplab.train.train`."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    with Run.start(config, "fsdp", model, tokenizer, on_step) as run:  # [mplab]
        model, device = run.model, run.device
        gathered = config.param_dtype or config.precision
        # [autocast] the policy casts: blocks compute in param_dtype, gradients travel in
        # reduce_dtype; the weights each rank keeps stay fp32 (the master copy, sharded)
        policy = MixedPrecisionPolicy(
            param_dtype=None if gathered == "fp32" else dtype_of(gathered),
            reduce_dtype=dtype_of(config.reduce_dtype))
        for block in transformer_blocks(model):
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        # fp32 gathers with bf16/fp16 asked for: autocast does the casting, as on the torch path
        autocast = torch.autocast(device.type, dtype=dtype_of(config.precision),
                                  enabled=gathered == "fp32" and config.precision != "fp32")
        # fp16: every rank must skip the same steps, so found-inf is summed across ranks
        # (torch's ShardedGradScaler; mplab's scaler given the process group does the same)
        scaler = (MplabGradScaler(device.type, enabled=config.precision == "fp16",
                                  process_group=dist.group.WORLD, **config.scaler_settings)
                  if config.scaler == "mplab" else
                  ShardedGradScaler(device.type, enabled=config.precision == "fp16",
                                    process_group=dist.group.WORLD, **config.scaler_settings))
        # over the sharded parameters (DTensors): each rank steps its own shard
        optimizer = torch.optim.AdamW(decay_groups(model, config.weight_decay), lr=config.lr,
                                      fused=fused_adamw(config, device))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(config))
        save, load = _checkpointing(run, model, optimizer, scheduler, scaler)  # [mplab]
        run.prepare(optimizer, scheduler, scaler, autocast, save_state=save, load_state=load)
        stepped = StepCounter(optimizer)
        watch = CommWatch() if config.watch else None  # [mplab] the first step's collectives
        run.traffic = watch.traffic if watch is not None else None

        for batch in run.batches():
            first = run.step == 0 and watch is not None
            with watch if first else nullcontext():  # [mplab]
                loss = 0.0
                for micro, sync in run.micro_batches(batch, model):  # [accumulation]
                    with sync:
                        with autocast:  # [autocast]
                            micro_loss = model(**micro).loss / config.accumulation_steps
                        scaler.scale(micro_loss).backward()  # [loss scaling] [backward]
                    loss += micro_loss.detach().float()
            loss = run.check_finite(loss)  # [mplab] stops the run on inf/NaN, saying why
            norm = None
            if config.max_grad_norm is not None:
                # [unscale + clip] the norm over every rank's shards (a DTensor)
                scaler.unscale_(optimizer)
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
                norm = norm.full_tensor()
            scaler.step(optimizer)  # [optimizer step] skips it on every rank alike
            scaler.update()  # [scaler update]
            run.report_ranks()  # [mplab] each rank's bytes and collectives, after step 1
            optimizer.zero_grad(set_to_none=True)  # [zero_grad]
            skipped = not stepped.stepped()
            if not skipped:
                scheduler.step()  # [lr schedule]
            run.record(loss, skipped=skipped, grad_norm=norm,  # [mplab]
                       scale=scaler.get_scale() if scaler.is_enabled() else None)
        stepped.remove()
        return run.finish()  # [mplab]


def _checkpointing(run: Run, model, optimizer, scheduler, scaler):
    """(save_state, load_state) for Run's checkpoints, each taking a folder: the model's and
    optimizer's full state gathered from every rank's shards (torch.distributed.checkpoint's
    state_dict helpers), written by rank 0; each
    rank's RNG state beside it. Loading hands every rank the full state to keep its shard of."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    rank = run.procs.rank

    def save(folder: str) -> None:
        model_state, optimizer_state = get_state_dict(model, optimizer, options=full)
        where = Path(folder)
        where.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            torch.save({"model": model_state, "optimizer": optimizer_state,
                        "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict()},
                       where / "state.pt")
        torch.save(torch.get_rng_state(), where / f"rng-{rank}.pt")
        dist.barrier()

    def load(folder: str) -> None:
        where = Path(folder)
        state = torch.load(where / "state.pt", map_location="cpu", weights_only=True)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"],
                       options=StateDictOptions(full_state_dict=True))
        scheduler.load_state_dict(state["scheduler"])
        if scaler.is_enabled():
            scaler.load_state_dict(state["scaler"])
        rng = where / f"rng-{rank}.pt"
        if rng.is_file():  # a checkpoint written by as many ranks
            torch.set_rng_state(torch.load(rng, weights_only=True))

    return save, load
