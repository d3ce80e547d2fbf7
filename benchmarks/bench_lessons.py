"""How long each lesson takes top to bottom in a fresh kernel: the budget is 60 s on 2 idle cores.

    python benchmarks/bench_lessons.py                 # every lesson, as shipped
    python benchmarks/bench_lessons.py 04_amp_pytorch  # the lessons whose names contain this

Each lesson runs through the grader (`mplab.grade`), as an instructor runs it, so the time is a
learner's "Run all" plus the kernel's start. The grader allows 120 s per cell: a lesson within
60 s on an idle machine leaves room for a loaded one. Prints one row per lesson.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mplab._display import Table
from mplab.grade import grade_notebook

BUDGET_S = 60
LESSONS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("[0-9]*.ipynb"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("only", nargs="*", help="run only lessons whose file names contain these")
    args = p.parse_args()
    chosen = [path for path in LESSONS if not args.only or any(o in path.name for o in args.only)]
    if not chosen:
        p.error(f"no lesson matches {args.only}; lessons: {', '.join(x.stem for x in LESSONS)}")
    rows = []
    for path in chosen:
        report = grade_notebook(path, timeout=600)
        rows.append({"lesson": path.stem, "seconds": report["elapsed_s"],
                     f"within {BUDGET_S} s": "yes" if report["elapsed_s"] <= BUDGET_S else "NO",
                     "problems": len(report["problems"])})
        print(f"{path.stem}: {report['elapsed_s']:g} s", flush=True)
    print()
    print(Table(rows, title="each lesson top to bottom in a fresh kernel, through the grader"))
    return 0 if all(r["problems"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
