"""Grading: one lesson notebook in a fresh kernel (:mod:`mplab.grade.notebook`), a folder of
them into a gradebook, each in a sandbox of its own (:mod:`mplab.grade.classroom`,
:mod:`mplab.grade.sandbox`), and what a grader flags (:mod:`mplab.grade.tamper`).

    python -m mplab.grade NOTEBOOK [--json FILE] [--timeout S] [--cell-timeout S] [--with-solutions]
    python -m mplab.grade SUBMISSIONS/ --csv grades.csv [--jobs N] [--json reports/] [--no-sandbox]
"""

from __future__ import annotations

import importlib
from pathlib import Path

from mplab._optional import require

__all__ = ["grade_notebook", "GradingError", "exercise_id", "report_table", "main"]


def __getattr__(name: str):
    # imported when first used: a sandbox's runner (python -m mplab.grade.sandbox) starts
    # without the grader's modules
    if name in ("grade_notebook", "GradingError", "exercise_id", "report_table"):
        _needs()
        return getattr(importlib.import_module("mplab.grade.notebook"), name)
    raise AttributeError(f"module 'mplab.grade' has no attribute {name!r}")


def main(argv=None) -> int:
    """``python -m mplab.grade``: a notebook, or with a folder the whole class."""
    _needs()
    from mplab.grade import classroom, notebook

    args = notebook.parser().parse_args(argv)
    return (classroom if Path(args.notebook).is_dir() else notebook).run(args)


def _needs() -> None:
    """The grader runs notebooks through nbformat and nbclient: say so where they are missing."""
    for package in ("nbformat", "nbclient"):
        require(package, "mplab.grade (grading notebooks)")
