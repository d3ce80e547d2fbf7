"""mplab.plots: the figures draw the runs they are given, readably at any length."""

import numpy as np
import pytest

from mplab import plots


def run(precision, losses):
    from mplab.train import TrainResult

    return TrainResult(path="torch", precision=precision, device="cpu", model="lesson",
                       losses=losses)


def test_loss_curves_smooth_every_run_alike_and_draw_one_line_for_equal_runs():
    long = [0.7 - i / 70 for i in range(40)]
    with pytest.warns(plots.LossCurveWarning, match=r"bf16: after 2 steps its loss is still"):
        fig = plots.loss_curves_plot({"fp32": run("fp32", long), "fp16": run("fp16", list(long)),
                                      "bf16": run("bf16", [0.7, 0.69])}, smooth=10,
                                     pyplot=False)
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert "mean of the last 10" in ax.get_title()
    both, bf16 = lines["fp32 = fp16 (same losses, bit for bit)"], lines["bf16: not learning yet"]
    assert both.get_ydata()[9:] == pytest.approx(np.convolve(long, np.ones(10) / 10, "valid"))
    assert both.get_ydata()[:3] == pytest.approx([0.7, 0.7 - 0.5 / 70, 0.7 - 1 / 70])
    assert not any(label in lines for label in ("fp32", "fp16"))  # one line, named for both
    assert lines["chance: ln 2 = 0.693"].get_ydata()[0] == pytest.approx(np.log(2))
    assert list(bf16.get_ydata()) == pytest.approx([0.7, 0.695])  # its mean, from step 1
    assert bf16.get_marker() == "o" and both.get_marker() == "None"  # a short run as dots
    raw = plots.loss_curves_plot([run("fp32", long[::5])], smooth=1, pyplot=False).axes[0]
    assert "mean" not in raw.get_title()
    assert list(raw.get_lines()[0].get_ydata()) == long[::5]


@pytest.mark.parametrize("losses, share", [([0.693] * 12, 0.0), ([0.7, 0.5, 0.35, 0.35, 0.35],
                                                                 0.495), ([], 0.0)])
def test_the_share_learned_is_the_last_quarters_fall_from_chance(losses, share):
    assert plots.learned_share(losses) == pytest.approx(share, abs=1e-3)
