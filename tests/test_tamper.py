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
from mplab.grade.tamper import KINDS, tamper_flags

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
    "outside files": [
        "answer = open('/srv/class/ada.ipynb').read()",
        "import os\nprint(os.listdir('..'))",
        "from pathlib import Path\ntext = Path('~/key/lesson1.py').read_text()",
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


def forged_copy(tmp_path, body) -> Path:
    """Lesson 1 with each exercise cell's source replaced by body(exercise id)."""
    nb = nbformat.read(LESSON_1, 4)
    for cell in nb.cells:
        xid = exercise_id(cell) if cell.cell_type == "code" else None
        if xid:
            cell.source = body(xid)
    path = tmp_path / "forged.ipynb"
    nbformat.write(nb, path)
    return path


@pytest.mark.slow
def test_a_forged_log_scores_nothing_the_grader_checks_and_is_flagged(tmp_path):
    """Issue 19's first forgery: every exercise cell of lesson 1 only appends a "passed" line
    to the grade log. The grader checks each value answer itself, from the answer a record
    carries: a line without one scores nothing. A function answer (1.5) is still scored from
    the kernel's log ("in-kernel" in the report), and its forged line is still flagged."""
    path = forged_copy(tmp_path, lambda xid: (
        "import json, os\nwith open(os.environ['MPLAB_GRADE_LOG'], 'a') as f:\n"
        f"    f.write(json.dumps({{'event': 'check', 'id': '{xid}', 'status': 'passed', "
        "'points': 9}) + '\\n')"))
    report = grade_notebook(path, timeout=300)
    by_id = {r["id"]: r for r in report["exercises"]}
    graded = [x for x, r in by_id.items() if r["decided"] == "grader"]
    assert len(graded) >= 4 and all(by_id[x]["points"] == 0 for x in graded)
    assert all("not one mplab wrote" in by_id[x]["message"] for x in graded)
    assert {r["decided"] for r in by_id.values() if r["id"] not in graded} == {"in-kernel"}
    code_flags = {f["exercise"] for f in report["flags"] if f["cell"] is not None}
    assert code_flags == set(by_id)  # every forging cell, shown
    assert json.loads(json.dumps(report))["flags"] == report["flags"]


@pytest.mark.slow
def test_checks_replaced_in_the_kernel_do_not_decide_the_score(tmp_path):
    """Issue 19's second forgery: every exercise's check and hidden check replaced by one that
    accepts anything, then ex.check(id, 12345). The kernel logs "passed"; the grader checks
    12345 itself and fails it, and flags the patch and the disagreement."""
    path = forged_copy(tmp_path, lambda xid: (
        "for e in ex.LESSON.exercises.values():\n"
        "    object.__setattr__(e, 'check', lambda *a: None)\n"
        "    object.__setattr__(e, 'hidden', lambda *a: None)\n"
        f"ex.check('{xid}', 12345)"))
    report = grade_notebook(path, timeout=300)
    graded = [r for r in report["exercises"] if r["decided"] == "grader"]
    assert graded and all(r["points"] == 0 and r["status"] == "failed" for r in graded)
    said = [f["code"] for f in report["flags"] if f["cell"] is None]
    assert any("the log says" in c and "'passed'" in c for c in said)
    assert {f["what"] for f in report["flags"] if f["cell"]} == {"patches"}


@pytest.mark.parametrize("answer", [
    0.1, 65504, "fp16", None, [1, 2.5, "x"], (3, 4), {"a": 1, "b": [2]}, {1, 4, 9},
    __import__("fractions").Fraction(1, 3), __import__("decimal").Decimal("0.1"),
    __import__("numpy").float32(0.5), __import__("numpy").arange(4),
    __import__("torch").tensor([1.5, -0.0]), __import__("torch").bfloat16])
def test_answers_travel_to_the_grader_as_data_and_come_back_equal(answer):
    import numpy as np
    import torch

    back = exercises.unpack_answer(json.loads(json.dumps(exercises.pack_answer(answer))))
    if isinstance(answer, torch.Tensor | np.ndarray):
        assert torch.equal(torch.as_tensor(back), torch.as_tensor(answer))
    else:
        assert back == answer and type(back) is (float if isinstance(answer, np.floating)
                                                 else type(answer))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # the forged pickle's
def test_what_is_not_data_never_runs_in_the_grader():
    import base64
    import pickle

    class Sneaky:
        def __reduce__(self):
            return (print, ("this ran in the grader",))

    assert "unpacked" in exercises.pack_answer(lambda x: x)
    assert "unpacked" in exercises.pack_answer(Sneaky())
    forged = {"torch": base64.b64encode(pickle.dumps(Sneaky())).decode()}
    with pytest.raises(ValueError, match="does not read back"):
        exercises.unpack_answer(forged)
    with pytest.raises(ValueError, match="does not read back"):
        exercises.unpack_answer({"torch": "not base64!"})
    with pytest.raises(ValueError, match="carries no answer"):
        exercises.unpack_answer("passed")
    huge = exercises.pack_answer(__import__("torch").zeros(1 << 19))
    assert "more than" in huge["unpacked"]
