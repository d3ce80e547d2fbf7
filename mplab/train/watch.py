"""What each optimizer step really did, seen by hooks rather than inferred from the loss, and
the one place a run's per-step record is written.

- `StepCounter`: whether `optimizer.step()` really ran (a GradScaler skips it on inf/NaN).
- `StepWatch`: per step, the share of gradient entries that are exactly 0 when the optimizer
  steps (fp16 gradients flush to 0 below 2**-24: underflow), and, for weights stored in
  bf16/fp16, the share of those weights that kept their value through the step (an update
  smaller than half a unit in the last place is rounded away: swamping).
- `ScalerCalls`: how many times `scale`, `unscale_`, `step` and `update` of a GradScaler ran in each
  iteration (once each is right; more is a bug the scale's history hides).

- `StepLog`: the record of each step (loss, time, skip, scale, norm, what the watch saw) and,
  at the end, what was observed and the audit. `Run` (mplab.train's paths) and `Recorder`
  (a loop of your own) both write through it, so both records follow the same rules.

mplab.train keeps the watch on every run that can show the effect (`TrainConfig.watch`);
`Recorder` puts it on a loop of your own. `mplab.diagnose` reads what they recorded.
"""

from __future__ import annotations

import functools

import torch

from mplab.amp.audit import Audit, Observer, audit

from .fp8_watch import FP8Watch
from .layers import LayerWatch, inner_optimizer, local_shard
from .result import TrainResult

__all__ = ["LOW_PRECISION", "SCALER_METHODS", "inner_optimizer", "local_shard", "StepCounter",
           "StepWatch", "ScalerCalls", "StepLog"]

LOW_PRECISION = (torch.float16, torch.bfloat16)
SCALER_METHODS = ("scale", "unscale_", "step", "update")


class StepCounter:
    """Did `optimizer.step()` really run? A GradScaler skips it when a gradient is inf/NaN; an
    optimizer post-hook sees whether it ran, as Accelerate's `step_was_skipped` does. (Reading
    it off a falling scale would miss a scale of 0 and `update(new_scale)`.) Fused optimizers
    given `grad_scale` skip inside their kernel instead: mplab's paths use plain AdamW."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.count = self._seen = 0
        self._hook = inner_optimizer(optimizer).register_step_post_hook(self._ran)

    def _ran(self, optimizer, args, kwargs) -> None:
        self.count += 1

    def stepped(self) -> bool:
        """True if the optimizer stepped since the last call."""
        ran, self._seen = self.count > self._seen, self.count
        return ran

    def remove(self) -> None:
        self._hook.remove()


class StepWatch:
    """`zeros`: count exactly-zero gradient entries at each step (embedding tables left out:
    the rows of tokens not in the batch are 0 in any precision). `unchanged`: compare the
    low-precision weights before and after. `measure()` gives the figures of the steps since
    its last call, or None for one it does not watch."""

    def __init__(self, model: torch.nn.Module, optimizer, *, zeros: bool = True,
                 unchanged: bool = True):
        params = [p for p in model.parameters() if p.requires_grad]
        tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        self._graded = [p for p in params if id(p) not in tables]
        self._low = [p for p in params if p.dtype in LOW_PRECISION] if unchanged else []
        self._zeros: list[float] = []
        self._hook = (inner_optimizer(optimizer).register_step_pre_hook(self._count_zeros)
                      if zeros else None)
        self._before = self._snapshot()

    def _count_zeros(self, optimizer, args, kwargs) -> None:
        # a DTensor's (FSDP2's) shard on this rank: its share, as the optimizer steps it
        grads = [local_shard(p.grad) for p in self._graded if p.grad is not None]
        total = sum(g.numel() for g in grads)
        if total:  # counted on the device, read with one sync
            zero = torch.stack([(g == 0).sum() for g in grads]).sum().item()
            self._zeros.append(zero / total)

    def _snapshot(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self._low]

    def measure(self) -> tuple[float | None, float | None]:
        """(share of gradient entries that were 0, share of low-precision weights unchanged)."""
        zero = max(self._zeros) if self._zeros else None  # the worst step among them
        self._zeros = []
        unchanged = None
        if self._low:
            total = sum(p.numel() for p in self._low)
            same = torch.stack([(p.detach() == old).sum()
                                for p, old in zip(self._low, self._before)]).sum().item()
            unchanged = same / total
            self._before = self._snapshot()
        return zero, unchanged

    def remove(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


class ScalerCalls:
    """Counts the calls of a GradScaler's `unscale_`, `step` and `update` (torch's or
    mplab's), by wrapping them on the instance; `counts()` gives those since its last call."""

    def __init__(self, scaler):
        self.scaler = scaler
        self._counts = dict.fromkeys(SCALER_METHODS, 0)
        for name in SCALER_METHODS:
            setattr(scaler, name, self._counted(name, getattr(scaler, name)))

    def _counted(self, name, method):
        @functools.wraps(method)
        def call(*args, **kwargs):
            self._counts[name] += 1
            return method(*args, **kwargs)
        return call

    def counts(self) -> dict[str, int]:
        counts, self._counts = self._counts, dict.fromkeys(SCALER_METHODS, 0)
        return counts

    def remove(self) -> None:
        for name in SCALER_METHODS:
            self.scaler.__dict__.pop(name, None)


class StepLog:
    """Writes a run's record, step by step, into `result` (a `TrainResult`), by one set of
    rules for every kind of run: a loss per step, the scale only with a scaler, skipped steps
    by number, norms only when given, zero gradients for fp16 runs, unchanged weights where
    they are low precision, and the scaler's calls where they are counted.

    It watches `model` (the dtypes its matmuls, output and gradients ran in: `Observer`) and,
    with `watch`, each step (`StepWatch`), where a non-finite value began (`LayerWatch`) and,
    where it trains through fp8 Linears, what their casts did (`FP8Watch`: config["fp8"]);
    `optimizer` may be given later (`watch_optimizer`).
    """

    def __init__(self, result: TrainResult, model: torch.nn.Module, optimizer=None, *,
                 watch: bool = True, scaler_calls: ScalerCalls | None = None,
                 zeros: bool | None = None):
        self.result, self.model, self.watching = result, model, watch
        # count zero gradients: in fp16 runs, or (True) in one whose precision is learned later
        self._zeros = result.precision == "fp16" if zeros is None else zeros
        self.observer = Observer(model)
        self._watch: StepWatch | None = None
        self._calls = scaler_calls
        self.layers = LayerWatch(model) if watch else None
        self.fp8 = FP8Watch.of(model) if watch else None  # None without fp8 Linears
        if optimizer is not None:
            self.watch_optimizer(optimizer)

    def watch_optimizer(self, optimizer) -> None:
        """Watch `optimizer`'s steps: the gradients' dtype, zeros (fp16) and unchanged weights."""
        self.observer.watch(inner_optimizer(optimizer))
        if self.layers is not None:
            self.layers.watch_optimizer(optimizer)
        if self.watching:  # underflow can only happen to fp16 gradients
            self._watch = StepWatch(self.model, optimizer, zeros=self._zeros)

    def step(self, loss: float, seconds: float, *, skipped: bool = False,
             scale: float | None = None, grad_norm=None, loss_dtype=None) -> None:
        """One optimizer step: its loss, time, whether it was skipped, the scale after it
        (None without a scaler), the gradient norm before clipping (None without) and the
        dtype the loss was computed in (where known)."""
        result = self.result
        if self.layers is not None:
            self.layers.step(result, loss, loss_dtype)
        if self.fp8 is not None:
            self.fp8.step(result)
        result.losses.append(loss)
        result.step_seconds.append(seconds)
        if skipped:
            result.skipped_steps.append(len(result.losses))
        if scale is not None:
            result.scales.append(scale)
        if grad_norm is not None:
            result.grad_norms.append(float(grad_norm))
            if self.layers is not None:
                self.layers.norms = True
        if self._calls is not None:
            result.scaler_calls.append(self._calls.counts())
        if self._watch is not None:
            zeros, unchanged = self._watch.measure()
            if self._zeros:
                result.zero_grad_fractions.append(zeros)
            if unchanged is not None:
                result.unchanged_weight_fractions.append(unchanged)

    def stopped(self, loss: float) -> None:
        """The step that stopped the run (its loss not finite) was never `step`ped: what the
        layers' watch saw in it still goes into the record."""
        if self.layers is not None:
            self.layers.step(self.result, loss)
        if self.fp8 is not None:
            self.fp8.step(self.result)

    def observed(self) -> None:
        """What the hooks saw, into the record: the matmul, output and gradient dtypes."""
        result, seen = self.result, self.observer
        result.compute_dtype = seen.compute_dtype or result.compute_dtype
        result.output_dtype = seen.output_dtype or result.output_dtype
        result.grad_dtype = seen.grad_dtype or result.grad_dtype

    def audit(self, optimizer, **parts) -> Audit:
        """The audit of the model and `optimizer` (mplab.amp.audit; `parts`: its scaler, autocast
        and accelerator), into the record; returns it, for the caller to warn of fallbacks."""
        result = self.result
        found = audit(self.model, optimizer, result=result, **parts)
        result.audit = found
        result.param_dtype = found.param_dtype
        result.optimizer_state_dtype = found.optimizer_state_dtype
        result.grad_dtype = result.grad_dtype or found.grad_dtype
        return found

    def remove(self) -> None:
        for part in (self.observer, self._watch, self._calls, self.layers, self.fp8):
            if part is not None:
                part.remove()
        self._watch = self._calls = self.layers = self.fp8 = None
