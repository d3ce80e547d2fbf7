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
left unchanged; at the end, the audit (mplab.audit) of the model and optimizer.
"""

from __future__ import annotations

import math
import time

import torch

from mplab.audit import Observer, audit
from mplab.formats import get_format
from mplab.hardware import has_units

from .common import device_name
from .result import TrainResult
from .run import StepCounter
from .watch import ScalerCalls, StepWatch, inner_optimizer

_SCALER_SETTINGS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")


class Recorder:
    """Record a loop of your own. `precision` ("fp32", "bf16", "fp16"): what you meant to
    train in; by default read off `autocast` (fp32 without one). `name`: how the record
    calls the model. Usable as a context manager, which removes the hooks at the end."""

    def __init__(self, model: torch.nn.Module, optimizer, *, scaler=None, autocast=None,
                 precision: str | None = None, max_grad_norm: float | None = None,
                 name: str = "own loop"):
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
        precision = precision or _precision_of(autocast)
        if precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"precision {precision!r}: accepted: 'fp32', 'bf16', 'fp16'")
        device = next(model.parameters()).device
        config = {"precision": precision, "max_grad_norm": max_grad_norm,
                  "optimizer": type(inner).__name__,
                  "rounding": getattr(optimizer, "rounding", None),
                  "scaler": type(scaler).__module__.split(".")[0] if scaler is not None else None}
        if scaler is not None and scaler.is_enabled():
            config |= {k: _setting(scaler, k) for k in _SCALER_SETTINGS}
        self.result = TrainResult(
            path="own loop", precision=precision, device=str(device), model=name,
            parameters=sum(p.numel() for p in model.parameters()), device_name=device_name(device),
            config=config, has_units=has_units(precision) if device.type == "cpu" else None)
        self._stepped = StepCounter(inner)
        self._observer = Observer(model, inner)
        self._watch = StepWatch(model, optimizer, zeros=precision == "fp16")
        self._calls = ScalerCalls(scaler) if scaler is not None else None
        self._started = self._tick = time.perf_counter()

    def step(self, loss, *, grad_norm=None) -> None:
        """End one iteration: its loss (a tensor or a number) and, if you clip, the norm
        `clip_grad_norm_` returned. Call it once per optimizer iteration, after zero_grad."""
        result = self.result
        value = float(loss.detach().float()) if isinstance(loss, torch.Tensor) else float(loss)
        now = time.perf_counter()
        result.step_seconds.append(now - self._tick)
        self._tick = now
        result.losses.append(value)
        result.steps = len(result.losses)
        if not self._stepped.stepped():
            result.skipped_steps.append(result.steps)
        if self.scaler is not None and self.scaler.is_enabled():
            result.scales.append(float(self.scaler.get_scale()))
        if self._calls is not None:
            result.scaler_calls.append(self._calls.counts())
        if grad_norm is not None:
            result.grad_norms.append(float(grad_norm))
        zeros, unchanged = self._watch.measure()
        if result.precision == "fp16":
            result.zero_grad_fractions.append(zeros)
        if unchanged is not None:
            result.unchanged_weight_fractions.append(unchanged)

    def finish(self) -> TrainResult:
        """The record, with what was observed and the audit; the hooks are removed."""
        result, seen = self.result, self._observer
        result.compute_dtype, result.output_dtype = seen.compute_dtype, seen.output_dtype
        result.seconds = result.train_seconds = time.perf_counter() - self._started
        found = audit(self.model, inner_optimizer(self.optimizer), scaler=self.scaler,
                      result=result, autocast=self.autocast)
        result.audit = found
        result.param_dtype, result.optimizer_state_dtype = (found.param_dtype,
                                                            found.optimizer_state_dtype)
        result.grad_dtype = seen.grad_dtype or found.grad_dtype
        result.warnings.extend(found.fallbacks)
        self.remove()
        return result

    def remove(self) -> None:
        for part in (self._stepped, self._observer, self._watch, self._calls):
            if part is not None:
                part.remove()
        self._calls = None

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def _precision_of(autocast) -> str:
    if autocast is None or not autocast._enabled:
        return "fp32"
    return get_format(autocast.fast_dtype).name


def _setting(scaler, name: str) -> float:
    if name == "init_scale":
        value = scaler.get_scale()
    else:
        value = getattr(scaler, f"get_{name}")()
    return value if math.isfinite(value) else str(value)
