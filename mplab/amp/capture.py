"""Capture a model's tensors in one training step: activations, their gradients, weight grads.

    cap = capture(model, batch)                   # one fp32 forward + backward, with hooks
    cap.table("fp16", 2**10, "activation_grads")  # what a cast would do to each layer's values
    cap.magnitudes("activation_grads")            # sorted once, for any format and scale
    cap.repeats("activation_grads")               # tensors that are another's, or its sum

These are the values a cast to fp16 or bf16 would hit in a real step, kept as fp32 copies so
that :mod:`mplab.numerics.casts` can count what any format and loss scale would do to them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from mplab._display import Table
from mplab.numerics.casts import (
    CastStats,
    Magnitudes,
    as_scale,
    combined,
    scale_text,
    storage_format,
)
from mplab.numerics.histograms import ExponentHistogram, data_bins, exponent_histogram

__all__ = ["KINDS", "Capture", "capture"]

#: What :func:`capture` records, and the names :meth:`Capture.table` and friends accept.
KINDS = ("activations", "activation_grads", "weight_grads")


def _default_loss(model: nn.Module, batch):
    if isinstance(batch, Mapping):
        out = model(**batch)
        loss = getattr(out, "loss", None)
        if loss is None and isinstance(out, Mapping):
            loss = out.get("loss")
        if loss is None:
            raise ValueError("model(**batch) returned no loss: put the labels in the batch "
                             "(a Hugging Face model computes .loss when given labels=...) or pass "
                             "loss_fn=lambda model, batch: ...")
        return loss
    return model(batch)


def _scalar_loss(loss) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        what = (f"a tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}"
                if isinstance(loss, torch.Tensor) else f"{type(loss).__name__}")
        raise ValueError(f"the loss must be a scalar float tensor, got {what}; pass "
                         "loss_fn=lambda model, batch: <scalar loss>, e.g. "
                         "torch.nn.functional.mse_loss(model(x), y)")
    if not loss.requires_grad:
        raise ValueError("the loss does not require grad: no parameter took part in computing "
                         "it (are they frozen, or did loss_fn run under torch.no_grad()?)")
    return loss.reshape(())


def _select_layers(model: nn.Module, layers) -> list[tuple[str, nn.Module]]:
    named = list(model.named_modules())
    if layers is None:
        chosen = [(n, m) for n, m in named if next(m.parameters(recurse=False), None) is not None]
    elif isinstance(layers, type) or (isinstance(layers, tuple) and layers
                                      and all(isinstance(t, type) for t in layers)):
        chosen = [(n, m) for n, m in named if isinstance(m, layers)]
    elif callable(layers):
        chosen = [(n, m) for n, m in named if layers(n, m)]
    else:
        wanted = [layers] if isinstance(layers, str) else list(layers)
        by_name = dict(named)
        unknown = [w for w in wanted if w not in by_name]
        if unknown:
            some = [n for n, _ in named if n][:8]
            raise ValueError(f"no module named {unknown[0]!r} in the model; accepted: names from "
                             f"model.named_modules(), e.g. {some}")
        chosen = [(w, by_name[w]) for w in wanted]
    if not chosen:
        raise ValueError(f"layers={layers!r} selected no module; pass None (every module that "
                         "owns parameters), a list of names, module types, or a predicate "
                         "(name, module) -> bool")
    return [(n or "(model)", m) for n, m in chosen]


def _first_tensor(output):
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, list | tuple) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float32, copy=True)


@dataclass(eq=False)  # holds arrays: compare fields, not records
class Capture:
    """The values one fp32 training step produced, per layer, as detached fp32 CPU copies.

    activations:      module name -> its output (the first tensor, if it returns a tuple)
    activation_grads: module name -> d loss / d output (same keys, forward order; missing for
                      outputs that need no gradient)
    weight_grads:     parameter name -> its .grad (parameters of the captured modules)
    loss:             the step's loss
    layer_types:      module name -> class name
    weights:          parameter name -> its value in the step (the same parameters)

    A module run twice in one step is recorded as "name", "name (call 2)", ...
    """

    activations: dict[str, torch.Tensor]
    activation_grads: dict[str, torch.Tensor]
    weight_grads: dict[str, torch.Tensor]
    loss: float
    layer_types: dict[str, str]
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def tensors(self, kind: str = "weight_grads") -> dict[str, torch.Tensor]:
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r}; accepted: " + ", ".join(map(repr, KINDS)))
        return getattr(self, kind)

    def all(self, kind: str = "weight_grads") -> torch.Tensor:
        """Every value of one kind in one flat fp32 tensor."""
        ts = [t.reshape(-1) for t in self.tensors(kind).values()]
        return torch.cat(ts) if ts else torch.empty(0)

    def magnitudes(self, kind: str = "weight_grads") -> dict[str, Magnitudes]:
        """name -> :class:`Magnitudes`, sorted once and kept (the fast path for every scale)."""
        key = ("magnitudes", kind)
        if key not in self._cache:
            self._cache[key] = {n: Magnitudes(t) for n, t in self.tensors(kind).items()}
        return self._cache[key]

    def stats(self, precision="fp16", scale=1.0, kind: str = "weight_grads", *,
              rel_error: bool = True) -> dict[str, CastStats]:
        """name -> :class:`~mplab.numerics.casts.CastStats` of casting that tensor times scale to
        the format."""
        return {n: m.stats(precision, scale, rel_error=rel_error)
                for n, m in self.magnitudes(kind).items()}

    def histograms(self, kind: str = "weight_grads", bins=None
                   ) -> dict[str, ExponentHistogram]:
        """name -> :class:`~mplab.numerics.histograms.ExponentHistogram` of log2|x|, all on the
        same bins (they add up): by default the :func:`~mplab.numerics.histograms.data_bins` of
        the whole kind."""
        mags = self.magnitudes(kind)
        bins = data_bins(list(mags.values())) if bins is None else bins
        return {n: exponent_histogram(m, bins) for n, m in mags.items()}

    def table(self, precision="fp16", scale=1.0, kind: str = "weight_grads", *,
              rel_error: bool = True) -> Table:
        """One row per tensor, and a last row "(all)": the share of its values that were 0
        already, and of its nonzero values the shares lost to 0, landing subnormal and
        overflowing (:meth:`~mplab.numerics.casts.CastStats.row`); relative error of the rest;
        largest |x|."""
        f = storage_format(precision)
        s = as_scale(scale)
        stats = self.stats(f, s, kind, rel_error=rel_error)
        rows = [{"name": n, "type": self.type_of(n, kind), **st.row()} for n, st in stats.items()]
        rows.append({"name": "(all)", "type": "", **combined(list(stats.values()), f, s).row()})
        to = {"inf": "±inf", "saturate": "±max", "nan": "NaN"}[f.overflow]
        return Table(rows, title=f"{kind} cast to {f.name} at scale {scale_text(s)} "
                                 f"(each share names its denominator; overflow → {to})")

    def repeats(self, kind: str = "activation_grads") -> Table:
        """The tensors of one kind that carry no values of their own: each row is a tensor
        that equals an earlier one bit for bit ("identical"), or equals an earlier one summed
        over the dimensions where it has size 1 and the earlier one does not (a tensor that
        was broadcast in the forward pass gets its gradient summed over those dimensions).

        In a BERT embedding layer, for example, the word, token-type and position embeddings
        are added together, so each receives the sum's gradient; the position embeddings,
        one row per position shared by the whole batch, receive it summed over the batch.
        Rows: name, shape, values, "same as" (the earlier tensor), how.
        """
        tensors = self.tensors(kind)
        names = list(tensors)
        rows = []
        for j, name in enumerate(names):
            t = tensors[name]
            for earlier in names[:j]:
                how = _repeat_of(tensors[earlier], t)
                if how:
                    rows.append({"name": name, "shape": tuple(t.shape), "values": t.numel(),
                                 "same as": earlier, "how": how})
                    break
        return Table(rows, title=f"{kind} that repeat an earlier tensor's values")

    def type_of(self, name: str, kind: str) -> str:
        """The class name of the module a recorded tensor belongs to ("Linear", ...): for
        weight grads the module owning the parameter, else the module itself; "" if unknown."""
        module = name.rsplit(".", 1)[0] if kind == "weight_grads" else name.split(" (call")[0]
        return self.layer_types.get(module, "")

    def __repr__(self) -> str:
        n = sum(t.numel() for k in KINDS for t in self.tensors(k).values())
        return (f"Capture(loss={self.loss:.6g}; {len(self.activations)} activations, "
                f"{len(self.activation_grads)} activation grads, {len(self.weight_grads)} weight "
                f"grads; {n:,} values)")


def _repeat_of(a: torch.Tensor, b: torch.Tensor) -> str:
    """How b repeats a: "identical", "a summed over dim 0 (32 → 1)", or "" (it does not)."""
    if a.shape == b.shape:
        return "identical" if b.numel() and torch.equal(a, b) else ""
    if a.dim() != b.dim() or not b.numel():
        return ""
    dims = [d for d, (m, n) in enumerate(zip(a.shape, b.shape)) if n == 1 and m > 1]
    if not dims or any(m != n for d, (m, n) in enumerate(zip(a.shape, b.shape)) if d not in dims):
        return ""
    total = a.double().sum(dim=dims, keepdim=True)
    # autograd sums in fp32 in its own order: equal up to that rounding, not bit for bit
    tol = 1e-5 * float(total.abs().max()) + 1e-30
    if not bool(((total - b.double()).abs() <= tol).all()):
        return ""
    what = ", ".join(f"dim {d} ({a.shape[d]} → 1)" for d in dims)
    return f"summed over {what}"


def capture(model: nn.Module, batch, loss_fn=None, layers=None) -> Capture:
    """Run ONE forward and backward pass in fp32 and keep what each layer produced.

    model:   any nn.Module whose floating parameters are fp32 (this is the fp32 reference).
    batch:   what the model eats. loss_fn(model, batch) -> scalar loss; by default
             ``model(**batch).loss`` for a dict (Hugging Face style, labels in the batch),
             otherwise ``model(batch)``, which must then be a scalar.
    layers:  which modules to record: None (every module that owns parameters: Linear,
             Embedding, LayerNorm, ...), a list of names from model.named_modules(), a module
             type (or tuple of types), or a predicate (name, module) -> bool.

    The step runs with autocast off and grad on, in whatever mode the model is in (call
    model.train() first for dropout). The caller's model is left as it was: existing .grad
    tensors are set aside before the step and put back after it, hooks are removed, and no
    optimizer step is taken; all of this also when the step raises.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function (model, batch) -> loss, got {loss_fn!r}")
    low = sorted({str(p.dtype) for p in model.parameters()
                  if p.is_floating_point() and p.dtype != torch.float32})
    if low:
        raise ValueError(f"capture records the fp32 reference step, but the model has "
                         f"{', '.join(low)} parameters; call model.float() first")
    chosen = _select_layers(model, layers)
    params = list(model.parameters())
    saved = [p.grad for p in params]
    activations: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    calls: dict[str, int] = {}
    handles = []

    def forward_hook(name):
        def hook(module, inputs, output):
            t = _first_tensor(output)
            if t is None or not t.is_floating_point():
                return
            calls[name] = calls.get(name, 0) + 1
            key = name if calls[name] == 1 else f"{name} (call {calls[name]})"
            activations[key] = _copy(t)
            if t.requires_grad:
                def keep_grad(g, key=key):
                    grads[key] = _copy(g)
                t.register_hook(keep_grad)
        return hook

    device = next((p.device.type for p in params), "cpu")
    try:
        for p in params:
            p.grad = None
        for name, module in chosen:
            handles.append(module.register_forward_hook(forward_hook(name)))
        with torch.enable_grad(), torch.autocast(device_type=device, enabled=False):
            loss = _scalar_loss((loss_fn or _default_loss)(model, batch))
            loss.backward()
        owned = {id(p) for _, m in chosen for p in m.parameters(recurse=False)}
        weight_grads = {n: _copy(p.grad) for n, p in model.named_parameters()
                        if id(p) in owned and p.grad is not None}
        weights = {n: _copy(p.detach()) for n, p in model.named_parameters() if n in weight_grads}
    finally:
        for h in handles:
            h.remove()
        for p, g in zip(params, saved):
            p.grad = g
    types = {n: type(m).__name__ for n, m in chosen}
    return Capture(activations, {k: grads[k] for k in activations if k in grads}, weight_grads,
                   float(loss.detach()), types, weights)
