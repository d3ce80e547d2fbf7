"""Lesson 2's widgets, driven from Python as a learner drives them in the browser.

Every number a widget shows is compared with direct torch casts of the same tensors, or with
mplab.numerics.casts and mplab.numerics.failures where the reference is a sum or a run of steps."""

import re

import pytest

pytest.importorskip("ipywidgets", reason="needs ipywidgets, which is not installed")
import torch  # noqa: E402

from mplab.amp.capture import Capture, capture  # noqa: E402
from mplab.models import lesson_model  # noqa: E402
from mplab.numerics.casts import largest_safe_scale  # noqa: E402
from mplab.numerics.failures import swamping_run  # noqa: E402
from mplab.numerics.formats import dtype_of  # noqa: E402
from mplab.widgets import lesson2  # noqa: E402
from mplab.widgets.lesson2 import loss_scale_explorer, swamping_demo  # noqa: E402


@pytest.fixture(scope="module")
def cap():
    """A real step of the lesson model on a small random batch: quick, with real layer names."""
    model = lesson_model()
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(5, model.config.vocab_size, (4, 16), generator=g),
             "attention_mask": torch.ones(4, 16, dtype=torch.long),
             "labels": torch.tensor([0, 1, 1, 0])}
    return capture(model, batch)


def torch_lost(t: torch.Tensor, precision: str, scale: float) -> tuple[int, int, int]:
    """(nonzero, flushed to 0, overflowed to inf) when torch casts t * scale to the format."""
    x = t.float() * scale
    alive = (x != 0) & torch.isfinite(x)
    y = x.to(dtype_of(precision)).float()
    over = alive & ~torch.isfinite(y)
    return int(alive.sum()), int((alive & (y == 0)).sum()), int(over.sum())


def table_rows(explorer) -> dict[str, dict]:
    """The per-layer table's rows, by layer name."""
    return {r["layer"]: r for r in explorer.table_rows}


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp8_e5m2"])
@pytest.mark.parametrize("k", [0, 9, 17, 24])
def test_moving_the_slider_shows_what_torch_casts_do_to_each_layer(cap, precision, k):
    explorer = loss_scale_explorer(cap, "activation_grads", precision)
    explorer.slider.value = k
    assert explorer.scale == 2.0**k and explorer.message.value == ""
    shown = table_rows(explorer)
    assert list(shown) == list(cap.activation_grads)
    totals = [0, 0, 0]
    for name, t in cap.activation_grads.items():
        nonzero, lost, over = torch_lost(t, precision, 2.0**k)
        totals = [a + b for a, b in zip(totals, (nonzero, lost, over))]
        row = shown[name]
        assert row["nonzero"] == nonzero, name
        assert row["lost (of nonzero)"] == (lost / nonzero if nonzero else 0.0), name
        assert row["overflow (of nonzero)"] == (over / nonzero if nonzero else 0.0), name
        assert row["type"] == cap.layer_types[name]
        assert row["max |x·scale|"] == t.abs().max().item() * 2.0**k
    nonzero, lost, over = totals
    total = explorer.total
    assert (total.nonzero, total.underflow, total.overflow) == (nonzero, lost, over)
    assert f"of the {nonzero:,} nonzero values" in explorer.summary.value
    assert f"<b>{lesson2.percent(lost / nonzero)}</b> lost to 0" in explorer.summary.value
    assert f"{lesson2.percent(over / nonzero)} overflow" in explorer.summary.value
    assert f"At scale 2^{k} " in explorer.summary.value
    assert explorer.table.value.count("<tr>") == len(cap.activation_grads)
    assert "lost (of nonzero)</th>" in explorer.table.value  # the header names the denominator


def test_the_explorer_axis_reaches_the_smallest_gradient_and_the_largest_at_2_24(cap):
    mags = [m for m in cap.magnitudes("activation_grads").values() if m.values.size]
    lo, hi = lesson2._xlim(cap, "activation_grads")
    assert lo < torch.tensor(min(m.min_abs for m in mags)).log2().item()
    assert hi > torch.tensor(max(m.max_abs for m in mags) * 2.0**24).log2().item()


def test_the_slider_changes_the_table_and_the_plot_and_a_big_scale_overflows(cap):
    explorer = loss_scale_explorer(cap)
    before_table, before_plot = explorer.table.value, explorer.plot.value
    assert bytes(before_plot).startswith(b"\x89PNG")
    safe = largest_safe_scale(list(cap.magnitudes("activation_grads").values()), "fp16")
    k = int(safe).bit_length()  # one binade past the safe scale: something overflows
    explorer.log2_scale = k
    assert explorer.table.value != before_table and explorer.plot.value != before_plot
    assert f"Largest safe scale for fp16: 2^{k - 1}" in explorer.summary.value
    assert 'color:#b00020;font-weight:bold">' in explorer.summary.value.split("subnormal")[1]
    explorer.log2_scale = k - 1
    assert "0 overflow" in explorer.summary.value


def test_format_kind_and_layer_controls(cap):
    explorer = loss_scale_explorer(cap, log2_scale=0)
    fp16_lost = explorer.stats
    explorer.precision.value = "bf16"  # fp32's range: nothing flushes at scale 1
    assert all(st.underflow == 0 for st in explorer.stats.values())
    assert any(st.underflow for st in fp16_lost.values())
    explorer.kind.value = "weight_grads"
    assert list(table_rows(explorer)) == list(cap.weight_grads)
    assert explorer.layer.options[0] == (f"all {len(cap.weight_grads)} tensors", "")
    assert explorer.layer.value == ""
    whole = explorer.plot.value
    explorer.layer.value = "classifier.weight"
    assert explorer.plot.value != whole and explorer.message.value == ""
    assert list(table_rows(explorer)) == list(cap.weight_grads)  # the table keeps every layer


def test_a_failure_inside_a_callback_is_shown_not_raised(cap, monkeypatch):
    explorer = loss_scale_explorer(cap)

    def broken(*args, **kwargs):
        raise RuntimeError("the plot broke")

    monkeypatch.setattr(lesson2.plots, "exponent_histogram_plot", broken)
    explorer.slider.value = 5  # must not raise into the kernel
    assert "RuntimeError: the plot broke" in explorer.message.value


@pytest.mark.parametrize("bad, error, words", [
    ({"capture": "grads"}, TypeError, "mplab.amp.capture.capture"),
    ({"kind": "gradients"}, ValueError, "'activation_grads'"),
    ({"precision": "fp32"}, ValueError, "'fp16'"),
    ({"precision": "fp17"}, ValueError, "fp17"),
    ({"log2_scale": 30}, ValueError, "0 to 24"),
    ({"log2_scale": 2.5}, ValueError, "0 to 24"),
])
def test_bad_explorer_arguments_say_what_is_accepted(cap, bad, error, words):
    args = {"capture": cap, **bad}
    with pytest.raises(error, match=re.escape(words)):
        loss_scale_explorer(**args)


def test_a_capture_without_that_kind_says_so(cap):
    empty = Capture(cap.activations, {}, cap.weight_grads, cap.loss, cap.layer_types)
    explorer = loss_scale_explorer(empty)
    assert "holds no activation grads" in explorer.summary.value and explorer.table.value == ""
    assert explorer.table_rows == [] and explorer.total is None


# --- swamping -----------------------------------------------------------------------------------

def test_swamping_demo_matches_torch_and_master_weights_fix_it():
    demo = swamping_demo()  # w0 = 1, update 1e-4, fp16: below half an ulp of 1
    w = torch.tensor(1.0, dtype=torch.float16)
    assert (w + torch.tensor(1e-4, dtype=torch.float16)) == w  # torch agrees: lost
    assert demo.run.lost_steps == 1000 and demo.run.final == 1.0
    assert "<b>1,000 of 1,000 updates lost</b>" in demo.summary.value
    demo.master.value = True
    master = torch.tensor(1.0)
    for _ in range(1000):
        master += torch.tensor(1e-4)
    assert demo.run.lost_steps == 0 and demo.run.final == master.half().item()
    assert "<b>0 of 1,000 updates lost</b>" in demo.summary.value
    assert demo.master.icon == "check"


def test_swamping_demo_learning_rate_and_format():
    demo = swamping_demo()
    plot = demo.plot.value
    demo.lr.value = 1e-2  # above half an ulp of fp16 near 1..11: nothing lost
    expected = swamping_run(1.0, demo.lr.value, 1000, "fp16")
    assert demo.run.lost_steps == expected.lost_steps == 0
    assert demo.plot.value != plot
    demo.lr.value = 1e-3
    demo.precision.value = "bf16"  # bf16's ulp at 1 is 2^-7: 1e-3 is lost
    assert demo.run.lost_steps == 1000
    assert "In bf16, an update of 0.001 vanishes once |w| ≥ 0.5" in demo.summary.value
    demo.precision.value = "fp32"
    assert demo.run.lost_steps == 0


@pytest.mark.parametrize("grad, does", [(-1.0, "adds lr"), (-2.0, "adds 2 × lr"),
                                        (0.5, "subtracts 0.5 × lr"), (0.0, "never moves")])
def test_the_update_rule_reads_without_a_minus_of_a_minus(grad, does):
    demo = swamping_demo(grad=grad, lr=1e-2)  # large enough not to be swamped
    run = demo.run  # what the rule says is what the run did
    assert (run.final > run.w0 if "adds" in does else
            run.final < run.w0 if "subtracts" in does else run.final == run.w0)
    header, shown = demo.children[0].value, demo._repr_mimebundle_()["text/html"]
    for text in (header, shown):  # the live widget and its static view
        assert does in text and "w ← w − lr × g" in text
        assert "(-" not in text and "(−" not in text and "- -" not in text
    if grad < 0:
        assert f"g = −{abs(grad):g}" in header


@pytest.mark.parametrize("bad, words", [
    ({"lr": 5.0}, "1e-6 to 1"), ({"lr": "big"}, "1e-6 to 1"), ({"steps": -1}, "steps"),
    ({"precision": "int8"}, "int8"), ({"precision": "tf32"}, "'fp16'"),
    ({"w0": float("nan")}, "w0"),
])
def test_bad_swamping_arguments_say_what_is_accepted(bad, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        swamping_demo(**bad)
