"""Where a non-finite value began, and each layer's numbers over the steps: the watch that
`mplab.diagnose` reads to tell an fp16 activation overflow from a mask constant out of range,
an eps that rounds to 0, an optimizer step that overflowed or gradients never zeroed.

Cheap enough to leave on (the spirit of transformers' `DebugUnderflowOverflow` and torch's
`detect_anomaly`, at a fraction of their cost): per forward, one `aminmax` of each module's
output and of the gradient that reaches it, kept on the device; per optimizer step, the largest
|value| of every weight after it, and of the gradients it was given where a weight turned
inf/NaN; one host sync per step reads them all (two on a sampled step). Every `every` steps
(and at step 1) the leaf modules' outputs and gradients are also measured against the
low-precision formats: the share of values below fp16's and bf16's smallest normal number,
past fp16's largest, and exactly 0, and the smallest nonzero |value|; of a tensor of more than
8,192 values, counted over 8,192 of them spread evenly over it (`_spread`; the largest |value|
is always the whole tensor's).

What keeps it cheap (benchmarks/watch_overhead.py measures it; the figures are in
benchmarks/RECORDS.md, "watch overhead"): a tensor that several modules return (a block's
output is its last layer's, a Dropout(0)'s its input) is measured once, and a module that at
the first step only returned tensors measured already loses its hook; the gradient hooks go on
the autograd node that made each output (a tenth of a tensor hook's cost); the figures stay on
the device as the 0-d tensors `aminmax` returns, read once per step; the weights before a step
are those read after the last, and the gradients are kept unread (`_kept`); a sampled step's
tensors are counted all at once (`_Samples`), comparing |x|'s float32 bits as integers into an
int32 tensor (into a bool tensor it is 4x as slow on a CPU).

What it finds goes into `TrainResult.numerics` (plain data, in the JSON too):
- "first": the first non-finite value of each kind, by where it was seen: "forward" (the
  first module, in the order they ran, whose output held inf/NaN), "loss", "backward" (the
  first module whose output's gradient did), "step" (a weight finite before the optimizer
  step and inf/NaN after, its gradient finite). Each: step, module, its class, dtype, the
  output's min and max, its largest finite |value| on the steps before, and for a norm its
  eps and whether its input was finite.
- "over_fp16": per module, the first step its forward output passed 65504.
- "stale_grads": steps whose first gradient found the last step's still held (never zeroed).
- "applied_norms" (a loop that clips): per stepped step after the first, the norm of the
  gradients the optimizer received (after unscaling and clipping).
- "loss_dtype": the loss's dtype; "layers": the sampled rows; "every": how often.
"""

from __future__ import annotations

import functools
import math
import weakref

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["FP16_MAX", "LAYER_FIELDS", "LayerWatch", "inner_optimizer", "local_shard"]

FP16_MAX = 65504.0
#: The figures of each sampled row (besides step, module, phase and dtype), and what each is.
LAYER_FIELDS = {
    "amax": "the largest |value|",
    "amin": "the smallest nonzero |value| (0 when all are 0)",
    "zeros": "share of values exactly 0",
    "fp16_subnormal": "share of nonzero values below fp16's smallest normal (2^-14): they "
                      "lose precision in fp16, or are flushed to 0 below 2^-24",
    "bf16_subnormal": "share of nonzero values below bf16's smallest normal (2^-126)",
    "fp16_overflow": "share of values past fp16's largest (65504), inf and NaN included",
}


def inner_optimizer(optimizer):
    """The torch optimizer inside Accelerate's or mplab.numerics.bf16_updates's wrapper (hooks
    go on it)."""
    while hasattr(optimizer, "optimizer"):  # AcceleratedOptimizer subclasses Optimizer too
        optimizer = optimizer.optimizer
    return optimizer


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP2's parameters and gradients); a tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _first_float(output) -> torch.Tensor | None:
    """The first floating-point tensor with values in a module's output (or args), in the
    order torch's pytree flattens it; walked by hand through tuples, lists and dicts (a
    ModelOutput is one): tree_flatten costs more than the rest of the hook."""
    if isinstance(output, torch.Tensor):  # most modules return one tensor
        return output if output.is_floating_point() and output.numel() else None
    if isinstance(output, (tuple, list, dict)):
        for item in output.values() if isinstance(output, dict) else output:
            if (found := _first_float(item)) is not None:
                return found
        return None
    if output is None or isinstance(output, (bool, int, float, str)):
        return None
    for t in tree_flatten(output)[0]:  # another pytree node (a dataclass registered)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
            return t
    return None


def _eps(module: torch.nn.Module) -> float | None:
    for name in ("eps", "variance_epsilon", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


# |x|'s float32 bits, ordered as |x| is: 2^-126 (bf16's smallest normal), 2^-14 (fp16's) and
# 65504 (fp16's largest); inf and NaN lie above them all.
_BF16_NORMAL_BITS, _FP16_NORMAL_BITS, _FP16_MAX_BITS = 0x00800000, 0x38800000, 0x477FE000
_SAMPLE_VALUES = 1 << 13  # the most values of one tensor a sampled row is counted over


def _spread(x: torch.Tensor) -> torch.Tensor:
    """x's values; of a larger tensor, `_SAMPLE_VALUES` of them spread evenly over it: every
    r-th run of 16 (a 64-byte cache line of float32: a single value every s-th would read
    all the lines, the whole tensor), r chosen so that the runs begin no more than 16 columns
    apart along the last dimension: every column (a layer's outlier channel too) is among
    them. 8,192 values give a share to within 1.1 % (two standard errors); counting a big
    activation whole would make a sampled step cost several steps."""
    flat = x.detach().reshape(-1)
    n = flat.numel()
    if n <= _SAMPLE_VALUES:
        return flat
    width, last = 16, x.shape[-1]
    stride, apart = -(-n // _SAMPLE_VALUES), last // math.gcd(width, last)
    while math.gcd(stride, apart) != 1:
        stride += 1
    return flat[:n - n % width].view(-1, width)[::stride]


def _count(x: torch.Tensor, work: torch.Tensor) -> list[list[float]]:
    """The figures of LAYER_FIELDS besides the largest |value| (each tensor's `aminmax` gives
    that) of each row of `x` (float32; overwritten), read: the smallest nonzero |x|, and the
    counts of values that are 0, below 2^-126, below 2^-14 and not past 65504 (inf and NaN
    are past it). `work`: an int32 tensor of x's shape. |x|'s float32 bits are compared as
    integers into an int32 tensor: into a bool tensor it is 4x as slow on a CPU
    (benchmarks/RECORDS.md, "watch pieces")."""
    bits = x.view(torch.int32).bitwise_and_(0x7FFFFFFF)

    def count_below(limit: int) -> torch.Tensor:  # int32 sums: int64's are 10x as slow
        return torch.lt(bits, limit, out=work).sum(1, dtype=torch.int32)

    zeros = count_below(1)  # `work` is now 1 where x is 0: lift those past every value
    smallest = torch.add(bits, work, alpha=0x7FFFFFFF, out=work).amin(1).view(torch.float32)
    counts = [zeros, count_below(_BF16_NORMAL_BITS), count_below(_FP16_NORMAL_BITS),
              count_below(_FP16_MAX_BITS + 1)]
    return torch.stack([smallest.double(), *(c.double() for c in counts)], 1).tolist()


class _Samples:
    """A sampled step's tensors, each `_spread` into a row of `_SAMPLE_VALUES` float32 values
    (exact for fp16 and bf16; copied, as the tensor may change before the step ends), padded
    with inf, which none of `_count`'s counts holds, and counted all at once: ten kernels a
    step, not ten a tensor. On a CPU the rows are kept from one sampled step to the next:
    megabytes allocated afresh cost their page faults each time, more than the counting (a
    GPU's caching allocator has them ready; there they are given back, 128 KiB a tensor)."""

    def __init__(self):
        self._rows: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # and `work`
        self._used: dict[torch.device, int] = {}
        self._at: list[tuple[torch.device, int]] = []

    def add(self, x: torch.Tensor) -> tuple[int, int]:
        """Where x's figures will lie among `count`'s, and how many values they count."""
        values = _spread(x)
        n, device = values.numel(), values.device
        i = self._used.get(device, 0)
        rows = self._rows.get(device)
        if rows is None or len(rows[0]) == i:
            grown = torch.empty(2 * i or 64, _SAMPLE_VALUES, dtype=torch.float32, device=device)
            if i:
                grown[:i] = rows[0]
            rows = self._rows[device] = (grown, torch.empty_like(grown, dtype=torch.int32))
        row = rows[0][i]
        row[:n].view(values.shape).copy_(values)
        if n < _SAMPLE_VALUES:
            row[n:].fill_(math.inf)
        self._used[device] = i + 1
        self._at.append((device, i))
        return len(self._at) - 1, n

    def count(self) -> list[list[float]]:
        """Each added tensor's figures (`_count`), in order; the rows are free again after."""
        counted = {device: _count(self._rows[device][0][:k], self._rows[device][1][:k])
                   for device, k in self._used.items()}
        found = [counted[device][i] for device, i in self._at]
        self._used, self._at = {}, []
        self._rows = {device: rows for device, rows in self._rows.items() if device.type == "cpu"}
        return found


def _row(values: list[float], n: int) -> dict[str, float]:
    """A sampled row's values, read, as LAYER_FIELDS (`n`: the number of values counted)."""
    lo, hi, smallest, zeros, bf16, fp16, fits = values
    return dict(zip(LAYER_FIELDS, [
        _absmax(lo, hi),
        smallest if math.isfinite(smallest) else 0.0,  # all 0, or only inf/NaN: 0
        zeros / n, (fp16 - zeros) / n, (bf16 - zeros) / n, (n - fits) / n]))


def _absmax(lo: float, hi: float) -> float:
    """The largest |value| from (min, max) (both NaN where any value was)."""
    return max(abs(lo), abs(hi))


def _aminmax(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """(min, max) of each tensor (of this rank's shard), end to end, on the device."""
    found = []
    with torch.no_grad():
        for t in tensors:
            if hasattr(t, "to_local"):  # local_shard, inline: this runs for every parameter
                t = t.to_local()
            found += torch.aminmax(t.abs() if t.is_complex() else t)
    return found


def _absmaxes(v: list[float], at: int, n: int) -> list[float]:
    """The largest |value| of each of the `n` tensors whose (min, max) lie from `v[at]` on."""
    return [_absmax(lo, hi) for lo, hi in zip(v[at:at + 2 * n:2], v[at + 1:at + 2 * n:2])]


def _read(scalars: list[torch.Tensor]) -> list[float]:
    """The values of 0-d tensors, in order. On a CPU, where a read is no sync, each is read:
    2x as fast as stacking them, 8x when autocast mixes their dtypes. Elsewhere one stack
    as float32 and one read (one host sync); one of each per device where they lie on
    several."""
    if not scalars:
        return []
    if scalars[0].device.type == "cpu":
        return [t.item() for t in scalars]
    try:
        return torch.stack(scalars, out=scalars[0].new_empty(len(scalars),
                                                              dtype=torch.float32)).tolist()
    except RuntimeError:
        at: dict[torch.device, list[int]] = {}
        for i, t in enumerate(scalars):
            at.setdefault(t.device, []).append(i)
        if len(at) == 1:
            raise
    values = [0.0] * len(scalars)  # on several devices
    for where in at.values():
        for i, v in zip(where, _read([scalars[i] for i in where])):
            values[i] = v
    return values


class LayerWatch:
    """Watch `model`'s modules (forward hooks, and hooks on the gradients of their outputs)
    and, once `watch_optimizer` is called, the optimizer's steps. `step(result, loss)` ends a
    step: it reads what was seen (one sync) into `result.numerics`."""

    def __init__(self, model: torch.nn.Module, every: int = 10):
        self.every = every
        self.step_no = 0
        modules = list(model.named_modules())
        self._kind = {name: type(m).__name__ for name, m in modules}
        self._eps = {name: e for name, m in modules if (e := _eps(m)) is not None}
        self._leaf = {name for name, m in modules if not any(True for _ in m.children())}
        named = [(name or "(model)", m) for name, m in modules]
        self._hooks = [m.register_forward_hook(functools.partial(
            self._forward, name, name in self._eps, name in self._leaf)) for name, m in named]
        self._hooked = dict(zip((name for name, _ in named), self._hooks))
        # at the first step: the modules that returned a tensor of their own, and those that
        # only returned one already measured (a block its last layer's, a Dropout(0) its
        # input): the hooks of the latter come off after it, as they would repeat others
        self._owners: set[str] = set()
        self._sharers: set[str] = set()
        self._kind["(model)"] = self._kind.pop("", type(model).__name__)
        self._params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if self._params:  # the first gradient after a step: was the last one still held?
            self._hooks.append(self._params[0][1].register_hook(self._arrives))
        self._fresh = False
        self._lazy: bool | None = None  # see `_kept`
        self._samples = _Samples()
        self._after: dict[str, float] = {}  # each weight's largest |value| after the last step
        # set once the loop clips (a norm was recorded): then the norm of the gradients the
        # optimizer really receives is read too, which tells a clip before unscale_ apart
        self.norms = False
        self._reset()
        self.peak: dict[str, float] = {}  # largest finite |output| per module, steps so far
        self.numerics: dict = {"every": every, "first": {}, "over_fp16": {},
                               "stale_grads": [], "loss_dtype": None, "layers": []}

    def _reset(self) -> None:
        # what was seen, unread: the 0-d tensors, each once, and per module where its own lie
        self._flat: list[torch.Tensor] = []
        # (module, its (min, max) at, a norm's input's (min, max) at or -1, dtype)
        self._fwd: list[tuple[str, int, int, torch.dtype]] = []
        self._bwd: list[tuple[str, int, torch.dtype]] = []
        # (module, phase, dtype, its (min, max) at, its sample's at, the values it holds)
        self._rows: list[tuple[str, str, torch.dtype, int, int, int]] = []
        self._grads = self._weights = self._before = None  # where each list's pairs begin
        # the gradients the optimizer step was given, and their versions: read only where a
        # weight turned inf/NaN, once the first step showed the loop leaves them be until
        # the step ends (zero_grad sets them to None), else measured at once (`_grads`); a
        # step of such a loop whose gradients did change names no "step" origin
        self._kept: list[torch.Tensor] | None = None
        self._versions: list[int] = []
        self._applied: int | None = None  # where the received gradients' norm lies
        self._stale: int | None = None
        # the last output measured (a weak reference, its version, where its (min, max) lie,
        # its `_Samples.add`, its gradient hook's modules): the next module that returns it
        # unchanged (its parent, a Dropout(0)) shares them; likewise the last gradient
        self._last_out: list | None = None
        self._last_grad: list | None = None
        n = self.step_no + 1  # the step about to run
        self._sampling = n == 1 or n % self.every == 0

    def _keep(self, tensors) -> int:
        """Where the figures `tensors` (0-d, unread) lie among the step's."""
        at = len(self._flat)
        self._flat += tensors
        return at

    def _forward(self, name: str, norm: bool, leaf: bool, module, args, output) -> None:
        if not torch.is_grad_enabled():  # an evaluation, not a training step
            return
        t = _first_float(output)
        if t is None:
            return
        last = self._last_out
        if last is None or last[0]() is not t or last[1] != t._version:
            names = None
            if t.requires_grad:
                names = []
                node = t.grad_fn
                if node is None:  # a leaf: a parameter returned as it is
                    t.register_hook(functools.partial(self._backward, names))
                else:  # a hook on the node that made t: a tenth of a tensor hook's cost
                    node.register_prehook(functools.partial(self._reaches, names, t.output_nr))
            last = self._last_out = [weakref.ref(t), t._version,
                                     self._keep(torch.aminmax(t.detach())), None, names]
            if not self.step_no:
                self._owners.add(name)
        elif not self.step_no:
            self._sharers.add(name)
        given = _first_float(args) if norm else None  # a norm: was its input finite?
        self._fwd.append((name, last[2], -1 if given is None else
                          self._keep(torch.aminmax(given.detach())), t.dtype))
        if self._sampling and leaf:
            if last[3] is None:
                last[3] = self._samples.add(t)
            self._rows.append((name, "forward", t.dtype, last[2], *last[3]))
        if last[4] is not None:
            last[4].append((name, leaf))

    def _reaches(self, names: list[tuple[str, bool]], k: int, grads: tuple) -> None:
        """The gradients reaching the node that made an output: its `k`-th is the output's."""
        if grads[k] is not None:
            self._backward(names, grads[k])

    def _backward(self, names: list[tuple[str, bool]], grad: torch.Tensor) -> None:
        if not grad.numel():
            return
        last = self._last_grad
        if last is None or last[0]() is not grad or last[1] != grad._version:
            last = self._last_grad = [weakref.ref(grad), grad._version,
                                      self._keep(torch.aminmax(grad.detach())), None]
        for name, leaf in names:
            self._bwd.append((name, last[2], grad.dtype))
            if self._sampling and leaf:
                if last[3] is None:
                    last[3] = self._samples.add(grad)
                self._rows.append((name, "backward", grad.dtype, last[2], *last[3]))

    def _arrives(self, grad: torch.Tensor) -> None:
        if self._fresh:
            self._fresh = False
            held = self._params[0][1].grad
            if held is not None:
                self._stale = self._keep([local_shard(held).detach().abs().amax()])

    # ---- the optimizer's side: gradients before its step, weights after ----------------------

    def watch_optimizer(self, optimizer) -> None:
        inner = inner_optimizer(optimizer)
        self._hooks += [inner.register_step_pre_hook(self._pre_step),
                        inner.register_step_post_hook(self._post_step)]

    def _pre_step(self, optimizer, args, kwargs) -> None:
        held = [(n, p) for n, p in self._params if p.grad is not None and p.grad.numel()]
        if held:
            self._stepped = [n for n, _ in held]
            self._held = [p for _, p in held]
            self._kept = [p.grad for p in self._held]
            self._versions = [g._version for g in self._kept]
            if not self._lazy:
                self._grads = self._keep(_aminmax(self._kept))
            # the weights before this step are those after the last one, read then: measured
            # again only when there are none (the first step, another set of gradients)
            if not all(n in self._after for n in self._stepped):
                self._before = self._keep(_aminmax(self._held))
            if self.norms:
                self._applied = self._keep([torch.linalg.vector_norm(torch.stack(
                    [local_shard(p.grad).detach().float().norm() for p in self._held]))])

    def _post_step(self, optimizer, args, kwargs) -> None:
        self._fresh = True
        if self._kept is not None:
            self._weights = self._keep(_aminmax(self._held))

    # ---- the end of a step --------------------------------------------------------------------

    def step(self, result, loss: float | None = None, loss_dtype: torch.dtype | None = None):
        """Read the step's figures (one sync) into `result.numerics`; `loss`: its value."""
        self.step_no += 1
        step, found = self.step_no, self.numerics
        if loss_dtype is not None and found["loss_dtype"] is None:
            found["loss_dtype"] = str(loss_dtype).replace("torch.", "")
        v, counted = _read(self._flat), self._samples.count()
        for name, phase, dtype, i, k, n in self._rows:
            found["layers"].append({"step": step, "module": name, "phase": phase,
                                    "dtype": str(dtype).replace("torch.", "")}
                                   | _row([v[i], v[i + 1], *counted[k]], n))
        if not all(map(math.isfinite, v)) or (loss is not None and not math.isfinite(loss)):
            self._non_finite(found["first"], step, v, loss)  # else none began in this step
        if self._kept is not None and self._lazy is not False:  # still untouched?
            self._lazy = self._versions == [g._version for g in self._kept]
        if self._stale is not None and v[self._stale] > 0:
            found["stale_grads"].append(step)
        if self._applied is not None:
            found.setdefault("applied_norms", []).append(v[self._applied])
        if self._weights is not None:
            n = len(self._stepped)
            self._after.update(zip(self._stepped, _absmaxes(v, self._weights, n)))
        over, peak = found["over_fp16"], self.peak
        for name, i, _, _ in self._fwd:
            amax = _absmax(v[i], v[i + 1])
            if math.isfinite(amax):
                if amax > FP16_MAX and name not in over:
                    over[name] = step
                if amax >= peak.get(name, 0.0):
                    peak[name] = amax
            elif name not in over:
                over[name] = step
        if step == 1:
            for name in self._sharers - self._owners - self._eps.keys():
                self._hooked.pop(name).remove()
        result.numerics = found
        self._reset()

    def _non_finite(self, first: dict, step: int, v: list[float], loss: float | None) -> None:
        """Where this step's first inf/NaN of each kind began, into `first` (see the module's
        docstring), from the step's figures `v`."""
        fwd = [(name, v[i], v[i + 1], dtype, v[j:j + 2] if j >= 0 else [])
               for name, i, j, dtype in self._fwd]
        bwd = [(name, v[i], v[i + 1], dtype, []) for name, i, dtype in self._bwd]
        if "forward" not in first:
            self._first(first, "forward", step, fwd)
        if "loss" not in first and loss is not None and not math.isfinite(loss):
            first["loss"] = {"step": step, "value": loss,
                             "dtype": self.numerics["loss_dtype"],
                             "outputs_finite": all(map(math.isfinite,
                                                       (x for _, lo, hi, *_ in fwd
                                                        for x in (lo, hi))))}
        if "backward" not in first:
            self._first(first, "backward", step, bwd)
        if self._kept is not None and "step" not in first:
            n = len(self._stepped)
            before = ([self._after[name] for name in self._stepped] if self._before is None
                      else _absmaxes(v, self._before, n))
            after = before if self._weights is None else _absmaxes(v, self._weights, n)
            turned = [i for i, (b, a) in enumerate(zip(before, after))
                      if math.isfinite(b) and not math.isfinite(a)]
            if not turned:
                return
            if self._grads is not None:
                grads = _absmaxes(v, self._grads, n)
            elif self._versions == [g._version for g in self._kept]:  # read them now
                grads = dict(zip(turned, _absmaxes(_read(_aminmax(
                    [self._kept[i] for i in turned])), 0, len(turned))))
            else:  # changed since the step: what it was given is unknown
                return
            for i in turned:
                if math.isfinite(grads[i]):
                    first["step"] = {"step": step, "parameter": self._stepped[i],
                                     "grad_amax": grads[i], "weight_amax_before": before[i]}
                    break

    def _first(self, first: dict, phase: str, step: int, seen: list) -> None:
        for name, lo, hi, dtype, given in seen:
            if math.isfinite(lo) and math.isfinite(hi):
                continue
            first[phase] = {"step": step, "module": name, "kind": self._kind.get(name, "?"),
                            "dtype": str(dtype).replace("torch.", ""), "min": lo, "max": hi,
                            "peak_before": self.peak.get(name), "eps": self._eps.get(name)}
            if given:  # a norm's input: finite, so the norm itself made the inf/NaN
                first[phase]["input_finite"] = all(map(math.isfinite, given))
            return

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
