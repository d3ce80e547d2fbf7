"""mplab without its optional packages, as on the GPU image (torch, transformers, accelerate,
lightning, pytest, matplotlib, ml-dtypes; no datasets, torchao, ipywidgets, nbformat, nbclient,
jupyter, playwright): every module the training paths, the bench, diagnose and the GPU checks
use imports; a module that needs a missing package says which, and how to install it."""

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import OPTIONAL

ROOT = Path(__file__).resolve().parents[1]

#: The modules that need one of them, and the packages they may miss.
NEEDS = {"mplab.widgets": {"ipywidgets"}, "mplab.exercises.sync": {"nbformat"},
         "mplab.grade.notebook": {"nbformat"}, "mplab.grade.kernel": {"nbclient"},
         "mplab.grade.classroom": {"nbformat", "nbclient"}}

#: Where a user meets them, each saying in words which package it needs and how to get it.
ENTRIES = {"mplab.widgets": "ipywidgets", "mplab.exercises.sync": "nbformat",
           "from mplab.grade import grade_notebook": "nbformat", "load_torchao()": "torchao"}

#: Run in a fresh interpreter: a finder that refuses the absent packages, then every module.
PROBE = """
import importlib, json, pkgutil, sys, warnings
ABSENT = set(sys.argv[1].split(","))

class Hiding:  # a finder that finds nothing of the absent packages, as if not installed
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT:
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, attribute):
        return getattr(self.finder, attribute)

sys.meta_path[:] = [Hiding(f) for f in sys.meta_path]
warnings.simplefilter("ignore")
import mplab
outcome = {}
for info in pkgutil.walk_packages(mplab.__path__, "mplab."):
    if info.name.endswith("__main__"):
        continue
    try:
        importlib.import_module(info.name)
        outcome[info.name] = None
    except ImportError as err:
        outcome[info.name] = [err.name, str(err)]
for entry, code in (("load_torchao()", "from mplab.lowbit.quantize import load_torchao; "
                                        "load_torchao()"),
                    ("from mplab.grade import grade_notebook", "from mplab.grade import "
                                                               "grade_notebook")):
    try:
        exec(code)
        outcome[entry] = None
    except ImportError as err:
        outcome[entry] = [err.name, str(err)]
print(json.dumps(outcome))
"""


def test_the_library_imports_without_the_lessons_packages():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", PROBE, ",".join(OPTIONAL)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(done.stdout.splitlines()[-1])
    assert len(outcome) > 80  # every module was tried
    for name, error in outcome.items():
        if error is None or name in ENTRIES:
            continue
        missing, message = error
        owner = next((m for m in NEEDS if name == m or name.startswith(m + ".")), None)
        assert owner, f"{name} does not import without {missing}: {message}"
        assert missing in NEEDS[owner], (name, missing, message)
    for entry, package in ENTRIES.items():
        assert outcome[entry] is not None, f"{entry} imported without {package}"
        missing, message = outcome[entry]
        assert missing == package, (entry, missing, message)
        assert f"needs {package}, which is not installed" in message, message
        assert f"pip install {package}" in message, message
    # and the parts the GPU checks run are all there
    for name in ("mplab.train", "mplab.train.trainer_path", "mplab.bench", "mplab.diagnosis.lab",
                 "mplab.lowbit.quantize", "mplab.lowbit.qdq", "mplab.train.fp8",
                 "mplab.exercises.lesson7", "mplab.grade.sandbox"):
        assert outcome[name] is None, (name, outcome[name])
