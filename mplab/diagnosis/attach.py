"""`mplab.diagnose` on a Hugging Face Trainer's run, attached in one line.

    watch = mplab.diagnosis.Watch()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[watch])
    trainer.train()
    print(watch.diagnose())          # the cause and the fix, as for a loop of your own

The callback finds the model, the optimizer and the Trainer's GradScaler (Accelerate's, on the
prepared optimizer) itself, and records every optimizer step through `mplab.train.Recorder`:
the loss (the mean of the step's micro-batch losses, read off the model's output, so
`logging_steps` need not change), skipped steps, the scale, the scaler's calls and the audit.
`watch.result` is the record (a `TrainResult`), `watch.diagnose()` its diagnosis, during the
run (what it has seen so far) or after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import TrainerCallback

from mplab.train import Recorder, TrainResult

from .findings import Diagnosis
from .runs import diagnose_run

__all__ = ["Watch"]


@dataclass(frozen=True)
class _Prepared:
    """What the audit reads of the Accelerator a Trainer trains through (a callback is not
    handed it): the mixed precision it was asked for, whether it autocasts the prepared
    model's forward (Accelerate ignores fp16 on a CPU: it does not), and the device."""

    mixed_precision: str
    native_amp: bool
    device: torch.device


class Watch(TrainerCallback):
    """A `TrainerCallback` that records the run for `mplab.diagnose`; `label` names the run in
    the diagnosis (by default "a Trainer run")."""

    def __init__(self, label: str = "a Trainer run"):
        self.label = label
        self.recorder: Recorder | None = None
        self.result: TrainResult | None = None
        self._losses: list[torch.Tensor] = []
        self._hook = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if model is None or optimizer is None:
            raise RuntimeError("mplab.diagnosis.Watch found no model or optimizer in the "
                               "Trainer's callback call; pass it as Trainer(callbacks=[watch])")
        precision = "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"
        state = getattr(optimizer, "accelerator_state", None)
        prepared = _Prepared(str(getattr(state, "mixed_precision", None) or "no"),
                             hasattr(model, "_original_forward"), next(model.parameters()).device)
        self.recorder = Recorder(model, optimizer, scaler=getattr(optimizer, "scaler", None),
                                 precision=precision, max_grad_norm=args.max_grad_norm or None,
                                 label=self.label, accelerator=prepared)
        self.result, self._losses = None, []
        self._hook = model.register_forward_hook(self._read_loss)

    def _read_loss(self, module, inputs, output) -> None:
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if module.training and isinstance(loss, torch.Tensor):
            self._losses.append(loss.detach().float())

    def on_step_end(self, args, state, control, **kwargs):
        if self.recorder is not None and self._losses:
            self.recorder.step(torch.stack(self._losses).mean())
            self._losses = []

    def on_train_end(self, args, state, control, **kwargs):
        if self.recorder is not None:
            self._hook.remove()
            self.result = self.recorder.finish()

    def diagnose(self) -> Diagnosis:
        """The diagnosis of the run: of its whole record after `trainer.train()`, of the steps
        so far during it."""
        if self.recorder is None:
            raise RuntimeError("this Watch has not seen a run: pass it to "
                               "Trainer(..., callbacks=[watch]) and call trainer.train()")
        return diagnose_run(self.result if self.result is not None else self.recorder.result)
