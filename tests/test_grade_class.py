"""A class graded at once: a folder of lesson-1 submissions (a blank, the key, half answers,
hostile ones), each in its own folder and kernel under limits, into one CSV; one that hangs,
allocates 10 GB or forges its log costs its own grade only."""

import csv
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from mplab.exercises import lesson1
from mplab.grade import exercise_id
from mplab.grade.classroom import Limits, grade_class, gradebook_rows

LESSON_1 = Path(__file__).resolve().parents[1] / "notebooks" / "01_float_formats.ipynb"


def submission(folder: Path, name: str, cells: dict) -> Path:
    """Lesson 1 with exercise cells replaced: cells[xid] is the new source (None: the key)."""
    nb = nbformat.read(LESSON_1, 4)
    for cell in nb.cells:
        xid = exercise_id(cell) if cell.cell_type == "code" else None
        if xid in cells:
            cell.source = cells[xid] or lesson1.EXERCISES[xid].solution_code
    path = folder / f"{name}.ipynb"
    nbformat.write(nb, path)
    return path


@pytest.fixture(scope="module")
def klass(tmp_path_factory):
    folder = tmp_path_factory.mktemp("submissions")
    ids = list(lesson1.EXERCISES)
    key = submission(folder, "key", dict.fromkeys(ids))
    submission(folder, "blank", {})
    submission(folder, "half", dict.fromkeys(ids[:2]))
    submission(folder, "forger", {x: (
        "import json, os\nwith open(os.environ['MPLAB_GRADE_LOG'], 'a') as f:\n"
        f"    f.write(json.dumps({{'event': 'check', 'id': '{x}', 'status': 'passed', "
        "'points': 1}) + '\\n')") for x in ids})
    submission(folder, "reader", {ids[0]: f"answer = len(open({str(key)!r}).read())\n"
                                           f"ex.check('{ids[0]}', answer)"})
    submission(folder, "hog", {ids[0]: "x = bytearray(10 * 2**30)"})
    submission(folder, "hang", {ids[1]: "while True:\n    pass"})
    (folder / "notes.ipynb").write_text("not a notebook")
    reports = grade_class(folder, jobs=2, limits=Limits(memory_gb=6), cell_timeout=10,
                          progress=False)
    return folder, {Path(r["notebook"]).stem: r for r in reports}


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
    decided = [e for e in by["forger"]["exercises"] if e["decided"] == "grader"]
    assert decided and all(e["points"] == 0 for e in decided)
    # the function answer (1.5) is still scored from the kernel's log: what it forged counts
    assert by["forger"]["total"] == sum(e["points"] for e in by["forger"]["exercises"]
                                        if e["decided"] == "in-kernel") > 0
    assert any(f["what"] == "grade log" for f in by["forger"]["flags"])
    assert any(f["what"] == "outside files" for f in by["reader"]["flags"])
    assert by["hog"]["exercises"][0]["status"] == "error"
    assert "MemoryError" in by["hog"]["exercises"][0]["message"]
    hang = by["hang"]["exercises"][1]
    assert hang["status"] == "error" and "10" in hang["message"]
    # the rest of the hanging notebook was still graded, in a new kernel
    assert by["hang"]["exercises"][2]["status"] == "not attempted"
    assert "is not a Jupyter notebook" in by["notes"]["error"]


@pytest.mark.slow
def test_the_gradebook_has_a_row_per_submission(klass, tmp_path):
    folder, by = klass
    rows = gradebook_rows(list(by.values()))
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
