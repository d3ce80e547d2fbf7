"""The three ways to train, side by side, measured from the code that really runs.

    from mplab.train import compare
    print(compare.diff("torch", "accelerate"))   # which lines Accelerate takes over
    compare.profiles()                           # lines of code, steps you write, settings

Lessons 5 and 6 place plain PyTorch, Accelerate and the Trainer on the course's chart of ease
of use against ability to customise. Both axes are counted here, from each path's function in
mplab.train (the code `train(path=...)` runs), not drawn by hand:

- **lines of code**: the function's statements, without its docstring, comments, blank lines
  and mplab's own bookkeeping (lines that call the `Run` record, `run.`/`Run.`): the code a
  learner writes for that method. Fewer lines: easier to use.
- **steps you write**: which of the training step's parts (autocast, loss scaling, backward,
  unscale and clip, optimizer step, scaler update, zero_grad, schedule, accumulation) appear
  in that code as calls of your own. A step you write is a step you can change; the others
  the library does for you, hidden.
- **settings exposed**: the keyword arguments of the object you configure (torch.autocast and
  torch.amp.GradScaler; Accelerator; TrainingArguments), read from the installed libraries.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import inspect
import re
import textwrap
from dataclasses import dataclass, fields, is_dataclass

from mplab._display import Table

from .config import PATHS

#: The function that is each path, as "module:function".
FUNCTIONS = {"torch": "mplab.train.torch_path:train_torch",
             "accelerate": "mplab.train.accelerate_path:train_accelerate",
             "trainer": "mplab.train.trainer_path:train_trainer"}

#: The parts of a mixed precision training step, and what shows the code writes each itself.
STEPS = {
    "autocast": r"torch\.autocast\(|\bautocast\b",
    "loss scaling": r"scaler\.scale\(",
    "backward": r"\.backward\(",
    "unscale + clip": r"clip_grad_norm_\(",
    "optimizer step": r"(optimizer|scaler)\.step\(",
    "scaler update": r"scaler\.update\(",
    "zero_grad": r"\.zero_grad\(",
    "lr schedule": r"(scheduler|lr_scheduler)\.step\(",
    "accumulation": r"accumulat",
}

#: The objects a learner configures on each path: "module:attribute".
CONFIGURED = {"torch": ("torch:autocast", "torch.amp:GradScaler"),
              "accelerate": ("accelerate:Accelerator",),
              "trainer": ("transformers:TrainingArguments",)}


@dataclass(frozen=True)
class PathProfile:
    """One path measured: see the module docstring for what each count means."""

    path: str
    lines_of_code: int
    steps_written: tuple[str, ...]
    settings_exposed: int

    @property
    def steps_hidden(self) -> tuple[str, ...]:
        return tuple(s for s in STEPS if s not in self.steps_written)

    def row(self) -> dict:
        return {"path": self.path, "lines of code": self.lines_of_code,
                "steps you write": f"{len(self.steps_written)} of {len(STEPS)}",
                "hidden by the library": ", ".join(self.steps_hidden) or "-",
                "settings exposed": self.settings_exposed}


def source(path: str) -> str:
    """The source of the function that is `path` (what `train(path=...)` runs)."""
    module, _, name = _function_name(path).partition(":")
    return inspect.getsource(getattr(importlib.import_module(module), name))


def diff(old: str, new: str, context: int = 3) -> str:
    """A unified diff of two paths' functions: what moving from `old` to `new` removes (-)
    and adds (+) in the code that really runs."""
    a, b = source(old).splitlines(), source(new).splitlines()
    return "\n".join(difflib.unified_diff(a, b, f"{old} path", f"{new} path", n=context,
                                          lineterm=""))


def method_lines(path: str) -> list[str]:
    """The lines counted as the method's code: the function's statements without its
    docstring, comments and blank lines, and without mplab's bookkeeping: statements that
    call the `Run` record (`run.record(...)`) or set its fields, and the `with Run.start(...)`
    that opens it. A statement that only reads `run.device` or `run.model` counts.
    A loop over `run.batches()` counts: a learner writes that loop over their own data."""
    text = textwrap.dedent(source(path))
    lines = text.splitlines()
    function = ast.parse(text).body[0]
    kept = []
    for first, last, compound in _chunks(function.body):
        chunk = [line.split("#", 1)[0].strip() for line in lines[first - 1:last]]
        code = " ".join(chunk)
        if re.search(r"\bRun\.", code) or (not compound and _bookkeeping(code)):
            continue
        kept += [c for c in chunk if c]
    return kept


def _bookkeeping(code: str) -> bool:
    """A statement that calls the Run record (`run.record(...)`) or sets one of its fields
    (`run.accelerator = ...`); one that only reads `run.device` is the method's own code."""
    return bool(re.search(r"\brun\.[\w.]+\(", code) or re.match(r"run\.[\w.]+\s*=[^=]", code))


def _chunks(body: list[ast.stmt]):
    """(first line, last line, is a compound header) for each statement, headers of compound
    statements apart from their bodies; the docstring left out."""
    for node in body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(
                node.value.value, str):
            continue
        inner = [getattr(node, k) for k in ("body", "orelse", "finalbody")
                 if getattr(node, k, None)]
        inner += [h.body for h in getattr(node, "handlers", [])]
        if not inner:
            yield node.lineno, node.end_lineno, False
            continue
        yield node.lineno, node.body[0].lineno - 1, True
        for block in inner:
            yield from _chunks(block)


def profile(path: str) -> PathProfile:
    """Measure one path (see the module docstring)."""
    code = "\n".join(method_lines(path))
    written = tuple(step for step, pattern in STEPS.items() if re.search(pattern, code))
    settings = sum(_settings(target) for target in CONFIGURED[_checked(path)])
    return PathProfile(path, len(method_lines(path)), written, settings)


def profiles(paths=None) -> Table:
    """Every path measured, one row each: the chart's data, as a table."""
    return Table([profile(p).row() for p in (paths or _available())],
                 title="the ways to train, measured from the code that runs")


def _available() -> list[str]:
    return [p for p in FUNCTIONS if p in PATHS]


def _checked(path: str) -> str:
    if path not in _available():
        raise ValueError(f"unknown path {path!r}; accepted: "
                         + ", ".join(map(repr, _available())))
    return path


def _function_name(path: str) -> str:
    return FUNCTIONS[_checked(path)]


def _settings(target: str) -> int:
    module, _, name = target.partition(":")
    obj = getattr(importlib.import_module(module), name)
    if is_dataclass(obj):
        return sum(f.init and not f.name.startswith("_") for f in fields(obj))
    params = inspect.signature(obj).parameters.values()
    return sum(p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name != "self"
               for p in params)
