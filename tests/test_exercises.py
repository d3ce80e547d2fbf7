"""mplab.exercises, the framework: what every exercise of every lesson does for a learner.

The lessons are found, not listed (every mplab/exercises/lesson*.py), so a new lesson's
exercises are held to the same promises without editing this file. Each lesson's own checks and
their feedback are tested in test_exercises_lessonN.py.
"""

import json

import pytest
from conftest import (
    checkable,
    exercise_ids,
    lesson_of,
    lessons,
    notebook_names,
    run_cell,
    skip_unless_checkable,
)

from mplab import exercises
from mplab.exercises import STATUSES, choice_list, python_block
from mplab.exercises import lesson1 as ex1

IDS = exercise_ids()
LESSONS = lessons()
JUNK = {"1": 1, "'x'": "x", "None": None, "[]": [], "{}": {}, "object()": object(),
        "nan": float("nan"), "a function that raises": lambda *args: 1 / 0,
        "a function that returns text": lambda *args: "not an answer"}


def exercise(xid):
    return lesson_of(xid).EXERCISES[xid]


def lesson_id(module) -> str:
    return module.__name__.rsplit(".", 1)[-1]


def test_the_lessons_are_found_in_order_with_their_exercises():
    assert [m.LESSON.number for m in LESSONS] == list(range(1, len(LESSONS) + 1))
    assert len(LESSONS) >= 4 and len(IDS) >= 19


# --- every exercise ---------------------------------------------------------------------------

@pytest.mark.parametrize("xid", IDS)
@pytest.mark.parametrize("grading", [False, True], ids=["learning", "grading"])
def test_the_untouched_starter_cell_is_not_attempted_never_an_error(xid, grading, monkeypatch):
    if grading:
        monkeypatch.setenv("MPLAB_GRADING", "1")
    result, _ = run_cell(exercise(xid).starter, **notebook_names(xid))
    assert (result.id, result.status, result.points) == (xid, "not attempted", 0), result
    assert result.max_points == exercise(xid).points


@pytest.mark.parametrize("xid", IDS)
@pytest.mark.parametrize("blank", [..., None], ids=["ellipsis", "None"])
def test_a_blank_answer_is_not_attempted(xid, blank):
    assert lesson_of(xid).check(xid, blank).status == "not attempted"


@pytest.mark.parametrize("xid", IDS)
def test_the_reference_cell_passes_with_full_points_and_says_which_checks_ran(xid, monkeypatch):
    skip_unless_checkable(xid)
    ex = exercise(xid)
    result, _ = run_cell(ex.solution_code, **notebook_names(xid))
    assert result.passed and result.points == result.max_points == ex.points, result
    assert result.message == ("Passed." if ex.hidden is None else
                              "Public checks passed. (Hidden checks run when the notebook is "
                              "graded.)")
    monkeypatch.setenv("MPLAB_GRADING", "1")
    result, _ = run_cell(ex.solution_code, **notebook_names(xid))
    assert result.passed and result.points == ex.points, result
    assert result.message == ("Passed." if ex.hidden is None else
                              "Passed: public and hidden checks.")


FUNCTION_IDS = [x for x in IDS if exercise(x).takes_function]


@pytest.mark.slow
def test_function_answers_recorded_in_another_process_replay_to_full_marks(tmp_path):
    """The key of every function exercise, run in a fresh Python process
    as a grading kernel runs it (log, grading and a seed set), replays here, where torch may
    use another number of threads, to full marks: the record is all the grader needs."""
    import os
    import subprocess
    import sys

    log = tmp_path / "grade.jsonl"
    ids = [x for x in FUNCTION_IDS if checkable(x)]
    script = "\n".join(
        ["import math, torch",
         "from transformers import TrainingArguments  # lesson 6's setup imports it"] + [
            f"from mplab.exercises import lesson{x.split('.')[0]} as ex\n"
            f"exec({exercise(x).solution_code!r})" for x in ids])
    env = {**os.environ, "MPLAB_GRADE_LOG": str(log), "MPLAB_GRADING": "1",
           "MPLAB_GRADE_SEED": "31337"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["id"] for r in records] == ids
    for record in records:
        regraded = lesson_of(record["id"]).LESSON.regrade(record["id"], record["function"],
                                                           seed=31337, function=True)
        assert regraded.passed, (record["id"], regraded)


@pytest.mark.parametrize("xid", IDS)
def test_the_grader_checks_the_key_again_from_the_data_the_kernel_logs(xid, tmp_path,
                                                                       monkeypatch):
    """Every exercise: the key's answer, packed into the log record as the kernel writes it (a
    function answer: the record of its calls), read back in this process and checked here, on
    the run's hidden inputs, passes with full points."""
    skip_unless_checkable(xid)
    ex = exercise(xid)
    log = tmp_path / "grade.jsonl"
    monkeypatch.setenv("MPLAB_GRADE_LOG", str(log))
    monkeypatch.setenv("MPLAB_GRADING", "1")
    monkeypatch.setenv("MPLAB_GRADE_SEED", "4242")
    run_cell(ex.solution_code, **notebook_names(xid))
    record = json.loads(log.read_text().splitlines()[-1])
    for name in ("MPLAB_GRADE_LOG", "MPLAB_GRADING", "MPLAB_GRADE_SEED"):
        monkeypatch.delenv(name)
    lesson = lesson_of(xid)
    function = ex.takes_function
    # the kernel runs a function's hidden calls for the grader: a hidden check needs them
    assert not function or (ex.hidden is None) == (ex.trials is None), xid
    assert ("function" in record) == function and ("answer" in record) != function
    data = json.loads(json.dumps(record["function"] if function else record["answer"]))
    regraded = lesson.LESSON.regrade(xid, data, seed=4242, function=function)
    assert regraded.passed and regraded.points == ex.points, regraded
    with pytest.raises(ValueError, match="carries no answer"):
        lesson.LESSON.regrade(xid, {"torch": None}, function=function)
    if function and ex.hidden is not None:
        # the same record on another run's hidden inputs: what the function gave is not what
        # these inputs need, so an answer that knows only some outputs fails
        again = lesson.LESSON.regrade(xid, data, seed=4243, function=True)
        assert again.status == "failed" and "hidden check" in again.message, again


@pytest.mark.parametrize("xid", IDS)
@pytest.mark.parametrize("junk", JUNK.values(), ids=JUNK.keys())
def test_check_never_raises_on_junk_and_never_passes_it(xid, junk, monkeypatch):
    monkeypatch.setenv("MPLAB_GRADING", "1")  # the hidden checks see it too
    result = lesson_of(xid).check(xid, junk)
    assert result.status in STATUSES and not result.passed and result.points == 0, result
    assert result.message and "Traceback" not in result.message


@pytest.mark.parametrize("xid", IDS)
def test_hints_step_from_concept_to_nearly_the_answer_then_run_out(xid):
    ex, hints = lesson_of(xid), exercise(xid).hints
    assert len(hints) == 3  # concept, API, nearly the answer
    results = [ex.hint(xid) for _ in range(5)]
    assert [r.message for r in results[:3]] == [f"Hint {k} of 3: {h}" for k, h in
                                                enumerate(hints, 1)]
    assert results[3].message.startswith(f"No more hints for {xid}")
    assert hints[-1] in results[3].message and f'ex.solution("{xid}")' in results[3].message
    assert results[4].message == results[3].message
    assert all(r.status == "hint" and r.points == 0 for r in results)


@pytest.mark.parametrize("xid", IDS)
def test_solution_reveals_the_reference_cell_and_records_the_reveal(xid):
    ex = lesson_of(xid)
    result = ex.solution(xid)
    assert result.status == "solution" and result.code == exercise(xid).solution_code
    assert ex.LESSON.revealed == {xid}


@pytest.mark.parametrize("xid", IDS)
def test_the_task_is_a_heading_with_id_and_title_then_the_whole_prompt(xid):
    ex = exercise(xid)
    assert lesson_of(xid).task_markdown(xid) == f"### Exercise {xid} — {ex.title}\n\n{ex.prompt}"
    assert ex.title.strip() == ex.title and ex.prompt.strip() == ex.prompt != ""
    assert not ex.prompt.startswith("#")  # the heading is task_markdown's; the prompt is the task


# --- every lesson -----------------------------------------------------------------------------

@pytest.mark.parametrize("lesson", LESSONS, ids=lesson_id)
def test_a_lessons_exercises_are_numbered_in_order_under_its_number(lesson):
    n = lesson.LESSON.number
    assert list(lesson.EXERCISES) == [f"{n}.{k}" for k in range(1, len(lesson.EXERCISES) + 1)]
    assert lesson.LESSON.import_code == f"from mplab.exercises import lesson{n} as ex"


@pytest.mark.parametrize("lesson", LESSONS, ids=lesson_id)
def test_a_lesson_module_offers_its_lessons_calls(lesson):
    for name in ["check", "hint", "solution", "task_markdown", "exercise_cells", "cells"]:
        assert getattr(lesson, name).__self__ is lesson.LESSON, name


@pytest.mark.parametrize("lesson", LESSONS, ids=lesson_id)
def test_each_cell_a_lesson_makes_is_tagged_and_checks_its_own_exercise(lesson):
    ids = list(lesson.EXERCISES)
    assert [xid for xid, _ in lesson.exercise_cells()] == ids
    for xid, starter in lesson.exercise_cells():
        last = starter.rstrip().splitlines()[-1]
        assert last.startswith(f'ex.check("{xid}", ')
        assert lesson.EXERCISES[xid].solution_code.rstrip().splitlines()[-1] == last
    assert [c.metadata["mplab"]["exercise"] for c in lesson.cells()] == ids
    assert [c.source for c in lesson.cells()] == [e.starter for e in lesson.EXERCISES.values()]
    assert [c.source for c in lesson.cells(solutions=True)] == \
        [e.solution_code for e in lesson.EXERCISES.values()]


@pytest.mark.parametrize("lesson", LESSONS, ids=lesson_id)
def test_an_unknown_exercise_id_is_an_error_that_names_the_accepted_ids(lesson):
    n = lesson.LESSON.number
    first, second = list(lesson.EXERCISES)[:2]
    with pytest.raises(ValueError, match=rf"'{n}\.99'.*accepted: '{first}', '{second}'"):
        lesson.check(f"{n}.99", 1)
    for call in (lesson.hint, lesson.solution, lesson.task_markdown):
        with pytest.raises(ValueError, match="accepted"):
            call(f"{n + 1}.1")
    assert lesson.check(float(first), ...).id == first  # ex.check(1.1, ...) means "1.1"


# --- the framework's parts, shown on lesson 1 -------------------------------------------------

def test_result_prints_as_text_and_renders_as_a_coloured_box():
    result = ex1.check("1.2", 65535)
    assert str(result).startswith("✗ Exercise 1.2: failed (0/1 points)")
    assert repr(result) == str(result)
    page = ex1.solution("1.4")._repr_html_()
    assert "border-left:6px solid" in page and "<pre" in page
    assert '"fp16"' not in page and "&quot;fp16&quot;" in page  # the code is escaped


def test_every_check_hint_and_reveal_is_logged_for_the_grader(tmp_path, monkeypatch):
    log = tmp_path / "grade.jsonl"
    monkeypatch.setenv("MPLAB_GRADE_LOG", str(log))
    ex1.check("1.2", 65535)
    ex1.hint("1.2")
    ex1.solution("1.3")
    records = [json.loads(line) for line in log.read_text().splitlines()]
    answer = records[0].pop("answer")  # what the grader checks again, in its own process
    assert records[0] | {"message": ""} == {"event": "check", "id": "1.2", "status": "failed",
                                             "points": 0, "max_points": 1, "message": "",
                                             "code": ""}
    assert exercises.unpack_answer(answer) == 65535
    assert ex1.LESSON.regrade("1.2", answer).status == "failed"
    assert records[1:] == [{"event": "hint", "id": "1.2", "stage": 1},
                           {"event": "solution", "id": "1.3"}]


def test_a_missing_grade_log_folder_never_breaks_the_notebook(tmp_path, monkeypatch):
    monkeypatch.setenv("MPLAB_GRADE_LOG", str(tmp_path / "no such folder" / "grade.jsonl"))
    assert ex1.check("1.2", 65535).status == "failed"


def test_an_answer_that_raises_while_checked_is_an_error_not_a_traceback():
    class Broken(dict):
        def __contains__(self, key):
            raise RuntimeError("broken container")

    result = ex1.check("1.4", Broken({0.1: "fp16"}))
    assert result.status == "error" and "RuntimeError: broken container" in result.message


def test_hint_stages_are_kept_per_exercise():
    ex1.hint("1.2")
    ex1.hint("1.2")
    assert ex1.hint("1.1").message.startswith("Hint 1 of 3")
    assert ex1.hint("1.2").message.startswith("Hint 3 of 3")


def test_choices_are_a_markdown_list_one_per_line_and_code_a_fenced_python_block():
    assert choice_list({"a": "range", "b": "precision"}) == "- (a) range\n- (b) precision"
    assert python_block("\nx = 1\ny = 2\n") == "```python\nx = 1\ny = 2\n```"

