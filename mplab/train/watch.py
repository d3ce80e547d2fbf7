"""What each optimizer step really did, seen by hooks rather than inferred from the loss.

- `StepWatch`: per step, the share of gradient entries that are exactly 0 when the optimizer
  steps (fp16 gradients flush to 0 below 2**-24: underflow), and, for weights stored in
  bf16/fp16, the share of those weights that kept their value through the step (an update
  smaller than half a unit in the last place is rounded away: swamping).
- `ScalerCalls`: how many times `unscale_`, `step` and `update` of a GradScaler ran in each
  iteration (once each is right; more is a bug the scale's history hides).

mplab.train keeps both on every run that can show the effect; `Recorder` puts them on a loop
of your own. `mplab.diagnose` reads what they recorded.
"""

from __future__ import annotations

import functools

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)
SCALER_METHODS = ("unscale_", "step", "update")


def inner_optimizer(optimizer):
    """The torch optimizer inside Accelerate's or mplab.bf16's wrapper (hooks go on it)."""
    while hasattr(optimizer, "optimizer"):  # AcceleratedOptimizer subclasses Optimizer too
        optimizer = optimizer.optimizer
    return optimizer


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
        grads = [p.grad for p in self._graded if p.grad is not None]
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
