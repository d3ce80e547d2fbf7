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


@pytest.fixture(scope="session")
def course_run():
    """The lesson model trained 600 fp32 steps through mplab.train with the course's exact
    call, `model(input_ids, labels=labels)` (no mask) on length-grouped batches: the one long
    run the suite shares (about 25 s on 2 cores). (result, trained model)."""
    from mplab import models
    from mplab.train import train

    model = models.lesson_model(seed=0)
    result = train(model=model, steps=600, attention_mask=False, by_length=True,
                   progress=False, device="cpu")
    print(f"\n600 fp32 steps, no attention mask: {result.train_seconds:.1f} s training "
          f"({result.seconds:.1f} s in all), accuracy {result.eval_accuracy:.3f}")
    return result, model
