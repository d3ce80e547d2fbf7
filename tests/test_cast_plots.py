"""mplab.cast_plots: the figures draw the numbers mplab.casts and mplab.failures compute."""

import numpy as np
import pytest
from cast_reference import grads_like

from mplab import cast_plots
from mplab import casts as C
from mplab import failures as X
from mplab import histograms as H


def test_exponent_histogram_plot_shades_bands_and_shifts_the_data_by_the_scale():
    x = grads_like()
    mags = {"a": C.Magnitudes(x[:25_000]), "b": C.Magnitudes(x[25_000:])}
    fig = cast_plots.exponent_histogram_plot(mags, "fp16", 2.0**8, pyplot=False)
    ax = fig.axes[0]
    gids = {a.get_gid(): a for a in ax.get_children()}
    assert {"band-zero", "band-subnormal", "band-normal", "band-overflow"} <= set(gids)
    unscaled = gids["hist-unscaled"].get_data().edges
    shifted = gids["hist-all"].get_data().edges
    assert np.array_equal(shifted - unscaled, np.full_like(unscaled, 8.0))
    summary = gids["cast-summary"].get_text()
    st = C.cast_stats(x, "fp16", 2.0**8)
    assert f"{100 * st.underflow / st.nonzero:.3g} %" in summary
    one = cast_plots.exponent_histogram_plot(x, "bf16", pyplot=False)
    assert "hist-unscaled" not in {a.get_gid() for a in one.axes[0].get_children()}
    hist_only = cast_plots.exponent_histogram_plot(H.exponent_histogram(x), "fp8_e5m2", 4.0,
                                              pyplot=False)
    assert hist_only.axes
    sweep_fig = cast_plots.scale_sweep_plot(C.scale_sweep(mags), pyplot=False)
    assert sweep_fig.axes[0].get_xlabel() == "log2 scale"


def test_swamping_plot_draws_the_run_and_marks_the_first_lost_update():
    run = X.swamping_run(1.0, 1e-4, 50, "fp16")
    fig = cast_plots.swamping_plot(run, pyplot=False)
    lines = fig.axes[0].get_lines()
    assert any((line.get_ydata() == run.weights).all() for line in lines)
    assert "50 of 50 updates lost" in fig.axes[0].get_title()
    master = cast_plots.swamping_plot(X.swamping_run(1.0, 1e-4, 50, "fp16", master=True),
                                 pyplot=False)
    assert len(master.axes[0].get_lines()) == 3  # exact, master, the weight used
    with pytest.raises(TypeError, match="swamping_run"):
        cast_plots.swamping_plot([1.0, 2.0])
