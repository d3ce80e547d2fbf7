"""Training the lesson model (or any sequence classifier) in fp32, fp16 or bf16.

    from mplab.train import train
    result = train(precision="bf16", steps=600)        # the plain PyTorch path, device "auto"
    result.losses, result.compute_dtype, result.eval_accuracy, result.samples_per_s
    result.summary()                                    # the key figures as a table

    python -m mplab.train --precision fp16 --steps 100 --json run.json
    torchrun --nproc_per_node 2 -m mplab.train --precision fp32 --batch-size 16

    train(path="accelerate", precision="bf16")          # Accelerator(mixed_precision="bf16")
    train(path="trainer", precision="bf16")             # TrainingArguments(bf16=True) + Trainer
    result.audit                                        # did mixed precision really happen?

    accelerate launch --multi_gpu --num_processes 2 -m mplab.train --path accelerate
    torchrun --nproc_per_node 2 -m mplab.train --path trainer --precision bf16

Every path returns the same `TrainResult`: `path="torch"` (autocast + GradScaler by hand, in
`torch_path.py`), `"accelerate"` (`accelerate_path.py`) and `"trainer"` (`trainer_path.py`),
each the whole method in one function, trained on the same batches (`order.py`) so that their
losses agree. Each path is a small file that drives a `run.Run`, which holds the run's state
and the bookkeeping every path shares (data, progress, timing, evaluation, checkpoints, the
audit, the result). Settings are `TrainConfig`'s fields, by the same names in the library, the
CLI and the widgets.
"""

from __future__ import annotations

import importlib
from dataclasses import fields

from .config import PATHS, PRECISIONS, TrainConfig
from .errors import NonFiniteLossError, TrainWarning
from .recorder import Recorder
from .result import TrainResult, accuracy_rise, loss_overlaps, step_time_noise

#: Names a lesson or a user reaches for, imported on first use (each path's libraries are slow
#: to import: only the path a run takes is loaded).
_LAZY = {
    "fresh_accelerate": "accelerate_path", "train_torch": "torch_path",
    "decay_groups": "run", "lr_schedule": "run",
    "renamed": "trainer_path", "course_arguments_error": "trainer_path",
    "compute_metrics": "trainer_path", "start_across": "launch", "built_table": "libraries",
}

__all__ = ["train", "TrainConfig", "TrainResult", "Recorder", "NonFiniteLossError", "TrainWarning",
           "PATHS", "PRECISIONS", "loss_overlaps", "step_time_noise", "accuracy_rise", "compare",
           "plan", "ranks", "launch", "fp8", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'mplab.train' has no attribute {name!r}")


def train(config: TrainConfig | None = None, *, model=None, tokenizer=None, on_step=None,
          **settings) -> TrainResult:
    """Train and return the run's `TrainResult`.

    Give a `TrainConfig`, or its fields as keywords (`precision="fp16", steps=100, ...`).
    `model`: "lesson" (default: random weights), "lesson-pretrained" (its shipped trained
    encoder with a fresh head: learns in tens of steps), "minilm" (the packaged pretrained
    encoder), a hub name or
    saved folder (through `mplab.models.load_pretrained`, fp32 weights), or a
    `torch.nn.Module` to train in place (with its
    `tokenizer`; the lesson tokenizer if none). `on_step(step, result)` is called after every
    optimizer step, e.g. to plot the loss live; raising in it stops the run.

    Under `torchrun` (or `accelerate launch`) every process calls this; they split each
    global batch between them.
    Raises `NonFiniteLossError` (with `.result`) when the loss becomes inf/NaN, and
    ValueError for settings it cannot run.
    """
    if isinstance(model, str):
        settings["model"] = model
        model = None
    if config is None:
        names = {f.name for f in fields(TrainConfig)}
        unknown = sorted(set(settings) - names)
        if unknown:
            raise ValueError(f"unknown setting(s) {', '.join(map(repr, unknown))}; accepted: "
                             f"{', '.join(sorted(names))}")
        config = TrainConfig(**settings)
    elif settings:
        raise ValueError(f"give a TrainConfig or settings as keywords, not both (got config "
                         f"and {sorted(settings)})")
    if not isinstance(config, TrainConfig):
        raise ValueError(f"config must be a TrainConfig, got {type(config).__name__}")
    # TrainConfig has checked `path` against PATHS. Only the chosen path is imported: the
    # Trainer's modules alone take seconds to import, in every process a launcher starts.
    path = importlib.import_module(f".{config.path}_path", __name__)
    return getattr(path, f"train_{config.path}")(config, model=model, tokenizer=tokenizer,
                                                 on_step=on_step)
