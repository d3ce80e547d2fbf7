"""Lesson 6's path, the Hugging Face Trainer: the same training in the course's few lines, with
`TrainingArguments(fp16=... or bf16=...)` asking Accelerate for the mixed precision.

`train_trainer` below is the course's code: data through `datasets` (where it is not installed,
`data.hf_dataset` hands over the same columns), `TrainingArguments`,
`Trainer(...)`, `trainer.train()`; `[mplab]` tags mplab's bookkeeping, as in torch_path.py.
`RecordRun`, a `TrainerCallback`, turns the Trainer's logs into the `TrainResult` every path
returns. `trainer_settings` maps `TrainConfig` onto the Trainer's arguments, so that it
trains as the torch path does. Under
`torchrun --nproc_per_node N -m mplab.train --path trainer ...` every process runs it.
"""

from __future__ import annotations

import json
import tempfile
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch

from mplab import data
from mplab.hardware import resolve_device

from .accelerate_path import fresh_accelerate
from .config import TrainConfig
from .order import Rows, RunOrder
from .result import TrainResult
from .run import Run, fused_adamw

__all__ = ["EVAL_BATCH", "RENAMED_ARGUMENTS", "train_trainer", "compute_metrics",
           "trainer_settings", "course_arguments_error", "renamed", "RecordRun"]

EVAL_BATCH = 128  # the torch path's evaluation batches

# Names the course (and many tutorials) use that transformers has since renamed or removed.
RENAMED_ARGUMENTS = {"evaluation_strategy": "eval_strategy"}  # 4.41 renamed; 4.51 removed


def train_trainer(config: TrainConfig, model=None, tokenizer=None, on_step=None) -> TrainResult:
    """Train as `config` says and return the record; see `mplab.train.train`."""
    from transformers import PrinterCallback, Trainer, TrainingArguments

    # managed: the Trainer evaluates and checkpoints on its own
    with Run.start(config, "trainer", model, tokenizer, on_step, managed=True) as run, \
            fresh_accelerate(), _output_dir(config) as output_dir:  # [mplab]
        with _quiet_datasets():  # [mplab] the run's progress bar is the one to watch
            dataset = {split: data.hf_dataset(config.dataset, split)
                       for split in _splits(config)}
            tokenized = {split: d.map(lambda batch: run.tokenizer(
                batch["text"], truncation=True, max_length=config.max_length), batched=True)
                for split, d in dataset.items()}
        train_dataset, eval_dataset = _in_run_order(run, tokenized)

        training_args = TrainingArguments(
            output_dir=output_dir,
            eval_strategy=_eval_strategy(config),
            fp16=config.precision == "fp16",
            bf16=config.precision == "bf16",
            use_cpu=run.device.type == "cpu",  # bf16 on a CPU needs it (else a ValueError)
            **trainer_settings(config, run.device))
        # The Trainer sees `**kwargs` in a Hugging Face model's forward and assumes its loss
        # divides by `num_items_in_batch`; a sequence classifier's loss is a plain mean, so on
        # transformers 5.23 the loss (logged, and so the gradients) came out multiplied by the
        # accumulation steps and by the number of processes. Saying so makes it a mean again.
        run.model.accepts_loss_kwargs = False
        trainer = Trainer(model=run.model, args=training_args, train_dataset=train_dataset,
                          eval_dataset=eval_dataset, compute_metrics=compute_metrics,
                          data_collator=train_dataset.collate,  # pads each batch to its widest
                          callbacks=[RecordRun(run, train_dataset)])
        trainer.remove_callback(PrinterCallback)  # [mplab] the run's progress bar shows it
        trainer.train(resume_from_checkpoint=_last_checkpoint(run))
        return run.finish(trainer.accelerator)  # [mplab]


def compute_metrics(eval_pred) -> dict:
    """The course's metric: accuracy, from the logits and labels the Trainer gathered."""
    logits, labels = eval_pred
    return {"accuracy": float((np.argmax(logits, axis=-1) == labels).mean())}


def trainer_settings(config: TrainConfig, device: torch.device | None = None) -> dict:
    """TrainingArguments for `config`, so that the Trainer trains as the torch path does
    (on `device`; by default config's):

    - the same AdamW (fused, the Trainer's default, unless a GradScaler steps it:
      `run.fused_adamw`), lr, betas, eps and seed; steps (`max_steps`), batch per device and
      accumulation;
    - the same batches, in the same order (`RunOrder`, sampled sequentially);
    - `max_grad_norm=0` turns the Trainer's default clipping (1.0) off when config has none;
    - the same two choices every path takes from the Trainer: no weight decay for biases and
      norm weights (`common.decay_groups`), and its schedule (`run.lr_schedule`).
    """
    saving = config.save_every is not None
    fused = fused_adamw(config, device or resolve_device(config.device))
    return {
        "max_steps": config.steps,
        "per_device_train_batch_size": config.batch_size,
        "gradient_accumulation_steps": config.accumulation_steps,
        "learning_rate": config.lr,
        "weight_decay": config.weight_decay,
        "warmup_steps": config.warmup_steps,
        "lr_scheduler_type": {"linear": "linear", "constant": "constant_with_warmup"}[
            config.schedule],
        "max_grad_norm": config.max_grad_norm or 0.0,
        "optim": "adamw_torch_fused" if fused else "adamw_torch",
        "seed": config.seed,
        "train_sampling_strategy": "sequential",
        "per_device_eval_batch_size": EVAL_BATCH,
        "eval_steps": config.eval_every,
        "logging_strategy": "steps",
        "logging_steps": 1,
        "logging_nan_inf_filter": False,  # mplab wants to see an inf loss, not an average
        "save_strategy": "steps" if saving else "no",
        "save_steps": config.save_every or 500,
        "report_to": "none",
        "disable_tqdm": True,
        "dataloader_pin_memory": False,
        "ddp_find_unused_parameters": False,
    }


def course_arguments_error(**arguments) -> str | None:
    """What the installed transformers says to the course's `TrainingArguments(...)` line
    (by default `output_dir=..., evaluation_strategy="epoch"`): the error's message, or None if
    it is accepted. `renamed(arguments)` gives the line as this transformers takes it."""
    from transformers import TrainingArguments

    arguments = arguments or {"evaluation_strategy": "epoch"}
    with tempfile.TemporaryDirectory() as folder:
        try:
            TrainingArguments(**{"output_dir": folder, "report_to": "none", **arguments})
        except (TypeError, ValueError) as err:
            return f"{type(err).__name__}: {err}"
    return None


def renamed(arguments: dict) -> tuple[dict, list[str]]:
    """The arguments with each renamed name replaced by today's, and a note per rename."""
    out, notes = {}, []
    for name, value in arguments.items():
        new = RENAMED_ARGUMENTS.get(name)
        if new is not None:
            notes.append(f"{name}={value!r} is now {new}={value!r} (renamed in transformers "
                         "4.41, the old name removed in 4.51)")
        out[new or name] = value
    return out, notes


# ---- the callback: the Trainer's logs into the run's record ---------------------------------

try:
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover - transformers is in requirements.txt
    TrainerCallback = object


class RecordRun(TrainerCallback):
    """Each optimizer step of the Trainer into the `Run`: its time (from `on_step_begin`),
    whether the prepared optimizer skipped it and the scale after (`on_optimizer_step`), its
    loss and gradient norm (`on_log`, every step), and each evaluation's accuracy."""

    def __init__(self, run: Run, order: RunOrder):
        self.run, self.order = run, order
        self._skipped, self._scale = False, None

    def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kw):
        run = self.run
        run.prepare(optimizer, lr_scheduler, getattr(optimizer, "scaler", None), nullcontext())
        if state.global_step:  # resumed from a checkpoint: its record is in the log history
            self._resume(state)
        run.begin()

    def _resume(self, state) -> None:
        run, result = self.run, self.run.result
        run.step = result.resumed_from = state.global_step
        for entry in state.log_history:
            if "loss" in entry:
                result.losses.append(entry["loss"])
                if entry.get("mplab_scale") is not None:
                    result.scales.append(entry["mplab_scale"])
                if entry.get("mplab_skipped"):
                    result.skipped_steps.append(entry["step"])
                if run.config.max_grad_norm is not None:
                    result.grad_norms.append(entry["grad_norm"])
            if "eval_accuracy" in entry:
                result.eval_history.append((entry["step"], entry["eval_accuracy"]))

    def on_step_begin(self, args, state, control, **kw):
        run = self.run
        per_epoch = len(self.order.layout) // run.global_size
        run.epoch, position = divmod(state.global_step, per_epoch)
        run.position = position + 1
        run.start_step(self.order.width(position) * run.global_size)

    def on_optimizer_step(self, args, state, control, optimizer=None, **kw):
        scaler = getattr(optimizer, "scaler", None)  # Accelerate's GradScaler: fp16 on a GPU
        self._skipped = bool(getattr(optimizer, "step_was_skipped", False))
        self._scale = scaler.get_scale() if scaler is not None else None

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:  # every step: its loss averaged over the processes
            run = self.run
            loss = run.check_finite(logs["loss"])
            norm = logs.get("grad_norm") if run.config.max_grad_norm is not None else None
            # kept in the Trainer's own log, so a resumed run has the whole record
            state.log_history[-1].update(mplab_skipped=self._skipped, mplab_scale=self._scale)
            run.record(loss, skipped=self._skipped, scale=self._scale, grad_norm=norm)

    def on_evaluate(self, args, state, control, metrics=None, **kw):
        if metrics and "eval_accuracy" in metrics:
            self.run.result.eval_history.append((state.global_step, metrics["eval_accuracy"]))


# ---- the data, in the torch path's order ----------------------------------------------------

def _splits(config: TrainConfig) -> tuple[str, ...]:
    return ("train",) if config.eval_samples == 0 else ("train", "test")


def _in_run_order(run: Run, tokenized: dict):
    """The Trainer's train and eval datasets: the tokenized rows in the torch path's batches
    and order, padded to each batch's width (so the Trainer's default collator stacks them)."""
    pad = run.tokenizer.pad_token_id or 0
    train_dataset = RunOrder(run, tokenized["train"][:], pad_id=pad)
    if "test" not in tokenized:
        return train_dataset, None
    test = tokenized["test"]
    n = run.config.eval_samples or len(test)
    columns = test.select(range(min(n, len(test))))[:]
    lengths = torch.tensor([len(ids) for ids in columns["input_ids"]])
    mask = torch.arange(int(lengths.max()))[None, :] < lengths[:, None]
    encoded = {"input_ids": lengths, "attention_mask": mask}
    layout = [(int(r), int(lengths[rows].max()))
              for rows in data.batch_rows(encoded, EVAL_BATCH, shuffle=False,
                                          by_length=run.config.by_length) for r in rows]
    return train_dataset, Rows(columns, layout, train_dataset.keys, pad)


@contextmanager
def _quiet_datasets():
    try:
        import datasets
    except ImportError:  # data.hf_dataset's stand-in: no progress bars to quiet
        yield
        return
    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if shown:
            datasets.enable_progress_bars()


def _eval_strategy(config: TrainConfig) -> str:
    if config.eval_samples == 0:
        return "no"
    return "steps" if config.eval_every else "epoch"


def _output_dir(config: TrainConfig):
    if config.checkpoint_dir:
        Path(config.checkpoint_dir).mkdir(parents=True, exist_ok=True)
        return nullcontext(config.checkpoint_dir)
    return tempfile.TemporaryDirectory(prefix="mplab-trainer-")


def _last_checkpoint(run: Run) -> str | None:
    """The Trainer's last checkpoint-N folder to resume from (None: start afresh), after
    checking that the run is the one that wrote it; the run's settings are kept beside."""
    config = run.config
    if not config.checkpoint_dir:
        return None
    from transformers.trainer_utils import get_last_checkpoint

    saved = Path(config.checkpoint_dir) / "mplab_config.json"
    last = get_last_checkpoint(config.checkpoint_dir) if config.resume else None
    if last is not None and saved.is_file():
        changed = config.differences(json.loads(saved.read_text()))
        if changed:
            listed = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
            raise ValueError(f"cannot resume from {last}: the run's settings changed ({listed})."
                             " A resumed run must be the same run; use the checkpoint's "
                             "settings, or another checkpoint_dir to start afresh")
    if config.resume and last is None:
        run.warn(f"resume: no checkpoint in {config.checkpoint_dir!r} yet, so the run starts "
                 "at step 0")
    if run.procs.main:
        saved.write_text(json.dumps(config.as_dict(), indent=1) + "\n")
    return last
