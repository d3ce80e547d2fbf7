"""Lesson 8's planner widget: what it shows is mplab.train.plan's, and a setting it refuses is said
in the widget, never raised into the kernel."""

import pytest

pytest.importorskip("ipywidgets", reason="needs ipywidgets, which is not installed")

from mplab.train import plan  # noqa: E402
from mplab.widgets import lesson8  # noqa: E402
from mplab.widgets._common import static_html  # noqa: E402


def test_the_planner_shows_the_plans_parts_and_whether_they_fit():
    w = lesson8.planner(parameters=70e9, world_size=8, policy="bf16_master", sharding="zero3")
    expected = plan.memory(70e9, "bf16_master", 8, "zero3")
    assert w.memory == expected
    assert [r["part"] for r in w.rows.rows] == ["weights", "gradients", "master", "optimizer"]
    assert sum(r["GB per GPU"] for r in w.rows.rows) == pytest.approx(expected.peak / 1e9)
    assert "does not fit" in w.view.value and "140 GB" in w.view.value
    w.ranks.value = 64
    assert w.memory.gb_per_rank == pytest.approx(17.5) and ">fits</b>" in w.view.value
    w.gpu.value = 141
    w.policy.value = "amp"
    w.sharding.value = "ddp"
    assert w.memory == plan.memory(70e9, "amp", 64, "ddp")
    assert [r["part"] for r in w.rows.rows][-1] == "buckets"
    assert "141 GB" in w.view.value
    assert "GB per GPU" in static_html(w)  # a page without a kernel shows the table too


def test_a_refused_setting_is_said_and_the_next_one_works():
    w = lesson8.planner()
    w.ranks.value = 4
    w.sharding.value = "none"  # one process only: the planner refuses 4
    assert w.memory is None and "sharding=&#x27;none&#x27; is one process" in w.message.value
    w.ranks.value = 1
    assert w.memory is not None and w.message.value == ""


@pytest.mark.parametrize("settings, words", [(dict(policy="fp8"), "accepted: 'fp32'"),
                                             (dict(world_size=3), "must be one of"),
                                             (dict(gpu_gb=40), "must be one of")])
def test_a_bad_start_is_a_clear_error(settings, words):
    with pytest.raises(ValueError, match=words):
        lesson8.planner(**settings)
