"""Grade a class: every notebook in a folder, each in a sandbox of its own, into one gradebook.

    python -m mplab.grade SUBMISSIONS/ --csv grades.csv [--jobs 2] [--json reports/]
    python -m mplab.grade SUBMISSIONS/ --csv grades.csv --no-sandbox   # trusted notebooks only

Before the first kernel starts, every ``*.ipynb`` in the folder is copied into a private folder
of the grader's (a symbolic link or anything but a regular file is refused, with a row saying
so; other files are listed as skipped). Each copy then runs in a bubblewrap sandbox of its own
(:mod:`mplab.grade.sandbox`: the learner's release of mplab without the key, its own tmpfs, no
network, no other submission, limits for the whole sandbox, nothing left alive after it), and
the grader scores what it logged in its own process. Before any cell the kernel also limits
itself (``resource.setrlimit``, inherited by what it forks): the memory a process allocates
(`memory_gb`, RLIMIT_DATA), CPU time (`cpu_s`), file size (`file_mb`), processes (`processes`).

A machine that cannot make a sandbox (no unprivileged user namespaces) stops with a message
saying what to enable. ``--no-sandbox`` grades without one, as before: each kernel in a
temporary folder of its own, as the grader's user, able to read what that user can (the
report flags such reads, it does not prevent them); the gradebook says it was unsandboxed.

The gradebook and the reports are written atomically (a temporary file renamed over the name,
so a link there is replaced, never followed), the reports into a new or empty folder; a CSV
cell that a spreadsheet would read as a formula (``= + - @``) is quoted with ``'``.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import stat
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from mplab._display import Table
from mplab.grade.kernel import clean
from mplab.grade.notebook import GradingError, grade_notebook

__all__ = ["Limits", "grade_class", "submissions", "gradebook_rows", "write_csv", "run"]

#: The largest notebook a class's grader copies in.
MAX_NOTEBOOK_MB = 100


@dataclass(frozen=True)
class Limits:
    """What one submission's kernel may use: memory it allocates, CPU seconds, the largest file it
    writes, processes (RLIMIT_NPROC counts the user's processes, and root is exempt)."""

    memory_gb: float = 8.0
    cpu_s: float = 900.0
    file_mb: float = 1024.0
    processes: int = 512
    disk_mb: float = 1024.0  # a sandbox's tmpfs (its HOME, TMPDIR and working folder)
    output_mb: float = 64.0  # the grade-log records a sandbox may stream to the grader

    def kernel_code(self) -> str:
        """One line of Python the kernel runs first: each limit, soft and hard. Memory is held
        by RLIMIT_DATA (what a process allocates and may write), not RLIMIT_AS: a CUDA build of
        torch (pip's default on Linux) maps 3 GB of address space it never touches on import,
        and a GPU's runtime reserves tens of GB more."""
        pairs = [("RLIMIT_DATA", int(self.memory_gb * 2**30)), ("RLIMIT_CPU", int(self.cpu_s)),
                 ("RLIMIT_FSIZE", int(self.file_mb * 2**20)), ("RLIMIT_NPROC", self.processes)]
        sets = "; ".join(f"_r.setrlimit(_r.{name}, ({value}, {value}))" for name, value in pairs)
        return f"import resource as _r; {sets}; del _r"


def _failed(path, why: str) -> dict:
    return clean({"notebook": str(path), "lesson": "", "total": 0, "max": 0, "exercises": [],
                  "problems": [], "flags": [], "error": why, "elapsed_s": 0.0})


def submissions(folder) -> tuple[list[Path], dict[Path, str], list[Path]]:
    """The folder's entries, sorted by name: the notebooks to grade, those refused (a link or
    not a regular file: why), and every other entry (skipped)."""
    graded, refused, skipped = [], {}, []
    for path in sorted(Path(folder).iterdir()):
        if path.suffix != ".ipynb":
            skipped.append(path)
        elif path.is_symlink():
            refused[path] = ("refused: a symbolic link (only regular files are graded; copy "
                             "the notebook into the folder)")
        elif not path.is_file():
            refused[path] = "refused: not a regular file"
        else:
            graded.append(path)
    return graded, refused, skipped


def _copy_in(path: Path, into: Path) -> Path | str:
    """`path` copied into `into`, never through a link (one swapped in since it was listed
    is refused too); or why not."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        return f"refused: cannot be opened as a regular file ({e.strerror})"
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            return "refused: not a regular file"
        if info.st_size > MAX_NOTEBOOK_MB * 2**20:
            return f"refused: {info.st_size / 2**20:.0f} MB, larger than {MAX_NOTEBOOK_MB} MB"
        copy = into / path.name
        copy.write_bytes(f.read())
    return copy


def _grade_one(copy: Path, original: Path, limits: Limits, timeout: float, cell_timeout: float,
               key, sandbox) -> dict:
    started = time.monotonic()
    try:
        if sandbox is not None:
            report = grade_notebook(copy, timeout=timeout, cell_timeout=cell_timeout,
                                    kernel_setup=limits.kernel_code(), key=key, sandbox=sandbox)
        else:  # a folder of its own for the kernel's HOME, TMPDIR and working files
            with tempfile.TemporaryDirectory(prefix="mplab-submission-") as tmp:
                home, scratch = Path(tmp) / "home", Path(tmp) / "tmp"
                home.mkdir()
                scratch.mkdir()
                work = Path(tmp) / "work"
                work.mkdir()
                os.replace(copy, work / copy.name)
                report = grade_notebook(work / copy.name, timeout=timeout,
                                        cell_timeout=cell_timeout,
                                        env={"HOME": str(home), "TMPDIR": str(scratch)},
                                        kernel_setup=limits.kernel_code(), key=key)
        report["error"] = ""
    except GradingError as e:  # not a notebook, no lesson: said in its row
        report = _failed(original, str(e).replace(str(copy), original.name))
    except Exception as e:  # the grader itself failed on this one: the class goes on
        report = _failed(original, f"grading failed: {type(e).__name__}: {e}")
    report["notebook"] = clean(str(original))  # a file name is the learner's text too
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    return report


def grade_class(folder, jobs: int = 2, limits: Limits = Limits(), timeout: float = 600,
                cell_timeout: float = 120, progress: bool = True, key=None,
                sandbox: bool = True) -> list[dict]:
    """Every .ipynb in `folder` (sorted by name), graded apart, `jobs` at a time: one report
    each, as :func:`mplab.grade.grade_notebook` makes it plus "error" (why a submission could
    not be graded, or ""), in the folder's order. `key`: the instructor's key folder.
    `sandbox`: each in a sandbox of its own (:mod:`mplab.grade.sandbox`; raises
    :class:`mplab.grade.sandbox.SandboxUnavailable` where the machine cannot make one)."""
    from tqdm.auto import tqdm

    from mplab.grade.sandbox import Sandbox

    folder = Path(folder)
    if not folder.is_dir():
        raise NotADirectoryError(f"{folder} is not a folder of submissions")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a positive integer, got {jobs!r}")
    paths, refused, _ = submissions(folder)
    reports = {path: _failed(path, why) for path, why in refused.items()}
    with tempfile.TemporaryDirectory(prefix="mplab-class-") as tmp, (
            Sandbox(limits) if sandbox else contextlib.nullcontext()) as box:
        copies = {}
        for i, path in enumerate(paths):  # all copied before the first kernel starts
            into = Path(tmp) / str(i)
            into.mkdir()
            copied = _copy_in(path, into)
            if isinstance(copied, str):
                reports[path] = _failed(path, copied)
            else:
                copies[path] = copied
        with ThreadPoolExecutor(max_workers=jobs) as pool, tqdm(
                total=len(copies), desc="grading", unit="notebook",
                disable=not progress) as bar:
            futures = {pool.submit(_grade_one, copy, path, limits, timeout, cell_timeout, key,
                                   box): path for path, copy in copies.items()}
            for future in as_completed(futures):
                reports[futures[future]] = future.result()
                bar.update()
    return [reports[p] for p in sorted(reports)]


def _flag_words(flags: list[dict]) -> str:
    counts: dict[str, int] = {}
    for f in flags:
        counts[f["what"]] = counts.get(f["what"], 0) + 1
    return "; ".join(f"{what} x{n}" for what, n in counts.items())


def gradebook_rows(reports: list[dict]) -> list[dict]:
    """One row per submission: file, lesson, each exercise's points (the union of the
    lessons' exercises, in order), total, max, flags, errors, seconds, sandbox."""
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
                     "errors": " | ".join(errors), "seconds": r.get("elapsed_s", ""),
                     "sandbox": r.get("sandbox", "")})
    return rows


def _cell(value):
    """A CSV cell a spreadsheet shows as text, never runs as a formula."""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


def _write_atomic(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file renamed over it: a reader sees the old
    file or the new one, and a link at `path` is replaced, never followed."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def fresh_folder(path) -> str | None:
    """Why `path` cannot take a class's reports (it must be new or an empty folder, not a
    link), or None."""
    path = Path(path)
    if path.is_symlink():
        return f"{path} is a symbolic link: give a new folder for the reports"
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        return f"{path} exists and is not an empty folder: give a new folder for the reports"
    return None


def write_csv(reports: list[dict], path, json_dir=None) -> None:
    """The gradebook as CSV at `path`; with `json_dir` (a new or empty folder), each report as
    <notebook>.json there too. Every file is written atomically."""
    rows = gradebook_rows(reports)
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=list(rows[0]) if rows else ["file"])
    writer.writeheader()
    writer.writerows({k: _cell(v) for k, v in row.items()} for row in rows)
    _write_atomic(Path(path), text.getvalue())
    if json_dir is not None:
        json_dir = Path(json_dir)
        if not json_dir.is_dir() or json_dir.is_symlink():
            json_dir.mkdir(parents=True)
        for r in reports:
            _write_atomic(json_dir / (Path(r["notebook"]).stem + ".json"),
                          json.dumps(r, indent=2) + "\n")


def run(args) -> int:
    """Grade the folder `args` (parsed by :func:`mplab.grade.notebook.parser`) names into its
    --csv gradebook, and print it."""
    import sys

    from mplab.grade.sandbox import SandboxUnavailable

    def fail(why: str) -> int:
        print(f"mplab.grade: error: {why}", file=sys.stderr)
        return 2

    if not args.csv:
        return fail("a folder of submissions needs --csv FILE for its gradebook")
    if args.jobs < 1 or args.with_solutions or args.executed:
        return fail("for a folder, --jobs must be at least 1, and --with-solutions and "
                    "--executed grade one notebook only")
    if args.key is not None and not Path(args.key).is_dir():
        return fail(f"--key {args.key} is not a folder (python -m mplab.exercises release OUT "
                    "--key DIR writes one)")
    if not Path(args.csv).resolve().parent.is_dir():
        return fail(f"--csv {args.csv}: its folder does not exist")
    if args.json and fresh_folder(args.json):
        return fail(f"--json {fresh_folder(args.json)}")
    started = time.monotonic()
    try:
        reports = grade_class(args.notebook, jobs=args.jobs, timeout=args.timeout,
                              cell_timeout=args.cell_timeout, key=args.key,
                              sandbox=not args.no_sandbox)
    except SandboxUnavailable as e:
        return fail(f"cannot grade a class in sandboxes on this machine: {e}")
    write_csv(reports, args.csv, args.json)
    how = ("UNSANDBOXED (--no-sandbox): each kernel ran as this user, with its files"
           if args.no_sandbox else "each in a bubblewrap sandbox")
    print(Table(gradebook_rows(reports),
                title=f"{args.notebook}: {len(reports)} notebooks, {how}"))
    skipped = submissions(args.notebook)[2]
    if skipped:
        print(f"skipped (not .ipynb): {', '.join(clean(p.name) for p in skipped)}")
    print(f"{len(reports)} notebooks in {time.monotonic() - started:.1f} s with {args.jobs} "
          f"jobs; gradebook in {args.csv}" + (f", reports in {args.json}" if args.json else ""))
    return 0
