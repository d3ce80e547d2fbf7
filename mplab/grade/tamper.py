"""What a grader flags in a learner's notebook: code that reaches for the grading itself.

    flags = tamper_flags(nb, watched_env=("MPLAB_GRADE_LOG", "MPLAB_GRADING"))
    # [{"cell": 12, "what": "grade log", "line": 3, "code": "open(os.environ[...], 'a')"}]

Read off each code cell's syntax (ast), nothing run. Four kinds, as an instructor who grades for
credit would want them shown:

- "grade log": the grader's environment or its log (the watched variables, ``os.environ``,
  ``os.getenv``);
- "patches": replacing or patching objects of mplab's exercises or grader (``setattr``,
  ``object.__setattr__``, ``__dict__``, an assignment to an attribute of ``ex``, ``sys.modules``,
  ``importlib.reload``);
- "answer key": reading it (``ex.solution(...)``, ``.solution_code``, ``.key``,
  ``inspect.getsource`` of an exercise object);
- "solution module": importing a lesson's internals or the grader (``from
  mplab.exercises.lesson1 import ...``, ``mplab.grade``);
- "outside files": opening or listing a path outside the submission's own folder (absolute,
  ``~`` or ``..``): another submission's, or the key's;
- "shell": a command for the shell (``!cmd``, ``%%bash``, ``%sx``, ``get_ipython().system``,
  ``os.system``).

Flagged, not failed: a flag is evidence for the instructor, who decides. What syntax cannot see
(code built from strings and run with exec, say) it cannot flag: ``exec`` and ``eval`` are
flagged as "patches" for that reason. A cell's shell escapes and magics are read for "shell",
then the rest as Python.
"""

from __future__ import annotations

import ast

__all__ = ["tamper_flags", "KINDS"]

KINDS = ("grade log", "patches", "answer key", "solution module", "outside files", "shell")
_FILE_CALLS = {"open", "Path", "listdir", "scandir", "glob", "iglob", "walk", "copy",
               "copyfile", "copytree", "read_text", "read_bytes", "rmtree", "remove"}
_KEY_ATTRS = {"solution", "solution_code", "key", "_check", "hidden"}
_PATCH_CALLS = {"setattr", "delattr", "exec", "eval", "__import__"}
_SHELL_MAGICS = {"bash", "sh", "script", "system", "sx", "perl", "ruby", "zsh"}
_SHELL_CALLS = {"system", "getoutput", "run_cell_magic", "run_line_magic"}


def _shell_lines(cell_source: str) -> list[int]:
    """The lines (from 1) that run a shell command: ``!cmd``, ``%%bash``, ``%sx cmd``."""
    found = []
    for number, line in enumerate(cell_source.splitlines(), 1):
        text = line.lstrip()
        magic = text.lstrip("%").split(maxsplit=1)[0] if text.startswith("%") else ""
        if text.startswith("!") or magic in _SHELL_MAGICS:
            found.append(number)
    return found


def _source(cell_source: str) -> str:
    # IPython's %magics and !shell lines are not Python; keep the line count for line numbers
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                     for line in cell_source.splitlines())


def _dotted(node) -> str:
    """"ex.EXERCISES.key" for ex.EXERCISES['1.1'].key: the names, through subscripts."""
    parts = []
    while isinstance(node, ast.Attribute | ast.Subscript):
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _exercise_names(tree: ast.AST) -> set[str]:
    """Names bound to mplab's exercise modules in this cell (``ex`` in the lessons)."""
    names = {"ex"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mplab.exercises"):
            names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names
                      if a.name.startswith("mplab.exercises")}
    return names


def _cell_flags(tree: ast.AST, watched: set[str], ours: set[str]) -> list[tuple[str, ast.AST]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and any(
                w in node.value for w in watched):
            found.append(("grade log", node))
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            root = dotted.split(".")[0]
            if dotted in ("os.environ", "os.getenv", "os.putenv", "os.unsetenv"):
                found.append(("grade log", node))
            elif node.attr in ("GRADE_LOG_ENV", "GRADING_ENV"):
                found.append(("grade log", node))
            elif node.attr == "__dict__" or dotted in ("sys.modules", "importlib.reload",
                                                       "object.__setattr__"):
                found.append(("patches", node))
            elif node.attr in _KEY_ATTRS and root in ours | {"EXERCISES", "LESSON"}:
                found.append(("answer key", node))
            elif isinstance(node.ctx, ast.Store | ast.Del) and root in ours:
                found.append(("patches", node))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                node.func.attr in _SHELL_CALLS and "get_ipython" in ast.unparse(node.func.value)
                or _dotted(node.func) in ("os.system", "os.popen")):  # get_ipython().system
            found.append(("shell", node))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and (
                node.func.id in _PATCH_CALLS):
            found.append(("patches", node))
        elif isinstance(node, ast.Call) and _dotted(node.func).split(".")[-1] in _FILE_CALLS \
                and any(isinstance(a, ast.Constant) and isinstance(a.value, str)
                        and (a.value.startswith(("/", "~")) or ".." in a.value)
                        for a in node.args):  # outside the submission's own folder
            found.append(("outside files", node))
        elif isinstance(node, ast.Call) and _dotted(node.func).split(".")[-1] in (
                "getsource", "getsourcelines", "getsourcefile") and node.args and (
                _dotted(node.args[0]).split(".")[0] in ours):  # the source of a check
            found.append(("answer key", node))
        elif isinstance(node, ast.Name) and node.id in ("GRADE_LOG_ENV", "GRADING_ENV"):
            found.append(("grade log", node))
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module == "mplab.grade" or (module == "mplab" and any(
                    a.name == "grade" for a in node.names)):
                found.append(("solution module", node))
            elif module.startswith("mplab.exercises."):  # a lesson, the framework, answers
                found.append(("solution module", node))
            elif module == "mplab.exercises" and any(
                    not a.name.startswith("lesson") for a in node.names):
                found.append(("solution module", node))
        elif isinstance(node, ast.Import) and any(
                a.name == "mplab.grade" or a.name.startswith("mplab.grade.")
                or (a.name.startswith("mplab.exercises.lesson") and not a.asname)
                or a.name.startswith(("mplab.exercises.framework", "mplab.exercises.answers"))
                for a in node.names):
            found.append(("solution module", node))
    return found


def tamper_flags(nb, watched_env=(), exercise_of=None) -> list[dict]:
    """Every place in `nb`'s code cells (an nbformat notebook) that reaches for the grading:
    ``{"cell": position from 1, "exercise": the cell's exercise or None, "what": one of KINDS,
    "line": line in the cell, "code": that line}``, in notebook order, one per kind and line.
    `watched_env`: the grader's environment variables (their names in any string are flagged);
    `exercise_of(cell)`: the exercise id a cell answers, for the report."""
    watched = {w for w in watched_env if w}
    flags = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        source = _source(cell.source)
        lines = cell.source.splitlines()
        found = [("shell", line) for line in _shell_lines(cell.source)]
        first = lines[0].lstrip() if lines else ""
        if not (first.startswith("%%") and _shell_lines(first)):  # a shell cell is no Python
            try:
                tree = ast.parse(source)
                found += [(what, getattr(node, "lineno", 1))
                          for what, node in _cell_flags(tree, watched, _exercise_names(tree))]
            except SyntaxError:
                pass  # it cannot run either: the grader reports the cell's error
        seen = set()
        for what, line in found:
            if (what, line) in seen:
                continue
            seen.add((what, line))
            flags.append({"cell": index + 1,
                          "exercise": exercise_of(cell) if exercise_of else None,
                          "what": what, "line": line,
                          "code": lines[line - 1].strip() if line <= len(lines) else ""})
    flags.sort(key=lambda f: (f["cell"], f["line"], KINDS.index(f["what"])))
    return flags
