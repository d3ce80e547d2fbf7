"""What autocast really did: every aten op of one training step, with the dtype it ran in.

    t = trace(model, batch, precision="bf16")  # one forward + loss under autocast, one backward
    t.summary()                               # per op: how often, which dtypes, which kind
    t.by_layer()                              # per module: its ops as colour-coded tags
    t.table(phase="forward", kinds="fp32 (autocast)")
    t.matmul_dtype                            # torch.bfloat16: what the matmuls really ran in

How it sees it. A `TorchDispatchMode` sits *below* autocast in torch's dispatcher, so it sees
the ops after autocast has acted: the `aten::_to_copy` casts autocast inserted, and every op
with the dtypes it really got. It cannot see whether autocast was on (every dispatch key above
Python's handler is excluded by then, Autocast's own exclusion included), so a
`TorchFunctionMode` above autocast notes, for each Python-level torch call (`F.linear`,
`F.cross_entropy`, `x + y`, `x.float()`), whether autocast is on and whether the code asked for
a dtype itself. From what ran, each op gets one kind: `KINDS` says what each means
(`Trace.kinds()`: those a trace holds, as a table); `autocast_policy` shows autocast's lists
themselves, on a few calls traced one by one. Autocast's promote list (`cat`, `stack`, ...) is
the one list taken from ATen's autocast_mode.cpp rather than observed.

Each op also records whether autocast cast an input of its call first (`autocast_cast`, the
column "autocast cast inputs"): `_log_softmax` after autocast's bf16 -> fp32 cast says yes, a
`native_layer_norm` fed an fp32 residual says no. Casts, views, "other" ops and the backward
(autocast is off there) say neither. A Python-level function such as `F.cross_entropy` counts
as one call: after an upcast, all of its fp32 ops count as autocast's.

Modules. Forward ops belong to the innermost module running (`named_modules()` names, "" for
the model itself, "(loss)" for a loss computed outside it), tracked with forward hooks;
backward ops to the module whose forward created the autograd node running them
(`torch._C._current_autograd_node()`), "(autograd)" when none runs.

The step: the forward and the loss under `torch.autocast(device, dtype)`, the backward outside
it, as the AMP recipe says. The model is moved to `device` and back; its gradients are left as
they were.
"""

from __future__ import annotations

import html
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mplab._display import Table
from mplab.hardware import cuda_units, resolve_device
from mplab.numerics.formats import dtype_of, get_format

__all__ = ["KINDS", "OpRecord", "Trace", "LayerView", "parse_precision", "trace", "POLICY_CALLS",
           "autocast_policy", "MatmulDtypeProbe"]

CAST, EXPLICIT_CAST = "cast (autocast)", "cast (explicit)"
LOW, FP32_AUTOCAST, PROMOTE = "low precision", "fp32 (autocast)", "fp32 (promoted)"
FP32, VIEW, OTHER = "fp32 (as given)", "view", "other"
#: Every kind an op can get, and what it means: the one list the tables and lessons use.
KINDS = {CAST: "a conversion autocast inserted (an fp32 weight to bf16 before a matmul, a bf16 "
               "input up for an op on its fp32 list); in backward, such a cast's gradient",
         EXPLICIT_CAST: "a conversion the code asked for (.float(), .to(dtype), dtype=...)",
         LOW: "an op that produced fp16 or bf16",
         FP32_AUTOCAST: "fp32, because autocast first cast an fp16/bf16 input of the call up (an "
                        "op on its fp32 list), or the op made fp32 of fp16/bf16 inputs itself",
         PROMOTE: "fp32 from fp16/bf16 and fp32 inputs mixed: type promotion (add(bf16, fp32)) "
                  "or autocast's promote list (cat, stack, ...)",
         FP32: "fp32 from fp32 inputs: autocast changed nothing",
         VIEW: "an aliasing op (t, view, expand, detach): it computes nothing",
         OTHER: "no floating-point tensors (indices, masks), or float64"}

_LOW = (torch.float16, torch.bfloat16)
_CASTS = ("aten::_to_copy", "aten::copy_")  # copy_(dst, src) casts src into dst's dtype
# Autocast's promote policy (ATen autocast_mode.cpp, CPU and CUDA lists)
_PROMOTE = {"cat", "stack", "index_copy", "addcdiv", "addcmul", "atan2", "_trilinear", "cross",
            "linalg_cross", "dot", "vdot", "grid_sampler_2d", "grid_sampler_3d", "index_put",
            "index_put_", "_index_put_impl_", "scatter_add", "tensordot"}
_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_addmm_activation"}
_COLOURS = {CAST: "#e6d4f5", EXPLICIT_CAST: "#f2ecf8", LOW: "#c8ebc8", FP32_AUTOCAST: "#ffc9a8",
            PROMOTE: "#fde7a8", FP32: "#dde3ea", VIEW: "#f4f4f4", OTHER: "#f4f4f4"}
LOSS_MODULE, AUTOGRAD_MODULE = "(loss)", "(autograd)"
_NO_QUESTION = (CAST, EXPLICIT_CAST, VIEW, OTHER)  # kinds with no "autocast cast inputs"


@dataclass(frozen=True)
class OpRecord:
    """One aten op as it ran: dtypes are those of its floating tensor arguments and results."""

    index: int
    phase: str                      # "forward" or "backward"
    module: str                     # named_modules() name; "" is the model itself
    op: str                         # e.g. "aten::addmm"
    inputs: tuple[torch.dtype, ...]
    outputs: tuple[torch.dtype, ...]
    kind: str                       # one of KINDS
    autocast_cast: bool | None = None  # autocast cast an input of its call first (see above)

    @property
    def name(self) -> str:
        """The op without its namespace: "addmm"."""
        return self.op.partition("::")[2] or self.op

    def row(self) -> dict:
        return {"#": self.index, "phase": self.phase, "module": _module_label(self.module),
                "op": self.op, "inputs": _dtypes(self.inputs), "outputs": _dtypes(self.outputs),
                "kind": self.kind, "autocast cast inputs": _yes_no([self.autocast_cast])}


class Trace:
    """The ops of one traced step (`records`) and views of them."""

    def __init__(self, records: list[OpRecord], device: torch.device, dtype: torch.dtype):
        self.records, self.device, self.dtype = records, device, dtype

    def __repr__(self) -> str:
        counts = ", ".join(f"{n} {k}" for k, n in Counter(r.kind for r in self.records).items())
        return f"Trace({len(self.records)} ops, {self.setting}: {counts})"

    @property
    def setting(self) -> str:
        """E.g. "cpu, autocast bf16" or "cpu, no autocast"."""
        if self.dtype == torch.float32:
            return f"{self.device.type}, no autocast"
        return f"{self.device.type}, autocast {_short(self.dtype)}"

    def select(self, phase: str | None = None, kinds=None) -> list[OpRecord]:
        """The records of one phase ("forward"/"backward", None for both) and of some kinds."""
        if phase not in (None, "forward", "backward"):
            raise ValueError(f"phase must be 'forward', 'backward' or None, got {phase!r}")
        kinds = [kinds] if isinstance(kinds, str) else None if kinds is None else list(kinds)
        if kinds is not None and (unknown := [k for k in kinds if k not in KINDS]):
            raise ValueError(f"unknown kind(s) {unknown!r}; accepted: {', '.join(KINDS)}")
        return [r for r in self.records
                if (phase is None or r.phase == phase) and (kinds is None or r.kind in kinds)]

    def table(self, phase: str | None = None, kinds=None, limit: int | None = None) -> Table:
        """Every op in order (of `phase`, of `kinds`, the first `limit`)."""
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                                  or limit < 0):
            raise ValueError(f"limit must be a non-negative integer or None, got {limit!r}")
        rows = [r.row() for r in self.select(phase, kinds)][:limit]
        return Table(rows, title=f"ops ({self.setting})")

    def summary(self, phase: str | None = None) -> Table:
        """Per op name: how often it ran, the dtypes seen, and its kinds (most frequent first)."""
        by_op: dict[str, list[OpRecord]] = {}
        for r in self.select(phase):
            by_op.setdefault(r.op, []).append(r)
        rows = []
        for op, recs in by_op.items():
            kinds = Counter(r.kind for r in recs)
            rows.append({
                "op": op, "count": len(recs),
                "kind": ", ".join(k if n == len(recs) else f"{k} x{n}"
                                  for k, n in kinds.most_common()),
                "inputs": _dtypes(sorted({d for r in recs for d in r.inputs}, key=str)),
                "outputs": _dtypes(sorted({d for r in recs for d in r.outputs}, key=str)),
                "autocast cast inputs": _yes_no(r.autocast_cast for r in recs),
                "phases": "/".join(sorted({r.phase for r in recs}, reverse=True))})
        return Table(rows, title="which ops stayed in low precision and which ran in fp32")

    def kinds(self) -> Table:
        """The kinds this trace's ops got, in `KINDS`' order: how many ops, and what it means."""
        seen = Counter(r.kind for r in self.records)
        return Table([{"kind": k, "ops": seen[k], "what it means": meaning}
                      for k, meaning in KINDS.items() if seen[k]], title="the trace's kinds")

    def by_layer(self, phase: str = "forward") -> LayerView:
        """One row per module: its ops in order as tags coloured by kind (views and integer
        ops left out: they say nothing about precision)."""
        rows: dict[str, list[OpRecord]] = {}
        for r in self.select(phase):
            if r.kind not in (VIEW, OTHER):
                rows.setdefault(r.module, []).append(r)
        return LayerView(rows, f"{phase} ops per module ({self.setting})")

    def _names(self, kind: str) -> set[str]:
        return {r.op for r in self.records if r.kind == kind}

    @property
    def casts(self) -> list[OpRecord]:
        """The casts autocast inserted (forward) and their gradients (backward)."""
        return [r for r in self.records if r.kind == CAST]

    @property
    def fp32_ops(self) -> set[str]:
        """Names of the ops autocast ran in fp32."""
        return self._names(FP32_AUTOCAST)

    @property
    def low_precision_ops(self) -> set[str]:
        """Names of the ops that produced fp16/bf16, forward or backward."""
        return self._names(LOW)

    @property
    def matmul_dtype(self) -> torch.dtype | None:
        """The dtype the forward's matmul/conv ops ran in (the most common one, should they
        differ: `summary()` tells them apart); None if none ran. Backward's follow the forward."""
        seen = Counter(r.outputs[0] for r in self.select("forward")
                       if r.outputs and (r.name in _MATMULS or "conv" in r.name))
        return seen.most_common(1)[0][0] if seen else None


class LayerView:
    """Per-module op tags: `rows` maps a module name to its records; HTML in a notebook."""

    def __init__(self, rows: dict[str, list[OpRecord]], title: str):
        self.rows, self.title = rows, title

    def __len__(self) -> int:
        return len(self.rows)

    def __str__(self) -> str:
        width = max((len(_module_label(m)) for m in self.rows), default=0)
        lines = [self.title, f"legend: '!' {FP32_AUTOCAST}, '+' {PROMOTE}, '~' {EXPLICIT_CAST}, "
                 f"unmarked a->b {CAST}"]
        lines += [f"{_module_label(m).ljust(width)}  " + " ".join(_text_tag(r) for r in recs)
                  for m, recs in self.rows.items()]
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        legend = " ".join(_span(k, k, k) for k in KINDS if k not in (VIEW, OTHER))
        body = "".join(
            f"<tr><td style='text-align:left'><code>{html.escape(_module_label(m))}</code></td>"
            f"<td style='text-align:left'>{''.join(_html_tag(r) for r in recs)}</td></tr>"
            for m, recs in self.rows.items())
        return (f"<div class='mplab-trace'><div>{html.escape(self.title)}</div>"
                f"<div>{legend}</div><table><thead><tr><th>module</th><th>ops</th></tr>"
                f"</thead><tbody>{body}</tbody></table></div>")


def _module_label(module: str) -> str:
    return module or "(model)"


def _short(dtype) -> str:
    """mplab's name of a float dtype ("bf16"); other dtypes by torch's name ("float64")."""
    try:
        return get_format(dtype).name
    except ValueError:
        return str(dtype).removeprefix("torch.")


def _dtypes(dtypes) -> str:
    return ", ".join(_short(d) for d in dtypes)


def _yes_no(flags) -> str:
    """"yes", "no", or both with counts ("no x4, yes x1"); "" when no record answers (None)."""
    seen = Counter("yes" if f else "no" for f in flags if f is not None)
    return ", ".join(k if n == seen.total() else f"{k} x{n}" for k, n in sorted(seen.items()))


def _source(op: str, inputs: tuple) -> torch.dtype:
    """The dtype a cast converts from: copy_(dst, src) reads its second argument."""
    return inputs[-1] if op == "aten::copy_" else inputs[0]


def _text_tag(r: OpRecord) -> str:
    if r.kind in (CAST, EXPLICIT_CAST):
        mark = "~" if r.kind == EXPLICIT_CAST else ""
        return f"{mark}{_dtypes([_source(r.op, r.inputs)])}->{_dtypes(r.outputs[:1])}"
    mark = {FP32_AUTOCAST: "!", PROMOTE: "+"}.get(r.kind, "")
    return f"{r.name}:{_dtypes(r.outputs[:1]) or '-'}{mark}"


def _html_tag(r: OpRecord) -> str:
    title = f"{r.op}: {_dtypes(r.inputs) or '-'} -> {_dtypes(r.outputs) or '-'} ({r.kind})"
    return _span(_text_tag(r), r.kind, title)


def _span(text: str, kind: str, title: str) -> str:
    css = kind.replace(" ", "-").replace("(", "").replace(")", "")
    return (f"<span class='op {css}' title='{html.escape(title, quote=True)}' style='"
            f"background:{_COLOURS[kind]};border-radius:3px;padding:0 3px;margin:1px;"
            f"display:inline-block;font-family:monospace'>{html.escape(text)}</span>")


# Python-level calls that convert because the code asked (so does any call given a dtype)
_CONVERSIONS = {"to", "float", "half", "bfloat16", "double", "type", "type_as", "copy_"}


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _floating(tensors) -> tuple[torch.dtype, ...]:
    return tuple(t.dtype for t in tensors if t.is_floating_point())


class _Recorder(TorchDispatchMode):
    """Records each aten op below autocast; `_CallWatcher` and module hooks give it context."""

    def __init__(self, enabled: bool):
        super().__init__()
        self.enabled = enabled                 # autocast on for this step
        self.records: list[OpRecord] = []
        self.phase = "forward"
        self.modules: list[str] = []           # the forward's module stack, innermost last
        self.call = _Call(False)               # the Python-level torch call now running
        self.nodes: dict = {}                  # autograd node -> (module, made by autocast)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins, outs = _floating(_tensors((args, kwargs))), _floating(_tensors(out))
        op = func._schema.name
        if self.phase == "forward":
            module = self.modules[-1] if self.modules else LOSS_MODULE
            kind = self.classify(func, op, ins, outs, self.call)
            cast_first = None if kind in _NO_QUESTION else self.call.casts > 0
        else:  # backward runs outside autocast; a cast undoes one made by autocast or not
            node = torch._C._current_autograd_node()
            module, by_autocast = self.nodes.get(node, (AUTOGRAD_MODULE, False))
            kind = self.classify(func, op, ins, outs, _Call(False))
            if kind == EXPLICIT_CAST and by_autocast:
                kind = CAST
            cast_first = None  # backward runs outside autocast
        self.records.append(OpRecord(len(self.records), self.phase, module, op, ins, outs,
                                     kind, cast_first))
        return out

    def leave(self, module, args, output) -> None:  # a forward hook: the module has run
        self.modules.pop()

    @staticmethod
    def classify(func, op: str, ins: tuple, outs: tuple, call: _Call) -> str:
        if op in _CASTS and ins and outs and _source(op, ins) != outs[0]:
            if not call.implicit or op == "aten::copy_":
                return EXPLICIT_CAST
            call.casts += 1
            call.upcast = call.upcast or (_source(op, ins) in _LOW and outs[0] == torch.float32)
            return CAST
        if getattr(func, "is_view", False) or op == "aten::detach":
            return VIEW
        result = outs[0] if outs else None
        if result in _LOW:
            return LOW
        if result != torch.float32:
            return OTHER
        if call.upcast:  # autocast cast an input of this call up to fp32 first
            return PROMOTE if op.partition("::")[2] in _PROMOTE else FP32_AUTOCAST
        if call.implicit and ins and all(d in _LOW for d in ins):
            return FP32_AUTOCAST  # e.g. CUDA's _softmax(bf16, half_to_float=True)
        return PROMOTE if any(d in _LOW for d in ins) else FP32


@dataclass
class _Call:
    """One Python-level torch call: may autocast have acted in it, and what it did there."""

    implicit: bool        # autocast on, and no dtype asked for by the code
    casts: int = 0        # casts autocast inserted
    upcast: bool = False  # one of them low -> fp32


class _CallWatcher(TorchFunctionMode):
    """Sees each Python-level torch call (above autocast, where the dispatch mode cannot see
    whether autocast is on), and maps the autograd nodes it made to the running module."""

    def __init__(self, recorder: _Recorder, device: torch.device):
        super().__init__()
        self.recorder = recorder
        self.key = getattr(torch._C.DispatchKey, "AutocastCUDA" if device.type == "cuda"
                           else "AutocastCPU")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.recorder
        autocast_on = rec.enabled and not torch._C._dispatch_tls_is_dispatch_key_excluded(self.key)
        explicit = getattr(func, "__name__", "") in _CONVERSIONS or any(
            isinstance(a, torch.dtype) for a in (*args, *kwargs.values()))
        outer, rec.call = rec.call, _Call(autocast_on and not explicit)
        try:
            out = func(*args, **kwargs)
            call = rec.call
        finally:
            rec.call = outer
        if rec.phase == "forward":
            owner = (rec.modules[-1] if rec.modules else LOSS_MODULE, call.casts > 0)
            for t in _tensors(out):
                self.adopt(t.grad_fn, owner)
        return out

    def adopt(self, node, owner) -> None:
        """Map `node` and the nodes behind it not yet seen to `owner`."""
        todo = [node]
        while todo:
            node = todo.pop()
            if node is None or node in self.recorder.nodes:
                continue
            self.recorder.nodes[node] = owner
            todo.extend(n for n, _ in node.next_functions)


def parse_precision(precision) -> torch.dtype:
    """torch.bfloat16/float16 or "bf16"/"fp16" (autocast), torch.float32/"fp32" (autocast off)."""
    try:
        if (dtype := dtype_of(precision)) in (*_LOW, torch.float32):
            return dtype
    except ValueError:
        pass
    raise ValueError(f"unknown precision {precision!r}; accepted: 'bf16', 'fp16' (or "
                     "torch.bfloat16, torch.float16), or 'fp32' / torch.float32 for a step "
                     "without autocast")


def trace(model, batch_or_inputs, *, precision="bf16", device="auto", loss_fn=None,
          backward: bool = True) -> Trace:
    """Run one step of `model` under autocast and record every aten op that ran.

    `batch_or_inputs`: a dict (`model(**batch)`, Hugging Face style), a tensor (`model(x)`) or
    a tuple/list (`model(*inputs)`); tensors are moved to `device`. The loss, under autocast
    like the forward: `loss_fn(output)` if given; else for a dict batch `output.loss`; else
    `output.float().sum()` of the (first) output tensor, a stand-in that reaches every
    parameter (its `.float()` shows as an explicit cast). `backward=False`: the forward only.
    `precision`: bf16 or fp16 autocast; fp32 traces the step without autocast, to compare.
    The first trace in a process takes longer (torch imports torch._dynamo); each trace costs
    many plain steps (benchmarks/RECORDS.md).
    """
    dtype = parse_precision(precision)
    if not isinstance(device, str | torch.device):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    dev = resolve_device(device)
    if dev.type == "cuda" and dev.index is None:  # compare equal to the parameters' cuda:N
        dev = torch.device("cuda", torch.cuda.current_device())
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if dev.type == "cuda" and dtype == torch.bfloat16 and not cuda_units("bf16", dev):
        raise ValueError(f"{torch.cuda.get_device_name(dev)} has no bf16 units (bf16 is "
                         "emulated there); trace with precision='fp16'")
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"loss_fn must be a function of the model's output, got {loss_fn!r}")
    call = _caller(batch_or_inputs, dev)
    params = list(model.parameters())
    home, grads = {p.device for p in params}, [p.grad for p in params]
    for p in params:  # backward would add into the saved gradients in place
        p.grad = None
    recorder = _Recorder(enabled=dtype != torch.float32)
    hooks = []
    try:
        if len(home) == 1 and home != {dev}:
            model.to(dev)
        for name, module in model.named_modules():
            hooks.append(module.register_forward_pre_hook(
                lambda m, args, name=name: recorder.modules.append(name)))
            hooks.append(module.register_forward_hook(recorder.leave))
        with recorder, _CallWatcher(recorder, dev):
            with torch.autocast(dev.type, dtype=dtype if recorder.enabled else None,
                                enabled=recorder.enabled):
                output = call(model)
                if backward:
                    loss = _loss(output, loss_fn, batch_or_inputs)
                elif loss_fn is not None:
                    loss_fn(output)
            if backward:
                recorder.phase = "backward"
                loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
        recorder.nodes.clear()
        if len(home) == 1 and home != {dev}:
            model.to(next(iter(home)))
        for p, g in zip(params, grads):
            p.grad = g
    return Trace(recorder.records, dev, dtype)


def _caller(batch, dev: torch.device):
    """A function that calls the model with `batch` moved to `dev`."""
    def move(x):
        return x.to(dev) if isinstance(x, torch.Tensor) else x
    if isinstance(batch, dict):
        if bad := [k for k in batch if not isinstance(k, str)]:
            raise ValueError(f"a dict batch is passed as model(**batch), so its keys must be "
                             f"strings; got keys {bad!r}")
        moved = {k: move(v) for k, v in batch.items()}
        return lambda model: model(**moved)
    if isinstance(batch, torch.Tensor) or isinstance(batch, tuple | list) and batch:
        inputs = [move(x) for x in ([batch] if isinstance(batch, torch.Tensor) else batch)]
        return lambda model: model(*inputs)
    empty = " (empty)" if isinstance(batch, tuple | list) else ""
    raise ValueError(f"batch_or_inputs must be a dict (model(**batch)), a tensor (model(x)) or "
                     f"a non-empty tuple/list of inputs (model(*inputs)); got "
                     f"{type(batch).__name__}{empty}")


def _loss(output, loss_fn, batch) -> torch.Tensor:
    """The scalar to call backward() on (see `trace`)."""
    if loss_fn is not None:
        loss, source = loss_fn(output), "loss_fn(output)"
    elif isinstance(batch, dict):
        if (loss := getattr(output, "loss", None)) is None:
            raise ValueError(f"the model returned no loss for a batch with keys {list(batch)}; "
                             "include 'labels', give loss_fn=..., or trace with backward=False")
        source = "output.loss"
    else:
        items = output.to_tuple() if hasattr(output, "to_tuple") else output
        first = output if isinstance(output, torch.Tensor) else next(
            iter(_tensors(items)), None) if isinstance(items, tuple | list) else None
        if first is None or not first.is_floating_point():
            raise ValueError(f"cannot make a loss from the model's output "
                             f"({type(output).__name__}); give loss_fn=..., or trace with "
                             "backward=False")
        loss, source = first.float().sum(), "output.float().sum()"
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"{source} must be a one-element tensor to call backward() on, got "
                         f"{getattr(loss, 'shape', type(loss).__name__)}")
    if not loss.requires_grad:
        raise ValueError(f"{source} does not require grad (no trainable parameter reached it, "
                         "or the model ran under no_grad); trace with backward=False")
    return loss


#: The calls `autocast_policy` traces: where CPU and CUDA autocast differ, and a loss.
POLICY_CALLS = {
    "F.softmax(x, -1)": lambda x: F.softmax(x, -1),
    "F.log_softmax(x, -1)": lambda x: F.log_softmax(x, -1),
    "F.layer_norm(x, (8,))": lambda x: F.layer_norm(x, (8,)),
    "x.sum()": lambda x: x.sum(),
    "F.cross_entropy(x, labels)": lambda x: F.cross_entropy(x, torch.arange(4, device=x.device)),
}


class _Apply(torch.nn.Module):  # a call as a model, for trace()
    def __init__(self, fn):
        super().__init__()
        self.forward = fn


def autocast_policy(precision="bf16", device="auto", calls=None) -> Table:
    """What autocast does to each of `calls` (name -> function of x; default `POLICY_CALLS`)
    on `device`, seen by tracing the call alone on a 4x8 tensor `x` already in `precision`,
    as a matmul under autocast hands it on: the dtype it computed in, its kind, and the aten
    ops one Python call ran as (casts and views left out)."""
    if (dtype := parse_precision(precision)) == torch.float32:
        raise ValueError(f"autocast_policy needs precision 'bf16' or 'fp16', got {precision!r}")
    rows = []
    for name, fn in (POLICY_CALLS if calls is None else calls).items():
        t = trace(_Apply(fn), torch.randn(4, 8).to(dtype), precision=dtype, device=device,
                  backward=False)
        ran = [r for r in t.records if r.kind not in (CAST, EXPLICIT_CAST, VIEW, OTHER)]
        rows.append({"call": name, "computed in": _dtypes(ran[-1].outputs[:1]) if ran else "-",
                     "kind": ", ".join(dict.fromkeys(r.kind for r in ran)),
                     "ran as": ", ".join(r.op for r in ran)})
    return Table(rows, title=f"autocast's policy, each call traced alone ({t.setting}, "
                             f"x in {_short(dtype)})")


class MatmulDtypeProbe:
    """The dtype a model's matmuls ran in, seen cheaply in a real run: a forward hook on each
    matmul layer (Linear, Conv, Hugging Face's Conv1D) reads its output's dtype on its first
    call, then removes itself. The low-precision dtype most layers ran in, where any did: a
    layer kept in fp32 on purpose (a custom Function with `custom_fwd(cast_inputs=float32)`,
    an fp32 island) does not make the run's matmuls fp32. `trace(...).matmul_dtype` sees it
    from every aten op."""

    def __init__(self, model: torch.nn.Module):
        self.seen: dict[torch.dtype, int] = {}
        self._hooks = {}
        for layer in (m for m in model.modules() if _is_matmul_layer(m)):
            self._hooks[id(layer)] = layer.register_forward_hook(self._seen)

    @property
    def dtype(self) -> torch.dtype | None:
        low = {d: n for d, n in self.seen.items() if d in _LOW}
        counts = low or self.seen
        return max(counts, key=counts.get) if counts else None

    def _seen(self, module, args, output):
        if isinstance(output, torch.Tensor):
            self.seen[output.dtype] = self.seen.get(output.dtype, 0) + 1
        self._hooks.pop(id(module)).remove()

    def remove(self) -> None:
        for hook in self._hooks.values():
            hook.remove()
        self._hooks = {}


def _is_matmul_layer(module: torch.nn.Module) -> bool:
    layers = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    return isinstance(module, layers) or type(module).__name__ == "Conv1D"
