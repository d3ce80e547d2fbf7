"""Grading: one lesson notebook in a fresh kernel (:mod:`mplab.grade.notebook`), a folder of
them into a gradebook (:mod:`mplab.grade.classroom`), and what a grader flags
(:mod:`mplab.grade.tamper`).

    python -m mplab.grade NOTEBOOK [--json FILE] [--timeout S] [--cell-timeout S] [--with-solutions]
    python -m mplab.grade SUBMISSIONS/ --csv grades.csv [--jobs N] [--json reports/]
"""

from __future__ import annotations

from pathlib import Path

from mplab.grade import classroom, notebook
from mplab.grade.notebook import GradingError, exercise_id, grade_notebook, report_table

__all__ = ["grade_notebook", "GradingError", "exercise_id", "report_table", "main"]


def main(argv=None) -> int:
    """``python -m mplab.grade``: a notebook, or with a folder the whole class."""
    args = notebook.parser().parse_args(argv)
    return (classroom if Path(args.notebook).is_dir() else notebook).run(args)
