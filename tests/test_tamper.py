"""The grader's flags: a learner's code that reaches for the grading itself is shown to the
instructor (flagged, not failed). The hostile cells are the forgeries a new user tried on
lesson 1; the shipped lessons, their starters and their keys raise no flag."""

import json
import re
from pathlib import Path

import nbformat
import pytest

from mplab import exercises
from mplab.grade import exercise_id, grade_notebook
from mplab.tamper import KINDS, tamper_flags

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
LESSON_1 = NOTEBOOKS / "01_float_formats.ipynb"
WATCHED = (exercises.GRADE_LOG_ENV, exercises.GRADING_ENV)

HOSTILE = {
    "grade log": [
        "import json, os\n"
        "with open(os.environ['MPLAB_GRADE_LOG'], 'a') as f:\n"
        "    f.write(json.dumps({'event': 'check', 'id': '1.1', 'status': 'passed', "
        "'points': 1}) + '\\n')",
        "import os\nlog = os.getenv('MPLAB_' + 'GRADE_LOG')",
    ],
    "patches": [
        "for e in ex.LESSON.exercises.values():\n"
        "    object.__setattr__(e, 'check', lambda *a: None)\n"
        "ex.check('1.1', 12345)",
        "ex.check = lambda *a: None",
        "setattr(ex, 'check', print)",
        "import sys\nsys.modules['mplab.exercises.lesson1'].check = print",
    ],
    "answer key": [
        "ex.solution('1.1')",
        "answer = ex.EXERCISES['1.1'].key",
        "import inspect\nprint(inspect.getsource(ex._check_1_5))",
    ],
    "solution module": [
        "from mplab.exercises.lesson1 import EXERCISES",
        "import mplab.grade",
        "from mplab.exercises import Exercise",
    ],
}


def notebook_of(*sources):
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])


@pytest.mark.parametrize("what, source", [(w, s) for w, ss in HOSTILE.items() for s in ss])
def test_each_hostile_cell_is_flagged_for_what_it_does(what, source):
    flags = tamper_flags(notebook_of("from mplab.exercises import lesson1 as ex", source),
                         WATCHED)
    assert what in {f["what"] for f in flags}, flags
    assert all(f["cell"] == 2 and f["what"] in KINDS for f in flags)


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_the_lessons_as_shipped_and_their_keys_raise_no_flag(path):
    nb = nbformat.read(path, 4)
    assert tamper_flags(nb, WATCHED) == []
    match = re.match(r"(\d+)_", path.name)
    if match:
        import importlib

        lesson = importlib.import_module(f"mplab.exercises.lesson{int(match.group(1))}")
        for cell in nb.cells:
            xid = exercise_id(cell) if cell.cell_type == "code" else None
            if xid in lesson.EXERCISES:
                cell.source = lesson.EXERCISES[xid].solution_code
        assert tamper_flags(nb, WATCHED) == []


def test_a_cell_with_a_magic_is_read_without_it_and_broken_code_raises_no_flag():
    flags = tamper_flags(notebook_of("%timeit 1\nex.solution('1.1')", "def (:"), WATCHED,
                         exercise_id)
    assert [(f["cell"], f["line"], f["what"]) for f in flags] == [(1, 2, "answer key")]


@pytest.mark.slow
def test_a_forged_log_is_flagged_in_the_report(tmp_path):
    """The forgery of issue 19: every exercise cell of lesson 1 only appends a "passed" line to
    the grade log. The score is still the log's (the grader deciding from data is to come);
    the report shows the instructor each forging cell."""
    nb = nbformat.read(LESSON_1, 4)
    forged = 0
    for cell in nb.cells:
        xid = exercise_id(cell) if cell.cell_type == "code" else None
        if xid:
            forged += 1
            cell.source = ("import json, os\nwith open(os.environ['MPLAB_GRADE_LOG'], 'a') as f:\n"
                           f"    f.write(json.dumps({{'event': 'check', 'id': '{xid}', "
                           "'status': 'passed', 'points': 9}) + '\\n')")
    path = tmp_path / "forged.ipynb"
    nbformat.write(nb, path)
    report = grade_notebook(path, timeout=300)
    flagged = {f["exercise"] for f in report["flags"] if f["what"] == "grade log"}
    assert len(flagged) == forged and None not in flagged
    assert json.loads(json.dumps(report))["flags"] == report["flags"]
