"""Matplotlib figures the lessons share. Every number drawn is computed by mplab.

    from mplab import plots
    plots.ulp_plot(); plots.exponent_histogram_plot(mags, "fp16", 2**10)
    plots.loss_curves_plot({"fp32": r32, "bf16": r16})

`formats`: each format's colour, a figure of the lessons' size, the spacing of a format's
numbers (lesson 1); `casts`: what a cast does to a tensor's values (lesson 2); `training`: a
loss scaler's run, training losses, what a library takes over, each layer's numbers over the
steps (lessons 3-7, 9). Every name is
re-exported here.
"""

from mplab.plots import casts, formats, training
from mplab.plots.casts import (
    BAND_COLORS,
    exponent_histogram_plot,
    scale_sweep_plot,
    swamping_plot,
)
from mplab.plots.formats import (
    FORMAT_COLORS,
    MarkerPng,
    closeup_range,
    mark_ulp,
    new_figure,
    ulp_plot,
    ulp_steps,
)
from mplab.plots.training import (
    LossCurveWarning,
    layers_plot,
    learned_share,
    loss_curves_plot,
    paths_chart,
    running_mean,
    scaler_timeline_plot,
)

__all__ = ["formats", "casts", "training", "BAND_COLORS", "exponent_histogram_plot",
           "scale_sweep_plot", "swamping_plot", "FORMAT_COLORS", "MarkerPng", "closeup_range",
           "mark_ulp", "new_figure", "ulp_plot", "ulp_steps", "LossCurveWarning", "layers_plot",
           "learned_share",
           "loss_curves_plot", "paths_chart", "running_mean", "scaler_timeline_plot"]
