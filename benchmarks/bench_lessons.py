"""How long each lesson takes top to bottom in a fresh kernel: the budget is 60 s on 2 idle cores.

    python benchmarks/bench_lessons.py                 # every lesson, as shipped
    python benchmarks/bench_lessons.py 04_amp_pytorch  # the lessons whose names contain this
    python benchmarks/bench_lessons.py --also-avx2     # and again as on a CPU with AVX2 only

Each lesson runs through the grader (`mplab.grade`), as an instructor runs it, so the time is a
learner's "Run all" plus the kernel's start. The grader allows 120 s per cell: a lesson within
60 s on an idle machine leaves room for a loaded one. Prints one row per lesson.

`--also-avx2` runs each lesson a second time in a kernel that computes as an AVX2-only CPU
(`ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`, and `MPLAB_CPU_FEATURES=avx2` so mplab
picks that CPU's sizes), and first measures whether that really slows bf16 down here: on a
CPU with bf16 units the emulation has an effect only where oneDNN honours the cap.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from mplab._display import Table
from mplab.grade import grade_notebook

BUDGET_S = 60
LESSONS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("[0-9]*.ipynb"))
AVX2 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MPLAB_CPU_FEATURES": "avx2"}
_SLOWDOWN = ("from mplab.hardware import time_matmul as t; "
             "print(t(256, 'bf16', 'cpu', threads=1).seconds / t(256, 'fp32', 'cpu', threads=1)"
             ".seconds)")


def bf16_slowdown(env: dict) -> float:
    """How many times longer a 256² bf16 matmul takes than an fp32 one, in a fresh process."""
    done = subprocess.run([sys.executable, "-c", _SLOWDOWN], env={**os.environ, **env},
                          capture_output=True, text=True, check=True)
    return float(done.stdout.split()[-1])


def seconds(path: Path, env: dict) -> tuple[float, int]:
    """(seconds, problems) of one graded run, the kernel started with `env` added."""
    before = dict(os.environ)
    os.environ.update(env)  # the kernel inherits the grader's environment
    try:
        report = grade_notebook(path, timeout=600)
    finally:
        os.environ.clear()
        os.environ.update(before)
    return report["elapsed_s"], len(report["problems"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("only", nargs="*", help="run only lessons whose file names contain these")
    p.add_argument("--also-avx2", action="store_true",
                   help="run each lesson again as on a CPU with AVX2 only")
    args = p.parse_args()
    chosen = [path for path in LESSONS if not args.only or any(o in path.name for o in args.only)]
    if not chosen:
        p.error(f"no lesson matches {args.only}; lessons: {', '.join(x.stem for x in LESSONS)}")
    kinds = {"this CPU": {}} | ({"AVX2 emulated": AVX2} if args.also_avx2 else {})
    if args.also_avx2:
        here, avx2 = bf16_slowdown({}), bf16_slowdown(AVX2)
        print(f"a 256² bf16 matmul takes {here:.1f}× fp32's time here, {avx2:.1f}× with AVX2 "
              "emulated" + ("" if avx2 > 1.5 * here else
                            ": the emulation does not slow bf16 here (no bf16 units, or a cap "
                            "oneDNN ignores), so both columns measure this CPU"))
    rows, problems = [], 0
    for path in chosen:
        row = {"lesson": path.stem}
        for kind, env in kinds.items():
            took, found = seconds(path, env)
            problems += found
            row[f"s, {kind}"] = took
            row[f"within {BUDGET_S} s, {kind}"] = "yes" if took <= BUDGET_S else "NO"
            print(f"{path.stem} ({kind}): {took:g} s", flush=True)
        rows.append(row)
    print()
    print(Table(rows, title="each lesson top to bottom in a fresh kernel, through the grader"))
    return 0 if problems == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
