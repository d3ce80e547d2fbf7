"""Lesson 3's scaler stepper, driven from Python as a learner drives it in the browser.

The reference is torch.amp.GradScaler itself, stepped through the same iterations here."""

import re

import pytest

pytest.importorskip("ipywidgets", reason="needs ipywidgets, which is not installed")
import torch  # noqa: E402

from mplab import plots  # noqa: E402
from mplab.fixtures import ScalerRun  # noqa: E402
from mplab.widgets import lesson3  # noqa: E402
from mplab.widgets.lesson3 import scaler_stepper  # noqa: E402


def torch_run(clicks: list[bool], **settings) -> torch.amp.GradScaler:
    """torch's scaler through the same iterations (True: an inf injected)."""
    run = ScalerRun(torch.amp.GradScaler("cpu", **settings))
    for inject in clicks:
        run.iteration(inject)
    return run.scaler


def test_clicks_step_the_scaler_exactly_as_torch_does():
    stepper = scaler_stepper(init_scale=2.0**10, growth_interval=2)
    clicks = []
    for button, injected in [(stepper.next_step, [False]), (stepper.next_step, [False]),
                             (stepper.inject_inf, [True]), (stepper.ten_steps, [False] * 10),
                             (stepper.inject_inf, [True]), (stepper.next_step, [False])]:
        button.click()
        clicks += injected
        ref = torch_run(clicks, init_scale=2.0**10, growth_interval=2)
        assert stepper.scaler.state_dict() == ref.state_dict()
        assert "✓ torch.amp.GradScaler" in stepper.agreement.value
        assert stepper.message.value == ""
    history = stepper.scaler.history
    assert len(history) == len(clicks) == 15
    assert [r.found_inf for r in history] == clicks
    assert f"scale <b>{ref.get_scale():g}</b>" in stepper.status.value
    assert "2 steps skipped" in stepper.status.value
    last = stepper.table_rows
    assert len(last) == lesson3.ROWS_SHOWN and last[-1]["iteration"] == 15  # from 1
    assert (last[-2]["inf/NaN found"], last[-2]["step"]) == (True, "skipped")
    assert (last[-1]["inf/NaN found"], last[-1]["step"]) == (False, "taken")
    assert last[-1]["new scale"] == ref.get_scale()
    assert [r["scale used"] for r in last[1:]] == [r["new scale"] for r in last[:-1]]
    assert stepper.table.value.count("<tr>") == lesson3.ROWS_SHOWN  # what the table shows


def test_settings_restart_the_run_with_the_new_values():
    stepper = scaler_stepper()
    stepper.next_step.click()
    plot = stepper.plot.value
    stepper.growth_interval.value = 1
    assert stepper.scaler.history == [] and "After 0 iterations" in stepper.status.value
    assert "<tr>" not in stepper.table.value and "No iteration yet" in stepper.table.value
    stepper.growth_factor.value = 1.5
    stepper.backoff_factor.value = 0.25
    stepper.init_scale.value = 4
    stepper.ten_steps.click()  # growth_interval 1: grows by 1.5 every clean step
    ref = torch_run([False] * 10, init_scale=16.0, growth_factor=1.5, backoff_factor=0.25,
                    growth_interval=1)
    assert stepper.scaler.get_scale() == ref.get_scale() == 16.0 * 1.5**10
    stepper.inject_inf.click()
    assert stepper.scaler.get_scale() == torch_run([False] * 10 + [True], init_scale=16.0,
                                                   growth_factor=1.5, backoff_factor=0.25,
                                                   growth_interval=1).get_scale()
    assert stepper.plot.value != plot
    stepper.reset.click()
    assert stepper.scaler.history == [] and stepper.scaler.get_scale() == 16.0


def test_a_failure_inside_a_click_is_shown_not_raised(monkeypatch):
    stepper = scaler_stepper()

    def broken(*args, **kwargs):
        raise RuntimeError("no plot today")

    monkeypatch.setattr(lesson3.plots, "scaler_timeline_plot", broken)
    stepper.next_step.click()
    assert "RuntimeError: no plot today" in stepper.message.value


@pytest.mark.parametrize("bad, words", [
    ({"init_scale": 3.0}, "power of two"), ({"init_scale": 2.0**40}, "power of two"),
    ({"init_scale": "big"}, "power of two"), ({"growth_interval": 0}, "1 to 50"),
    ({"growth_factor": 3.0}, "accepted: 2.0"), ({"backoff_factor": 1.0}, "accepted: 0.5"),
])
def test_bad_settings_say_what_is_accepted(bad, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        scaler_stepper(**bad)


def test_timeline_plot_marks_the_skipped_steps():
    stepper = scaler_stepper(growth_interval=2)
    for b in (stepper.next_step, stepper.inject_inf, stepper.next_step):
        b.click()
    fig = plots.scaler_timeline_plot(stepper.scaler.history, pyplot=False)
    ax = fig.axes[0]
    assert ax.get_title() == "3 iterations, 1 skipped"
    crosses = [line for line in ax.get_lines() if line.get_marker() == "x"]
    assert len(crosses) == 1 and list(crosses[0].get_xdata()) == [2]  # the 2nd iteration
    with pytest.raises(TypeError, match="GradScaler.history"):
        plots.scaler_timeline_plot([1.0, 2.0])


def test_timeline_plot_reads_an_fp16_training_run_like_the_scalers_own_history():
    """Lesson 3's real run: the same staircase and crosses from a TrainResult's record."""
    from mplab.train import TrainResult

    run = TrainResult("torch", "fp16", "cpu", "lesson", losses=[0.7, 0.7, 0.6],
                      scales=[2.0**23, 2.0**22, 2.0**22], skipped_steps=[1, 2],
                      config={"init_scale": 2.0**24})
    ax = plots.scaler_timeline_plot(run, pyplot=False).axes[0]
    assert ax.get_title() == "3 iterations, 2 skipped"
    (staircase,) = [line for line in ax.get_lines() if line.get_marker() != "x"]
    assert list(staircase.get_ydata()) == [24, 23, 22, 22]
    (crosses,) = [line for line in ax.get_lines() if line.get_marker() == "x"]
    assert list(crosses.get_xdata()) == run.skipped_steps  # counted from 1, as the run does
    bf16 = TrainResult("torch", "bf16", "cpu", "lesson", losses=[0.7])
    with pytest.raises(TypeError, match="used no GradScaler"):
        plots.scaler_timeline_plot(bf16)
