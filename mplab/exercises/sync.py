"""Rewrite lesson notebooks' exercise sections from mplab.exercises, their one source.

    python -m mplab.exercises.sync notebooks/*.ipynb          # rewrite what differs, say what
    python -m mplab.exercises.sync --check notebooks/*.ipynb  # change nothing; 1 if any differ

Each exercise cell (a code cell with metadata ``{"mplab": {"exercise": "N.M"}}``) becomes the
exercise's starter, without outputs, and the markdown cell right before it becomes
``Lesson.task_markdown("N.M")``: the heading and the whole task. When the cell before is not
that exercise's task (no "### Exercise N.M" heading), it is left alone and a task cell is
inserted. Nothing else changes, and a notebook is written as nbformat writes it (indent 1), so
its diff shows only the exercise sections. Exit status 1 when a lesson's exercise has no cell in
the notebook (or, with --check, when anything differs); 2 when a notebook cannot be read or a
cell is tagged with an exercise the library does not have.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path

from mplab._optional import require
from mplab.exercises import CELL_METADATA_KEY, Lesson

__all__ = ["lesson", "exercise_id", "sync", "missing", "main"]

nbformat = require("nbformat", "mplab.exercises.sync (writing the lessons' exercise cells)")


def lesson(number) -> Lesson:
    """Lesson `number`'s exercises: ``mplab.exercises.lesson<number>.LESSON``."""
    name = f"mplab.exercises.lesson{number}"
    try:
        return importlib.import_module(name).LESSON
    except ModuleNotFoundError as e:
        if e.name != name:
            raise  # the lesson exists but something it imports does not
        raise ValueError(f"there is no lesson {number} ({name} does not exist)") from None


def exercise_id(cell) -> str | None:
    """The exercise a code cell is tagged with, or None."""
    meta = cell.get("metadata", {}).get(CELL_METADATA_KEY)
    if cell.get("cell_type") != "code" or not isinstance(meta, dict):
        return None
    return str(meta["exercise"]) if meta.get("exercise") else None


def _lesson_of(id: str) -> Lesson:
    return lesson(id.split(".")[0])


def sync(nb) -> list[str]:
    """Make the notebook's exercise sections what the library says, in place; returns what
    differed ("3.3 task", "3.3 task (inserted)", "3.3 starter"), empty when nothing did.
    Raises ValueError for a cell tagged with an exercise the library does not have."""
    changes = []
    i = 0
    while i < len(nb.cells):
        cell, id = nb.cells[i], exercise_id(nb.cells[i])
        if id is None:
            i += 1
            continue
        source = _lesson_of(id)
        task, starter = source.task_markdown(id), source.get(id).starter
        before = nb.cells[i - 1] if i else None
        heading = re.compile(rf"#+\s*Exercise\s+{re.escape(id)}\b")
        if before is not None and before.cell_type == "markdown" and heading.match(before.source):
            if before.source != task:
                before.source = task
                changes.append(f"{id} task")
        else:
            nb.cells.insert(i, nbformat.v4.new_markdown_cell(task))
            changes.append(f"{id} task (inserted)")
            i += 1
        if cell.source != starter or cell.get("outputs") or cell.get("execution_count"):
            cell.source, cell.outputs, cell.execution_count = starter, [], None
            changes.append(f"{id} starter")
        i += 1
    return changes


def missing(nb) -> list[str]:
    """Exercises of the lessons this notebook's cells belong to that have no cell in it."""
    ids = [id for id in map(exercise_id, nb.cells) if id]
    numbers = dict.fromkeys(id.split(".")[0] for id in ids)
    return [id for n in numbers for id in lesson(n).exercises if id not in ids]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mplab.exercises.sync",
        description="Rewrite each exercise's task cell and starter cell in lesson notebooks "
                    "from mplab.exercises.")
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a notebook differs from the library")
    args = parser.parse_args(argv)
    status = 0
    for path in args.notebooks:
        try:
            nb = nbformat.read(path, as_version=4)
            changes, gaps = sync(nb), missing(nb)
        except (OSError, ValueError) as e:
            print(f"{path}: {e}", file=sys.stderr)
            return 2
        if changes:
            print(f"{path}: {'differs' if args.check else 'rewrote'}: {', '.join(changes)}")
            if args.check:
                status = 1
            else:
                nbformat.write(nb, path)
        for id in gaps:
            print(f"{path}: exercise {id} has no cell here; add a code cell with metadata "
                  f'{{"{CELL_METADATA_KEY}": {{"exercise": "{id}"}}}} where it belongs, and '
                  "run this again", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
