"""The grader runs notebooks in a fresh kernel: a learner's mistake costs points, never the report.

The fixture notebooks are built here from lesson 1's own cells (ex.cells()), so they follow the
exercises rather than any lesson notebook.
"""

import json
import subprocess
import sys
import time

import pytest

nbformat = pytest.importorskip("nbformat", reason="needs nbformat, which is not installed")

from mplab.exercises import lesson1 as ex  # noqa: E402
from mplab.grade import GradingError, exercise_id, grade_notebook, main  # noqa: E402

MAX = sum(e.points for e in ex.EXERCISES.values())


def code(source: str, exercise: str | None = None):
    return nbformat.v4.new_code_cell(
        source, metadata={"mplab": {"exercise": exercise}} if exercise else {})


def write_notebook(path, cells):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Lesson 1"),
                                         code(ex.LESSON.import_code), *cells])
    nbformat.write(nb, path)
    return path


@pytest.fixture
def blank_notebook(tmp_path):
    return write_notebook(tmp_path / "blank.ipynb", ex.cells())


def statuses(report) -> dict:
    return {r["id"]: r["status"] for r in report["exercises"]}


@pytest.mark.timeout(60)
def test_the_reference_solutions_earn_full_marks_hidden_checks_included(blank_notebook):
    report = grade_notebook(blank_notebook, timeout=50, cell_timeout=20, with_solutions=True)
    assert statuses(report) == dict.fromkeys(ex.EXERCISES, "passed")
    assert report["total"] == report["max"] == MAX
    assert "hidden" in next(r for r in report["exercises"] if r["id"] == "1.5")["message"]


@pytest.mark.timeout(90)
def test_errors_hangs_and_a_dead_kernel_cost_only_their_own_exercise(tmp_path):
    swallow_interrupts = "while True:\n    try:\n        pass\n    except KeyboardInterrupt:\n" \
                         "        pass"
    after_restarts = ex.EXERCISES["1.5"].solution_code.replace(
        "ex.check", "assert state == 'kept'  # replayed into each new kernel\nex.check")
    path = write_notebook(tmp_path / "messy.ipynb", [
        code("import os\nstate = 'kept'"),
        code("answer = 65535\nex.check('1.2', answer)", "1.2"),
        code("raise RuntimeError('oops')\nex.check('1.1', 1)", "1.1"),
        code(swallow_interrupts, "1.3"),
        code("ex.solution('1.4')"),
        code("os._exit(1)", "1.4"),
        code(after_restarts, "1.5"),
    ])
    started = time.monotonic()
    report = grade_notebook(path, timeout=60, cell_timeout=5)
    assert time.monotonic() - started < 60
    assert statuses(report) == {"1.1": "error", "1.2": "failed", "1.3": "error", "1.4": "error",
                                "1.5": "passed"}
    rows = {r["id"]: r for r in report["exercises"]}
    assert "RuntimeError: oops" in rows["1.1"]["message"]
    assert "reserved" not in rows["1.2"]["message"] and "unsigned" in rows["1.2"]["message"]
    assert "time limit" in rows["1.3"]["message"]
    assert "killed" in rows["1.4"]["message"] and rows["1.4"]["solution_viewed"]
    assert report["total"] == 2 and [p["exercise"] for p in report["problems"]] == \
        ["1.1", "1.3", "1.4"]


@pytest.mark.timeout(60)
def test_the_overall_timeout_bounds_the_whole_run(tmp_path):
    path = write_notebook(tmp_path / "slow.ipynb", [
        code("while True:\n    pass", "1.1"),
        code("ex.check('1.2', 65504)", "1.2"),
    ])
    started = time.monotonic()
    report = grade_notebook(path, timeout=8, cell_timeout=60)
    assert time.monotonic() - started < 8 + 3  # + shutting the last kernel down
    assert statuses(report) | {"1.3": "-"} == {"1.1": "error", "1.2": "error", "1.3": "-",
                                              "1.4": "not attempted", "1.5": "not attempted"}
    assert all("time limit ran out" in p["problem"] for p in report["problems"])


@pytest.mark.timeout(60)
def test_the_cli_grades_a_blank_notebook_as_not_attempted_and_writes_json(blank_notebook,
                                                                          tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "mplab.grade", str(blank_notebook), "--json",
                           str(out), "--timeout", "50", "--cell-timeout", "20"],
                          capture_output=True, text=True, timeout=55)
    assert proc.returncode == 0, proc.stderr
    assert f"Total: 0/{MAX} points" in proc.stdout and "not attempted" in proc.stdout
    report = json.loads(out.read_text())
    assert (report["total"], report["max"], report["problems"]) == (0, MAX, [])
    assert [r["id"] for r in report["exercises"]] == list(ex.EXERCISES)
    for row in report["exercises"]:
        assert {"id", "status", "points", "max_points"} <= set(row)
        assert (row["status"], row["points"]) == ("not attempted", 0)


def test_misuse_exits_nonzero_with_a_clear_message(tmp_path, capsys):
    text = tmp_path / "notes.ipynb"
    text.write_text("not json")
    no_lesson = tmp_path / "plain.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[code("print(1)")]), no_lesson)
    for path, says in [(tmp_path / "missing.ipynb", "no such notebook"),
                       (text, "is not a Jupyter notebook"),
                       (no_lesson, "from mplab.exercises import lesson1")]:
        assert main([str(path)]) == 2
        assert says in capsys.readouterr().err
        with pytest.raises(GradingError, match=says):
            grade_notebook(path)


def test_exercise_cells_are_found_by_metadata_or_by_their_check_call():
    assert exercise_id(code("anything", "1.4")) == "1.4"
    assert exercise_id(code('answer = 3\nex.check("1.3", answer)')) == "1.3"
    assert exercise_id(code("print('no exercise here')")) is None
