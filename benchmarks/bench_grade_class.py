"""How long a class takes to grade: 40 lesson-1 submissions, sandboxed and not, side by side.

    python benchmarks/bench_grade_class.py                  # 40 submissions, 2 jobs, both ways
    python benchmarks/bench_grade_class.py --n 12 --jobs 2  # quicker
    python benchmarks/bench_grade_class.py --singles        # also each submission alone
    python benchmarks/bench_grade_class.py --csv grades.csv # keep the sandboxed gradebook

The submissions are generated (:func:`make_class`): blanks, keys, half answers and hostile ones
(a forged grade-log line, every check replaced with ``lambda *a: None`` through
``object.__setattr__``, an endless loop, a 10 GB allocation, 1,000 forked processes, a file
written past the file-size limit), each the whole lesson-1 notebook. The folder is graded with
``grade_class(..., jobs=N)`` twice, without a sandbox (``--no-sandbox``) and with one per
submission (issue 35: at least as fast per submission), printing each run's seconds per
submission and their ratio. With ``--singles``, each is first graded alone (a folder of one,
``jobs=1``, sandboxed), and the criterion of issue 19 is checked: the sandboxed class run takes
at most 1.2x the sum of the single runs divided by the jobs. The times are wall-clock times: on
a machine that others share they vary from run to run.

`submission` and `make_class` are the one generator of lesson-1 submissions:
tests/test_grade_class.py builds its class with them.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import nbformat

from mplab._display import Table
from mplab.exercises import lesson1
from mplab.grade import exercise_id
from mplab.grade.classroom import Limits, grade_class, write_csv

CRITERION = 1.2
LESSON_1 = Path(__file__).resolve().parent.parent / "notebooks" / "01_float_formats.ipynb"
FORK_MARK = "mplab-fork-mark"  # the forked processes' name (/proc/PID/comm: 15 characters)
IDS = list(lesson1.EXERCISES)


def submission(folder: Path, name: str, cells: dict, whole: bool = True) -> Path:
    """Lesson 1 with exercise cells replaced: cells[xid] is the new source (None: the key).
    Not `whole`: only the cell importing the exercises and the exercise cells (a quick one)."""
    nb = nbformat.read(LESSON_1, 4)
    if not whole:
        nb.cells = [c for c in nb.cells if c.cell_type == "code" and (
            exercise_id(c) or "mplab.exercises import" in c.source)]
    for cell in nb.cells:
        xid = exercise_id(cell) if cell.cell_type == "code" else None
        if xid in cells:
            cell.source = cells[xid] or lesson1.EXERCISES[xid].solution_code
    path = folder / f"{name}.ipynb"
    nbformat.write(nb, path)
    return path


def forger() -> dict:
    """Every exercise "passed" by a line written straight into the grade log."""
    return {x: ("import json, os\nwith open(os.environ['MPLAB_GRADE_LOG'], 'a') as f:\n"
                f"    f.write(json.dumps({{'event': 'check', 'id': '{x}', 'status': 'passed', "
                "'points': 1}) + '\\n')") for x in IDS}


def patcher() -> dict:
    """Every exercise's check and hidden check replaced by one that accepts anything."""
    return {x: ("for e in ex.LESSON.exercises.values():\n"
                "    object.__setattr__(e, 'check', lambda *a: None)\n"
                "    object.__setattr__(e, 'hidden', lambda *a: None)\n"
                f"ex.check('{x}', 12345)") for x in IDS}


_BOMB = """\
import os, sys, time
forked = 0
try:
    for i in range(int(sys.argv[1])):
        if os.fork() == 0:
            try:
                if i % 3 == 1:
                    os.setpgid(0, 0)
                elif i % 3 == 2:
                    os.setsid()
                with open('/proc/self/comm', 'w') as f:
                    f.write(sys.argv[2])
                time.sleep(600)
            finally:
                os._exit(0)
        forked += 1
finally:
    if sys.argv[3:]:
        with open(sys.argv[3], 'w') as f:
            f.write(str(forked))
"""


def forker(n: int = 1000, record: Path | None = None, mark: str = FORK_MARK) -> dict:
    """Exercise 1.1 starts a Python that forks `n` processes and exits: each sleeps 600 s,
    named `mark` (15 characters at most); a third leave the kernel's process group, a third
    its session. The kernel goes on; the other exercises are the key's. `record`: a file the
    forking Python writes how many it forked to.

    The forking runs in a bare Python (``-S``), not in the kernel: forking the kernel, which
    holds lesson 1's torch and plots, takes some 40 ms a process, 1,000 of them longer than a
    cell may run; a bare Python forks 1,000 in about a second. What the grader must end is the
    same: processes in the kernel's session and group (or out of them), no longer its
    children, with its environment."""
    argv = ["-S", "-c", _BOMB, str(n), mark[:15]] + ([str(record)] if record else [])
    return {IDS[0]: f"import subprocess, sys\nsubprocess.run([sys.executable, *{argv!r}])",
            **dict.fromkeys(IDS[1:])}


def filler(mb: int = 256) -> dict:
    """Exercise 1.1 writes a file of `mb` MiB (past the class's file-size limit), 1 MiB at a
    time; the other exercises are the key's."""
    return {IDS[0]: ("chunk = bytes(2**20)\nwith open('filler.bin', 'wb') as f:\n"
                     f"    for _ in range({mb}):\n        f.write(chunk)"),
            **dict.fromkeys(IDS[1:])}


KINDS = {  # what make_class cycles through
    "key": lambda: dict.fromkeys(IDS),
    "blank": dict,
    "half-first": lambda: dict.fromkeys(IDS[:len(IDS) // 2]),
    "half-last": lambda: dict.fromkeys(IDS[len(IDS) // 2:]),
    "forger": forger,
    "patcher": patcher,
    "hang": lambda: {IDS[1]: "while True:\n    pass"},
    "hog": lambda: {IDS[0]: "x = bytearray(10 * 2**30)"},
    "forker": forker,
    "filler": filler,
}


def make_class(folder: Path, n: int = 40) -> dict[str, str]:
    """`n` lesson-1 submissions in `folder`, cycling through KINDS: {notebook name: kind}."""
    kinds = list(KINDS)
    made = {}
    for i in range(n):
        kind = kinds[i % len(kinds)]
        made[submission(folder, f"{i:02d}-{kind}", KINDS[kind]()).name] = kind
    return made


def left_behind(mark: str = FORK_MARK) -> int:
    """How many live processes named `mark` (see :func:`forker`) there are."""
    count = 0
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            comm = Path(f"/proc/{name}/comm").read_text().strip()
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        count += comm == mark[:15] and stat[stat.rindex(")") + 2] not in "ZX"
    return count


def _class_run(folder: Path, args, limits: Limits, sandbox: bool) -> tuple[list, float]:
    started = time.monotonic()
    reports = grade_class(folder, jobs=args.jobs, limits=limits, cell_timeout=args.cell_timeout,
                          progress=False, sandbox=sandbox)
    return reports, time.monotonic() - started


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=40, help="submissions (default 40)")
    p.add_argument("--jobs", type=int, default=2, help="the class runs' jobs (default 2)")
    p.add_argument("--cell-timeout", type=float, default=10,
                   help="seconds a cell may run, the hang's included (default 10)")
    p.add_argument("--singles", action="store_true",
                   help="also grade each submission alone (issue 19's criterion)")
    p.add_argument("--csv", metavar="FILE", help="keep the sandboxed class's gradebook here")
    args = p.parse_args()
    limits = Limits(memory_gb=6, file_mb=64)
    print(f"{args.n} lesson-1 submissions, {os.cpu_count()} CPUs, limits {limits}, cell "
          f"timeout {args.cell_timeout:g} s", flush=True)
    with tempfile.TemporaryDirectory(prefix="mplab-bench-class-") as tmp:
        folder = Path(tmp) / "class"
        folder.mkdir()
        kinds = make_class(folder, args.n)
        single = {}
        for name in kinds if args.singles else ():
            alone = Path(tmp) / "alone"
            alone.mkdir()
            shutil.copyfile(folder / name, alone / name)
            started = time.monotonic()
            grade_class(alone, jobs=1, limits=limits, cell_timeout=args.cell_timeout,
                        progress=False)
            single[name] = time.monotonic() - started
            shutil.rmtree(alone)
            print(f"{name}: {single[name]:.1f} s alone", flush=True)

        plain, plain_took = _class_run(folder, args, limits, sandbox=False)
        print(f"class run without a sandbox: {plain_took:.1f} s", flush=True)
        reports, took = _class_run(folder, args, limits, sandbox=True)
        print(f"class run, each in a sandbox: {took:.1f} s", flush=True)
        out = Path(args.csv) if args.csv else Path(tmp) / "grades.csv"
        write_csv(reports, out)
        rows = list(csv.DictReader(out.open(encoding="utf-8")))

    print()
    by = {Path(r["notebook"]).name: r for r in reports}
    by_plain = {Path(r["notebook"]).name: r for r in plain}
    print(Table([{"submission": name, "kind": kind,
                  **({"s alone": round(single[name], 1)} if single else {}),
                  "s unsandboxed": by_plain[name]["elapsed_s"],
                  "s sandboxed": by[name]["elapsed_s"],
                  "points unsandboxed": f"{by_plain[name]['total']:g}",
                  "points sandboxed": f"{by[name]['total']:g}/{by[name]['max']:g}"}
                 for name, kind in kinds.items()], title="each submission's seconds"))
    n = len(reports)
    print(f"class run, jobs={args.jobs}, without a sandbox: {plain_took:.1f} s, "
          f"{plain_took / n:.2f} s per submission")
    print(f"class run, jobs={args.jobs}, each in a sandbox: {took:.1f} s, {took / n:.2f} s per "
          f"submission; sandboxed / unsandboxed: {took / plain_took:.2f} (issue 35: at most 1)")
    if single:
        share = sum(single.values()) / args.jobs
        ratio = took / share
        print(f"time per submission alone: mean {sum(single.values()) / len(single):.1f} s, "
              f"min {min(single.values()):.1f} s, max {max(single.values()):.1f} s")
        print(f"sum of single runs / jobs: {sum(single.values()):.1f} s / {args.jobs} = "
              f"{share:.1f} s; ratio: {ratio:.2f} (criterion: at most {CRITERION:g}): "
              + ("met" if ratio <= CRITERION else "NOT met"))
    differ = [name for name in kinds if by[name]["total"] != by_plain[name]["total"]]
    print(f"gradebook: {len(rows)} rows" + (f" in {args.csv}" if args.csv else "")
          + f"; points that differ between the two runs: {', '.join(differ) or 'none'}")
    print(f"forked processes left behind: {left_behind()}")
    return 0 if len(rows) == len(kinds) else 1


if __name__ == "__main__":
    sys.exit(main())
