"""Your own training loop, recorded as a `TrainResult` that `mplab.diagnose` can read.

    rec = Recorder(model, optimizer, scaler=scaler, autocast=autocast)
    for batch in batches:
        ...                                  # your loop, as you wrote it
        rec.step(loss, grad_norm=norm)       # once per iteration, after zero_grad
    result = rec.finish()                    # the record, with its audit
    mplab.diagnose(result)

It watches by hooks, changing nothing the loop computes: whether the optimizer really
stepped, the scale, how often the scaler's `unscale_`/`step`/`update` ran, the dtypes the
matmuls ran in, the share of gradient entries that were 0 and of low-precision weights a step
left unchanged; at the end, the audit (mplab.amp.audit) of the model and optimizer.
"""

from __future__ import annotations

import math
import time

import torch

from mplab.amp.audit import autocast_supported
from mplab.hardware import has_units
from mplab.numerics.formats import get_format

from .processes import device_name
from .result import OWN_LOOP, TrainResult
from .watch import ScalerCalls, StepCounter, StepLog, inner_optimizer

__all__ = ["Recorder"]

_SCALER_SETTINGS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")


class Recorder:
    """Record a loop of your own. `precision` ("fp32", "bf16", "fp16"): what you meant to
    train in; by default read off `autocast`, and without one, the dtype the loop's matmuls
    were seen running in (so a loop that writes `with torch.autocast(...)` inline needs
    neither). `name`: how the record
    calls the model (by default its class, e.g. "BertForSequenceClassification"); `label`:
    what the run is, which diagnose's header names it by (by default "own loop");
    `accelerator`: the Accelerator that prepared the loop, if one did (the audit reads what it
    was asked for and whether it autocasts). Usable as a context manager, which removes the
    hooks at the end."""

    def __init__(self, model: torch.nn.Module, optimizer, *, scaler=None, autocast=None,
                 precision: str | None = None, max_grad_norm: float | None = None,
                 name: str | None = None, label: str | None = None, accelerator=None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"Recorder watches a torch.nn.Module, got {type(model).__name__}")
        inner = inner_optimizer(optimizer)
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"Recorder needs the loop's torch optimizer (or a wrapper with "
                            f".optimizer), got {type(optimizer).__name__}")
        if autocast is not None and not isinstance(autocast, torch.autocast):
            raise TypeError(f"autocast= takes the torch.autocast(...) the forward runs in, got "
                            f"{type(autocast).__name__}")
        self.model, self.optimizer, self.scaler, self.autocast = model, optimizer, scaler, autocast
        self.accelerator = accelerator
        # asked for, or to be learned from what the matmuls ran in (`finish`)
        self._told = precision is not None or autocast is not None
        precision = precision or _precision_of(autocast)
        if precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"precision {precision!r}: accepted: 'fp32', 'bf16', 'fp16'")
        device = next(model.parameters()).device
        config = {"precision": precision, "max_grad_norm": max_grad_norm,
                  "optimizer": type(inner).__name__, "lr": inner.param_groups[0].get("lr"),
                  "eps": inner.param_groups[0].get("eps"),
                  "rounding": getattr(optimizer, "rounding", None),
                  "scaler": type(scaler).__module__.split(".")[0] if scaler is not None else None}
        if scaler is not None and scaler.is_enabled():
            config |= {k: _setting(scaler, k) for k in _SCALER_SETTINGS}
        if label is not None:
            config["label"] = str(label)
        self.result = TrainResult(
            path=OWN_LOOP, precision=precision, device=str(device),
            model=type(model).__name__ if name is None else str(name),
            parameters=sum(p.numel() for p in model.parameters()), device_name=device_name(device),
            config=config, has_units=has_units(precision) if device.type == "cpu" else None)
        self._stepped = StepCounter(inner)
        self.log = StepLog(self.result, model, optimizer,
                           scaler_calls=ScalerCalls(scaler) if scaler is not None else None,
                           zeros=True if not self._told else None)  # fp16 may be learned
        self._started = self._tick = time.perf_counter()

    def step(self, loss, *, grad_norm=None) -> None:
        """End one iteration: its loss (a tensor or a number) and, if you clip, the norm
        `clip_grad_norm_` returned. Call it once per optimizer iteration, after zero_grad."""
        value = float(loss.detach().float()) if isinstance(loss, torch.Tensor) else float(loss)
        now = time.perf_counter()
        seconds, self._tick = now - self._tick, now
        scaled = self.scaler is not None and self.scaler.is_enabled()
        self.log.step(value, seconds, skipped=not self._stepped.stepped(),
                      scale=float(self.scaler.get_scale()) if scaled else None,
                      grad_norm=grad_norm,
                      loss_dtype=loss.dtype if isinstance(loss, torch.Tensor) else None)
        self.result.steps = len(self.result.losses)

    def finish(self) -> TrainResult:
        """The record, with what was observed and the audit; the hooks are removed."""
        result = self.result
        self.log.observed()
        if not self._told and result.compute_dtype in (torch.float16, torch.bfloat16):
            self._learn_precision(get_format(result.compute_dtype).name)
        if not self._told and result.precision != "fp16":
            result.zero_grad_fractions = []  # counted in case it was fp16: it was not
        result.seconds = result.train_seconds = time.perf_counter() - self._started
        found = self.log.audit(inner_optimizer(self.optimizer), scaler=self.scaler,
                               autocast=self.autocast, accelerator=self.accelerator)
        result.warnings.extend(f.text for f in found.fallbacks)
        self.remove()
        return result

    def _learn_precision(self, precision: str) -> None:
        """A loop that autocasts inline, with neither `autocast=` nor `precision=` given: the
        precision is what its matmuls were seen running in, so that the diagnosis is the same
        whether or not the Recorder was told."""
        result = self.result
        result.precision = result.config["precision"] = precision
        if result.device.startswith("cpu"):
            result.has_units = has_units(precision)

    def remove(self) -> None:
        self._stepped.remove()
        self.log.remove()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def _precision_of(autocast) -> str:
    """What an autocast asks for: fp32 when off by choice (`enabled=False`); its dtype when
    on, or when torch switched it off (a dtype or device it does not support here)."""
    if autocast is None:
        return "fp32"
    if not autocast._enabled and autocast_supported(autocast.device, autocast.fast_dtype):
        return "fp32"
    name = get_format(autocast.fast_dtype).name
    return name if name in ("bf16", "fp16") else "fp32"


def _setting(scaler, name: str) -> float:
    if name == "init_scale":
        value = scaler.get_scale()
    else:
        value = getattr(scaler, f"get_{name}")()
    return value if math.isfinite(value) else str(value)
