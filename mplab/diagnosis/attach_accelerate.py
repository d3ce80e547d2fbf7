"""`mplab.diagnose` on a loop that trains through Hugging Face Accelerate, attached in one line.

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    watch = mplab.diagnosis.watch_accelerator(accelerator)
    for batch in loader:                 # your loop, as you wrote it
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            optimizer.zero_grad()
    print(watch.diagnose())              # the cause and the fix; watch.finish(): the record

The watch finds the prepared model and optimizer (`accelerator.prepare`'s) and Accelerate's
GradScaler (`accelerator.scaler`: fp16 on a GPU) itself, and records each *optimizer* step
through `mplab.train.Recorder`: it reads each micro-batch's loss in `accelerator.backward`
and ends a step when the prepared optimizer steps with `accelerator.sync_gradients` True (its
`step()` does nothing on the other micro-batches of a gradient accumulation), so the loss is
the mean of the step's micro-batch losses. Skipped steps, the scale, the scaler's calls come
from the Recorder; the audit reads the Accelerator (which ignores fp16 on a CPU).
`accelerator.backward` and the optimizer's `step` are wrapped on those two instances only,
and put back by `finish()`.
"""

from __future__ import annotations

import functools

import torch
from accelerate import Accelerator

from mplab.train import Recorder, TrainResult
from mplab.train.accelerate_path import MIXED_PRECISION

from .findings import Diagnosis
from .runs import diagnose_run

__all__ = ["AcceleratorWatch", "watch_accelerator"]

_PRECISION = {mode: name for name, mode in MIXED_PRECISION.items()}  # Accelerate's -> mplab's


def watch_accelerator(accelerator: Accelerator, *, model=None, optimizer=None,
                      label: str = "an Accelerate run") -> AcceleratorWatch:
    """Record the loop that trains through `accelerator`, from now on (call it after
    `accelerator.prepare`). `model`, `optimizer`: which prepared ones, where it prepared
    several. Returns the `AcceleratorWatch`: `.diagnose()` at any time, `.finish()` (or the
    end of a `with` block) for the record."""
    return AcceleratorWatch(accelerator, model=model, optimizer=optimizer, label=label)


class AcceleratorWatch:
    """What `watch_accelerator` returns: `recorder` (the `Recorder`), `result` (the record,
    once `finish()` ran), `diagnose()`. Usable as a context manager that finishes it."""

    def __init__(self, accelerator: Accelerator, *, model=None, optimizer=None,
                 label: str = "an Accelerate run"):
        if not isinstance(accelerator, Accelerator):
            raise TypeError(f"watch_accelerator() takes the accelerate.Accelerator your loop "
                            f"trains through, after accelerator.prepare(...); got "
                            f"{type(accelerator).__name__}")
        if "backward" in vars(accelerator):
            raise RuntimeError("this Accelerator is already watched: finish() that watch "
                               "before you watch it again")
        model = _one(accelerator._models, model, "model")
        optimizer = _one(accelerator._optimizers, optimizer, "optimizer")
        precision = _PRECISION.get(str(accelerator.mixed_precision))
        if precision is None:
            raise ValueError(f"watch_accelerator() cannot record mixed_precision="
                             f"{accelerator.mixed_precision!r}; accepted: "
                             + ", ".join(map(repr, _PRECISION)))
        self.accelerator, self.optimizer, self.label = accelerator, optimizer, label
        self.recorder = Recorder(accelerator.unwrap_model(model), optimizer,
                                 scaler=accelerator.scaler, precision=precision, label=label,
                                 accelerator=accelerator)
        self.result: TrainResult | None = None
        self._losses: list[torch.Tensor] = []
        accelerator.backward = self._backward(accelerator.backward)
        optimizer.step = self._step(optimizer.step)

    def _backward(self, backward):
        @functools.wraps(backward)
        def call(loss, **kwargs):
            self._losses.append(loss.detach().float())  # before Accelerate divides it
            return backward(loss, **kwargs)
        return call

    def _step(self, step):
        @functools.wraps(step)
        def call(*args, **kwargs):
            done = step(*args, **kwargs)
            if self.accelerator.sync_gradients:  # it stepped (or its scaler skipped it)
                if not self._losses:
                    raise RuntimeError("mplab's AcceleratorWatch saw an optimizer step with "
                                       "no loss: call accelerator.backward(loss), not "
                                       "loss.backward()")
                self.recorder.step(torch.stack(self._losses).mean())
                self._losses = []
            return done
        return call

    def finish(self) -> TrainResult:
        """The record, with its audit; Accelerate's methods are put back."""
        if self.result is None:
            vars(self.accelerator).pop("backward", None)
            vars(self.optimizer).pop("step", None)
            self.result = self.recorder.finish()
            if not self.result.steps:
                raise RuntimeError("mplab's AcceleratorWatch recorded no optimizer step: step "
                                   "the optimizer accelerator.prepare returned, and call "
                                   "accelerator.backward(loss)")
        return self.result

    def diagnose(self) -> Diagnosis:
        """The diagnosis of the run: of its whole record after `finish()`, of the steps so far
        before it."""
        return diagnose_run(self.result if self.result is not None else self.recorder.result)

    def __enter__(self) -> AcceleratorWatch:
        return self

    def __exit__(self, kind, *exc) -> None:
        if self.result is None:
            try:
                self.finish()
            except RuntimeError:
                if kind is None:  # no step recorded; else the loop's own error is on its way
                    raise


def _one(prepared: list, given, what: str):
    """The prepared model (or optimizer) to watch: `given`, or the only one prepared."""
    if given is not None:
        return given
    if len(prepared) == 1:
        return prepared[0]
    if not prepared:
        raise RuntimeError(f"the Accelerator has prepared no {what} yet: call "
                           f"watch_accelerator(accelerator) after model, optimizer, ... = "
                           f"accelerator.prepare(model, optimizer, ...)")
    raise ValueError(f"the Accelerator prepared {len(prepared)} {what}s: name the one to "
                     f"record, watch_accelerator(accelerator, {what}=...)")
