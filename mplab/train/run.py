"""A training run's state in one record, and the bookkeeping every path does around its step.

A path (torch_path.py, accelerate_path.py, trainer_path.py) builds its optimizer, scaler and
autocast where a reader sees them, then drives a `Run`:

    with Run.start(config, "torch", model, tokenizer, on_step) as run:
        ...                                    # the path's optimizer, scaler, autocast
        run.prepare(optimizer, scheduler, scaler, autocast)   # resumes from a checkpoint
        for batch in run.batches():            # global batches until config.steps, timed
            ...                                # the path's optimizer step
            run.record(loss, skipped=..., scale=..., grad_norm=...)
        return run.finish()

`Run` owns the data, progress bar, timing, periodic evaluation, checkpoints, the `on_step`
callback and the `TrainResult`, whose steps it writes through `watch.StepLog` (as `Recorder`
does for a loop of one's own); the path owns the arithmetic. A path whose library runs the
loop hands Run its pieces instead: Accelerate's prepared DataLoader (`loader_batches`), its
`save_state`/`load_state` (`prepare`), the Trainer's callbacks (`Run.start(..., managed=True)`:
the Trainer evaluates and checkpoints itself), the Accelerator to audit (`finish`).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from mplab import data, models
from mplab.hardware import attention_backend, has_units, synchronize

from .config import TrainConfig
from .errors import (
    NonFiniteLossError,
    TrainWarning,
    check_precision,
    low_precision_cost,
    non_finite_message,
)
from .inputs import accuracy, encoded_splits, global_batches, load_model
from .processes import Processes, device_name, peak_memory, reset_peak_memory
from .ranks import Traffic, gather_reports, rank_report
from .result import TrainResult
from .watch import StepLog

__all__ = ["CHECKPOINT_FORMAT", "Run", "decay_groups", "lr_schedule"]

CHECKPOINT_FORMAT = 1
_RECORD = ("losses", "scales", "skipped_steps", "grad_norms", "zero_grad_fractions",
           "unchanged_weight_fractions", "eval_history")  # resumed too


@dataclass
class Run:
    """Everything one run holds: settings, processes, model, data, the path's optimizer,
    scheduler, scaler and autocast, where it is (step, epoch, position) and its result."""

    config: TrainConfig
    procs: Processes
    model: torch.nn.Module
    tokenizer: object
    train_data: dict
    test_data: dict | None
    result: TrainResult
    on_step: object = None
    optimizer: torch.optim.Optimizer | None = None
    scheduler: object = None
    scaler: object = None
    autocast: object = field(default_factory=nullcontext)
    step: int = 0
    epoch: int = 0
    position: int = 0          # the next batch of the epoch: what a checkpoint resumes at
    started: float = field(default_factory=time.perf_counter)
    train_seconds: float = 0.0
    samples: int = 0
    tokens: int = 0
    managed: bool = False      # the Trainer evaluates and saves checkpoints itself
    save_state: object = None  # the path's own checkpointing of its parts (Accelerate's)
    load_state: object = None
    log: StepLog | None = None  # writes each step into `result`, and watches the model
    traffic: Traffic | None = None  # the collectives a multi-process path counts (lesson 8)
    _tick: float = 0.0
    _tokens_now: int = 0
    _bar: object = None

    @property
    def device(self) -> torch.device:
        return self.procs.device

    @property
    def per_process(self) -> int:
        return self.config.batch_size * self.config.accumulation_steps

    @property
    def global_size(self) -> int:
        return self.per_process * self.procs.world_size

    # ---- start and end --------------------------------------------------------------------

    @classmethod
    @contextmanager
    def start(cls, config: TrainConfig, path: str, model=None, tokenizer=None,
              on_step=None, *, managed: bool = False) -> Iterator[Run]:
        """Join the processes, seed the run (leaving the caller's RNG as it was), load the
        data and the model onto the device, and open the result record. `managed`: the
        path's library (the Trainer) evaluates and checkpoints on its own schedule."""
        procs = Processes.start(config.device, group=path == "fsdp")
        try:
            cuda = [procs.device.index or 0] if procs.device.type == "cuda" else []
            backend, why = attention_backend(config.precision, procs.device)
            with torch.random.fork_rng(devices=cuda), _attention(backend):
                torch.manual_seed(config.seed)
                run = cls._create(config, path, procs, model, tokenizer, on_step, managed)
                run.result.attention = why
                try:
                    yield run
                finally:
                    run._close()
        finally:
            procs.close()

    @classmethod
    def _create(cls, config, path, procs, model, tokenizer, on_step, managed) -> Run:
        device = procs.device
        check_precision(config.precision, device)
        global_size = config.batch_size * config.accumulation_steps * procs.world_size
        train_set = data.load_dataset(config.dataset, "train")
        if len(train_set) < global_size:
            raise ValueError(f"one optimizer step takes {global_size} reviews (batch_size "
                             f"{config.batch_size} x accumulation_steps "
                             f"{config.accumulation_steps} x {procs.world_size} processes), "
                             f"more than the {len(train_set)} in {config.dataset!r}; use a "
                             "smaller batch")
        with warnings.catch_warnings(record=True) as caught:  # what loading said: the result's
            warnings.simplefilter("always", models.LoadWarning)
            model, tokenizer, name = load_model(config, train_set.num_labels, model, tokenizer)
        notes = [str(w.message) for w in caught if issubclass(w.category, models.LoadWarning)]
        for other in (w for w in caught if not issubclass(w.category, models.LoadWarning)):
            warnings.warn(other.message, other.category, stacklevel=2)
        train_data, test_data = encoded_splits(config, tokenizer, train_set)
        model.to(device).train()
        result = TrainResult(
            path=path, precision=config.precision, device=str(device), model=name,
            steps=config.steps, parameters=sum(p.numel() for p in model.parameters()),
            world_size=procs.world_size, global_batch_size=global_size,
            device_name=device_name(device), config=config.as_dict(),
            has_units=has_units(config.precision) if device.type == "cpu" else None)
        run = cls(config, procs, model, tokenizer, train_data, test_data, result, on_step,
                  managed=managed)
        run.log = StepLog(result, model, watch=config.watch)  # what really ran, step by step
        for note in notes + _setting_notes(config, device, result):
            run.warn(note)
        return run

    def prepare(self, optimizer, scheduler, scaler, autocast, *, save_state=None,
                load_state=None) -> None:
        """Hand the run the path's parts, then resume from the checkpoint if asked to.

        A path that checkpoints its parts itself (Accelerate's `save_state`/`load_state`)
        gives those two functions, each taking a folder; the run then keeps only its own
        progress in checkpoint.pt. Otherwise checkpoint.pt holds everything.
        """
        self.optimizer, self.scheduler, self.scaler = optimizer, scheduler, scaler
        self.autocast = autocast
        self.save_state, self.load_state = save_state, load_state
        self.log.watch_optimizer(optimizer)
        if not self.config.resume or self.managed:  # the Trainer resumes on its own
            return
        if self._load_checkpoint():
            self.result.resumed_from = self.step
        else:
            self.warn(f"resume: no checkpoint in {self.config.checkpoint_dir!r} yet, so the run "
                      "starts at step 0")

    def finish(self, accelerator=None) -> TrainResult:
        """The final evaluation and checkpoint, then the figures and the audit (with the
        path's `accelerator`, Accelerate's, where it has one); returns the result."""
        result = self.result
        if self.test_data is not None:
            if not result.eval_history or result.eval_history[-1][0] != self.step:
                result.eval_history.append((self.step, self.evaluate()))
            result.eval_accuracy = result.eval_history[-1][1]
        if self.config.checkpoint_dir and not self.managed:
            self._save_checkpoint()
        self._figures()
        self.audit(accelerator)
        return result

    def audit(self, accelerator=None) -> None:
        """Did mixed precision really happen? The audit of the model, optimizer and what was
        observed goes into the result; each silent fallback it names becomes a warning."""
        autocast = self.autocast if isinstance(self.autocast, torch.autocast) else None
        found = self.log.audit(self.optimizer, scaler=self.scaler, autocast=autocast,
                               accelerator=accelerator)
        for fallback in found.fallbacks:
            self.warn(fallback.text)

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self.log is not None:
            self.log.remove()

    # ---- the loop's bookkeeping -----------------------------------------------------------

    def batches(self) -> Iterator[dict]:
        """Global batches (every process's rows) until `config.steps`; each one is timed from
        here until `record()`."""
        config = self.config
        self.begin()
        stream = global_batches(self.train_data, self.global_size, config, self.device,
                                self.epoch, self.position)
        while self.step < config.steps:
            epoch, index, batch = next(stream)
            self.epoch, self.position = epoch, index + 1
            self.start_step(batch["input_ids"].numel())
            yield batch

    def begin(self) -> None:
        """The progress bar and the memory count start: training begins."""
        self._bar = tqdm(total=self.config.steps, initial=self.step, unit="step",
                         desc=f"{self.config.precision} on {self.device.type}",
                         disable=not (self.config.progress and self.procs.main))
        reset_peak_memory(self.device)

    def start_step(self, tokens: int) -> None:
        """A step begins: its time counts from here until `record()`; `tokens` it computes on
        (all processes' together)."""
        self._tokens_now = tokens
        self._tick = time.perf_counter()

    def loader_batches(self, loader, skip=None) -> Iterator[dict]:
        """This process's micro-batches from a DataLoader over `order.RunOrder` (prepared by
        Accelerate), epoch after epoch, until `config.steps`; each step is timed from its first
        micro-batch. On a resumed run the first epoch continues where the checkpoint was,
        through `skip(loader, n)` (Accelerate's `skip_first_batches`)."""
        config, n = self.config, self.config.accumulation_steps
        self.begin()
        epoch, position = self.epoch, self.position
        while self.step < config.steps:
            loader.set_epoch(epoch)
            batches = skip(loader, position * n) if position and skip else loader
            for index, batch in enumerate(batches, start=position * n):
                if index % n == 0:
                    self.epoch, self.position = epoch, index // n + 1
                    self.start_step(batch["input_ids"].numel() * self.procs.world_size * n)
                yield batch
                if self.step >= config.steps:
                    return
            epoch, position = epoch + 1, 0

    def micro_batches(self, batch: dict, net) -> Iterator[tuple[dict, object]]:
        """This process's rows of a global batch (as DistributedSampler would give them), in
        `accumulation_steps` micro-batches of the model's keyword arguments, each with the
        context its backward runs in: DDP's `no_sync()` on all but the last, so gradients are
        all-reduced once per step (FSDP2 is told the same by `set_requires_gradient_sync`)."""
        config = self.config
        first = self.procs.rank * self.per_process
        keys = ["input_ids", "labels"] + (["attention_mask"] if config.attention_mask
                                          and "attention_mask" in batch else [])
        n = config.accumulation_steps
        for i in range(n):
            start = first + i * config.batch_size
            micro = {k: batch[k][start:start + config.batch_size] for k in keys}
            last = i == n - 1
            if hasattr(net, "set_requires_gradient_sync"):  # FSDP2: reduce-scatter on the last
                net.set_requires_gradient_sync(last)
            yield micro, (net.no_sync() if hasattr(net, "no_sync") and not last
                          else nullcontext())

    def report_ranks(self) -> None:
        """After the first optimizer step, before `zero_grad` (so the gradients are still
        held): every rank's `ranks.rank_report` into `result.ranks`, where the path counts its
        collectives (`traffic`). Every rank calls it: the reports are gathered."""
        if self.step == 0 and self.traffic is not None:
            report = rank_report(self.procs.rank, self.model, self.optimizer, self.traffic)
            self.result.ranks = gather_reports(report, self.procs.world_size)

    def check_finite(self, loss: torch.Tensor | float) -> float:
        """The step's loss, averaged over processes, as a number (one host sync per step; a
        float is taken as averaged already); a non-finite loss stops the run with
        `NonFiniteLossError` and the likely cause."""
        value = (float(loss) if not isinstance(loss, torch.Tensor)
                 else self.procs.mean(loss.detach().float()).item())
        if not math.isfinite(value):
            result = self.result
            result.stopped = non_finite_message(self.step + 1, value, self.config.precision,
                                                self.config.lr, result.losses)
            result.stop_reason = "non_finite_loss"
            self.log.stopped(value)
            self._figures()
            raise NonFiniteLossError(result.stopped, result)
        return value

    def record(self, loss: float, *, skipped: bool = False, scale: float | None = None,
               grad_norm=None) -> None:
        """End a step: its loss, whether the optimizer skipped it, the scale after `update()`
        (None without a scaler) and the norm before clipping; then evaluation, checkpoint,
        progress and `on_step`, as the settings ask."""
        config, result = self.config, self.result
        self.step += 1
        synchronize(self.device)
        seconds = time.perf_counter() - self._tick
        self.train_seconds += seconds
        self.samples += self.global_size
        self.tokens += self._tokens_now
        self.log.step(loss, seconds, skipped=skipped, scale=scale, grad_norm=grad_norm)
        postfix = {"loss": f"{loss:.4f}"} | ({"scale": f"{scale:g}"} if scale else {})
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update()
        if not self.managed:  # the Trainer evaluates and checkpoints on its own schedule
            if self.test_data is not None and config.eval_every \
                    and self.step % config.eval_every == 0:
                result.eval_history.append((self.step, self.evaluate()))
            if config.save_every and self.step % config.save_every == 0 \
                    and self.step < config.steps:
                self._save_checkpoint()
        if self.on_step is not None:
            self.on_step(self.step, result)

    def evaluate(self) -> float:
        """Test accuracy, with the model called as in training (mask policy, autocast)."""
        found = accuracy(self.model, self.test_data, self.config, self.device, self.autocast)
        if hasattr(self.model, "reshard"):
            # FSDP2 leaves the root's weights gathered (in param_dtype) after a forward with no
            # backward: back to the fp32 shards, which the audit and a checkpoint read
            self.model.reshard()
        return found

    def warn(self, message: str) -> None:
        """A note for the learner: kept in the result, and a TrainWarning on rank 0."""
        self.result.warnings.append(message)
        if self.procs.main:
            warnings.warn(message, TrainWarning, stacklevel=_outside_mplab_train())

    def _figures(self) -> None:
        result = self.result
        self.log.observed()
        result.seconds = time.perf_counter() - self.started
        result.train_seconds = self.train_seconds
        if self.train_seconds > 0:
            result.samples_per_s = self.samples / self.train_seconds
            result.tokens_per_s = self.tokens / self.train_seconds
        result.peak_memory_bytes, result.peak_memory_kind = peak_memory(self.device)

    # ---- checkpoints ----------------------------------------------------------------------

    def _save_checkpoint(self) -> None:
        """Everything the next step depends on, written by rank 0 (all ranks hold the same).
        With the path's own `save_state`, its parts go to a folder named for the step, which
        checkpoint.pt names: a run killed while saving keeps the last good pair."""
        state = {"format": CHECKPOINT_FORMAT, "config": self.config.as_dict(),
                 "step": self.step, "epoch": self.epoch, "position": self.position,
                 "record": {key: list(getattr(self.result, key)) for key in _RECORD}}
        path = self.config.checkpoint_path
        if self.save_state is not None:
            state["parts"] = f"state-{self.step}"
            self.save_state(str(path.parent / state["parts"]))  # every process: its RNG too
        else:
            rng = {"torch": torch.get_rng_state()}
            if self.device.type == "cuda":
                rng["cuda"] = torch.cuda.get_rng_state(self.device)
            state |= {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                      "scheduler": self.scheduler.state_dict(),
                      "scaler": self.scaler.state_dict(), "rng": rng}
        self.procs.barrier()
        if self.procs.main:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".partial")
            torch.save(state, partial)
            os.replace(partial, path)  # a run killed while saving keeps the last good one
            for old in path.parent.glob("state-*"):
                if old.name != state.get("parts"):
                    shutil.rmtree(old, ignore_errors=True)
        self.procs.barrier()

    def _load_checkpoint(self) -> bool:
        """Restore the checkpoint into the run; False if there is none yet."""
        path: Path = self.config.checkpoint_path
        if not path.is_file():
            return False
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{path} is not an mplab.train checkpoint (format "
                             f"{state.get('format')!r}, expected {CHECKPOINT_FORMAT})")
        changed = self.config.differences(state["config"])
        if changed:
            listed = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
            raise ValueError(f"cannot resume from {path}: the run's settings changed ({listed})."
                             " A resumed run must be the same run; use the checkpoint's "
                             "settings, or another checkpoint_dir to start afresh")
        if self.load_state is not None:
            self.load_state(str(path.parent / state["parts"]))
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            if self.scaler.is_enabled():
                self.scaler.load_state_dict(state["scaler"])
            torch.set_rng_state(state["rng"]["torch"])
            if self.device.type == "cuda" and "cuda" in state["rng"]:
                torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)
        for key in _RECORD:
            setattr(self.result, key, [tuple(v) if key == "eval_history" else v
                                       for v in state["record"].get(key, [])])  # older: fewer
        self.step, self.epoch, self.position = state["step"], state["epoch"], state["position"]
        return True


def _outside_mplab_train() -> int:
    """The stacklevel of the first frame outside mplab.train (and contextlib): a warning
    then points at the learner's call of train()."""
    inside = (str(Path(__file__).parent), contextlib.__file__)
    frame, level = sys._getframe(2), 2  # 1 is warn()'s caller: Run.warn
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's parameter groups by one rule on every path, the Trainer's (and nanoGPT's):
    weights with two or more dimensions (matmul weights, embedding tables) decay; biases and
    norm weights, one dimension each, do not, as shrinking them toward 0 only hurts."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def fused_adamw(config: TrainConfig, device: torch.device) -> bool:
    """Whether AdamW steps in one fused kernel, on every path alike (the Trainer's default,
    `optim="adamw_torch_fused"`): on a CPU a third of the plain step's time, which a bf16 step,
    its matmuls twice as fast, feels most (benchmarks/RECORDS.md, "fused AdamW"). Not under a
    GradScaler: there the fused step would skip inside its kernel on inf/NaN, where no hook
    sees it, and take the gradients still scaled. fp16 that Accelerate (alone or in the
    Trainer) ignores on a CPU trains as fp32 does, fused too, so the two stay equal."""
    ignored = config.path in ("accelerate", "trainer") and device.type == "cpu"
    return config.precision != "fp16" or ignored


def lr_schedule(config: TrainConfig, calls_per_step: int = 1):
    """The Trainer's schedule, on every path (transformers' `get_linear_schedule_with_warmup`,
    or `get_constant_schedule_with_warmup` for "constant"): the factor of lr at optimizer step
    s (from 0) is s / warmup_steps during the warm-up (so the first step has lr 0), then for
    "linear" (steps - s) / (steps - warmup_steps), down to 0 at the end.

    `calls_per_step`: how often the scheduler is stepped per optimizer step. Accelerate steps
    a prepared scheduler once per process (its convention: a schedule counts the steps of one
    process alone), so the accelerate path gives the number of processes.
    """
    def factor(calls: int) -> float:
        s = calls // calls_per_step
        if s < config.warmup_steps:
            return s / config.warmup_steps
        if config.schedule == "constant":
            return 1.0
        return max(0.0, (config.steps - s) / max(1, config.steps - config.warmup_steps))
    return factor


def _setting_notes(config: TrainConfig, device: torch.device, result: TrainResult) -> list[str]:
    notes = []
    # Accelerate (alone or in the Trainer) trains fp16 on a CPU in fp32: no fp16 cost to warn of
    ignored = config.path != "torch" and config.precision == "fp16" and device.type == "cpu"
    cost = None if ignored else low_precision_cost(config.precision, device)
    if cost:
        result.matmul_slowdown, said = cost
        notes.append(said)
    if config.scaler != "torch" and config.precision != "fp16":
        notes.append(f"scaler={config.scaler!r} is unused: only fp16 needs a GradScaler, "
                     f"{config.precision} runs without one")
    if not config.attention_mask and not config.by_length:
        notes.append("no attention mask and by_length=False: the model attends to the [PAD] "
                     "tokens of the shorter reviews in each batch, which costs accuracy (about "
                     "0.73 instead of 0.93 on the lesson data); pass the mask or batch by "
                     "length")
    return notes


def _attention(backend: str | None):
    """The run's attention backend (`hardware.attention_backend`), for every path alike."""
    if backend is None:
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, backend))
