"""Grade a lesson notebook: run it in a fresh kernel with a time limit, score each exercise.

    python -m mplab.grade NOTEBOOK [--json FILE] [--timeout S] [--cell-timeout S] [--with-solutions]

The notebook runs cell by cell in a fresh "python3" kernel, from its own folder, with
MPLAB_GRADING=1 (hidden checks on) and MPLAB_GRADE_LOG=<file> (each ex.check / hint / solution
appends a JSON line). The grader reads the new lines after every cell, so each result belongs to
the cell that produced it, and the last word on an exercise counts. A line is evidence, never
the score: the grader checks the answer it carries again, in its own process (a value, or the
record of a function's calls, replayed: :mod:`mplab.exercises.answers`), hidden checks on.

A learner's mistake costs that exercise's points, never the report:

- a cell that raises marks its exercise "error", and the run goes on in the same kernel;
- a cell that runs past --cell-timeout (even one that swallows KeyboardInterrupt) or kills the
  kernel (``os._exit``) marks its exercise "error"; the grader starts a new kernel, replays the
  cells that succeeded before (discarding their log lines), and goes on with the next cell;
- --timeout bounds the whole run, kernel starts and replays included: cells it leaves unrun
  mark their exercises "error".

Exercise cells are found by their metadata ``{"mplab": {"exercise": "1.1"}}`` (else by an
``ex.check("1.1", ...)`` call in the source); the lesson by its ``from mplab.exercises import
lessonN`` line. ``--key DIR`` takes the lesson modules, reference answers and hidden checks
included, from the instructor's key folder (:mod:`mplab.exercises.release`) rather than from the
installed mplab, which a learner's copy leaves without them. ``--with-solutions`` swaps every
exercise cell for the exercise's ``solution_code``, so an instructor can confirm the key earns
full marks.

The report also flags, per cell, code that reaches for the grading itself (the grade log or
the grader's environment, patching mplab's exercises, reading the answer key, importing a
lesson's internals: :mod:`mplab.grade.tamper`). Flagged, not failed: the instructor decides.

Exit status 0 whenever grading completed, whatever the score; 2 for misuse (no such file, not a
notebook, no lesson to grade).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import pkgutil
import re
import secrets
import sys
import tempfile
import threading
import time
from pathlib import Path

if sys.argv[:1] == ["-m"]:  # started as `python -m mplab.grade` (runpy imports us first)
    # nbformat validates with jsonschema, which builds an IRI grammar at import when the
    # optional rfc3987-syntax is installed (most of the command's start, benchmarks/RECORDS.md;
    # jupyter-events pulls it in).
    # A notebook holds no IRIs to check: the grading command goes without it.
    sys.modules.setdefault("rfc3987_syntax", None)

import nbformat

import mplab
import mplab.exercises as exercises
from mplab._display import Table
from mplab.exercises import CELL_METADATA_KEY, GRADE_LOG_ENV, GRADING_ENV, SEED_ENV
from mplab.grade.kernel import Outcome, Run, clean
from mplab.grade.tamper import tamper_flags

__all__ = ["grade_notebook", "GradingError", "exercise_id", "parser", "run",
           "report_table"]

_LESSON_IMPORT = re.compile(r"from\s+mplab\.exercises\s+import\s+(lesson\d+)\b"
                            r"|(?:from|import)\s+mplab\.exercises\.(lesson\d+)\b")
_CHECK_CALL = re.compile(r"""\bcheck\(\s*["'](\d+\.\d+)["']""")


class GradingError(Exception):
    """The grader was misused: no such notebook, not a notebook, or no lesson to grade."""


def exercise_id(cell) -> str | None:
    """The exercise a code cell answers: its mplab metadata, else its first check("N.M", ...)."""
    meta = cell.get("metadata", {}).get(CELL_METADATA_KEY)
    if isinstance(meta, dict) and meta.get("exercise"):
        return str(meta["exercise"])
    match = _CHECK_CALL.search(cell.get("source", ""))
    return match.group(1) if match else None


def _read(path: Path):
    if not path.is_file():
        raise GradingError(f"no such notebook: {path}")
    try:
        return nbformat.read(path, as_version=4)
    except Exception as e:  # nbformat raises JSON, validation and reader errors alike
        raise GradingError(f"{path} is not a Jupyter notebook ({type(e).__name__}: {e})") from None


_KEYS: dict[Path, object] = {}
_KEYS_LOCK = threading.Lock()


def _key_module(folder, name: str):
    """The lesson module `name` as the instructor's key folder holds it (reference answers and
    hidden checks included), loaded once, apart from the installed mplab's own."""
    path = (Path(folder) / f"{name}.py").resolve()
    with _KEYS_LOCK:
        if path not in _KEYS:
            if not path.is_file():
                raise GradingError(f"the key folder {folder} has no {name}.py")
            spec = importlib.util.spec_from_file_location(f"mplab_key_{len(_KEYS)}_{name}", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # a dataclass looks its module up there
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[spec.name]
                raise
            _KEYS[path] = module
        return _KEYS[path]


def _lesson_module(nb, path: Path, key=None):
    """The notebook's lesson: its name ("lesson1") and its module, from `key` if given."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    names = [m.group(1) or m.group(2) for c in code for m in _LESSON_IMPORT.finditer(c.source)]
    ids = [i for i in map(exercise_id, code) if i]
    name = names[0] if names else f"lesson{ids[0].split('.')[0]}" if ids else None
    accepted = sorted(m.name for m in pkgutil.iter_modules(exercises.__path__)
                      if m.name.startswith("lesson"))
    if name is None:
        raise GradingError(f"{path} has no exercises to grade: expected a line like "
                           f"`from mplab.exercises import lesson1 as ex`")
    if name not in accepted:
        raise GradingError(f"{path} uses mplab.exercises.{name}, which does not exist; "
                           f"accepted: {', '.join(accepted)}")
    if key is not None:
        return name, _key_module(key, name)
    return name, importlib.import_module(f"mplab.exercises.{name}")


def grade_notebook(path, timeout: float = 600, cell_timeout: float = 120,
                   with_solutions: bool = False, executed=None, env=None,
                   kernel_setup: str = "", key=None, sandbox=None) -> dict:
    """Run a notebook in a fresh kernel and score its exercises.

    Returns ``{"notebook", "lesson", "total", "max", "exercises": [{"id", "status", "points",
    "max_points", "message", "solution_viewed", "attempts"}], "problems": [{"cell",
    "exercise", "problem"}], "flags": [{"cell", "exercise", "what", "line", "code"}],
    "with_solutions", "key", "sandbox", "elapsed_s"}``; status is one of "passed",
    "failed", "not attempted", "error" (the last word on the exercise: its last check, regraded
    here, or its cell's failure after it; "attempts" lists the statuses the grade log claimed
    for the checks before, then the grader's); a problem's "cell" is its position in the
    notebook, counting from 1. Text from the learner's kernel comes without control characters.
    `executed`: a path to also write the notebook as it ran, outputs included (what the
    learner's cells printed, for an instructor to read). `env`: variables the kernel gets on
    top of the grader's (a class's own HOME and TMPDIR); `kernel_setup`: Python the kernel runs
    in its own process before any cell (a class's limits: :mod:`mplab.grade.classroom`).
    `key`: the instructor's key folder (:mod:`mplab.exercises.release`), whose lesson modules
    decide the scores, hidden checks included; without it the installed mplab's own do, and
    report["key"] says whether they hold a key at all. `sandbox`: run the cells there instead
    (:class:`mplab.grade.sandbox.Sandbox`; `env` and `executed` do not apply).
    Raises :class:`GradingError` for a missing file, a non-notebook, or no lesson.
    """
    if timeout <= 0 or cell_timeout <= 0:
        raise GradingError(f"timeouts must be positive, got timeout={timeout}, "
                           f"cell_timeout={cell_timeout}")
    started = time.monotonic()
    path = Path(path)
    nb = _read(path)
    name, lesson = _lesson_module(nb, path, key)
    cell_exercise = {i: exercise_id(c) for i, c in enumerate(nb.cells) if c.cell_type == "code"}
    flags = tamper_flags(nb, (GRADE_LOG_ENV, GRADING_ENV), exercise_id)  # as submitted
    if with_solutions:
        for i, xid in cell_exercise.items():
            if xid in lesson.EXERCISES:
                nb.cells[i].source = lesson.EXERCISES[xid].solution_code

    seed = secrets.randbelow(2**31)  # hidden inputs are drawn afresh for every run
    outcome = Outcome(lesson.EXERCISES, cell_exercise)
    if sandbox is not None:
        sandbox.run(path, outcome, seed=seed, deadline=started + timeout,
                    cell_timeout=cell_timeout, setup=kernel_setup)
    else:
        with tempfile.TemporaryDirectory(prefix="mplab-grade-") as tmp:
            log = Path(tmp) / "grade.jsonl"
            log.touch()
            # The kernel grades with this same mplab, whatever the notebook's folder holds.
            package_root = str(Path(mplab.__file__).resolve().parent.parent)
            python_path = os.pathsep.join(
                p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
            env = {**os.environ, **(env or {}), GRADING_ENV: "1", GRADE_LOG_ENV: str(log),
                   SEED_ENV: str(seed), "PYTHONPATH": python_path}
            Run(nb, path.resolve().parent, log, env, started + timeout, cell_timeout, outcome,
                 kernel_setup).run()
        if executed is not None:
            nbformat.write(nb, executed)

    rows = {}
    for xid, ex in lesson.EXERCISES.items():
        row = {"id": xid, "status": "not attempted", "points": 0, "max_points": ex.points,
               "message": f'Never checked: no cell ran ex.check("{xid}", ...).',
               "solution_viewed": xid in outcome.viewed, "attempts": outcome.claimed[xid]}
        last = outcome.last.get(xid)
        if last is not None and last[0] == "check":  # only the last word is regraded
            _regrade(lesson, row, last[1], flags, seed)
        elif last is not None:
            row.update(status="error", points=0, message=last[1][0].upper() + last[1][1:])
        rows[xid] = row
    problems = [{"cell": index + 1, "exercise": cell_exercise.get(index), "problem": text}
                for index, text in outcome.problems]

    exercises_out = list(rows.values())
    return clean({
        "notebook": str(path),
        "lesson": name,
        "total": sum(r["points"] for r in exercises_out),
        "max": sum(r["max_points"] for r in exercises_out),
        "exercises": exercises_out,
        "problems": problems,
        "flags": flags,
        "with_solutions": with_solutions,
        "key": (str(key) if key is not None else "installed mplab"
                if any(e.key for e in lesson.EXERCISES.values()) else "none"),
        "sandbox": sandbox.name if sandbox is not None else "none",
        "elapsed_s": round(time.monotonic() - started, 1),
    })


def _regrade(lesson, row: dict, record: dict, flags: list, seed: int) -> None:
    """Score one check from the answer its record carries (a value, or the record of a
    function's calls), checked here in the grader's process on this run's hidden inputs: the
    status the learner's kernel wrote is evidence, never the score."""
    xid = row["id"]
    function = "function" in record
    try:
        result = lesson.LESSON.regrade(xid, record["function"] if function else
                                       record.get("answer"), seed=seed, function=function)
    except ValueError as e:  # a record with no answer the grader can read: a forged line?
        row["attempts"] = row["attempts"] + ["error"]
        if function and record.get("status") == "error":
            # the kernel's check itself stopped early (out of memory, say), so its record of
            # the calls is short: its own error, which scores nothing anyway, is the report
            row.update(status="error", points=0, message=str(record.get("message", "")))
            return
        row.update(status="error", points=0,
                   message=f"The grade log's record of this check is not one mplab wrote: {e}.")
        flags.append({"cell": None, "exercise": xid, "what": "grade log", "line": None,
                      "code": f"a log record for {xid} that carries no answer: {e}"})
        return
    row["attempts"] = row["attempts"] + [result.status]
    row.update(status=result.status, points=result.points, message=result.message)
    # the kernel's verdict on a function answer leaves the hidden checks to the grader
    hidden_only = record.get("status") == "passed" and result.message.startswith(
        exercises.HIDDEN_FAILED)
    if record.get("status") != result.status and not hidden_only:
        flags.append({"cell": None, "exercise": xid, "what": "grade log", "line": None,
                      "code": f"the log says {xid} {str(record.get('status'))[:40]!r}; its "
                              f"answer, checked by the grader, is {result.status!r}"})


def report_table(report: dict) -> Table:
    """The report as a table: one row per exercise."""
    def short(text: str, width: int = 72) -> str:
        line = text.strip().splitlines()[0] if text.strip() else ""
        return line if len(line) <= width else line[:width - 1] + "…"

    return Table([{"exercise": r["id"], "status": r["status"],
                   "points": f"{r['points']:g}/{r['max_points']:g}",
                   "solution viewed": "yes" if r.get("solution_viewed") else "",
                   "feedback": short(r.get("message", ""))} for r in report["exercises"]],
                 title=f"{report['notebook']} ({report['lesson']}"
                       + (", graded with the reference solutions)" if report["with_solutions"]
                          else ")"))


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m mplab.grade`` (one notebook, or a folder of them)."""
    parser = argparse.ArgumentParser(
        prog="python -m mplab.grade",
        description="Run a lesson notebook in a fresh kernel and report each exercise's points; "
                    "given a folder, grade every notebook in it, each apart, into a CSV.")
    parser.add_argument("notebook", help="the .ipynb file to grade, or a folder of them")
    parser.add_argument("--json", metavar="FILE",
                        help="also write the report as JSON here (a folder: one per notebook)")
    parser.add_argument("--csv", metavar="FILE", help="a folder's gradebook, one row a notebook")
    parser.add_argument("--jobs", type=int, default=2, metavar="N",
                        help="a folder's notebooks graded N at a time (default 2)")
    parser.add_argument("--timeout", type=float, default=600, metavar="S",
                        help="time limit for the whole run, in seconds (default 600)")
    parser.add_argument("--cell-timeout", type=float, default=120, metavar="S",
                        help="time limit for one cell, in seconds (default 120)")
    parser.add_argument("--key", metavar="DIR",
                        help="the instructor's key folder (python -m mplab.exercises release "
                             "OUT --key DIR): reference answers and hidden checks from there")
    parser.add_argument("--no-sandbox", action="store_true",
                        help="grade a folder's notebooks without a sandbox each (only for "
                             "notebooks you trust: each kernel runs as you, with your files)")
    parser.add_argument("--with-solutions", action="store_true",
                        help="replace each exercise cell with its reference solution")
    parser.add_argument("--executed", metavar="FILE",
                        help="also write the notebook as it ran, with its outputs, here")
    return parser


def run(args) -> int:
    """Grade the one notebook `args` (parsed by :func:`parser`) names, and print its report."""
    try:
        report = grade_notebook(args.notebook, timeout=args.timeout,
                                cell_timeout=args.cell_timeout, with_solutions=args.with_solutions,
                                executed=args.executed, key=args.key)
    except GradingError as e:
        print(f"mplab.grade: error: {e}", file=sys.stderr)
        return 2
    print(report_table(report))
    graded = {r["id"] for r in report["exercises"]}
    for p in report["problems"]:  # those of exercise cells are in the table already
        if p["exercise"] not in graded:
            print(f"cell {p['cell']}: {p['problem']}")
    for f in report["flags"]:  # evidence for the instructor, who decides: nothing is failed
        where = f"cell {f['cell']}, line {f['line']}" if f["cell"] else f"exercise {f['exercise']}"
        print(f"flagged ({f['what']}): {where}: {f['code']}")
    if report["key"] == "none":
        print("this mplab holds no answer key: hidden checks did not run (give --key DIR)")
    print(f"Total: {report['total']:g}/{report['max']:g} points ({report['elapsed_s']:g} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0

