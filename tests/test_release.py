"""A learner's copy of mplab without the answer key (python -m mplab.exercises release), and the
grader taking the key from the instructor's folder (python -m mplab.grade --key DIR)."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mplab.exercises import lesson1, release

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "mplab" / "exercises").glob("lesson[0-9]*.py"))


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    folder = tmp_path_factory.mktemp("release")
    out, key = folder / "learner", folder / "key"
    done = subprocess.run([sys.executable, "-m", "mplab.exercises", "release", str(out),
                           "--key", str(key)], capture_output=True, text=True, cwd=folder)
    assert done.returncode == 0, done.stderr
    return out, key


def in_release(out: Path, code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(out)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=out)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_learners_copy_has_no_key_and_no_hidden_check(released):
    out, key = released
    assert sorted(p.name for p in key.glob("*.py")) == [p.name for p in LESSONS]
    shipped = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert sorted(p.name for p in (out / "notebooks").glob("*.ipynb")) == shipped
    assert (out / "data" / "sentiment" / "train.jsonl").is_file()
    printed = in_release(out, (
        "import importlib, mplab\n"
        "print(mplab.__file__)\n"
        "for n in range(1, 10):\n"
        "    m = importlib.import_module(f'mplab.exercises.lesson{n}')\n"
        "    for e in m.EXERCISES.values():\n"
        "        print(e.id, repr(e.key), e.hidden is None, e.trials is not None)\n"
        "print(m.solution('9.4').message)\n"
        "from mplab.exercises import lesson1 as ex\n"
        "print(ex.check('1.1', ...).status)"))
    lines = printed.splitlines()
    assert lines[0] == str(out / "mplab" / "__init__.py")
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:-2]}
    for path in LESSONS:  # every exercise of every lesson, as the full package has them
        module = __import__(f"mplab.exercises.{path.stem}", fromlist=["EXERCISES"])
        for xid, ex in module.EXERCISES.items():
            assert rows[xid] == ["''", "True", str(ex.trials is not None)], xid
    assert "not shipped" in lines[-2] and lines[-1] == "not attempted"
    for path in LESSONS:
        stripped = (out / "mplab" / "exercises" / path.name).read_text()
        ast.parse(stripped)
        full = __import__(f"mplab.exercises.{path.stem}", fromlist=["EXERCISES"])
        for ex in full.EXERCISES.values():
            if ex.hidden is not None:  # the hidden check's own function is gone
                assert ex.hidden.__name__ not in stripped, ex.id
            if len(ex.key) > 40:  # a reference answer of any length is not in the copy
                assert ex.key not in stripped and repr(ex.key) not in stripped, ex.id


def test_stripping_keeps_what_the_public_checks_use_and_drops_what_only_the_key_did():
    source = '''
def _only_hidden(x):
    return _helper_of_hidden(x)
def _helper_of_hidden(x):
    return x
def _public(x):
    return x
def shared(x):
    return x
EXERCISES = [Exercise(id="1.1", key="answer = 42", check=_public, hidden=_only_hidden)]
'''
    stripped = release.strip_key(source)
    assert "_only_hidden" not in stripped and "_helper_of_hidden" not in stripped
    assert "_public" in stripped and "def shared" in stripped and "42" not in stripped
    assert "key=''" in stripped and "hidden" not in stripped.split("\n", 3)[-1]


def test_every_lessons_key_loads_from_the_key_folder_as_the_grader_loads_it(released):
    """The grader loads a lesson from the key folder apart from the installed mplab (a module
    of its own name): every lesson's, dataclasses and all, with the installed one's keys and
    hidden checks."""
    from mplab.grade.notebook import _key_module

    _, key = released
    for path in LESSONS:
        full = __import__(f"mplab.exercises.{path.stem}", fromlist=["EXERCISES"])
        apart = _key_module(key, path.stem)
        assert apart is not full and apart.__name__.endswith(path.stem)
        assert [(e.id, e.key, e.hidden is None) for e in apart.EXERCISES.values()] == [
            (e.id, e.key, e.hidden is None) for e in full.EXERCISES.values()], path.stem


def test_a_release_into_a_folder_with_files_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    done = subprocess.run([sys.executable, "-m", "mplab.exercises", "release", str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "not empty" in done.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine"


def grade(out: Path, notebook: Path, *extra) -> dict:
    report = notebook.with_suffix(".json")
    env = {**os.environ, "PYTHONPATH": str(out)}
    done = subprocess.run([sys.executable, "-m", "mplab.grade", str(notebook), "--json",
                           str(report), "--timeout", "300", *extra], capture_output=True,
                          text=True, env=env, cwd=notebook.parent)
    assert done.returncode == 0, done.stderr
    return {**json.loads(report.read_text()), "stdout": done.stdout}


@pytest.mark.slow
def test_the_grader_takes_the_key_from_the_instructors_folder(released, tmp_path):
    """Grading with the learner's copy installed: --key DIR gives the key full marks, hidden
    checks included, in a kernel that has no key; without it, the report says the hidden
    checks did not run."""
    from test_tamper import forged_copy

    out, key = released
    copy = forged_copy(tmp_path, None, "lesson1")  # lesson 1's exercise cells, as shipped
    full = sum(e.points for e in lesson1.EXERCISES.values())
    report = grade(out, copy, "--key", str(key), "--with-solutions")
    assert report["total"] == full and report["key"] == str(key), report["exercises"]
    assert report["exercises"][-1]["message"] == "Passed: public and hidden checks."
    no_key = grade(out, copy)
    assert no_key["key"] == "none" and "hidden checks did not run" in no_key["stdout"]


@pytest.mark.slow
def test_with_the_key_apart_an_answer_that_knows_only_the_public_inputs_fails(released,
                                                                               tmp_path):
    from test_tamper import PUBLIC_ONLY_1_5, forged_copy

    out, key = released
    cells = {"1.5": PUBLIC_ONLY_1_5, "1.1": "print(ex.solution('1.1'))\nex.check('1.1', ...)"}
    path = forged_copy(tmp_path, lambda xid: cells.get(xid, f"ex.check('{xid}', ...)"),
                       "public_only")
    report = grade(out, path, "--key", str(key))
    by_id = {r["id"]: r for r in report["exercises"]}
    assert by_id["1.5"]["status"] == "failed" and by_id["1.5"]["points"] == 0
    assert "hidden check" in by_id["1.5"]["message"]
    assert by_id["1.1"]["status"] == "not attempted" and by_id["1.1"]["solution_viewed"]
