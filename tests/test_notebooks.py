"""Every notebook is stored clean and runs top to bottom in a fresh kernel, as a learner would."""

import copy
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="needs nbformat, which is not installed")
NotebookClient = pytest.importorskip(
    "nbclient", reason="needs nbclient, which is not installed").NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
LESSONS = [p for p in NOTEBOOKS if p.name[:2].isdigit()]
PAGES = [p for p in NOTEBOOKS if p not in LESSONS]
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def test_there_are_notebooks():
    assert any(p.name.startswith("01_") for p in NOTEBOOKS)
    assert any(p.name == "precision_explorer.ipynb" for p in NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


# A lesson runs top to bottom in the grading test below (its blank run executes every cell in
# a fresh kernel and fails on any error), so only the other notebooks run here.
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom_in_a_fresh_kernel(path):
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError, naming the cell, on the first error
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors
    rendered_widget_views(nb)


def rendered_widget_views(nb) -> list:
    """Rendered to HTML by nbconvert as GitHub shows a notebook (no widget state), each widget
    shows its first view (the text and figures of the text/html it carries), never its repr.
    Returns the widgets' outputs it checked."""
    import re

    from bs4 import BeautifulSoup
    from nbconvert import HTMLExporter

    def text(markup: str) -> str:
        return " ".join(BeautifulSoup(markup, "html.parser").get_text(" ").split())

    nb = copy.deepcopy(nb)
    nb.metadata.pop("widgets", None)
    views = [o.data for c in nb.cells if c.cell_type == "code" for o in c.outputs
             if WIDGET_VIEW in o.get("data", {})]
    page, _ = HTMLExporter().from_notebook_node(nb)
    words = text(page)
    for view in views:
        assert "text/html" in view, view["text/plain"]
        assert text(view["text/html"]) in words and view["text/plain"] not in page, (
            view["text/plain"])
        for figure in re.findall(r"base64,([A-Za-z0-9+/=]+)", view["text/html"]):
            assert figure in page, view["text/plain"]
    return views



def starters_then_key(path: Path):
    """The lesson as shipped with, right after each exercise cell, that cell filled in with
    the key: one run is then the blank run (every starter, and every other cell, as a
    learner first meets them) and the key's run, since no other cell reads an answer."""
    import ast

    from mplab.grade import exercise_id

    nb = nbformat.read(path, as_version=4)
    lesson = __import__(f"mplab.exercises.lesson{int(path.name[:2])}", fromlist=["EXERCISES"])
    answers = {e.arg for e in lesson.EXERCISES.values()}
    cells = []
    for cell in nb.cells:
        cells.append(cell)
        xid = exercise_id(cell) if cell.cell_type == "code" else None
        if xid:
            key = copy.deepcopy(cell)
            key.source = lesson.EXERCISES[xid].solution_code
            key.id = f"{cell.id}-key"  # cell ids are unique in a notebook
            cells.append(key)
        elif cell.cell_type == "code":
            read = {n.id for n in ast.walk(ast.parse(cell.source)) if isinstance(n, ast.Name)}
            assert not read & answers, f"a cell reads an exercise's answer: {cell.source[:80]}"
    nb.cells = cells
    return nb


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_lesson_as_shipped_is_not_attempted_and_its_key_earns_full_marks(path, tmp_path,
                                                                         monkeypatch):
    from mplab.grade import grade_notebook

    # A new machine has no datasets cache: its first load shows what a learner first sees
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))

    both = tmp_path / path.name
    nbformat.write(starters_then_key(path), both)
    report = grade_notebook(both, timeout=600, executed=tmp_path / "ran.ipynb")
    assert report["max"] > 0 and len(report["exercises"]) >= 4
    for row in report["exercises"]:  # the starter, then the key
        assert row["attempts"] == ["not attempted", "passed"], row
    assert not report["problems"], report["problems"]  # every other cell ran cleanly
    assert report["total"] == report["max"], report["exercises"]
    ran = nbformat.read(tmp_path / "ran.ipynb", 4)
    assert rendered_widget_views(ran)
    said = "".join(o.get("text", "") for c in ran.cells if c.cell_type == "code"
                   for o in c.outputs if o.output_type == "stream")
    assert "LossCurveWarning" not in said  # every loss curve drawn shows learning
    # The budget is 60 s on 2 idle cores; benchmarks/bench_lessons.py measures it alone.
    print(f"\n{path.stem}: top to bottom, starters and key, in {report['elapsed_s']:g} s")
