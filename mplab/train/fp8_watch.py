"""What each step's FP8 casts did to the tensors they were given, for a model that trains through
torchao's `Float8Linear` (`torchao.float8.convert_to_float8_training`) or mplab's `QDQLinear`
(`mplab.lowbit.qdq`), in mplab's paths or a loop of your own (`Recorder`): `StepLog` puts it on.

    watch = FP8Watch.of(model)      # None when the model holds no fp8 Linear
    ...                             # forward, backward, optimizer step
    watch.step(result)              # the step's figures into result.config["fp8"]
    watch.remove()

Hooks on each fp8 Linear see what its casts are given, before the cast: the input and the
weight (a forward hook) and the output gradient (a hook on the output's gradient). From the
module's own settings (torchao: `Float8Linear.config`'s cast configs, their format,
granularity and power-of-two scales, and torchao's floor under amax; mplab: the `QDQRecipe`)
the watch computes what the cast does, as the library does: scale = max / clamp(amax, floor).
Of the output gradient: the share of nonzero values flushed to 0 and of values past the
format's largest. Of every scaled cast: the tensors (or rows, with one scale per row) whose
amax was 0, whose scale is max / floor (torchao's 1e-12: 4.5e14 for e4m3, huge but finite, and
the cast gives 0) or, with no floor, inf (and 0 * inf = NaN). And whether a module's casts made
inf/NaN from finite values: its output not finite from a finite input and weights, or its weight
gradient not finite from a finite output gradient. Counted on the device, read with one sync a
step; nothing the model computes changes.

`config["fp8"]`: the keys mplab.train.fp8 writes ("grad_format", "grad_scaling", and one
"grad_flushed" and "grad_saturated" per step) and "library", "recipe", "operands",
"amax_floor", "zero_amax" (per step: the casts, tensors or rows, whose amax was 0),
"zero_amax_first" (the first: step, module, tensor, count, of) and "nan_from_cast" (the first
module whose casts made inf/NaN from finite values: step, module, phase, and the tensors of
that module whose amax was 0 in that step).
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import torch

from mplab.numerics.formats import FloatFormat, get_format

from .layers import local_shard

__all__ = ["Cast", "FP8Watch", "fp8_linears"]

TENSORS = ("input", "weight", "grad_output")


@dataclasses.dataclass(frozen=True)
class Cast:
    """How a module casts one tensor: to `format`, with one scale per tensor ("tensorwise"),
    per row ("rowwise": torchao's axiswise, along the last dimension) or none ("none": scale
    1), optionally rounded down to a power of two, amax clamped to `floor` first."""

    format: FloatFormat
    scaling: str
    power_of_2: bool = False
    floor: float = 1e-12

    def scale(self, amax: torch.Tensor) -> torch.Tensor:
        """torchao's amax_to_scale (and mplab.lowbit.quantize's): in float64, then float32."""
        if self.scaling == "none":
            return torch.ones_like(amax)
        s = (float(self.format.max_finite) / amax.double().clamp(min=self.floor)).float()
        return torch.exp2(torch.floor(torch.log2(s))) if self.power_of_2 else s


def _loaded(module: str, name: str):
    """A class from a module only if something already imported it: a model cannot hold a
    torchao Float8Linear (or a QDQLinear) unless its module is loaded, so nothing is imported."""
    return getattr(sys.modules.get(module), name, None)


def _torchao_casts(m) -> dict[str, Cast | None]:
    c = m.config
    floor = _loaded("torchao.float8.float8_utils", "EPS") or 1e-12

    def cast(cc) -> Cast | None:
        if cc.scaling_type.value == "disabled":
            return None
        rows = cc.scaling_granularity.value == "axiswise"
        return Cast(get_format(cc.target_dtype), "rowwise" if rows else "tensorwise",
                    bool(c.round_scales_to_power_of_2), float(floor))
    return {"input": cast(c.cast_config_input), "weight": cast(c.cast_config_weight),
            "grad_output": cast(c.cast_config_grad_output)}


def _qdq_casts(m) -> dict[str, Cast | None]:
    r = m.recipe

    def cast(precision, scaling) -> Cast | None:
        f = get_format(precision)
        return Cast(f, scaling, False, float(r.amax_floor)) if f.bits <= 8 else None
    operands = cast(r.operands, r.operand_scaling)
    return {"input": operands, "weight": operands, "grad_output": cast(r.grad, r.grad_scaling)}


def _torchao_recipe(m) -> str:
    """The name of torchao's recipe the module's config is (its casts), else "custom"."""
    config_class = _loaded("torchao.float8.config", "Float8LinearConfig")
    fields = ("cast_config_input", "cast_config_weight", "cast_config_grad_output",
              "cast_config_input_for_grad_weight", "cast_config_weight_for_grad_input",
              "cast_config_grad_output_for_grad_weight", "round_scales_to_power_of_2")
    for name in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        recipe = config_class.from_recipe_name(name)
        if all(getattr(recipe, f) == getattr(m.config, f) for f in fields):
            return name
    return "custom"


def _qdq_recipe(m) -> str:
    known = _loaded("mplab.lowbit.qdq", "QDQ_RECIPES") or {}
    return next((name for name, r in known.items() if r == m.recipe), "custom")


def fp8_linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str, str,
                                                          dict[str, Cast | None]]]:
    """The model's fp8 Linears: (name, module, library, recipe, {tensor: Cast or None}), for
    torchao's Float8Linear and mplab's QDQLinear (those whose recipe casts to 8 bits or fewer:
    not mplab's bf16 emulation)."""
    float8 = _loaded("torchao.float8.float8_linear", "Float8Linear")
    qdq = _loaded("mplab.lowbit.qdq", "QDQLinear")
    found = []
    for name, m in model.named_modules():
        if float8 is not None and isinstance(m, float8):
            found.append((name, m, "torchao", _torchao_recipe(m), _torchao_casts(m)))
        elif qdq is not None and isinstance(m, qdq):
            casts = _qdq_casts(m)
            if any(casts.values()):
                found.append((name, m, "mplab", _qdq_recipe(m), casts))
    return found


def _names(values) -> str | None:
    seen = list(dict.fromkeys(v for v in values if v is not None))
    return ", ".join(seen) if seen else None


def _zeros(amax: torch.Tensor, cast: Cast | None) -> tuple[torch.Tensor, int]:
    """(casts whose amax was 0, casts) of a tensor whose rows' amax is `amax`: its rows with
    rowwise scales, the tensor as one with tensorwise, none unscaled (scale 1 needs no amax)."""
    if cast is None or cast.scaling == "none":
        return amax.new_zeros((), dtype=torch.long), 0
    if cast.scaling == "rowwise":
        return (amax == 0).sum(), amax.numel()
    return (amax.amax() == 0).long(), 1


# what one forward call and one output gradient give, in this order (a long tensor each),
# by name: _F["output_finite"] is the forward row's index of it
_FORWARD = ("input_zero", "input_casts", "weight_zero", "weight_casts", "input_finite",
            "params_finite", "output_finite")
_BACKWARD = ("nonzero", "flushed", "saturated", "values", "grad_zero", "grad_casts",
             "grad_finite")
_F, _B = ({name: k for k, name in enumerate(names)} for names in (_FORWARD, _BACKWARD))


class FP8Watch:
    """Hooks on the fp8 Linears `fp8_linears(model)` finds; `step(result)` ends an optimizer
    step, writing what the casts of its forward and backward passes did."""

    def __init__(self, model: torch.nn.Module, linears=None):
        linears = fp8_linears(model) if linears is None else linears
        if not linears:
            raise ValueError("the model holds no fp8 Linear (torchao's Float8Linear or "
                             "mplab's QDQLinear): nothing to watch")
        self.names = [n or "(model)" for n, *_ in linears]
        self.casts = [casts for *_, casts in linears]
        first = {t: next((c[t] for c in self.casts if c[t] is not None), None) for t in TENSORS}
        self.settings = {
            "library": _names(lib for _, _, lib, _, _ in linears),
            "recipe": _names(lib if recipe == lib else f"{lib} {recipe}"
                             for _, _, lib, recipe, _ in linears),
            "operands": _names(c[t].format.name for c in self.casts for t in ("input", "weight")
                               if c[t] is not None),
            "grad_format": _names(c["grad_output"].format.name for c in self.casts
                                  if c["grad_output"] is not None),
            "grad_scaling": first["grad_output"].scaling if first["grad_output"] else None,
            "amax_floor": min(c[t].floor for c in self.casts for t in TENSORS
                              if c[t] is not None),
        }
        self.step_no = 0
        self._hooks = []
        for i, (_, m, *_) in enumerate(linears):
            self._hooks.append(m.register_forward_hook(functools.partial(self._forward, i),
                                                       with_kwargs=True))
            if m.weight.requires_grad:
                self._hooks.append(m.weight.register_hook(functools.partial(self._weight, i)))
        self._reset()

    @classmethod
    def of(cls, model: torch.nn.Module) -> FP8Watch | None:
        """A watch on `model`'s fp8 Linears, or None when it has none."""
        linears = fp8_linears(model)
        return cls(model, linears) if linears else None

    def _reset(self) -> None:
        self._fwd: list[tuple[int, torch.Tensor]] = []
        self._bwd: list[tuple[int, torch.Tensor]] = []
        self._wgrad: list[tuple[int, torch.Tensor]] = []
        self._mass: list[torch.Tensor] = []  # per output gradient: sum |g|, of those flushed

    # ---- the hooks: each call's figures, kept on the device ---------------------------------

    def _forward(self, i: int, module, args, kwargs, output) -> None:
        if not torch.is_grad_enabled():  # an evaluation, not a training step
            return
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, torch.Tensor) or not isinstance(output, torch.Tensor):
            return
        casts = self.casts[i]
        rows = x.detach().reshape(-1, x.shape[-1]).abs().amax(-1)
        weight = local_shard(module.weight).detach().abs().amax(-1)  # one per output row
        finite = weight.isfinite().all()
        if module.bias is not None:
            finite = finite & local_shard(module.bias).detach().isfinite().all()
        x_zero, x_casts = _zeros(rows, casts["input"])
        w_zero, w_casts = _zeros(weight, casts["weight"])
        self._fwd.append((i, torch.stack([
            x_zero, rows.new_tensor(x_casts, dtype=torch.long), w_zero.to(rows.device),
            rows.new_tensor(w_casts, dtype=torch.long), rows.isfinite().all().long(),
            finite.long().to(rows.device), output.detach().isfinite().all().long()])))
        if output.requires_grad:
            output.register_hook(functools.partial(self._backward, i))

    def _backward(self, i: int, grad: torch.Tensor) -> None:
        if not grad.numel():
            return
        cast = self.casts[i]["grad_output"]
        a = grad.detach().reshape(-1, grad.shape[-1]).abs().float()
        rows = a.amax(-1, keepdim=True)
        zero, casts = _zeros(rows, cast)
        if cast is None:  # not cast (torchao's "disabled"): nothing to count but finiteness
            figures, mass = [zero, zero, zero, zero], a.new_zeros(2)
        else:
            f, nonzero = cast.format, a != 0
            scaled = a * cast.scale(rows if cast.scaling == "rowwise" else rows.amax())
            # rounding to nearest even sends |v| <= half the smallest subnormal to 0, and
            # takes back at most half the spacing past the largest (Quantized.saturated's)
            flushed = nonzero & (scaled <= float(f.min_subnormal) / 2)
            figures = [nonzero.sum(), flushed.sum(),
                       (scaled > float(f.max_finite) + 2.0 ** (f.emax - f.man_bits - 1)).sum(),
                       a.new_tensor(a.numel(), dtype=torch.long)]
            mass = torch.stack([a.sum(), torch.where(flushed, a, 0.0).sum()])
        figures += [zero, a.new_tensor(casts, dtype=torch.long), rows.isfinite().all().long()]
        self._bwd.append((i, torch.stack(figures)))
        self._mass.append(mass)

    def _weight(self, i: int, grad: torch.Tensor) -> None:
        self._wgrad.append((i, local_shard(grad).detach().isfinite().all().long().reshape(1)))

    # ---- the end of a step ----------------------------------------------------------------

    def step(self, result) -> None:
        """Read the step's figures (one sync) into `result.config["fp8"]`."""
        self.step_no += 1
        fp8 = result.config.setdefault("fp8", {})
        for key, value in self.settings.items():
            fp8.setdefault(key, value)
        for key in ("grad_flushed", "grad_flushed_mass", "grad_saturated", "zero_amax"):
            fp8.setdefault(key, [])
        fp8.setdefault("zero_amax_first", None)
        fp8.setdefault("nan_from_cast", None)
        kinds = (self._fwd, self._bwd, self._wgrad)
        parts = [v for calls in kinds for _, v in calls]
        values = (torch.cat([v.to(parts[0].device) for v in parts]).tolist() if parts else [])
        # read after the sync above, so ready: sum |g| over the output gradients, and flushed
        mass = (torch.stack([m.to(parts[0].device) for m in self._mass]).sum(0).tolist()
                if self._mass else [0.0, 0.0])
        seen, at = [], 0
        for calls in kinds:
            seen.append([])
            for i, v in calls:
                seen[-1].append((i, values[at:at + v.numel()]))
                at += v.numel()
        self._reset()
        self._write(fp8, *seen, mass)

    def _write(self, fp8: dict, fwd: list, bwd: list, wgrad: list, mass: list) -> None:
        step = self.step_no
        nonzero, flushed, saturated, total = (sum(v[_B[k]] for _, v in bwd) for k in
                                              ("nonzero", "flushed", "saturated", "values"))
        fp8["grad_flushed"].append(flushed / nonzero if nonzero else None)
        fp8["grad_flushed_mass"].append(mass[1] / mass[0] if mass[0] else None)
        fp8["grad_saturated"].append(saturated / total if total else None)
        # the casts whose amax was 0, in the order they ran: forward, then backward
        zeros = [(i, t, v[_F[f"{t}_zero"]], v[_F[f"{t}_casts"]]) for i, v in fwd
                 for t in ("input", "weight") if v[_F[f"{t}_zero"]]]
        zeros += [(i, "grad_output", v[_B["grad_zero"]], v[_B["grad_casts"]]) for i, v in bwd
                  if v[_B["grad_zero"]]]
        fp8["zero_amax"].append(int(sum(z[2] for z in zeros)))
        if zeros and fp8["zero_amax_first"] is None:
            i, tensor, count, of = zeros[0]
            fp8["zero_amax_first"] = {"step": step, "module": self.names[i], "tensor": tensor,
                                      "count": int(count), "of": int(of)}
        if fp8["nan_from_cast"] is None:
            made = self._made_nan(fwd, bwd, wgrad)
            if made is not None:
                i, phase = made
                fp8["nan_from_cast"] = {"step": step, "module": self.names[i], "phase": phase,
                                        "zero_amax": list(dict.fromkeys(
                                            t for j, t, *_ in zeros if j == i))}

    @staticmethod
    def _made_nan(fwd: list, bwd: list, wgrad: list) -> tuple[int, str] | None:
        """The first module whose casts made inf/NaN from finite values this step: an output
        not finite from a finite input and weights (forward), or a weight gradient not finite
        from a finite output gradient, input and weights (backward); None."""
        inputs_finite: dict[int, bool] = {}
        for i, v in fwd:
            given = bool(v[_F["input_finite"]] and v[_F["params_finite"]])
            inputs_finite[i] = inputs_finite.get(i, True) and given
            if given and not v[_F["output_finite"]]:
                return i, "forward"
        grads_finite: dict[int, bool] = {}
        for i, v in bwd:
            grads_finite[i] = grads_finite.get(i, True) and bool(v[_B["grad_finite"]])
        for i, v in wgrad:
            if not v[0] and grads_finite.get(i) and inputs_finite.get(i):
                return i, "backward"
        return None

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
