"""The grader's flags: a learner's code that reaches for the grading itself is shown to the
instructor (flagged, not failed). The hostile cells are the forgeries a new user tried on
lesson 1; the shipped lessons, their starters and their keys raise no flag."""

import json
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="needs nbformat, which is not installed")

from mplab import exercises  # noqa: E402
from mplab.grade import exercise_id, grade_notebook  # noqa: E402
from mplab.grade.tamper import KINDS, tamper_flags  # noqa: E402

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
    "shell": [
        "!cat ~/.ssh/id_rsa",
        "%%bash\ncp /srv/class/*.ipynb .",
        "listing = 1\n%sx ls /srv/class",
        "get_ipython().system('ls /srv/class')",
        "import os\nos.system('ls /srv/class')",
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


def test_a_python_cell_under_a_line_magic_is_still_read():
    flags = tamper_flags(notebook_of("%%time\nimport os\nlog = os.environ['MPLAB_GRADE_LOG']",
                                     "%matplotlib inline\nx = 1"), WATCHED)
    assert [(f["cell"], f["what"], f["line"]) for f in flags] == [(1, "grade log", 3)]


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


def forged_copy(tmp_path, body, name: str = "forged") -> Path:
    """Lesson 1's exercise cells and the import they need (the rest of the lesson plays no part
    here), each exercise cell's source replaced by body(exercise id); body None keeps them."""
    nb = nbformat.read(LESSON_1, 4)
    nb.cells = [c for c in nb.cells if c.cell_type == "code" and (
        exercise_id(c) or "mplab.exercises import" in c.source)]
    for cell in nb.cells if body is not None else []:
        xid = exercise_id(cell) if cell.cell_type == "code" else None
        if xid:
            cell.source = body(xid)
    path = tmp_path / f"{name}.ipynb"
    nbformat.write(nb, path)
    return path


@pytest.mark.slow
def test_a_forged_log_scores_nothing_and_is_flagged(tmp_path):
    """Issue 19's first forgery: every exercise cell of lesson 1 only appends a "passed" line
    to the grade log. The grader checks each answer itself, from the data a record carries (a
    value, or the record of a function's calls): a line without one scores nothing."""
    path = forged_copy(tmp_path, lambda xid: (
        "import json, os\nwith open(os.environ['MPLAB_GRADE_LOG'], 'a') as f:\n"
        f"    f.write(json.dumps({{'event': 'check', 'id': '{xid}', 'status': 'passed', "
        "'points': 9}) + '\\n')"))
    report = grade_notebook(path, timeout=300)
    by_id = {r["id"]: r for r in report["exercises"]}
    assert report["total"] == 0 and all(r["status"] == "error" for r in by_id.values())
    assert all("not one mplab wrote" in r["message"] for r in by_id.values())
    code_flags = {f["exercise"] for f in report["flags"] if f["cell"] is not None}
    assert code_flags == set(by_id)  # every forging cell, shown
    assert json.loads(json.dumps(report))["flags"] == report["flags"]


# 1.5 answered with a table of the public patterns' values: right there, and nowhere else
PUBLIC_ONLY_1_5 = """from mplab.numerics import formats
TABLE = {bits: formats.from_bits(bits, formats.get_format("fp16")) for bits in
         [0x3C00, 0xC000, 0x3555, 0x7BFF, 0x0400, 0x0000, 0x8000, 0x0001, 0x03FF, 0x7C00,
          0xFC00, 0x7E00]}
def decode(bits, exp_bits, man_bits, bias):
    return TABLE.get(bits, 0.0)
ex.check("1.5", decode)"""


@pytest.mark.slow
def test_answers_that_know_only_the_public_inputs_or_copy_the_key_score_nothing(tmp_path):
    """A function that returns the reference's outputs for the public inputs only fails the
    inputs the grader drew for this run; one whose kernel dropped those calls from its record
    is an error and flagged; an answer cell that runs ex.solution's code answers nothing
    (the key is not shown while grading) and is flagged."""
    drop_trials = ("for e in ex.LESSON.exercises.values():\n"
                   "    object.__setattr__(e, 'trials', None)\n" + PUBLIC_ONLY_1_5)
    for name, source_1_5 in (("public", PUBLIC_ONLY_1_5), ("dropped", drop_trials)):
        path = forged_copy(tmp_path, lambda xid, source_1_5=source_1_5: (
            source_1_5 if xid == "1.5" else
            f"answer = ...\nexec(ex.solution('{xid}').code)\nex.check('{xid}', answer)"))
        report = grade_notebook(path, timeout=300)
        by_id = {r["id"]: r for r in report["exercises"]}
        assert report["total"] == 0, report["exercises"]
        assert all(by_id[x]["status"] == "not attempted" for x in by_id if x != "1.5")
        flagged = {f["exercise"] for f in report["flags"] if f["what"] == "answer key"}
        assert flagged == set(by_id) - {"1.5"}
        if name == "public":
            assert by_id["1.5"]["status"] == "failed", by_id["1.5"]
            assert by_id["1.5"]["message"].startswith(exercises.HIDDEN_FAILED)
            assert not [f for f in report["flags"] if f["exercise"] == "1.5"]
        else:
            assert by_id["1.5"]["status"] == "error"
            assert "more often than the record says" in by_id["1.5"]["message"]
            assert {f["what"] for f in report["flags"] if f["exercise"] == "1.5"} == {
                "grade log", "patches"}


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
    graded = report["exercises"]
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
    huge = exercises.pack_answer(__import__("torch").zeros(1 << 21))
    assert "more than" in huge["unpacked"]
