"""The three ways to train, side by side, measured from the code that really runs.

    from mplab.train import compare
    print(compare.diff("torch", "accelerate"))   # which lines Accelerate takes over
    print(compare.diff("accelerate", "trainer", bookkeeping=False))  # only what a user writes
    compare.profiles()                           # lines of code, steps you write, settings
    print(compare.versus("torch", "accelerate"))  # the two rows, in a sentence

Lessons 5 and 6 place plain PyTorch, Accelerate and the Trainer on the course's chart of ease
of use against ability to customise. Both axes are counted here, from each path's function in
mplab.train (the code `train(path=...)` runs), by the tags its comments carry, as
Accelerate's `by_feature` examples mark their new code:

- **lines of code**: the lines of the function's statements that a learner would write for
  that method: its docstring, comments, blank lines and imports left out, and mplab's own
  bookkeeping (the `Run` record, the same on every path): the statements tagged `[mplab]`, the
  ones that only feed them (an assignment of a constant or a `.detach()`ed value to names that
  only bookkeeping reads: a running loss, a norm kept for the record), and a compound
  statement (`if ...:`) holding nothing else. `Accelerator(...)`, `prepare(...)` and
  `TrainingArguments(...)` count, every line of them. Fewer lines: easier to use.
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

__all__ = ["FUNCTIONS", "STEPS", "BOOKKEEPING", "CONFIGURED", "PathProfile", "source", "diff",
           "user_code", "method_lines", "steps_written", "profile", "profiles", "versus"]

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


def diff(old: str, new: str, context: int = 3, *, bookkeeping: bool = True,
         tags: bool = True) -> str:
    """A unified diff of two paths' functions: what moving from `old` to `new` removes (-)
    and adds (+) in the code that really runs. `bookkeeping=False` diffs only the lines
    counted as each method's code (`user_code`): what a user writes, each statement that
    writes a step keeping its tags, unless `tags=False` (the code alone, for a reader to name
    the steps)."""
    if bookkeeping and not tags:
        raise ValueError("tags=False diffs the code a user writes, without comments: give it "
                         "with bookkeeping=False (the full source keeps its comments)")
    a, b = ((source(p) if bookkeeping else user_code(p, tags=tags)).splitlines()
            for p in (old, new))
    return "\n".join(difflib.unified_diff(a, b, f"{old} path", f"{new} path", n=context,
                                          lineterm=""))


def user_code(path: str, *, tags: bool = True) -> str:
    """The lines counted as the method's code (`method_lines`), indented as in the source,
    without their comments; a statement that writes steps ends its first line with their tags
    (`# [backward]`), unless `tags=False`."""
    lines = textwrap.dedent(source(path)).splitlines()
    counted = _counted(path)
    kept, ids = [], {id(s) for s in counted}
    for statement in counted:
        # indented under the counted statements holding it (a `with` of mplab's is not shown)
        depth, parent = 0, statement.parent
        while parent is not None:
            depth += id(parent) in ids
            parent = parent.parent
        own = textwrap.dedent("\n".join(lines[statement.first - 1:statement.last]))
        steps = " ".join(f"[{step}]" for step in STEPS if tags and step in statement.tags)
        for n, line in enumerate(own.splitlines()):
            code = line.split("#", 1)[0].rstrip()
            if code.strip():
                kept.append("    " * depth + code + (f"  # {steps}" if steps and not n else ""))
    return "\n".join(kept)


def method_lines(path: str) -> list[str]:
    """The lines counted as the method's code: the function's statements without its
    docstring, comments, blank lines and imports, and without mplab's bookkeeping (see the
    module docstring)."""
    lines = textwrap.dedent(source(path)).splitlines()
    return [code for s in _counted(path) for code in
            (line.split("#", 1)[0].strip() for line in lines[s.first - 1:s.last]) if code]


def steps_written(path: str) -> tuple[str, ...]:
    """The parts of a training step (STEPS) that the path's counted statements are tagged
    with."""
    tags = {tag for statement in _counted(path) for tag in statement.tags}
    return tuple(step for step in STEPS if step in tags)


@dataclass
class _Statement:
    """One statement of a path's function (a compound one: its header alone, the statements
    inside it in `inner`), its lines and the tags its comments give it."""

    node: ast.stmt
    first: int
    last: int
    tags: set[str]
    inner: list[_Statement]
    parent: _Statement | None

    @property
    def header(self) -> bool:
        return bool(self.inner) or _blocks(self.node) != []


def _counted(path: str) -> list[_Statement]:
    """The statements counted as the method's code, in source order."""
    text = textwrap.dedent(source(path))
    statements = list(_statements(ast.parse(text).body[0].body, _tags(text)))
    left_out = _left_out(statements)
    return [s for s in statements if id(s) not in left_out]


def _statements(body: list[ast.stmt], tags: dict[int, set[str]], parent=None):
    """Each statement, in source order (a compound one's header before the statements inside
    it); the docstring left out."""
    for node in body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(
                node.value.value, str):
            continue
        blocks = _blocks(node)
        last = blocks[0][0].lineno - 1 if blocks else node.end_lineno
        found = set().union(*(tags.get(n, set()) for n in range(node.lineno, last + 1)))
        statement = _Statement(node, node.lineno, last, found, [], parent)
        yield statement
        for block in blocks:
            for inner in _statements(block, tags, statement):
                statement.inner.append(inner)
                yield inner


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


def _blocks(node: ast.stmt) -> list[list[ast.stmt]]:
    blocks = [getattr(node, k) for k in ("body", "orelse", "finalbody")
              if getattr(node, k, None)]
    return blocks + [h.body for h in getattr(node, "handlers", [])]


def _left_out(statements: list[_Statement]) -> set[int]:
    """The ids of the statements not counted: imports, and mplab's bookkeeping (the module
    docstring says which)."""
    left_out = {id(s) for s in statements
                if BOOKKEEPING in s.tags or isinstance(s.node, ast.Import | ast.ImportFrom)}
    feeds = {id(s): _bound(s.node) for s in statements
             if not s.tags and not s.header and _record_only_value(s.node)}
    record = set().union(*feeds.values())  # names only bookkeeping reads, until one is not
    changed = True
    while changed:
        changed = False
        for s in statements:
            if id(s) in left_out or (id(s) in feeds and feeds[id(s)] <= record):
                continue
            read = _read(s) & record
            if read:
                record -= read
                changed = True
    left_out |= {key for key, names in feeds.items() if names <= record}
    for s in reversed(statements):  # inner statements before the compound ones holding them
        if s.header and s.inner and not set(STEPS) & s.tags and all(
                id(i) in left_out for i in s.inner):
            left_out.add(id(s))
    return left_out


def _bound(node: ast.stmt) -> set[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}


def _record_only_value(node: ast.stmt) -> bool:
    """An assignment to plain names of a value that does nothing but read: constants, names,
    arithmetic, `.detach()` (the only call allowed)."""
    if not isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign) or node.value is None:
        return False
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    if not all(isinstance(n, ast.Name | ast.Tuple | ast.Store) for t in targets
               for n in ast.walk(t)):
        return False
    return all(isinstance(n.func, ast.Attribute) and n.func.attr == "detach" and not n.args
               for n in ast.walk(node.value) if isinstance(n, ast.Call))


def _read(statement: _Statement) -> set[str]:
    """The names a statement reads (a compound one: in its header only)."""
    node = statement.node
    inside = {id(n) for block in _blocks(node) for s in block for n in ast.walk(s)}
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and id(n) not in inside
             and isinstance(n.ctx, ast.Load)}
    if isinstance(node, ast.AugAssign):
        names |= _bound(node)  # `x += y` reads x
    return names


def profile(path: str) -> PathProfile:
    """Measure one path (see the module docstring)."""
    settings = sum(_settings(target) for target in CONFIGURED[_checked(path)])
    return PathProfile(path, len(method_lines(path)), steps_written(path), settings)


def profiles(paths=None) -> Table:
    """Every path measured, one row each: the chart's data, as a table."""
    return Table([profile(p).row() for p in (paths or _available())],
                 title="the ways to train, measured from the code that runs")


def versus(old: str, new: str) -> str:
    """The two paths' rows in words, from their counts: how many lines of code `new` takes to
    `old`'s (fewer, more or as many), how many steps each writes and which ones `new` hands
    to the library, and how many settings each exposes."""
    a, b = profile(old), profile(new)
    gap = b.lines_of_code - a.lines_of_code
    lines = ("as many" if gap == 0 else f"{abs(gap)} {'fewer' if gap < 0 else 'more'}")
    moved = [s for s in a.steps_written if s not in b.steps_written]
    added = [s for s in b.steps_written if s not in a.steps_written]
    steps = (f"it writes {len(b.steps_written)} of the {len(STEPS)} steps to {old}'s "
             f"{len(a.steps_written)}")
    if moved:
        steps += f", handing {_listing(moved)} to the library"
    if added:
        steps += f", taking {_listing(added)} back from the library"
    return (f"{new}: {b.lines_of_code} lines of code to {old}'s {a.lines_of_code} ({lines}); "
            f"{steps}; it exposes {b.settings_exposed} settings to {old}'s "
            f"{a.settings_exposed}.")


def _listing(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


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
