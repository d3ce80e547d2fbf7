"""Grade a class: every notebook in a folder, each apart, into one gradebook.

    python -m mplab.grade SUBMISSIONS/ --csv grades.csv [--jobs 2] [--json reports/]

Each submission is copied into a temporary folder of its own and graded there
(:func:`mplab.grade.grade_notebook`) in a fresh kernel whose HOME and TMPDIR are that folder's,
so a kernel's working files land apart from every other's and are removed after. Before any
cell the kernel limits itself (``resource.setrlimit`` in its own process, inherited by what it
forks): its address space (`Limits.memory_gb`), its CPU time (`cpu_s`), the size of a file it
writes (`file_mb`) and, for a user other than root, its processes (`processes`). A submission
that hangs, crashes, fills the disk or forks costs its own grade, never the others'; when its
kernel is shut down or dropped, the processes it left (in its session or process group, or
started with its environment) are killed too.

What this does not do, said plainly: the kernel runs as the grader's user, so it can read any
file that user can (the other submissions included, by absolute path): the report flags such
reads, it does not prevent them; root may raise its own limits again; a process that leaves
the kernel's session and clears its environment outlives the grading. Grade untrusted
notebooks as an unprivileged user, in a container or a VM.
"""

from __future__ import annotations

import csv
import json
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from mplab._display import Table
from mplab.grade.notebook import GradingError, grade_notebook

__all__ = ["Limits", "grade_class", "gradebook_rows", "write_csv", "run"]


@dataclass(frozen=True)
class Limits:
    """What one submission's kernel may use: address space, CPU seconds, the largest file it
    writes, processes (RLIMIT_NPROC counts the user's processes, and root is exempt)."""

    memory_gb: float = 8.0
    cpu_s: float = 900.0
    file_mb: float = 1024.0
    processes: int = 512

    def kernel_code(self) -> str:
        """One line of Python the kernel runs first: each limit, soft and hard."""
        pairs = [("RLIMIT_AS", int(self.memory_gb * 2**30)), ("RLIMIT_CPU", int(self.cpu_s)),
                 ("RLIMIT_FSIZE", int(self.file_mb * 2**20)), ("RLIMIT_NPROC", self.processes)]
        sets = "; ".join(f"_r.setrlimit(_r.{name}, ({value}, {value}))" for name, value in pairs)
        return f"import resource as _r; {sets}; del _r"


def _grade_one(path: Path, limits: Limits, timeout: float, cell_timeout: float, key) -> dict:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mplab-submission-") as tmp:
        work, home, scratch = (Path(tmp) / name for name in ("work", "home", "tmp"))
        for folder in (work, home, scratch):
            folder.mkdir()
        copy = work / path.name
        shutil.copyfile(path, copy)
        try:
            report = grade_notebook(copy, timeout=timeout, cell_timeout=cell_timeout,
                                    env={"HOME": str(home), "TMPDIR": str(scratch)},
                                    kernel_setup=limits.kernel_code(), key=key)
            report["error"] = ""
        except GradingError as e:  # not a notebook, no lesson: said in its row
            report = {"lesson": "", "total": 0, "max": 0, "exercises": [], "problems": [],
                      "flags": [], "error": str(e)}
        except Exception as e:  # the grader itself failed on this one: the class goes on
            report = {"lesson": "", "total": 0, "max": 0, "exercises": [], "problems": [],
                      "flags": [], "error": f"grading failed: {type(e).__name__}: {e}"}
    report["notebook"] = str(path)
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    return report


def grade_class(folder, jobs: int = 2, limits: Limits = Limits(), timeout: float = 600,
                cell_timeout: float = 120, progress: bool = True, key=None) -> list[dict]:
    """Every .ipynb in `folder` (sorted by name), graded apart, `jobs` at a time: one report
    each, as :func:`mplab.grade.grade_notebook` makes it plus "error" (why a submission could
    not be graded, or ""), in the folder's order. `key`: the instructor's key folder."""
    from tqdm.auto import tqdm

    folder = Path(folder)
    if not folder.is_dir():
        raise NotADirectoryError(f"{folder} is not a folder of submissions")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a positive integer, got {jobs!r}")
    paths = sorted(p for p in folder.glob("*.ipynb") if p.is_file())
    reports: dict[Path, dict] = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool, tqdm(
            total=len(paths), desc="grading", unit="notebook", disable=not progress) as bar:
        futures = {pool.submit(_grade_one, p, limits, timeout, cell_timeout, key): p
                   for p in paths}
        for future in as_completed(futures):
            reports[futures[future]] = future.result()
            bar.update()
    return [reports[p] for p in paths]


def _flag_words(flags: list[dict]) -> str:
    counts: dict[str, int] = {}
    for f in flags:
        counts[f["what"]] = counts.get(f["what"], 0) + 1
    return "; ".join(f"{what} x{n}" for what, n in counts.items())


def gradebook_rows(reports: list[dict]) -> list[dict]:
    """One row per submission: file, lesson, each exercise's points (the union of the
    lessons' exercises, in order), total, max, flags, errors, seconds."""
    ids: list[str] = []
    for r in reports:
        ids += [e["id"] for e in r["exercises"] if e["id"] not in ids]
    ids.sort(key=lambda x: tuple(int(n) for n in x.split(".")))
    rows = []
    for r in reports:
        points = {e["id"]: e["points"] for e in r["exercises"]}
        errors = [r["error"]] if r.get("error") else []
        errors += [f"cell {p['cell']}: {p['problem']}" for p in r.get("problems", [])]
        rows.append({"file": Path(r["notebook"]).name, "lesson": r.get("lesson", ""),
                     **{x: points.get(x, "") for x in ids}, "total": r["total"],
                     "max": r["max"], "flags": _flag_words(r.get("flags", [])),
                     "errors": " | ".join(errors), "seconds": r.get("elapsed_s", "")})
    return rows


def write_csv(reports: list[dict], path, json_dir=None) -> None:
    """The gradebook as CSV at `path`; with `json_dir`, each report as <notebook>.json too."""
    rows = gradebook_rows(reports)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["file"])
        writer.writeheader()
        writer.writerows(rows)
    if json_dir is not None:
        Path(json_dir).mkdir(parents=True, exist_ok=True)
        for r in reports:
            out = Path(json_dir) / (Path(r["notebook"]).stem + ".json")
            out.write_text(json.dumps(r, indent=2) + "\n", encoding="utf-8")


def run(args) -> int:
    """Grade the folder `args` (parsed by :func:`mplab.grade.notebook.parser`) names into its
    --csv gradebook, and print it."""
    import sys

    if not args.csv:
        print("mplab.grade: error: a folder of submissions needs --csv FILE for its gradebook",
              file=sys.stderr)
        return 2
    if args.jobs < 1 or args.with_solutions or args.executed:
        print("mplab.grade: error: for a folder, --jobs must be at least 1, and "
              "--with-solutions and --executed grade one notebook only", file=sys.stderr)
        return 2
    started = time.monotonic()
    if args.key is not None and not Path(args.key).is_dir():
        print(f"mplab.grade: error: --key {args.key} is not a folder (python -m "
              "mplab.exercises release OUT --key DIR writes one)", file=sys.stderr)
        return 2
    reports = grade_class(args.notebook, jobs=args.jobs, timeout=args.timeout,
                          cell_timeout=args.cell_timeout, key=args.key)
    write_csv(reports, args.csv, args.json)
    print(Table(gradebook_rows(reports), title=f"{args.notebook}: {len(reports)} notebooks"))
    print(f"{len(reports)} notebooks in {time.monotonic() - started:.1f} s with {args.jobs} "
          f"jobs; gradebook in {args.csv}")
    return 0
