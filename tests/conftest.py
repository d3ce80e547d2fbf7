"""What the exercise tests share: a fresh learner session, and cells run as Jupyter runs them."""

import ast
import sys

import pytest


@pytest.fixture(autouse=True)
def fresh_session(monkeypatch):
    """Not grading, no grade log, and no hint stages or reveals left over from another test."""
    monkeypatch.delenv("MPLAB_GRADING", raising=False)
    monkeypatch.delenv("MPLAB_GRADE_LOG", raising=False)
    for name, module in list(sys.modules.items()):
        if name.startswith("mplab.exercises.lesson") and hasattr(module, "LESSON"):
            module.LESSON.reset()


def run_cell(source: str, **names):
    """Run a notebook cell the way Jupyter does; returns (the last expression's value, the
    namespace). `names` are what earlier cells defined (ex, cap, ...)."""
    import math

    import torch

    tree = ast.parse(source)
    last = tree.body.pop()
    namespace = {"math": math, "torch": torch, **names}
    exec(compile(tree, "<cell>", "exec"), namespace)
    return eval(compile(ast.Expression(last.value), "<cell>", "eval"), namespace), namespace


def failed_saying(result, *words):
    """Assert a check failed (0 points) and its feedback mentions each of `words`."""
    assert result.status == "failed" and result.points == 0, result
    for w in words:
        assert w.lower() in result.message.lower(), result.message
    return result.message
