"""Packages only some of mplab needs: the lessons' widgets and notebooks (ipywidgets, nbformat,
nbclient), the Trainer's data library (datasets), torchao. The library's training paths, the
bench, diagnose and the GPU checks import without them (pyproject's extras say which part needs
which); a part that needs one says so, by name, when it is used without it."""

from __future__ import annotations

import importlib

__all__ = ["require"]


def require(package: str, needed_for: str):
    """`package` imported, or a ModuleNotFoundError naming it, what needs it and how to install
    it (a ModuleNotFoundError, so code that checks for a missing module still recognises it)."""
    try:
        return importlib.import_module(package)
    except ModuleNotFoundError as err:
        if err.name != package.split(".")[0]:
            raise  # the package is there and something it imports is not: its own error
        raise ModuleNotFoundError(
            f"{needed_for} needs {package}, which is not installed here: "
            f"pip install -r requirements.txt installs the lessons' whole stack "
            f"(or pip install {package.split('.')[0]})", name=err.name) from None
