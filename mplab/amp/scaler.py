"""GradScaler from scratch: a drop-in twin of ``torch.amp.GradScaler``, bit for bit.

fp16 gradients underflow: values under 2**-25 round to zero. Loss scaling multiplies the loss by a
large ``scale`` before ``backward()`` so the gradients land in fp16's range, then divides them by
the same scale ("unscales") before the optimizer sees them. Too large a scale overflows to inf, so
the scale is *dynamic*: each iteration that finds an inf or NaN skips the optimizer step and
multiplies the scale by ``backoff_factor``; ``growth_interval`` clean iterations in a row multiply
it by ``growth_factor``.

One iteration, per optimizer, moves through three stages, and each call checks it is in order::

    scaler.scale(loss).backward()   # any number of losses and backward passes
    scaler.unscale_(optimizer)      # optional: READY -> UNSCALED (e.g. to clip gradients)
    scaler.step(optimizer)          # READY/UNSCALED -> STEPPED; skipped if an inf/NaN was found
    scaler.update()                 # new scale; every optimizer back to READY

Everything is written with public torch operations (plus ``torch._foreach_mul_`` and, for
sparse grads, ``Tensor._values()``); where torch calls its private C++ kernels
(``_amp_foreach_non_finite_check_and_unscale_``, ``_amp_update_scale_``), this module spells the
same arithmetic out, so swapping ``torch.amp.GradScaler`` for this class changes no bit of
training. Every misuse raises the same exception type with the same message as torch. One
deliberate difference: torch's CUDA kernel rejects bf16 gradients (NotImplementedError, pytorch
issue #127176); here they are unscaled as on the CPU.

Across processes (lesson 8), ``process_group=`` makes it torch's ``ShardedGradScaler``'s twin:
each found-inf is summed over the group's ranks (``all_reduce``, SUM) before any step is
decided, so a rank whose own shard is finite still skips the step another rank overflowed on.
Without it, as with ``torch.amp.GradScaler``, each rank sees its own gradients only: that is
right under DDP (every rank holds the all-reduced gradients), wrong under FSDP (shards).
Sharded gradients (DTensors) are checked and unscaled on this rank's shard.

On top of torch's behaviour, ``scaler.history`` keeps one :class:`UpdateRecord` per ``update()``:
what the scale was, what it became, and which optimizers stepped. It costs no host-device sync
during training: the numbers stay on the scale's device until ``history`` is read (or every
``HISTORY_FLUSH`` updates, so unread records never pile up on a GPU).
"""

from __future__ import annotations

import inspect
import operator
import warnings
from collections import abc, defaultdict
from dataclasses import dataclass, field
from enum import Enum
from importlib.util import find_spec
from typing import Any

import torch

__all__ = ["GradScaler", "Stage", "UpdateRecord", "found_inf_in"]

HISTORY_FLUSH = 256  # pending history entries copied to the host in one sync


class Stage(Enum):
    """Where one optimizer is in the current iteration (torch calls this ``OptState``)."""

    READY = 0  # nothing done since the last update()
    UNSCALED = 1  # grads checked for inf/NaN and unscaled; step() may follow
    STEPPED = 2  # step() ran or was skipped; only update() may follow


@dataclass
class _OptimizerState:
    """One optimizer's progress through the iteration. Module level, so the scaler pickles."""

    stage: Stage = Stage.READY
    found_inf_per_device: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    called_step: bool = False  # for the history only


@dataclass(frozen=True)
class UpdateRecord:
    """What one ``update()`` saw and did.

    ``stepped`` maps each optimizer that took part in the iteration (by its index, in the order
    the scaler first saw it) to whether its parameters were updated. A step skipped because of an
    inf/NaN, and an optimizer that was only ``unscale_``-d, count as not stepped. Fused
    optimizers skip inside their own kernel; they are recorded the same way.
    """

    iteration: int  # 0 for the first update()
    scale: float  # the scale this iteration's losses were multiplied by
    new_scale: float  # the scale after update()
    growth_tracker: int  # clean iterations in a row, after update()
    found_inf: bool  # an inf/NaN was found in this iteration's gradients
    stepped: dict[int, bool]
    manual: bool = False  # update(new_scale) set the scale; the growth/backoff rule did not run


class GradScaler:
    """Dynamic loss scaling, with torch.amp.GradScaler's arguments, methods and errors.

    Args:
        device: device type, "cuda" or "cpu" (or any other torch device type).
        init_scale: the first scale. Nothing checks it; 0, negative or inf are accepted.
        growth_factor: multiplies the scale after ``growth_interval`` clean updates (> 1).
        backoff_factor: multiplies the scale after an update that found an inf/NaN (< 1).
        growth_interval: clean ``update()`` calls in a row needed to grow the scale.
        enabled: if False, ``scale`` returns its argument and ``step`` just calls
            ``optimizer.step``: the same loop runs with or without scaling.
        process_group: a torch.distributed group whose ranks' found-infs are summed, as
            ``ShardedGradScaler``'s ``process_group`` (None: this process alone).

    Beyond torch's API, ``history`` lists one :class:`UpdateRecord` per ``update()``
    (iteration, scale, new_scale, growth_tracker, found_inf, stepped, manual), and
    ``get_growth_tracker()`` is public.
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group=None,
    ) -> None:
        self._device = device
        self._process_group = process_group
        self._enabled = enabled
        self._history: list[UpdateRecord] = []
        self._pending: list[tuple[torch.Tensor, dict[str, Any]]] = []
        self._optimizer_index: dict[int, int] = {}  # id(optimizer) -> order first seen
        # Like torch: only the exact string "cuda" triggers the check.
        cuda_missing = not (torch.cuda.is_available() or find_spec("torch_xla"))
        if device == "cuda" and enabled and cuda_missing:
            warnings.warn(
                "torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling.",
                stacklevel=2,
            )
            self._enabled = False

        if self._enabled:  # a disabled scaler validates nothing and keeps no state, like torch's
            if growth_factor <= 1.0:
                raise AssertionError("The growth factor must be > 1.0.")
            if backoff_factor >= 1.0:
                raise AssertionError("The backoff factor must be < 1.0.")
            self._init_scale = init_scale
            self._init_growth_tracker = 0
            # Created by the first scale(), on the device of the tensor it scales.
            self._scale: torch.Tensor | None = None
            self._growth_tracker: torch.Tensor | None = None
            self._growth_factor = growth_factor
            self._backoff_factor = backoff_factor
            self._growth_interval = growth_interval
            self._per_optimizer_states: dict[int, _OptimizerState] = defaultdict(_OptimizerState)

    # ---- the iteration: scale, unscale_, step, update ------------------------------------------

    def scale(self, outputs):
        """Multiply a tensor, or nested lists/tuples/iterables of tensors, by the scale.

        Lists and tuples keep their type; any other iterable comes back as a lazy ``map``.
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):  # the common case: one loss
            if self._scale is None:
                self._lazy_init(outputs.device)
            return outputs * self._scale.to(device=outputs.device, non_blocking=True)

        per_device: dict[torch.device, torch.Tensor] = {}  # one copy of the scale per device

        def scaled(value):
            if isinstance(value, torch.Tensor):
                if self._scale is None:
                    self._lazy_init(value.device)
                if value.device not in per_device:
                    copy = self._scale.to(value.device, non_blocking=True, copy=True)
                    per_device[value.device] = copy
                return value * per_device[value.device]
            if isinstance(value, abc.Iterable):
                result = map(scaled, value)
                return type(value)(result) if isinstance(value, (list, tuple)) else result
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return scaled(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale, in place, and check them for inf/NaN.

        Optional: ``step`` unscales if you did not. Call it to inspect or clip the real gradients;
        at most once per optimizer per iteration, after all its gradients are accumulated.
        """
        if not self._enabled:
            return
        scale, _ = self._check_scale_growth_tracker("unscale_")
        state = self._state_of(optimizer)
        if state.stage is Stage.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state.stage is Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        # The reciprocal is taken in float64 and rounded once, as torch does, so that
        # grad * inv_scale is the same number torch computes (MPS has no float64).
        if scale.device.type == "mps":
            inv_scale = scale.reciprocal()
        else:
            inv_scale = scale.double().reciprocal().float()
        state.found_inf_per_device = self._check_and_unscale(optimizer, inv_scale)
        state.stage = Stage.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """Unscale (if ``unscale_`` was not called) and run ``optimizer.step(*args, **kwargs)``,
        unless a gradient holds an inf or NaN. Returns what ``optimizer.step`` returns, or None
        when the step is skipped.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:  # a closure would recompute the loss without scaling it
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        state = self._state_of(optimizer)
        if state.stage is Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        state.called_step = True

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._fused_step(optimizer, state, args, kwargs)

        if state.stage is Stage.READY:
            self.unscale_(optimizer)
        if len(state.found_inf_per_device) == 0:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        # The one host-device sync of an iteration: Python must know whether to call step().
        retval = None
        if not sum(v.item() for v in state.found_inf_per_device.values()):
            retval = optimizer.step(*args, **kwargs)
        state.stage = Stage.STEPPED
        return retval

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Set the scale for the next iteration, and reset every optimizer to READY.

        Without ``new_scale``: if any optimizer found an inf/NaN this iteration, the scale is
        multiplied by ``backoff_factor``; otherwise, on the ``growth_interval``-th clean update
        in a row, by ``growth_factor`` (unless that would make it inf). With ``new_scale``
        (a float, or a 1-element tensor on the scaler's device type) the scale is set to it and
        the growth tracker is left as it is.
        """
        if not self._enabled:
            return
        scale, _ = self._check_scale_growth_tracker("update")
        scale_used = scale.double()  # a copy for the history, which float64 holds exactly
        if new_scale is not None:
            if isinstance(new_scale, float):
                scale.fill_(new_scale)
            else:
                reason = (
                    "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                    "torch.FloatTensor with requires_grad=False."
                )
                if new_scale.device.type != self._device:
                    raise AssertionError(reason)
                if new_scale.numel() != 1:
                    raise AssertionError(reason)
                if new_scale.requires_grad is True:
                    raise AssertionError(reason)
                scale.copy_(new_scale)  # a copy: later changes to new_scale do not leak in
            found_inf = None
        else:
            found_infs = [
                found_inf.to(device=scale.device, non_blocking=True)
                for state in self._per_optimizer_states.values()
                for found_inf in state.found_inf_per_device.values()
            ]
            if len(found_infs) == 0:
                raise AssertionError("No inf checks were recorded prior to update.")
            found_inf = sum(found_infs)  # same order as torch; any non-zero means "back off"
            self._update_scale(found_inf)
        self._remember(scale_used, found_inf, manual=new_scale is not None)
        self._per_optimizer_states = defaultdict(_OptimizerState)

    # ---- the arithmetic --------------------------------------------------------------------------

    def _check_and_unscale(self, optimizer, inv_scale=None, allow_fp16=False):
        """Check the optimizer's grads for inf/NaN, then multiply them by ``inv_scale`` in place
        (``None``: check only). Returns ``{device: found_inf}``, a float 0-dim tensor that is
        1.0 if that device's grads held an inf or NaN. Makes no host-device sync.
        """
        grads_by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if not isinstance(param, torch.Tensor):
                        raise AssertionError(
                            f"expected param to be torch.Tensor, got {type(param).__name__}"
                        )
                    grad = param.grad
                    if grad is None:
                        continue
                    if hasattr(grad, "to_local"):  # a DTensor: this rank's shard, in place
                        grad = grad.to_local()
                    if not allow_fp16 and grad.dtype == torch.float16:
                        # Unscaled fp16 grads would underflow again: keep fp32 master params.
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    if grad.is_sparse:
                        # Like torch: check and unscale the stored values. fp16 values (fused
                        # optimizers only) are coalesced first, since summing duplicates may
                        # overflow; other sparse grads are left uncoalesced, so each stored
                        # value is unscaled exactly as torch does it.
                        if grad.dtype is torch.float16:
                            param.grad = grad = grad.coalesce()
                        grad = grad._values()
                    grads_by_device[grad.device].append(grad)

            found_inf_per_device = {}
            for device, grads in grads_by_device.items():
                found_inf_per_device[device] = found_inf_in(grads, device)  # before unscaling
                if inv_scale is not None:
                    torch._foreach_mul_(grads, inv_scale.to(device, non_blocking=True))
        if self._process_group is not None:
            self._sum_over_ranks(found_inf_per_device)
        return found_inf_per_device

    def _sum_over_ranks(self, found_inf_per_device: dict) -> None:
        """ShardedGradScaler's sync: every found-inf summed over the group, in place. A rank
        holding no gradient still joins, with a 0 on the scale's device."""
        import torch.distributed as dist

        if not found_inf_per_device:
            found_inf_per_device[self._scale.device] = torch.zeros_like(self._scale)
        for found in found_inf_per_device.values():
            dist.all_reduce(found, group=self._process_group)

    def _update_scale(self, found_inf: torch.Tensor) -> None:
        """torch's ``_amp_update_scale_`` kernel in tensor operations, so the scale never leaves
        its device. Like the kernel, products are taken in float64 and rounded once to float32:
        for factors that are not powers of two this differs from a float32 multiply.
        """
        scale, tracker = self._scale, self._growth_tracker
        backed_off = (scale.double() * self._backoff_factor).float()
        grown = (scale.double() * self._growth_factor).float()
        clean_in_a_row = tracker + 1  # int32, wraps at 2**31 - 1 like the kernel's counter
        # Exact equality: a tracker already past the interval never grows the scale again.
        # (The CPU kernel compares in int64; the CUDA kernel truncates the interval to int32.)
        grow = clean_in_a_row.long() == operator.index(self._growth_interval)
        found = found_inf != 0  # NaN and negative sums count, as in the kernel's `if`
        keep_or_grow = torch.where(grow & grown.isfinite(), grown, scale)  # never grow to inf
        scale.copy_(torch.where(found, backed_off, keep_or_grow))
        tracker.copy_(torch.where(found | grow, 0, clean_in_a_row))

    def _fused_step(self, optimizer, state: _OptimizerState, args, kwargs):
        """Optimizers with ``_step_supports_amp_scaling`` (``fused=True`` Adam, AdamW, SGD,
        Adagrad) unscale and skip inside their own kernel: hand them the scale and found_inf.
        """
        has_grad_scaler_kwarg = "grad_scaler" in inspect.signature(optimizer.step).parameters
        if has_grad_scaler_kwarg:  # the older contract: the optimizer drives the scaler itself
            warnings.warn(
                "GradScaler is going to stop passing itself as a keyword argument to the passed "
                "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                "`found_inf: Tensor` to the passed optimizer and let the optimizer use them "
                "directly.",
                FutureWarning,
                stacklevel=3,
            )
            kwargs["grad_scaler"] = self
        else:
            if state.stage is Stage.READY:
                self._check_inf_per_device(optimizer)
            scale = self._scale
            found_inf = sum(
                [t.to(scale.device, non_blocking=True) for t in state.found_inf_per_device.values()]
            )
            # Grads already unscaled need no grad_scale; a user-set one multiplies ours.
            if state.stage is Stage.UNSCALED:
                optimizer.grad_scale = getattr(optimizer, "grad_scale", None)
            else:
                optimizer.grad_scale = scale * getattr(optimizer, "grad_scale", 1)
            optimizer.found_inf = found_inf
        retval = optimizer.step(*args, **kwargs)
        state.stage = Stage.STEPPED
        if not has_grad_scaler_kwarg:
            del optimizer.grad_scale
            del optimizer.found_inf
        return retval

    # ---- getters, setters, state -----------------------------------------------------------------

    def get_scale(self) -> float:
        """The current scale (syncs with the device), ``init_scale`` before the first
        ``scale()``, or 1.0 when disabled."""
        if self._enabled:
            return self._init_scale if self._scale is None else self._scale.item()
        return 1.0

    def get_growth_tracker(self) -> int:
        """Clean updates in a row so far (syncs with the device); 0 when disabled."""
        if self._enabled:
            if self._growth_tracker is None:
                return self._init_growth_tracker
            return self._growth_tracker.item()
        return 0

    _get_growth_tracker = get_growth_tracker  # torch's name for it

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = new_factor  # not validated, as in torch

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = new_factor

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = new_interval

    def is_enabled(self) -> bool:
        return self._enabled

    @property
    def history(self) -> list[UpdateRecord]:
        """One :class:`UpdateRecord` per ``update()``, oldest first. Reading it syncs once."""
        self._flush_history()
        return self._history

    def state_dict(self) -> dict[str, Any]:
        """The five numbers that resume scaling: call it after ``update()``. Empty if disabled."""
        if self._enabled:
            return {
                "scale": self.get_scale(),
                "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor,
                "growth_interval": self._growth_interval,
                "_growth_tracker": self.get_growth_tracker(),
            }
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()`` (ours or torch's). A no-op when disabled."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved "
                "from a disabled instance of GradScaler."
            )
        self._init_scale = state_dict["scale"]
        if self._scale is not None:
            self._scale.fill_(state_dict["scale"])
        self._growth_factor = state_dict["growth_factor"]
        self._backoff_factor = state_dict["backoff_factor"]
        self._growth_interval = state_dict["growth_interval"]
        self._init_growth_tracker = state_dict["_growth_tracker"]
        if self._growth_tracker is not None:
            self._growth_tracker.fill_(state_dict["_growth_tracker"])

    def __getstate__(self) -> dict[str, Any]:
        """Pickle between iterations only; the scale travels as a number and its tensor is
        re-created on the first ``scale()`` after loading."""
        self._flush_history()
        state = self.__dict__.copy()
        state["_process_group"] = None  # a group lives in its processes; give it again after
        if self._enabled:
            if len(self._per_optimizer_states) != 0:
                raise AssertionError(
                    "A GradScaler instance may only be pickled at the beginning "
                    "of an iteration, or at the end after scaler.update()."
                )
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = self.get_growth_tracker()
            state["_scale"] = None
            state["_growth_tracker"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # ---- helpers -------------------------------------------------------------------------------

    def _lazy_init(self, device: torch.device) -> None:
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)
        self._growth_tracker = torch.full(
            (), self._init_growth_tracker, dtype=torch.int32, device=device
        )

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        fix = (
            "This may indicate your script did not use scaler.scale(loss or outputs) "
            "earlier in the iteration."
        )
        if self._scale is None:
            raise AssertionError(f"Attempted {funcname} but _scale is None.  " + fix)
        if self._growth_tracker is None:
            raise AssertionError(f"Attempted {funcname} but _growth_tracker is None.  " + fix)
        return self._scale, self._growth_tracker

    def _state_of(self, optimizer) -> _OptimizerState:
        self._optimizer_index.setdefault(id(optimizer), len(self._optimizer_index))
        return self._per_optimizer_states[id(optimizer)]

    def _remember(self, scale_used: torch.Tensor, found_inf, manual: bool) -> None:
        """Queue this update's numbers, as one float64 tensor on the scale's device."""
        called_step, found_infs = {}, []
        for key, state in self._per_optimizer_states.items():
            called_step[self._optimizer_index[key]] = state.called_step
            found = [f.to(scale_used.device) for f in state.found_inf_per_device.values()]
            found_infs.append(sum(found, torch.zeros_like(self._scale)))
        if found_inf is None:  # update(new_scale): report whether any check found inf/NaN
            found_inf = sum(found_infs, torch.zeros_like(self._scale))
        # Stacked with the float64 scale_used, all become float64: the int32 tracker stays exact.
        row = torch.stack([scale_used, self._scale, self._growth_tracker, found_inf, *found_infs])
        self._pending.append((row, {"manual": manual, "called": called_step}))
        if len(self._pending) >= HISTORY_FLUSH:
            self._flush_history()

    def _flush_history(self) -> None:
        if not self._pending:
            return
        values = torch.cat([numbers for numbers, _ in self._pending]).tolist()  # one sync
        for numbers, meta in self._pending:
            row, values = values[: len(numbers)], values[len(numbers) :]
            scale, new_scale, tracker, found_inf, *per_optimizer = row
            stepped = {
                index: called and found == 0
                for (index, called), found in zip(meta["called"].items(), per_optimizer)
            }
            self._history.append(
                UpdateRecord(
                    iteration=len(self._history),
                    scale=scale,
                    new_scale=new_scale,
                    growth_tracker=int(tracker),
                    found_inf=found_inf != 0,
                    stepped=stepped,
                    manual=meta["manual"],
                )
            )
        self._pending.clear()

    # torch's fused optimizers of the older contract call these on the scaler they are given.
    def _get_scale_async(self) -> torch.Tensor | None:
        return self._scale

    def _check_inf_per_device(self, optimizer) -> dict[torch.device, torch.Tensor]:
        self._check_scale_growth_tracker("_check_inf_per_device")
        state = self._per_optimizer_states[id(optimizer)]
        state.found_inf_per_device = self._check_and_unscale(optimizer, None, allow_fp16=True)
        return state.found_inf_per_device

    def _found_inf_per_device(self, optimizer) -> dict[torch.device, torch.Tensor]:
        return self._per_optimizer_states[id(optimizer)].found_inf_per_device


def found_inf_in(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """1.0 if any of ``grads`` holds an inf or NaN, else 0.0, exactly and without a sync.

    Every value is finite exactly when the smallest and the largest are: min and max propagate
    NaN and, unlike a sum or a norm, cannot overflow on large finite values. ``aminmax`` reads
    each tensor once and allocates nothing, so it costs about as much as the unscaling multiply.
    """
    extremes = [m for g in grads if g.numel() > 0 for m in torch.aminmax(g)]
    if not extremes:
        return torch.zeros((), dtype=torch.float32, device=device)
    return (~torch.stack(extremes).isfinite().all()).float()
