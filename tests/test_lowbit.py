"""Lesson 9's readings of the model's tensors: each recipe's SQNR, flushed and saturated shares
and bytes, computed from the recipes (tests/test_quantize.py holds them to torchao) and checked
here against a direct count."""

import math

import numpy as np
import pytest
import torch

from mplab import lowbit
from mplab.fixtures import lesson_capture

LAYER = "bert.encoder.layer.0.intermediate.dense"


@pytest.fixture(scope="module")
def tensors():
    return lowbit.layer_tensors(lesson_capture(), LAYER)


def test_a_layers_four_tensors_are_its_captured_ones(tensors):
    cap = lesson_capture()
    assert list(tensors) == ["activation", "activation grad", "weight", "weight grad"]
    assert torch.equal(tensors["weight"], cap.weights[f"{LAYER}.weight"])
    assert torch.equal(tensors["activation grad"],
                       cap.activation_grads[LAYER].reshape(-1, 256))
    with pytest.raises(ValueError, match="not a captured Linear layer; accepted: .*query"):
        lowbit.layer_tensors(cap, "bert.nope")


@pytest.mark.parametrize("recipe", lowbit.RECIPES)
def test_every_recipes_figures_are_a_direct_count(recipe, tensors):
    x = tensors["activation grad"]
    q = lowbit.apply(recipe, x)
    nonzero = x != 0
    assert q.flushed == ((q.dequantized == 0) & nonzero).sum().item() / nonzero.sum().item()
    noise = (x.double() - q.dequantized.double()).pow(2).sum().item()
    assert q.sqnr_db == pytest.approx(10 * math.log10(x.double().pow(2).sum().item() / noise))
    h = lowbit.scaled_histogram(q)
    assert h["counts"].sum() == h["values"] == ((q.scaled != 0) & q.scaled.isfinite()).sum()
    assert h["flushed"] / nonzero.sum().item() == pytest.approx(q.flushed, abs=1e-9)
    assert h["saturated"] / nonzero.sum().item() == pytest.approx(q.saturated, abs=1e-9)


def test_the_table_shows_each_recipe_per_tensor_and_names_the_best(tensors):
    table = lowbit.recipe_table(tensors)
    assert [r["tensor"] for r in table.rows] == list(tensors)
    sqnr = {r: float(table.rows[1][r]) for r in lowbit.RECIPES}
    best = max(sqnr, key=sqnr.get)
    assert f"activation grad: best {best}" in table.note
    flushed = lowbit.recipe_table(tensors, "flushed")
    # one scale per tensor flushes gradients that a scale per 1x128 tile keeps
    share = {r: float(flushed.rows[1][r].rstrip(" %")) for r in lowbit.RECIPES}
    assert share["tensorwise e4m3"] > 10 * max(share["block 1xN e4m3"], 0.01)
    with pytest.raises(ValueError, match="measure must be one of"):
        lowbit.recipe_table(tensors, "snr")


def test_blocks_that_do_not_tile_a_tensor_show_a_dash():
    table = lowbit.recipe_table({"odd": torch.randn(4, 48)}, recipes=["MXFP8", "tensorwise e4m3"])
    assert table.rows[0]["MXFP8"] == "-" and table.rows[0]["tensorwise e4m3"] != "-"


def test_smaller_blocks_flush_less_around_outliers():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 512, generator=g) * 0.01
    x[:, ::64] = 10.0
    rows = lowbit.outlier_blocks(x, "MXFP4").rows
    flushed = [float(r["flushed to 0"].rstrip(" %")) for r in rows]
    assert flushed == sorted(flushed) and flushed[0] < flushed[-1]
    assert [r["bytes per value"] for r in rows] == sorted(
        (r["bytes per value"] for r in rows), reverse=True)


@pytest.mark.parametrize("recipe, block, match", [
    ("MXFP9", None, "unknown recipe 'MXFP9'; accepted"),
    ("NVFP4", 32, "no block size to choose"),
    ("MXFP4", 12, "takes a block of 8, 16, 32, 64, 128"),
])
def test_bad_recipes_and_blocks_say_what_is_accepted(recipe, block, match):
    with pytest.raises(ValueError, match=match):
        lowbit.apply(recipe, torch.randn(4, 64), block)


def test_the_plot_marks_the_formats_range(tensors):
    q = lowbit.apply("MXFP4", tensors["activation grad"])
    fig = lowbit.plot_scaled(q)
    ax = fig.axes[0]
    lines = sorted(line.get_xdata()[0] for line in ax.lines)
    assert lines == pytest.approx([math.log2(0.25), math.log2(6.0)])
    assert "flushed" in ax.get_title() and f"{100 * q.flushed:.2f} %" in ax.get_title()
    h = lowbit.scaled_histogram(q)
    assert np.isclose(sum(p.get_height() for p in ax.patches), h["counts"].sum())


@pytest.mark.parametrize("recipe", ["MXFP8", "tensorwise e4m3", "NVFP4"])
def test_the_plot_draws_every_lost_value_red_and_counts_the_zeros_it_leaves_out(recipe, tensors):
    """Flushed and saturated values are red in whichever bin they fall (a bin straddling the
    format's top holds both kinds); the source's exact zeros are said in the legend."""
    q = lowbit.apply(recipe, tensors["activation grad"])
    h = lowbit.scaled_histogram(q)
    assert h["flushed_counts"].sum() == h["flushed"] and h["saturated_counts"].sum() == h[
        "saturated"]
    assert h["zeros"] == (q.scaled == 0).sum().item()
    ax = lowbit.plot_scaled(q).axes[0]
    from matplotlib.colors import to_rgb

    red = [p.get_height() for p in ax.patches
           if np.allclose(p.get_facecolor()[:3], to_rgb("#c44e52"))]
    assert sum(red) == h["flushed"] + h["saturated"] > 0
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(f"{h['zeros']:,} exact zeros" in t for t in legend) == (h["zeros"] > 0)


def test_the_delayed_table_is_delayed_scalings_own_run():
    from mplab.lowbit.quantize import DelayedScaling

    steps = [torch.full((8,), v) for v in (1.0, 3.0, 1.0)]
    rows = lowbit.delayed_table(steps, history_len=2, margins=(0, 1)).rows
    d = DelayedScaling(history_len=2, margin=1)
    for row, x in zip(rows, steps):
        q = d.quantize(x)
        assert row["saturated (margin 1)"] == f"{100 * q.saturated:.1f} %"
        assert row["times (margin 1)"] == round(1 / q.scale.item(), 4)
    assert rows[1]["saturated (margin 0)"] == "100.0 %" and rows[0]["times (margin 0)"] == 1.0
    assert [r["recipe"] for r in lowbit.recipes_table().rows] == list(lowbit.RECIPES)
