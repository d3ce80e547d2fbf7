"""The three ways to train, side by side, measured from the code that really runs.

    from mplab.train import compare
    print(compare.diff("torch", "accelerate"))   # which lines Accelerate takes over
    compare.profiles()                           # lines of code, steps you write, settings

Lessons 5 and 6 place plain PyTorch, Accelerate and the Trainer on the course's chart of ease
of use against ability to customise. Both axes are counted here, from each path's function in
mplab.train (the code `train(path=...)` runs), by the tags its comments carry, as
Accelerate's `by_feature` examples mark their new code:

- **lines of code**: the function's statements, without its docstring, comments, blank lines
  and the statements tagged `[mplab]` (mplab's own bookkeeping: the `Run` record, the same on
  every path): the code a learner writes for that method. Fewer lines: easier to use.
- **steps you write**: which of the training step's parts (autocast, loss scaling, backward,
  unscale and clip, optimizer step, scaler update, zero_grad, schedule, accumulation) the
  code writes itself, each tagged where it does (`[backward]`). A step you write is a step
  you can change; the others the library does for you, hidden.
- **settings exposed**: the keyword arguments of the object you configure (torch.autocast and
  torch.amp.GradScaler; Accelerator; TrainingArguments), read from the installed libraries.

A tag on any line of a statement marks the statement (for a compound one, its header).
"""

from __future__ import annotations

import ast
import difflib
import importlib
import inspect
import io
import re
import textwrap
import tokenize
from dataclasses import dataclass, fields, is_dataclass

from mplab._display import Table

from .config import PATHS

#: The function that is each path, as "module:function".
FUNCTIONS = {"torch": "mplab.train.torch_path:train_torch",
             "accelerate": "mplab.train.accelerate_path:train_accelerate",
             "trainer": "mplab.train.trainer_path:train_trainer"}

#: The parts of a mixed precision training step, each the tag of the lines that write it.
STEPS = ("autocast", "loss scaling", "backward", "unscale + clip", "optimizer step",
         "scaler update", "zero_grad", "lr schedule", "accumulation")
#: The tag of mplab's bookkeeping: statements not counted as the method's code.
BOOKKEEPING = "mplab"

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
    docstring, comments and blank lines, and without the statements tagged `[mplab]`."""
    return [line for line, _ in _tagged_lines(path)]


def steps_written(path: str) -> tuple[str, ...]:
    """The parts of a training step (STEPS) that the path's counted lines are tagged with."""
    tags = {tag for _, line_tags in _tagged_lines(path) for tag in line_tags}
    return tuple(step for step in STEPS if step in tags)


def _tagged_lines(path: str) -> list[tuple[str, set[str]]]:
    """(code without its comment, the tags of its statement) for each counted line."""
    text = textwrap.dedent(source(path))
    lines = text.splitlines()
    tags = _tags(text)
    kept = []
    for first, last, _ in _chunks(ast.parse(text).body[0].body):
        found = set().union(*(tags.get(n, set()) for n in range(first, last + 1)))
        if BOOKKEEPING in found:
            continue
        chunk = [line.split("#", 1)[0].strip() for line in lines[first - 1:last]]
        kept += [(c, found) for c in chunk if c]
    return kept


def _tags(text: str) -> dict[int, set[str]]:
    """Line number -> the [tags] in its comment (a comment on a line of its own tags the
    line after it). An unknown tag is an error: a typo would silently move the chart."""
    found: dict[int, set[str]] = {}
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type != tokenize.COMMENT:
            continue
        row, col = token.start
        alone = not token.line[:col].strip()
        for tag in re.findall(r"\[([^\]]+)\]", token.string):
            if tag not in (*STEPS, BOOKKEEPING):
                raise ValueError(f"line {row}: unknown tag [{tag}]; accepted: "
                                 + ", ".join(f"[{t}]" for t in (*STEPS, BOOKKEEPING)))
            found.setdefault(row + 1 if alone else row, set()).add(tag)
    return found


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
    settings = sum(_settings(target) for target in CONFIGURED[_checked(path)])
    return PathProfile(path, len(method_lines(path)), steps_written(path), settings)


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
