"""The import paths mplab 0.1.0 published (the README, the lessons) still work for one release:
each old module hands back its new home, with an MplabDeprecationWarning that names it."""

import importlib
import subprocess
import sys

import pytest

import mplab
from mplab._moved import MOVED, SPLIT


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_hands_back_its_new_module_and_says_where(old):
    new = importlib.import_module(MOVED[old])
    sys.modules.pop(old, None)
    with pytest.warns(mplab.MplabDeprecationWarning, match=f"{old} moved to {MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is new


def test_a_split_module_finds_each_name_in_its_new_home():
    from mplab.train.errors import TrainWarning
    from mplab.train.processes import Processes
    from mplab.train.run import decay_groups

    sys.modules.pop("mplab.train.common", None)
    with pytest.warns(mplab.MplabDeprecationWarning, match="mplab.train.common moved to"):
        common = importlib.import_module("mplab.train.common")
    assert (common.decay_groups, common.TrainWarning, common.Processes) == (
        decay_groups, TrainWarning, Processes)
    with pytest.raises(AttributeError, match="split into mplab.train.errors"):
        common.no_such_name  # noqa: B018
    assert set(SPLIT) == {"mplab.train.common"}


def test_the_old_imports_a_notebook_wrote_run_in_a_fresh_process():
    """`from mplab import formats as F`, lesson 4's widget module, the README's mplab.plan:
    each runs, warns once, and is the same object as the new path's."""
    pytest.importorskip("ipywidgets", reason="needs ipywidgets, which is not installed")
    code = (
        "import warnings\n"
        "warnings.simplefilter('error')\n"  # any warning but ours would fail here
        "warnings.filterwarnings('default', category=__import__('mplab').MplabDeprecationWarning)\n"
        "from mplab import formats as F, lab, lessons\n"
        "from mplab.widgets.lesson4 import training_panel\n"
        "import mplab.plan\n"
        "from mplab.numerics import formats\n"
        "from mplab.widgets.training import training_panel as new_panel\n"
        "assert F is formats and training_panel is new_panel\n"
        "assert F.round_to(0.1, 'bf16') == 0.10009765625\n"
        "assert mplab.plan.memory is __import__('mplab.train.plan', fromlist=['memory']).memory\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    said = [line for line in done.stderr.splitlines() if "MplabDeprecationWarning" in line]
    assert len(said) == 5, done.stderr  # formats, lab, lessons, widgets.lesson4, plan


def test_a_name_that_never_existed_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("mplab.no_such_module")
