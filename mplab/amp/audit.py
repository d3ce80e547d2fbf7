"""Did mixed precision really happen? One look at a model, its optimizer and its run.

    report = audit(model, optimizer, scaler=scaler, batch=batch, autocast=autocast)
    report                     # prints as a readable report: verdict, dtypes, silent fallbacks
    report.compute_dtype       # torch.bfloat16: what the matmuls really ran in (observed)
    report.fallbacks           # each silent fallback found: Fallback(code, text)
    report.as_dict()           # plain JSON

Asking for mixed precision is not getting it. Accelerate and the Trainer ignore fp16 on a CPU
without a word; torch disables autocast for a dtype it does not support; a checkpoint saved in
bf16 loads as bf16 weights, so "mixed" training has no fp32 master weights. The audit looks
at what is there, and watches what runs:

- the parameters (the master weights), their gradients and the optimizer's states: dtypes by
  number of elements, read off the tensors;
- the autocast: device, dtype and whether it is on, from the context you give (or the one
  Accelerate builds into a prepared model's forward, from `accelerator=`);
- the dtype the matmuls really ran in and the dtype of the output, *observed*: with `batch=`,
  one forward (and backward) step under `autocast` watched by hooks, the model and its
  gradients left as they were; or from a finished run's `result=` (`mplab.train.TrainResult`);
- the GradScaler: present or not, its scale, the steps it skipped.

Each silent fallback has one check, declared with its code, in :mod:`mplab.amp.fallbacks`.
`Observer` is the cheap watch a training run keeps for the same answers (mplab.train uses it).
This module is library-level: torch, and mplab's formats, trace and Table; nothing else.
"""

from __future__ import annotations

import html
from collections import Counter
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

import torch

from mplab._display import Table
from mplab.amp.fallbacks import (
    FALLBACKS,
    LOW_PRECISION,
    Fallback,
    asked_dtype,
    autocast_supported,
    find_fallbacks,
    known_code,
    read_fallback,
)
from mplab.amp.trace import MatmulDtypeProbe
from mplab.numerics.formats import dtype_from_name, dtype_name

__all__ = ["DTYPE_FIELDS", "FALLBACKS", "Fallback", "Observer", "Audit", "audit",
           "autocast_supported"]

_LOW = LOW_PRECISION
DTYPE_FIELDS = ("param_dtype", "grad_dtype", "optimizer_state_dtype", "compute_dtype",
                "output_dtype")

class Observer:
    """What a model really does while it trains, seen by hooks at almost no cost: the dtype its
    matmuls run in and its output's dtype (first forward pass), and its gradients' dtype (at
    the optimizer's first step, before zero_grad clears them). Call `remove()` when done."""

    def __init__(self, model: torch.nn.Module, optimizer=None):
        self._matmul = MatmulDtypeProbe(model)
        self.output_dtype: torch.dtype | None = None
        self.grad_dtypes: dict[torch.dtype, int] = {}
        self._hooks = [model.register_forward_hook(self._output)]
        if optimizer is not None:
            self.watch(optimizer)

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return self._matmul.dtype

    @property
    def grad_dtype(self) -> torch.dtype | None:
        return _majority(self.grad_dtypes)

    def watch(self, optimizer) -> None:
        """Also read the gradients' dtypes when `optimizer` first steps."""
        self._hooks.append(_unwrap_optimizer(optimizer).register_step_pre_hook(self._grads))

    def _output(self, module, args, output) -> None:
        tensor = _first_float(output)
        if tensor is not None and self.output_dtype is None:
            self.output_dtype = tensor.dtype

    def _grads(self, optimizer, args, kwargs) -> None:
        if not self.grad_dtypes:
            self.grad_dtypes = _by_dtype(p.grad for g in optimizer.param_groups
                                         for p in g["params"] if p.grad is not None)

    def remove(self) -> None:
        self._matmul.remove()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


@dataclass
class Audit:
    """What one audit found. Dtypes are torch dtypes (None: nothing to look at); `*_dtypes`
    count elements per dtype name; `fallbacks` name each silent fallback (`Fallback`),
    `notes` explain what is normal but surprising."""

    param_dtype: torch.dtype | None = None
    grad_dtype: torch.dtype | None = None
    optimizer_state_dtype: torch.dtype | None = None
    compute_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    asked: str | None = None            # the precision asked for: "fp16", "bf16", "fp32"
    autocast: dict | None = None        # {"device", "dtype", "enabled", "by"}; None: none given
    scaler: dict | None = None          # {"enabled", "scale", "skipped_steps"}; None: no scaler
    param_dtypes: dict[str, int] = field(default_factory=dict)
    grad_dtypes: dict[str, int] = field(default_factory=dict)
    optimizer_state_dtypes: dict[str, int] = field(default_factory=dict)
    fallbacks: list[Fallback] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def has(self, code: str) -> bool:
        """Does the audit name the fallback `code` (a key of FALLBACKS)?"""
        known_code(code)
        return any(f.code == code for f in self.fallbacks)

    @property
    def mixed(self) -> bool:
        """Mixed precision really happened: low-precision matmuls over fp32 master weights."""
        return self.compute_dtype in _LOW and self.param_dtype == torch.float32

    @property
    def verdict(self) -> str:
        compute, params = dtype_name(self.compute_dtype), dtype_name(self.param_dtype)
        if self.compute_dtype is None:
            return "the matmuls were not observed: give batch= (one step is run) or result="
        if self.mixed:
            scaled = " with a GradScaler" if self.scaler and self.scaler["enabled"] else ""
            return f"mixed precision: {compute} matmuls over float32 master weights{scaled}"
        if self.compute_dtype in _LOW:
            return f"pure {compute}: the matmuls and the weights are {params}, no fp32 master copy"
        if self.asked in ("fp16", "bf16"):
            return (f"{self.asked} was asked for, but everything ran in {compute}: no mixed "
                    "precision")
        return f"{compute} throughout: no mixed precision (none was asked for)"

    def as_dict(self) -> dict:
        out = asdict(self)
        for key in DTYPE_FIELDS:
            out[key] = dtype_name(out[key])
        if self.autocast:
            out["autocast"] = {**self.autocast, "dtype": dtype_name(self.autocast["dtype"])}
        out["mixed"], out["verdict"] = self.mixed, self.verdict
        return out

    @classmethod
    def from_dict(cls, data: dict) -> Audit:
        data = {k: v for k, v in data.items() if k not in ("mixed", "verdict")}
        data["fallbacks"] = [read_fallback(f) for f in data.get("fallbacks", [])]
        for key in DTYPE_FIELDS:
            data[key] = dtype_from_name(data.get(key))
        if data.get("autocast"):
            dtype = dtype_from_name(data["autocast"]["dtype"])
            data["autocast"] = {**data["autocast"], "dtype": dtype}
        return cls(**data)

    def table(self, verdict: bool = True) -> Table:
        """The audit's findings, one row each, under a title holding the verdict;
        `verdict=False`: the rows alone (what was read and observed, for a reader to judge)."""
        rows = [("asked for", self.asked or "-"),
                ("autocast", _autocast_text(self.autocast)),
                ("matmuls ran in (observed)", dtype_name(self.compute_dtype) or "not observed"),
                ("model output", dtype_name(self.output_dtype) or "not observed"),
                ("weights (master copy)", _breakdown(self.param_dtypes)),
                ("gradients", _breakdown(self.grad_dtypes) or "none yet"),
                ("optimizer states", _breakdown(self.optimizer_state_dtypes) or "none yet"),
                ("GradScaler", _scaler_text(self.scaler))]
        return Table([{"what": k, "found": v} for k, v in rows],
                     title="mixed precision audit" + (f": {self.verdict}" if verdict else ""))

    def __str__(self) -> str:
        lines = [str(self.table())]
        lines += [f"\nSILENT FALLBACK: {f.text}" for f in self.fallbacks]
        lines += [f"\nnote: {n}" for n in self.notes]
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        items = [f"<li><b>silent fallback:</b> {html.escape(f.text)}</li>"
                 for f in self.fallbacks]
        items += [f"<li>note: {html.escape(n)}</li>" for n in self.notes]
        return self.table()._repr_html_() + (f"<ul>{''.join(items)}</ul>" if items else "")


def audit(model: torch.nn.Module, optimizer=None, *, scaler=None, result=None, batch=None,
          autocast=None, accelerator=None) -> Audit:
    """Audit a model, its optimizer and run: see the module docstring.

    `optimizer`: a torch optimizer, or Accelerate's prepared one (its scaler is then found
    too). `scaler`: a torch.amp.GradScaler or mplab.amp.scaler.GradScaler. `result`: a finished
    `mplab.train` run (what was asked, the dtypes it observed, its skipped steps). `batch`: a
    dict for `model(**batch)` (with labels, so a loss is there): one forward and backward step
    is run and watched, with the model's gradients restored after. `autocast`: the context
    the forward runs in (`torch.autocast(...)`); none is needed for a model Accelerate
    prepared, which autocasts in its own forward. `accelerator`: an `Accelerator` (or a
    Trainer's `trainer.accelerator`): what it was asked for and what it built.
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"audit() looks at a torch.nn.Module, got {type(model).__name__}")
    inner = getattr(model, "module", model)  # DistributedDataParallel's model
    report = Audit()
    report.param_dtypes = _named(_by_dtype(inner.parameters()))
    report.param_dtype = _majority_named(report.param_dtypes)
    if optimizer is not None:
        states = _optimizer_states(optimizer)
        report.optimizer_state_dtypes = _named(_by_dtype(states))
        report.optimizer_state_dtype = _majority_named(report.optimizer_state_dtypes)
    if scaler is None:
        scaler = getattr(optimizer, "scaler", None) or getattr(accelerator, "scaler", None)
    report.scaler = _scaler_state(scaler, result)
    report.autocast = _autocast_state(autocast, accelerator, inner)
    report.asked = _asked(result, accelerator, report.autocast)
    grads = _by_dtype(p.grad for p in inner.parameters() if p.grad is not None)
    if batch is not None:
        seen = _watch_one_step(model, batch, autocast)
        report.compute_dtype, report.output_dtype = seen.compute_dtype, seen.output_dtype
        grads = grads or seen.grad_dtypes
    elif result is not None:
        report.compute_dtype = result.compute_dtype
        report.output_dtype = getattr(result, "output_dtype", None)
        if not grads and getattr(result, "grad_dtype", None) is not None:
            grads = {result.grad_dtype: sum(report.param_dtypes.values())}
    report.grad_dtypes = _named(grads)
    report.grad_dtype = _majority_named(report.grad_dtypes)
    report.fallbacks, report.notes = find_fallbacks(report, inner, result, accelerator)
    return report


# ---- what the audit reads -------------------------------------------------------------------

def _unwrap_optimizer(optimizer):
    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer
    if not isinstance(inner, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer (or Accelerate's prepared "
                         f"one), got {type(optimizer).__name__}")
    return inner


def _optimizer_states(optimizer) -> list[torch.Tensor]:
    """The optimizer's per-parameter state tensors (AdamW's exp_avg, exp_avg_sq), not its
    scalar step counters."""
    inner = _unwrap_optimizer(optimizer)
    return [v for state in inner.state.values() for k, v in state.items()
            if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "step"
            and v.dim() > 0]


def _scaler_state(scaler, result) -> dict | None:
    skipped = len(result.skipped_steps) if result is not None else None
    if scaler is None or not scaler.is_enabled():
        if result is not None and result.scales:
            return {"enabled": True, "scale": result.scales[-1], "skipped_steps": skipped}
        return None
    return {"enabled": True, "scale": float(scaler.get_scale()), "skipped_steps": skipped}


def _autocast_state(autocast, accelerator, model) -> dict | None:
    if isinstance(autocast, torch.autocast):
        return {"device": autocast.device, "dtype": autocast.fast_dtype,
                "enabled": bool(autocast._enabled), "by": "torch.autocast"}
    if autocast is not None and not isinstance(autocast, nullcontext):
        raise ValueError(f"autocast must be a torch.autocast(...) context (or None), got "
                         f"{type(autocast).__name__}")
    if accelerator is not None:
        asked = asked_dtype(str(getattr(accelerator, "mixed_precision", "no")))
        native = bool(getattr(accelerator, "native_amp", False))
        return {"device": accelerator.device.type, "dtype": asked if native else None,
                "enabled": native and asked is not None,
                "by": "Accelerate, inside the prepared model's forward"}
    if hasattr(model, "_original_forward"):  # prepared by Accelerate, which autocasts inside
        return {"device": next(model.parameters()).device.type, "dtype": None, "enabled": True,
                "by": "Accelerate, inside the prepared model's forward"}
    return None


def _asked(result, accelerator, autocast) -> str | None:
    if result is not None:
        return result.precision
    if accelerator is not None:
        mode = str(getattr(accelerator, "mixed_precision", "no"))
        return "fp32" if mode == "no" else mode
    if autocast is not None and autocast["dtype"] is not None:
        return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(autocast["dtype"],
                                                                  dtype_name(autocast["dtype"]))
    return None


def _watch_one_step(model, batch, autocast) -> Observer:
    """One forward and backward step on `batch`, watched; the gradients are put back after."""
    if not isinstance(batch, dict) or not batch:
        raise ValueError(f"batch must be a dict of the model's inputs (model(**batch)), with "
                         f"'labels' for a loss; got {type(batch).__name__}")
    params = list(model.parameters())
    saved = [p.grad for p in params]
    device = params[0].device if params else torch.device("cpu")
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    seen = Observer(model)
    was_training = model.training
    try:
        with autocast if autocast is not None else nullcontext():
            output = model(**batch)
        loss = getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            for p in params:
                p.grad = None
            loss.backward()  # outside autocast, as in training
            seen.grad_dtypes = _by_dtype(p.grad for p in params if p.grad is not None)
    finally:
        seen.remove()
        for p, g in zip(params, saved):
            p.grad = g
        model.train(was_training)
    return seen


# ---- small helpers --------------------------------------------------------------------------

def _by_dtype(tensors) -> dict[torch.dtype, int]:
    counts = Counter()
    for t in tensors:
        counts[t.dtype] += t.numel()
    return dict(counts)


def _named(counts: dict[torch.dtype, int]) -> dict[str, int]:
    return {dtype_name(d): n for d, n in sorted(counts.items(), key=lambda kv: -kv[1])}


def _majority(counts: dict) -> torch.dtype | None:
    return max(counts, key=counts.get) if counts else None


def _majority_named(counts: dict[str, int]) -> torch.dtype | None:
    return dtype_from_name(_majority(counts))


def _first_float(output) -> torch.Tensor | None:
    """The output's logits (Hugging Face), or its first floating tensor."""
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    items = output if isinstance(output, tuple | list) else (output,)
    return next((t for t in items if isinstance(t, torch.Tensor) and t.is_floating_point()),
                None)


def _breakdown(counts: dict[str, int]) -> str:
    total = sum(counts.values())
    if not total:
        return ""
    if len(counts) == 1:
        return f"{next(iter(counts))} ({total:,} values)"
    return ", ".join(f"{name} {n / total:.1%}" for name, n in counts.items())


def _autocast_text(state: dict | None) -> str:
    if state is None:
        return "none given"
    if not state["enabled"]:
        asked = f" ({dtype_name(state['dtype'])} asked)" if state["dtype"] is not None else ""
        return f"off{asked}, {state['by']}"
    return f"on: {state['device']}, {dtype_name(state['dtype']) or 'its dtype'}, {state['by']}"


def _scaler_text(state: dict | None) -> str:
    if state is None:
        return "none"
    skipped = "" if state["skipped_steps"] is None else f", {state['skipped_steps']} skipped steps"
    return f"on: scale {state['scale']:g}{skipped}"
