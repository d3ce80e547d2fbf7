"""mplab's own FP8 recipe, from scratch: a quantise-dequantise around each nn.Linear.

    layer = QDQLinear(linear, QDQ_RECIPES["mplab"], counter=GradCasts())
    model = convert_to_qdq(model, QDQ_RECIPES["mplab"])   # every Linear fp8_filter accepts
    y = qdq_linear(x, weight, bias)                      # the functional form

Forward, the input and the weight are cast to e4m3 with one scale per tensor
(`mplab.lowbit.quantize.tensorwise`) and multiplied as the dequantised values, in fp32; backward,
the output gradient is cast to e5m2 the same way, and both gradients are computed in fp32 from the
dequantised values. That is torchao's float8 "tensorwise" recipe as its emulation computes it, and
equal to it bit for bit. A `QDQRecipe` says which formats and scaling; `GradCasts` counts what the
gradient casts flushed to 0 and saturated, for `mplab.diagnose` (mplab.train.fp8 records it per
step).
"""

from __future__ import annotations

import dataclasses

import torch

from mplab.lowbit.quantize import EPS, Quantized, element_format, round_to_format, tensorwise

__all__ = ["QDQRecipe", "QDQ_RECIPES", "GradCasts", "qdq_linear", "QDQLinear", "fp8_filter",
           "convert_to_qdq"]


@dataclasses.dataclass(frozen=True)
class QDQRecipe:
    """What `QDQLinear` casts its matmul's operands to: the input and weight to `operands`, one
    scale per tensor from its amax ("tensorwise") or none ("none": scale 1); the output
    gradient to `grad`, scaled by `grad_scaling` the same way. `amax_floor`: what amax is
    clamped to before max / amax, torchao's 1e-12; 0 is the formula as papers write it, whose
    scale for an all-zero tensor is inf (and its cast NaN: 0 * inf)."""

    operands: str = "fp8_e4m3"
    grad: str = "fp8_e5m2"
    operand_scaling: str = "tensorwise"
    grad_scaling: str = "tensorwise"
    amax_floor: float = EPS

    def __post_init__(self):
        floor = self.amax_floor
        if isinstance(floor, bool) or not isinstance(floor, int | float) or not floor >= 0:
            raise ValueError(f"amax_floor must be a number of at least 0, got {floor!r}")
        for name in ("operand_scaling", "grad_scaling"):
            if getattr(self, name) not in ("tensorwise", "none"):
                raise ValueError(f"{name} must be 'tensorwise' or 'none', got "
                                 f"{getattr(self, name)!r}")
        for precision in (self.operands, self.grad):
            element_format(precision)  # an error naming the formats accepted


#: The from-scratch recipes by name: bf16's emulation, mplab's fp8 and its broken twin.
QDQ_RECIPES = {
    "bf16": QDQRecipe("bf16", "bf16", "none", "none"),
    "mplab": QDQRecipe(),
    "e4m3_unscaled": QDQRecipe(grad="fp8_e4m3", grad_scaling="none"),
}


def _cast(x: torch.Tensor, precision: str, scaling: str,
          floor: float = EPS) -> tuple[torch.Tensor, Quantized | None]:
    """x quantised and dequantised, and the Quantized (None for 16-bit formats, which are
    rounded with no scale: nothing to count)."""
    f = element_format(precision)
    if f.bits >= 16:
        return round_to_format(x, f), None
    # scale 1 exactly: max_finite / amax with amax = max_finite
    q = (tensorwise(x, f, eps=floor) if scaling == "tensorwise"
         else tensorwise(x, f, amax=f.max_finite))
    return q.dequantized, q


class GradCasts:
    """What the output-gradient casts of a step did, summed over every QDQLinear that shares
    this counter: `take()` gives (share of nonzero values flushed to 0, share of values past
    the format's largest), weighted by each layer's counts, and starts the next step."""

    def __init__(self):
        self.flushed = self.nonzero = self.saturated = self.total = 0.0

    def add(self, q: Quantized) -> None:
        nonzero = (q.source != 0).sum().item()
        self.flushed += q.flushed * nonzero
        self.nonzero += nonzero
        self.saturated += q.saturated * q.source.numel()
        self.total += q.source.numel()

    def take(self) -> tuple[float | None, float | None]:
        out = (self.flushed / self.nonzero if self.nonzero else None,
               self.saturated / self.total if self.total else None)
        self.__init__()
        return out


class _QDQMatmul(torch.autograd.Function):
    """y = q(x) @ q(w).T + b, and backward from q(dy): every product of dequantised values, in
    fp32, as torchao's emulation computes them. The bias is added outside the matmul, in high
    precision, so its gradient is dy's sum, uncast (as in torchao's Float8Linear)."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe: QDQRecipe, counter: GradCasts | None):
        xq, _ = _cast(x, recipe.operands, recipe.operand_scaling, recipe.amax_floor)
        wq, _ = _cast(weight, recipe.operands, recipe.operand_scaling, recipe.amax_floor)
        ctx.save_for_backward(xq, wq)
        ctx.recipe, ctx.counter, ctx.has_bias = recipe, counter, bias is not None
        out = xq @ wq.t()
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx, grad):
        xq, wq = ctx.saved_tensors
        gq, q = _cast(grad, ctx.recipe.grad, ctx.recipe.grad_scaling, ctx.recipe.amax_floor)
        if q is not None and ctx.counter is not None:
            ctx.counter.add(q)
        grad_x = gq @ wq if ctx.needs_input_grad[0] else None
        grad_w = (gq.reshape(-1, gq.shape[-1]).t() @ xq.reshape(-1, xq.shape[-1])
                  if ctx.needs_input_grad[1] else None)
        grad_b = (grad.reshape(-1, grad.shape[-1]).sum(0)
                  if ctx.has_bias and ctx.needs_input_grad[2] else None)
        return grad_x, grad_w, grad_b, None, None


def qdq_linear(x, weight, bias=None, recipe: QDQRecipe = QDQ_RECIPES["mplab"],
               counter: GradCasts | None = None) -> torch.Tensor:
    """F.linear with the recipe's casts around the matmul, forward and backward."""
    if not isinstance(recipe, QDQRecipe):
        raise TypeError(f"recipe must be a QDQRecipe, got {type(recipe).__name__}")
    return _QDQMatmul.apply(x, weight, bias, recipe, counter)


class QDQLinear(torch.nn.Linear):
    """An nn.Linear whose matmul runs through `qdq_linear`: the same parameters (shared with
    the Linear it was made from, so an optimizer built before or after sees the same ones)."""

    def __init__(self, linear: torch.nn.Linear, recipe: QDQRecipe,
                 counter: GradCasts | None = None):
        with torch.device("meta"):  # no second set of weights: the original's are taken over
            super().__init__(linear.in_features, linear.out_features, linear.bias is not None)
        self.weight, self.bias = linear.weight, linear.bias
        self.recipe, self.counter = recipe, counter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return qdq_linear(x, self.weight, self.bias, self.recipe, self.counter)

    def extra_repr(self) -> str:
        r = self.recipe
        return (f"{super().extra_repr()}, operands={r.operands} ({r.operand_scaling}), "
                f"grad={r.grad} ({r.grad_scaling})"
                + (f", amax_floor={r.amax_floor:g}" if r.amax_floor != EPS else ""))


def fp8_filter(module: torch.nn.Module, fqn: str = "") -> bool:
    """Which layers an fp8 recipe converts: Linears whose sides are both multiples of 16, as
    fp8 matmuls (torch._scaled_mm) need; torchao's `module_filter_fn` signature."""
    return (isinstance(module, torch.nn.Linear) and module.in_features % 16 == 0
            and module.out_features % 16 == 0)


def convert_to_qdq(model: torch.nn.Module, recipe: QDQRecipe, counter: GradCasts | None = None,
                   module_filter_fn=fp8_filter) -> torch.nn.Module:
    """Swap each Linear `module_filter_fn(module, fqn)` accepts for a QDQLinear, in place, as
    torchao's convert_to_float8_training does; returns the model."""
    for fqn, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            path = f"{fqn}.{name}" if fqn else name
            if type(child) is torch.nn.Linear and module_filter_fn(child, path):
                setattr(module, name, QDQLinear(child, recipe, counter))
    return model
