"""A learner's copy of mplab without the answer key, and the key kept apart.

    python -m mplab.exercises release OUT [--key KEYDIR]

OUT gets a copy of the course (``pip install -e OUT``, or ``PYTHONPATH=OUT``): the lesson
notebooks, the data they train on, and mplab, whose lesson modules
carry no reference answers and no hidden checks: each ``Exercise``'s `key` is "" and its
`hidden` is gone, and so are the private functions and constants only they used. The modules
are rewritten from their syntax trees; nothing of them runs. In that copy ``ex.check`` runs the
public checks, ``ex.solution`` says the key is not shipped, and a function answer's hidden
inputs (``Exercise.trials``) are still there, since the kernel must run them for the grader.

KEYDIR gets the lesson modules as they are: the instructor's key, for
``python -m mplab.grade --key KEYDIR``, which takes the reference answers and the hidden checks
from there and grades with them in its own process.

What a release cannot hide: a value exercise's public check must know its answer to say
"passed", so that answer is in the learner's copy, as it is in any grader that gives feedback.
"""

from __future__ import annotations

import argparse
import ast
import shutil
import sys
from pathlib import Path

import mplab

__all__ = ["strip_key", "release", "main"]

_HEADER = ("# Written by `python -m mplab.exercises release`: this learner's copy of the\n"
           "# lesson's exercises has no reference answers and no hidden checks (the instructor\n"
           "# keeps them).\n")


def _defined(node: ast.stmt) -> set[str]:
    """The names a top-level statement defines, if it is a private definition that may go."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        names = {node.name}
    elif isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
        names = {t.id for t in node.targets}
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        names = {node.target.id}
    else:
        return set()
    return names if all(n.startswith("_") and not n.startswith("__") for n in names) else set()


def _used(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def strip_key(source: str) -> str:
    """A lesson module's source without its key: every ``Exercise(...)``'s `key` made "" and
    its `hidden` removed, then each private top-level definition nothing else uses, until none
    is left."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Exercise":
            node.keywords = [k for k in node.keywords if k.arg != "hidden"]
            for k in node.keywords:
                if k.arg == "key":
                    k.value = ast.Constant("")
    while True:
        body = tree.body
        used_elsewhere = [set().union(*(_used(other) for j, other in enumerate(body) if j != i))
                          for i in range(len(body))]
        keep = [node for node, others in zip(body, used_elsewhere)
                if not _defined(node) or _defined(node) & others]
        if len(keep) == len(body):
            break
        tree.body = keep
    return _HEADER + ast.unparse(tree) + "\n"


def _lesson_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("lesson[0-9]*.py"))


def release(out, key=None, notebooks: bool = True) -> list[Path]:
    """Write the learner's copy of mplab into `out` (a new or empty folder) and, with `key`,
    the lesson modules as they are into that folder; the lesson modules written to `out`.
    Without `notebooks`, only mplab and its data (what a grading sandbox mounts)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty: give a new folder for the release")
    package = Path(mplab.__file__).resolve().parent
    shutil.copytree(package, out / "mplab", ignore=shutil.ignore_patterns("__pycache__"))
    lessons = _lesson_files(package / "exercises")
    written = []
    for path in lessons:
        target = out / "mplab" / "exercises" / path.name
        target.write_text(strip_key(path.read_text(encoding="utf-8")), encoding="utf-8")
        written.append(target)
    root = package.parent
    for folder in ("notebooks", "data")[0 if notebooks else 1:]:  # lessons, what they train on
        if (root / folder).is_dir():
            shutil.copytree(root / folder, out / folder,
                            ignore=shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints"))
    if (root / "pyproject.toml").is_file():  # so that `pip install -e OUT` works
        shutil.copyfile(root / "pyproject.toml", out / "pyproject.toml")
    (out / "README.md").write_text(
        "# mplab, a learner's copy\n\nThe lessons (`notebooks/`) and their library without the "
        "exercises' reference answers and hidden checks. Install it with `pip install -e .` "
        "and open the notebooks in JupyterLab.\n", encoding="utf-8")
    if key is not None:
        key = Path(key)
        key.mkdir(parents=True, exist_ok=True)
        for path in lessons:
            shutil.copyfile(path, key / path.name)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mplab.exercises release",
        description="Write a learner's copy of mplab without the answer key (and the key apart).")
    parser.add_argument("out", help="a new folder for the learner's copy")
    parser.add_argument("--key", metavar="KEYDIR",
                        help="also write the lesson modules, key included, here")
    args = parser.parse_args(argv)
    try:
        written = release(args.out, args.key)
    except FileExistsError as e:
        print(f"mplab.exercises release: error: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: mplab without the key ({len(written)} lesson modules stripped)"
          + (f"; the key in {args.key}" if args.key else ""))
    return 0
