"""What Accelerate and the Trainer build when asked for FSDP (lesson 8), run in every process of
a torchrun job (`launch.run_across(2, "mplab.train.libraries:accelerate_fsdp", [{}])`).

Each asks for FSDP2 with a bf16 MixedPrecisionPolicy the way their docs say, prepares the
lesson model, and reports what it really got: the distributed type, the wrapper around the
model, and whether any parameter is sharded (a DTensor). A refusal comes back as raised
(`launch` returns the error). On CPUs, accelerate 1.15 and transformers 5.23 take the FSDP
settings without a word and build DistributedDataParallel (MULTI_CPU): every rank holds the
whole model. mplab's `path="fsdp"` calls `fully_shard` itself, so it shards on a CPU too.
"""

from __future__ import annotations

import torch

from mplab import models
from mplab._display import Table

__all__ = ["accelerate_fsdp", "trainer_fsdp", "both", "built_table"]


def _built(distributed_type, model: torch.nn.Module, asked: str) -> dict:
    params = list(model.parameters())
    return {"asked": asked, "distributed_type": str(distributed_type).rpartition(".")[2],
            "wrapper": type(model).__name__,
            "sharded": any(hasattr(p, "to_local") for p in params),
            "param_dtype": str(params[0].dtype).removeprefix("torch.")}


def accelerate_fsdp() -> dict:
    """`Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, ...))`."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    from .accelerate_path import fresh_accelerate

    policy = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32,
              "output_dtype": torch.float32}
    with fresh_accelerate():
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, mixed_precision_policy=policy)
        accelerator = Accelerator(mixed_precision="bf16", fsdp_plugin=plugin,
                                  cpu=not torch.cuda.is_available())
        model = models.lesson_model(2, seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
        return _built(accelerator.distributed_type, model,
                      "FullyShardedDataParallelPlugin(fsdp_version=2, bf16 policy)")


def trainer_fsdp(output_dir: str) -> dict:
    """`TrainingArguments(fsdp="full_shard", fsdp_config={"fsdp_version": 2}, bf16=True)`, one
    step of the Trainer (it wraps the model when training starts)."""
    from transformers import Trainer, TrainingArguments

    from .accelerate_path import fresh_accelerate

    generator = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(5, 200, (16,), generator=generator),
             "labels": torch.tensor(i % 2)} for i in range(32)]
    with fresh_accelerate():
        args = TrainingArguments(output_dir=output_dir, fsdp="full_shard",
                                 fsdp_config={"fsdp_version": 2}, bf16=True,
                                 use_cpu=not torch.cuda.is_available(), report_to=[],
                                 max_steps=1, per_device_train_batch_size=8,
                                 save_strategy="no", disable_tqdm=True)
        trainer = Trainer(model=models.lesson_model(2, seed=0), args=args, train_dataset=rows)
        trainer.train()
        return _built(trainer.accelerator.distributed_type, trainer.model_wrapped,
                      'TrainingArguments(fsdp="full_shard", fsdp_config={"fsdp_version": 2})')


def both(output_dir: str) -> list[dict]:
    """What each library built, Accelerate's then the Trainer's, in one torchrun job."""
    return [accelerate_fsdp(), trainer_fsdp(output_dir)]


def built_table(built: list[dict]) -> Table:
    """What `both` found, as a table; `note` says whether anything was sharded."""
    unsharded = [b for b in built if not b["sharded"]]
    note = ("Both sharded the model." if not unsharded else
            "Not sharded: " + "; ".join(f"{b['asked']} built {b['wrapper']} "
                                        f"({b['distributed_type']})" for b in unsharded)
            + ", without a word: every rank holds the whole model. mplab's path='fsdp' calls "
              "fully_shard itself, so it shards on these processes too.")
    return Table(built, title="what each library built when asked for FSDP2", note=note)
