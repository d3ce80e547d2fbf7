"""Every lesson notebook shows each exercise as mplab.exercises defines it, its one source: the
markdown cell right before the exercise's cell is ``Lesson.task_markdown(id)`` (the heading and
the whole task) and the cell is its starter. Lessons (mplab/exercises/lesson*.py) and notebooks
with exercise cells are found, not listed, so a lesson still to come is held to this too.

``python -m mplab.exercises.sync notebooks/*.ipynb`` fixes what these tests find.
"""

import functools
import re
import shutil
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="needs nbformat, which is not installed")
from conftest import exercise_ids, lesson_of, lessons  # noqa: E402

from mplab.exercises import sync  # noqa: E402

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
FIX = "run `python -m mplab.exercises.sync notebooks/*.ipynb` to rewrite it from the library"
IMPORT = re.compile(r"from mplab\.exercises import (lesson\d+) as ex\b")


def read(path: Path):
    return nbformat.read(path, as_version=4)


def tagged_cells(nb) -> list[tuple[int, str]]:
    """(index, exercise id) of each code cell with metadata {"mplab": {"exercise": id}}."""
    return [(i, str(c.metadata["mplab"]["exercise"])) for i, c in enumerate(nb.cells)
            if c.cell_type == "code" and c.metadata.get("mplab", {}).get("exercise")]


@functools.cache
def tagged(path: Path) -> list[tuple[int, str]]:
    return tagged_cells(read(path))


WITH_EXERCISES = [path for path in NOTEBOOKS if tagged(path)]


def cells_of(xid: str) -> list[tuple[Path, int]]:
    return [(path, i) for path in WITH_EXERCISES for i, tag in tagged(path) if tag == xid]


def test_the_lesson_notebooks_hold_exercises():
    assert len(WITH_EXERCISES) >= 4


@pytest.mark.parametrize("xid", exercise_ids())
def test_every_exercise_has_exactly_one_cell_in_the_notebooks(xid):
    places = [f"{path.name} cell {i}" for path, i in cells_of(xid)]
    assert len(places) == 1, (f"exercise {xid} has {len(places)} tagged cells {places}; it "
                              f'needs one, with metadata {{"mplab": {{"exercise": "{xid}"}}}}')


@pytest.mark.parametrize("xid", exercise_ids())
def test_the_markdown_cell_before_each_exercise_is_its_whole_task_from_the_library(xid):
    for path, i in cells_of(xid):
        before = read(path).cells[i - 1] if i else None
        assert before is not None and before.cell_type == "markdown", \
            f"{path.name}: no markdown task cell before exercise {xid}; {FIX}"
        assert before.source == lesson_of(xid).task_markdown(xid), \
            f"{path.name}: the task shown for exercise {xid} is not the library's; {FIX}"


@pytest.mark.parametrize("xid", exercise_ids())
def test_each_exercise_cell_holds_its_starter(xid):
    for path, i in cells_of(xid):
        assert read(path).cells[i].source == lesson_of(xid).EXERCISES[xid].starter, \
            f"{path.name}: exercise {xid}'s cell is not the library's starter; {FIX}"


@pytest.mark.parametrize("path", WITH_EXERCISES, ids=lambda p: p.name)
def test_a_notebooks_exercises_are_numbered_in_the_order_a_learner_meets_them(path):
    met = [xid for _, xid in tagged(path)]
    number = [tuple(int(n) for n in xid.split(".")) for xid in met]
    assert number == sorted(number), f"{path.name} shows its exercises as {met}"
    lesson = lesson_of(met[0])
    assert list(lesson.EXERCISES) == met, "the grader's report lists them in the same order"


@pytest.mark.parametrize("path", WITH_EXERCISES, ids=lambda p: p.name)
def test_a_notebooks_exercise_cells_all_belong_to_the_lesson_it_imports(path):
    code = "\n".join(c.source for c in read(path).cells if c.cell_type == "code")
    imported = set(IMPORT.findall(code))
    assert len(imported) == 1, f"{path.name} imports {imported or 'no lesson'} as ex"
    modules = {m.__name__.rsplit(".", 1)[-1]: m for m in lessons()}
    (name,) = imported
    assert name in modules, f"{path.name} imports mplab.exercises.{name}, which does not exist"
    unknown = [xid for _, xid in tagged(path) if xid not in modules[name].EXERCISES]
    assert not unknown, f"{path.name}: exercise cells unknown to {name}: {unknown}"


# --- the sync tool ----------------------------------------------------------------------------

@pytest.fixture
def lesson3_copy(tmp_path):
    original = next(p for p in WITH_EXERCISES if p.name.startswith("03_"))
    return original, Path(shutil.copy(original, tmp_path / original.name))


def edit(path: Path, change) -> None:
    """Change a notebook's cells as an author might: change(cells, {exercise id: index})."""
    nb = read(path)
    change(nb.cells, {xid: i for i, xid in tagged_cells(nb)})
    nbformat.write(nb, path)


def test_the_stored_notebooks_are_in_sync(capsys):
    assert sync.main(["--check", *map(str, NOTEBOOKS)]) == 0
    assert capsys.readouterr().out == ""


def test_sync_rewrites_drifted_tasks_and_starters_back_byte_for_byte(lesson3_copy, capsys):
    original, copy = lesson3_copy

    def drift(cells, at):
        cells[at["3.3"] - 1].source = "### Exercise 3.3 — Find the bug\n\nFix the loop above."
        starter = cells[at["3.4"]]
        starter.source = 'answer = "b"\nex.check("3.4", answer)'
        starter.execution_count = 3
        starter.outputs = [nbformat.v4.new_output("stream", name="stdout", text="✓ passed")]

    edit(copy, drift)
    assert sync.main(["--check", str(copy)]) == 1
    assert "differs: 3.3 task, 3.4 starter" in capsys.readouterr().out
    assert sync.main([str(copy)]) == 0
    assert copy.read_bytes() == original.read_bytes()


def test_sync_inserts_a_missing_task_cell_and_leaves_the_prose_before_it(lesson3_copy):
    original, copy = lesson3_copy
    edit(copy, lambda cells, at: cells.pop(at["3.5"] - 1))
    assert sync.main([str(copy)]) == 0
    want = [(c.cell_type, c.source) for c in read(original).cells]
    assert [(c.cell_type, c.source) for c in read(copy).cells] == want


def test_sync_reports_an_exercise_missing_from_its_notebook(lesson3_copy, capsys):
    _, copy = lesson3_copy
    edit(copy, lambda cells, at: cells[at["3.2"]].metadata.pop("mplab"))
    assert sync.main([str(copy)]) == 1
    assert "exercise 3.2 has no cell here" in capsys.readouterr().err


def test_sync_refuses_a_cell_tagged_with_an_exercise_the_library_lacks(lesson3_copy, capsys):
    _, copy = lesson3_copy
    edit(copy, lambda cells, at: cells[at["3.2"]].metadata["mplab"].update(exercise="3.9"))
    tagged_wrong = copy.read_bytes()
    assert sync.main([str(copy)]) == 2
    assert "unknown exercise '3.9' in lesson 3; accepted: '3.1'" in capsys.readouterr().err
    assert copy.read_bytes() == tagged_wrong  # nothing written
    edit(copy, lambda cells, at: cells[at["3.9"]].metadata["mplab"].update(exercise="99.1"))
    assert sync.main([str(copy)]) == 2
    assert "there is no lesson 99" in capsys.readouterr().err
