"""mplab.plots: the figures draw the runs they are given, readably at any length."""

import numpy as np
import pytest

from mplab import plots


def test_loss_curves_draw_a_mean_only_where_a_run_is_long_enough_and_keep_equal_runs_apart():
    from mplab.train import TrainResult

    def run(precision, losses):
        return TrainResult(path="torch", precision=precision, device="cpu", model="lesson",
                           losses=losses)

    long = [1.0 - i / 100 for i in range(40)]
    fig = plots.loss_curves_plot({"fp32": run("fp32", long), "fp16": run("fp16", list(long)),
                                  "bf16": run("bf16", [0.7, 0.69])}, smooth=10, pyplot=False)
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert "mean of 10 steps" in ax.get_title()
    fp32, fp16, bf16 = lines["fp32"], lines["fp16"], lines["bf16"]
    assert fp32.get_ydata() == pytest.approx(np.convolve(long, np.ones(10) / 10, "valid"))
    assert fp32.get_linestyle() != fp16.get_linestyle()  # the same losses, both visible
    assert list(bf16.get_ydata()) == [0.7, 0.69] and bf16.get_marker() == "o"
    short = plots.loss_curves_plot([run("fp32", long[:8])], smooth=10, pyplot=False).axes[0]
    assert "mean" not in short.get_title()
    assert len(short.get_lines()[0].get_ydata()) == 8
