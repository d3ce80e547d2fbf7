"""A class graded at once: a folder of lesson-1 submissions (a blank, the key, half answers,
hostile ones), each in its own sandbox (and, with --no-sandbox, in its own folder and kernel)
under limits, into one CSV; one that hangs, allocates 10 GB, forges its log, forks 1,000
processes or writes past the file-size limit costs its own grade only, and leaves no process
behind. The sandbox's own guarantees are tests/test_grade_sandbox.py's."""

import csv
import importlib.util
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("nbclient", reason="needs nbclient, which is not installed")

from mplab.exercises import lesson1  # noqa: E402
from mplab.grade import sandbox  # noqa: E402
from mplab.grade.classroom import Limits, grade_class, gradebook_rows  # noqa: E402
from mplab.grade.sandbox import unavailable  # noqa: E402

# The one generator of lesson-1 submissions is the class benchmark's.
BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_grade_class.py"
_spec = importlib.util.spec_from_file_location("bench_grade_class", BENCH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def submission(folder: Path, name: str, cells: dict) -> Path:
    """A quick lesson-1 submission: its exercise cells and the import they need."""
    return bench.submission(folder, name, cells, whole=False)

# The forked processes' name: this run's own, should another run of this file share the machine.
MARK = f"mplab-{os.getpid() % 10**8}"


class Most:
    """The most live processes named MARK seen while a class grades (sampled every 0.1 s)."""

    def __init__(self):
        self.seen, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self):
        while not self._stop.wait(0.1):
            self.seen = max(self.seen, bench.left_behind(MARK))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.seen


@pytest.fixture(scope="module", params=["cgroups", "polled", "none"],
                ids=["sandboxed", "sandboxed-without-cgroups", "no-sandbox"])
def klass(request, tmp_path_factory):
    """The class, graded in sandboxes (held by cgroups where the grader may make them, as on
    CI, or by the grader's polling alone, as where it may not) or without."""
    if request.param != "none" and unavailable():
        pytest.fail(f"this machine cannot make a grading sandbox: {unavailable()}")
    patch = pytest.MonkeyPatch()
    if request.param == "polled":
        patch.setattr(sandbox._Cgroups, "__init__", lambda self, limits: setattr(
            self, "folders", {}))
    folder = tmp_path_factory.mktemp("submissions")
    ids = list(lesson1.EXERCISES)
    key = submission(folder, "key", dict.fromkeys(ids))
    submission(folder, "blank", {})
    submission(folder, "half", dict.fromkeys(ids[:2]))
    submission(folder, "forger", bench.forger())
    submission(folder, "reader", {ids[0]: f"answer = len(open({str(key)!r}).read())\n"
                                           f"ex.check('{ids[0]}', answer)"})
    submission(folder, "hog", {ids[0]: "x = bytearray(10 * 2**30)"})
    submission(folder, "hang", {ids[1]: "while True:\n    pass"})
    submission(folder, "forker", bench.forker(1000, folder / "forked.txt", MARK))
    submission(folder, "filler", bench.filler(64))  # MiB, past file_mb
    (folder / "notes.ipynb").write_text("not a notebook")
    most = Most()
    # 20 s a cell: a cell that imports torch on a loaded machine takes some of it
    try:
        reports = grade_class(folder, jobs=2, limits=Limits(memory_gb=6, file_mb=16),
                              cell_timeout=20, progress=False, sandbox=request.param != "none")
    finally:
        patch.undo()
    by = {Path(r["notebook"]).stem: r for r in reports}
    by["most forked alive"] = most.stop()
    return folder, by


@pytest.mark.slow
def test_each_submission_gets_its_own_grade(klass):
    _, by = klass
    full = sum(e.points for e in lesson1.EXERCISES.values())
    assert by["key"]["total"] == full and not by["key"]["flags"]
    assert by["blank"]["total"] == 0
    assert {e["status"] for e in by["blank"]["exercises"]} == {"not attempted"}
    half = lesson1.EXERCISES[list(lesson1.EXERCISES)[0]].points + lesson1.EXERCISES[
        list(lesson1.EXERCISES)[1]].points
    assert by["half"]["total"] == half


@pytest.mark.slow
def test_hostile_submissions_cost_only_their_own_points(klass):
    _, by = klass
    assert by["forger"]["total"] == 0
    assert any(f["what"] == "grade log" for f in by["forger"]["flags"])
    assert any(f["what"] == "outside files" for f in by["reader"]["flags"])
    assert by["hog"]["exercises"][0]["status"] == "error"
    assert "MemoryError" in by["hog"]["exercises"][0]["message"]
    hang = by["hang"]["exercises"][1]
    assert hang["status"] == "error" and "20" in hang["message"]
    # the rest of the hanging notebook was still graded, in a new kernel
    assert by["hang"]["exercises"][2]["status"] == "not attempted"
    assert "is not a Jupyter notebook" in by["notes"]["error"]


def graded(report: dict, ids: list) -> list:
    """Each exercise's grade, with its message (the same where the grades are the same)."""
    return [(e["id"], e["status"], e["points"], e["message"]) for e in report["exercises"]
            if e["id"] in ids]


@pytest.mark.slow
def test_a_fork_bomb_costs_nothing_else_and_no_process_of_it_survives(klass):
    """1,000 sleepers (a third out of the kernel's process group, a third out of its session,
    all orphans once their forking parent exits). Unsandboxed, RLIMIT_NPROC does not bind
    root, so the grader ends them when it drops the kernel; in a sandbox the limit counts the
    sandbox's own user namespace, root's too, and its PID namespace ends with it. They are
    found by the name each gave itself."""
    folder, by = klass
    if by["forker"]["sandbox"] == "none":  # the forking Python could write outside
        forked = int((folder / "forked.txt").read_text())
        assert forked == 1000 if os.geteuid() == 0 else forked > 0
    else:
        assert not (folder / "forked.txt").exists()  # the sandbox sees no host folder
    assert by["most forked alive"] > 0  # they were alive while it graded
    assert bench.left_behind(MARK) == 0
    forker = by["forker"]
    assert forker["exercises"][0]["status"] == "not attempted"  # the cell ran to its end
    if forker["sandbox"] != "none":  # the grader ended the processes past the limit
        assert any("process limit" in p["problem"] for p in forker["problems"]), forker["problems"]
    later = list(lesson1.EXERCISES)[1:]
    assert graded(forker, later) == graded(by["key"], later)  # and so did the rest


@pytest.mark.slow
def test_a_file_past_the_size_limit_fails_its_exercise_only(klass):
    _, by = klass
    filler = by["filler"]["exercises"][0]
    assert filler["status"] == "error" and "File too large" in filler["message"]
    later = list(lesson1.EXERCISES)[1:]
    assert graded(by["filler"], later) == graded(by["key"], later)  # the same kernel went on


def test_the_class_generator_mixes_every_kind(tmp_path):
    made = bench.make_class(tmp_path, 12)
    assert sorted(p.name for p in tmp_path.glob("*.ipynb")) == sorted(made)
    assert set(made.values()) == set(bench.KINDS) and len(made) == 12


@pytest.mark.slow
def test_the_gradebook_has_a_row_per_submission(klass, tmp_path):
    folder, by = klass
    rows = gradebook_rows([r for r in by.values() if isinstance(r, dict)])
    assert {r["file"] for r in rows} == {p.name for p in folder.glob("*.ipynb")}
    key = next(r for r in rows if r["file"] == "key.ipynb")
    assert [key[x] for x in lesson1.EXERCISES] == [e.points for e in lesson1.EXERCISES.values()]
    assert next(r for r in rows if r["file"] == "forger.ipynb")["flags"].startswith("grade log")


def test_the_cli_grades_a_folder_into_a_csv(tmp_path):
    folder = tmp_path / "class"
    folder.mkdir()
    submission(folder, "blank", {})
    out = tmp_path / "grades.csv"
    proc = subprocess.run([sys.executable, "-m", "mplab.grade", str(folder), "--csv", str(out),
                           "--jobs", "1", "--json", str(tmp_path / "reports")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader(out.open()))
    assert [r["file"] for r in rows] == ["blank.ipynb"] and rows[0]["total"] == "0"
    assert (tmp_path / "reports" / "blank.json").is_file()
    said = subprocess.run([sys.executable, "-m", "mplab.grade", str(folder)],
                          capture_output=True, text=True, timeout=60)
    assert said.returncode == 2 and "needs --csv FILE" in said.stderr
    no_key = subprocess.run([sys.executable, "-m", "mplab.grade", str(folder), "--csv", str(out),
                             "--key", str(tmp_path / "nowhere")],
                            capture_output=True, text=True, timeout=60)
    assert no_key.returncode == 2 and "nowhere is not a folder" in no_key.stderr


def test_a_machine_without_user_namespaces_stops_the_class_and_says_what_to_enable(
        tmp_path, monkeypatch, capsys):
    """bwrap as it fails where unprivileged user namespaces are off: no kernel starts, the
    message says why and what to enable, and --no-sandbox is the explicit way around."""
    from mplab.grade import classroom, main, sandbox

    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\n"
                    "exit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sandbox, "bwrap", lambda: str(fake))
    monkeypatch.setattr(sandbox, "_CHECKED", {})
    started = []
    monkeypatch.setattr(classroom, "grade_notebook", lambda *a, **k: started.append(a))
    folder = tmp_path / "class"
    folder.mkdir()
    submission(folder, "blank", {})
    assert main([str(folder), "--csv", str(tmp_path / "grades.csv")]) == 2
    said = capsys.readouterr().err
    assert "uid map: Permission denied" in said and "unprivileged user namespaces" in said
    assert "--no-sandbox" in said and not started and not (tmp_path / "grades.csv").exists()
    with pytest.raises(sandbox.SandboxUnavailable, match="Permission denied"):
        grade_class(folder, progress=False)


def test_an_unsandboxed_class_says_so_on_its_gradebook(tmp_path, capsys):
    folder = tmp_path / "class"
    folder.mkdir()
    submission(folder, "blank", {})
    out = tmp_path / "grades.csv"
    from mplab.grade import main

    assert main([str(folder), "--csv", str(out), "--no-sandbox", "--jobs", "1"]) == 0
    assert "UNSANDBOXED" in capsys.readouterr().out
    assert [r["sandbox"] for r in csv.DictReader(out.open())] == ["none"]


def test_a_kernel_under_the_memory_limit_imports_torch_and_cannot_allocate_past_it():
    """The kernel's memory limit counts what it allocates, not the address space it maps:
    torch imports under a limit below the address space it maps on import (its CPU build maps
    0.7 GB, its CUDA build 3.2 GB, of which its libraries' data take about 1 GB), and 2 GB of
    bytes is refused with a MemoryError in the cell."""
    import torch

    limit = 0.6 if torch.version.cuda is None else 1.2
    code = Limits(memory_gb=limit).kernel_code() + "\n" + (
        "import torch, transformers\n"
        "try:\n"
        "    bytearray(2 * 2**30)\n"
        "except MemoryError:\n"
        "    print('refused')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "refused", done.stderr[-2000:]
