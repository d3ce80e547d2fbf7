"""Lesson 9's recipe explorer, driven as a learner would: each pick shows that recipe's figures,
as mplab.lowbit computes them, and a pick that does not fit says so without losing the view."""

import pytest

pytest.importorskip("ipywidgets", reason="needs ipywidgets, which is not installed")
import torch  # noqa: E402

from mplab import lowbit  # noqa: E402
from mplab.fixtures import lesson_capture  # noqa: E402
from mplab.widgets import lesson9  # noqa: E402
from mplab.widgets._common import static_html  # noqa: E402


@pytest.fixture(scope="module")
def tensors():
    return lowbit.layer_tensors(lesson_capture(), "bert.encoder.layer.0.intermediate.dense")


def shown(w):
    return w.rows.rows[0]


def test_each_pick_shows_that_recipes_figures(tensors):
    w = lesson9.recipe_explorer(tensors, recipe="MXFP4", tensor="activation grad")
    q = lowbit.apply("MXFP4", tensors["activation grad"], 32)
    assert shown(w)["SQNR (dB)"] == round(q.sqnr_db, 2) and w.block.value == 32
    assert shown(w)["flushed to 0"] == f"{100 * q.flushed:.2f} %" and w.figure.value
    w.block.value = 8
    eight = lowbit.apply("MXFP4", tensors["activation grad"], 8)
    assert shown(w)["flushed to 0"] == f"{100 * eight.flushed:.2f} %"
    w.recipe.value = "NVFP4"  # no block to choose: the block menu says so
    assert w.block.options == (lesson9.NO_BLOCK,) and w.rows.title == "NVFP4"
    nvfp4 = lowbit.apply("NVFP4", tensors["activation grad"])
    assert shown(w)["SQNR (dB)"] == round(nvfp4.sqnr_db, 2)
    w.recipe.value = "block 1xN e4m3"
    assert w.block.value == 128 and w.block.options == (32, 64, 128)
    w.tensor.value = "weight"
    assert shown(w)["tensor"] == "weight" and shown(w)["shape"] == "256x128"
    assert "recipe" in static_html(w) and "<img" in static_html(w)


def test_a_tensor_the_blocks_do_not_tile_is_said_not_raised():
    w = lesson9.recipe_explorer({"fits": torch.randn(4, 64), "odd": torch.randn(4, 48)},
                                recipe="MXFP8")
    w.tensor.value = "odd"
    assert "multiple of the block" in w.message.value and w.quantized is None
    w.tensor.value = "fits"
    assert w.message.value == "" and w.quantized is not None


@pytest.mark.parametrize("settings, match", [
    (dict(recipe="MXFP9"), "unknown recipe"),
    (dict(recipe="MXFP4", block=12), "takes a block of"),
    (dict(tensor="bias"), "tensor must be one of"),
])
def test_a_bad_start_says_what_is_accepted(tensors, settings, match):
    with pytest.raises(ValueError, match=match):
        lesson9.recipe_explorer(tensors, **settings)
    with pytest.raises(ValueError, match="dict of name -> 2-D tensor"):
        lesson9.recipe_explorer([torch.ones(2, 2)])
