"""Thin ipywidgets views over the mplab library: one module per lesson, and `training`, the
training panel lessons 4-6 share.

    from mplab.widgets import precision_explorer, training_panel
    precision_explorer(0.1)                   # lesson 1 (and the explorer page)

A widget builds its controls, wires callbacks that call library functions, and returns;
every number it shows is computed by the library. Each widget is imported on first use, so a
lesson loads only its own.
"""

from __future__ import annotations

import importlib

from mplab._optional import require

require("ipywidgets", "mplab.widgets (the lessons' widgets)")

#: widget -> the module that builds it.
WIDGETS = {
    "precision_explorer": "lesson1", "loss_scale_explorer": "lesson2", "swamping_demo": "lesson2",
    "scaler_stepper": "lesson3", "training_panel": "training", "comparison": "training",
    "failure_lab": "lesson7", "speedup_profile": "lesson7", "planner": "lesson8",
    "recipe_explorer": "lesson9",
}

__all__ = ["WIDGETS", "lesson1", "lesson2", "lesson3", "training", "lesson7", "lesson8", "lesson9",
           *WIDGETS]


def __getattr__(name: str):
    if name in WIDGETS:
        return getattr(importlib.import_module(f".{WIDGETS[name]}", __name__), name)
    raise AttributeError(f"module 'mplab.widgets' has no attribute {name!r}")
