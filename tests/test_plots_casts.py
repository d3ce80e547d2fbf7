"""mplab.plots.casts: the figures draw the numbers mplab.numerics.casts and
mplab.numerics.failures compute."""

import math

import numpy as np
import pytest
import torch
from cast_reference import grads_like

from mplab import plots
from mplab.numerics import casts as C
from mplab.numerics import failures as X
from mplab.numerics import histograms as H


def test_exponent_histogram_plot_shades_bands_and_shifts_the_data_by_the_scale():
    x = grads_like()
    mags = {"a": C.Magnitudes(x[:25_000]), "b": C.Magnitudes(x[25_000:])}
    fig = plots.exponent_histogram_plot(mags, "fp16", 2.0**8, pyplot=False)
    ax = fig.axes[0]
    gids = {a.get_gid(): a for a in ax.get_children()}
    assert {"band-zero", "band-subnormal", "band-normal", "band-overflow"} <= set(gids)
    unscaled = gids["hist-unscaled"].get_data().edges
    shifted = gids["hist-all"].get_data().edges
    assert np.array_equal(shifted - unscaled, np.full_like(unscaled, 8.0))
    summary = gids["cast-summary"].get_text()
    st = C.cast_stats(x, "fp16", 2.0**8)  # the box's shares are the table's (of nonzero)
    row = st.row()
    assert f"of the {st.nonzero:,} nonzero values" in summary
    assert f"lost to 0  {100 * row['lost (of nonzero)']:.3g} %" in summary
    assert f"subnormal  {100 * row['subnormal (of nonzero)']:.3g} %" in summary
    one = plots.exponent_histogram_plot(x, "bf16", pyplot=False)
    assert "hist-unscaled" not in {a.get_gid() for a in one.axes[0].get_children()}
    hist_only = plots.exponent_histogram_plot(H.exponent_histogram(x), "fp8_e5m2", 4.0,
                                              pyplot=False)
    assert hist_only.axes


def test_the_histogram_axis_reaches_the_smallest_and_largest_values():
    x = torch.cat([grads_like(), torch.tensor([2.0**-81, -(2.0**-77)])])  # far below 2^-60
    ax = plots.exponent_histogram_plot(x, "fp16", pyplot=False).axes[0]
    lo, hi = ax.get_xlim()
    assert lo <= -81 and hi >= math.log2(30.0)
    drawn = {a.get_gid(): a for a in ax.get_children()}["hist-all"].get_data()
    assert drawn.edges[0] == -81 and drawn.values.sum() == pytest.approx(1.0)  # all of them
    fixed = plots.exponent_histogram_plot(x, "fp16", bins=range(-60, 20), pyplot=False)
    legend = [t.get_text() for t in fixed.axes[0].get_legend().get_texts()]
    assert any("2 values outside" in t for t in legend), legend


def test_the_sweep_curve_and_its_window_share_one_denominator():
    x = grads_like()
    sweep = C.scale_sweep(x, "fp16")
    fig = plots.scale_sweep_plot(sweep, underflow_tol=0.05, pyplot=False)
    ax = fig.axes[0]
    assert ax.get_xlabel() == "log2 scale" and "nonzero" in ax.get_ylabel()
    gids = {a.get_gid(): a for a in ax.get_children()}
    lost = gids["sweep-lost"].get_ydata()
    assert list(lost) == sweep.column("lost (of nonzero)")
    lo, hi = C.good_scale_window(sweep, underflow_tol=0.05)
    inside = [y for k, y in zip(gids["sweep-lost"].get_xdata(), lost)
              if math.log2(lo) <= k <= math.log2(hi)]
    before = [y for k, y in zip(gids["sweep-lost"].get_xdata(), lost) if k < math.log2(lo)]
    assert max(inside) <= 0.05 < before[-1]  # the window starts where the drawn curve crosses
    span = gids["sweep-window"]  # a Rectangle in data x
    assert (span.get_x(), span.get_x() + span.get_width()) == (math.log2(lo), math.log2(hi))
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "good scales: lost ≤ 5 %, no overflow" in legend
    none = plots.scale_sweep_plot(C.scale_sweep(torch.tensor([2.0**-40, 1e4])),
                                       underflow_tol=0.0, pyplot=False)
    assert "no scale loses" in {a.get_gid(): a for a in none.axes[0].get_children()}[
        "sweep-no-window"].get_text()


def test_swamping_plot_draws_the_run_and_marks_the_first_lost_update():
    run = X.swamping_run(1.0, 1e-4, 50, "fp16")
    fig = plots.swamping_plot(run, pyplot=False)
    lines = fig.axes[0].get_lines()
    assert any((line.get_ydata() == run.weights).all() for line in lines)
    assert "50 of 50 updates lost" in fig.axes[0].get_title()
    master = plots.swamping_plot(X.swamping_run(1.0, 1e-4, 50, "fp16", master=True),
                                 pyplot=False)
    assert len(master.axes[0].get_lines()) == 3  # exact, master, the weight used
    with pytest.raises(TypeError, match="swamping_run"):
        plots.swamping_plot([1.0, 2.0])


@pytest.mark.parametrize("precision, scale", [("fp16", 1.0), ("fp16", 2.0**19),
                                              ("fp8_e4m3", 16.0), ("fp8_e5m2", 1.0)])
def test_the_histogram_labels_are_readable_and_overlap_nothing(precision, scale):
    x = torch.cat([grads_like(), torch.tensor([2.0**-81])])  # a wide axis: narrow bands
    mags = {f"bert.encoder.layer.{i}.attention.self.query": C.Magnitudes(x[i::5])
            for i in range(5)}  # long layer names in the legend
    fig = plots.exponent_histogram_plot(mags, precision, scale, pyplot=False)
    fig.canvas.draw()
    ax, r = fig.axes[0], fig.canvas.get_renderer()
    labels = [a for a in ax.texts if (a.get_gid() or "").startswith("band-label-")]
    assert {a.get_gid() for a in labels} == {"band-label-zero", "band-label-subnormal",
                                             "band-label-normal", "band-label-overflow"}
    boxes = [a.get_window_extent(r) for a in labels]
    for i, b in enumerate(boxes):  # each band's name, upright, inside the axes, apart
        assert labels[i].get_rotation() == 0 and labels[i].get_fontsize() >= 9
        assert ax.bbox.x0 <= b.x0 and b.x1 <= ax.bbox.x1 + 0.5, labels[i].get_text()
        assert not any(b.overlaps(o) for o in boxes[i + 1:]), labels[i].get_text()
    side = [ax.get_legend().get_window_extent(r),
            next(a for a in ax.texts if a.get_gid() == "cast-summary").get_window_extent(r)]
    for b in side:  # legend and summary box: inside the figure, apart from each other
        assert b.x1 <= fig.bbox.x1 and b.y0 >= fig.bbox.y0
    assert not side[0].overlaps(side[1])
    assert all(t.get_fontsize() >= 9 for t in ax.get_legend().get_texts())
