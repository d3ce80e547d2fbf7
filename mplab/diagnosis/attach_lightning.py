"""`mplab.diagnose` on a Lightning run, attached in one line.

    watch = mplab.diagnosis.LightningWatch()
    trainer = lightning.Trainer(..., callbacks=[watch])
    trainer.fit(module, loader)
    print(watch.diagnose())          # the cause and the fix, as for a loop of your own

The callback finds the LightningModule, its optimizer, and in the Trainer's precision plugin
the autocast and the GradScaler ("16-mixed" on a GPU) itself, and records each optimizer step
through `mplab.train.Recorder`: the loss (the mean of the step's micro-batch losses, as
`training_step` returned them), skipped steps, the scale, the scaler's calls and the audit,
for the precision the Trainer runs ("32-true", "bf16-mixed", "16-mixed", "bf16-true",
"16-true"). `watch.result` is the record (a `TrainResult`) after `trainer.fit` (or after it
raised), `watch.diagnose()` its diagnosis, during the run or after it.

`lightning.pytorch` and `pytorch_lightning` are the same code under two names, each Trainer
expecting its own `Callback`: the class subclasses the `Callback` of each one installed, so
one name serves both.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

import torch

from mplab.train import Recorder, TrainResult

from .findings import Diagnosis
from .runs import diagnose_run

__all__ = ["PRECISIONS", "LightningWatch"]

#: Lightning's precision (`trainer.precision`) -> the precision mplab records
PRECISIONS = {"32-true": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16", "bf16-true": "bf16",
              "16-true": "fp16"}


def _callbacks() -> tuple[type, ...]:
    found = []
    for package in ("lightning.pytorch", "pytorch_lightning"):
        try:
            found.append(importlib.import_module(package).Callback)
        except ImportError:
            pass
    if not found:
        raise ImportError("mplab.diagnosis.LightningWatch records a Lightning run: install "
                          "lightning (pip install lightning) or pytorch_lightning")
    return tuple(found)


class LightningWatch(*_callbacks()):
    """A Lightning `Callback` that records the run for `mplab.diagnose`; `label` names the
    run in the diagnosis (by default "a Lightning run")."""

    def __init__(self, label: str = "a Lightning run"):
        if not isinstance(label, str):
            raise TypeError(f"LightningWatch(label=...) takes the run's name, a str; got "
                            f"{type(label).__name__} (pass the watch itself to "
                            "Trainer(callbacks=[watch]))")
        self.label = label
        self.recorder: Recorder | None = None
        self.result: TrainResult | None = None
        self._losses: list[torch.Tensor] = []
        self._steps = 0

    def on_train_start(self, trainer, pl_module) -> None:
        optimizers = list(trainer.optimizers)
        if len(optimizers) != 1:
            raise RuntimeError(f"mplab.diagnosis.LightningWatch records a run with one "
                               f"optimizer; configure_optimizers() gave {len(optimizers)}")
        precision = PRECISIONS.get(str(trainer.precision))
        if precision is None:
            raise ValueError(f"mplab.diagnosis.LightningWatch cannot record "
                             f"precision={trainer.precision!r}; accepted: "
                             + ", ".join(map(repr, PRECISIONS)))
        plugin = trainer.precision_plugin
        make = getattr(plugin, "autocast_context_manager", None)  # MixedPrecision's autocast
        autocast = make() if callable(make) and precision != "fp32" else None
        clip = trainer.gradient_clip_val if trainer.gradient_clip_algorithm in (None, "norm") \
            else None
        self.recorder = Recorder(
            pl_module, optimizers[0], scaler=getattr(plugin, "scaler", None),
            autocast=autocast if isinstance(autocast, torch.autocast) else None,
            precision=precision, max_grad_norm=float(clip) if clip else None, label=self.label)
        self.result, self._losses, self._steps = None, [], trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.recorder is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().float()
            if pl_module.automatic_optimization:  # Lightning divided it for accumulation
                loss = loss * trainer.accumulate_grad_batches
            self._losses.append(loss)
        # global_step counts optimizer steps (one a scaler skipped too): a step ended here
        if trainer.global_step > self._steps:
            self._steps = trainer.global_step
            if self._losses:
                self.recorder.step(torch.stack(self._losses).mean())
                self._losses = []

    def on_train_end(self, trainer, pl_module) -> None:
        self._finish()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._finish()  # the steps before the error are the record diagnose reads

    def _finish(self) -> None:
        if self.recorder is not None and self.result is None:
            self.result = self.recorder.finish()

    def diagnose(self) -> Diagnosis:
        """The diagnosis of the run: of its whole record after `trainer.fit`, of the steps so
        far during it."""
        if self.recorder is None:
            raise RuntimeError("this LightningWatch has not seen a run: pass it to "
                               "Trainer(..., callbacks=[watch]) and call trainer.fit(...)")
        return diagnose_run(self.result if self.result is not None else self.recorder.result)
