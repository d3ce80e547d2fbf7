"""Lesson 7's failure lab, driven from Python as a learner drives it in the browser.

The reference is mplab.diagnosis.lab and mplab.diagnose called directly: the widget must show what
they say, and decide "fixed" by whether diagnose still finds the failure's cause."""

import dataclasses
import html
import re

import pytest

pytest.importorskip("ipywidgets", reason="needs ipywidgets, which is not installed")

from mplab import diagnose  # noqa: E402
from mplab.diagnosis import CAUSES, Diagnosis, Finding, lab  # noqa: E402
from mplab.train import NonFiniteLossError, TrainResult  # noqa: E402
from mplab.widgets.lesson7 import failure_lab, verdict  # noqa: E402


def text(value: str) -> str:
    """What an HTML widget's value reads as on the page."""
    return html.unescape(re.sub(r"<[^>]+>", "", value))


def replace_runner(monkeypatch, name: str, runner) -> None:
    monkeypatch.setitem(lab.FAILURES, name,
                        dataclasses.replace(lab.FAILURES[name], runner=runner))


def test_run_it_reproduces_the_failure_and_shows_diagnose_naming_it():
    panel = failure_lab("clip_before_unscale", steps=12)
    panel.run_button.click()
    reference = lab.run("clip_before_unscale", steps=12)
    assert panel.message.value == "" and panel.fixed is None and panel.verdict.value == ""
    assert panel.broken.losses == reference.losses  # the same seeded run
    found = panel.diagnoses["broken"]
    assert found.cause == "clip_before_unscale" and found.names == diagnose(reference).names
    assert found._repr_html_() in panel.views["broken"].value
    (row,) = panel.rows
    assert row == {"failure": "clip_before_unscale", "fix": "none (broken)", "steps": 12,
                   "final loss": reference.final_loss, "skipped steps": 0,
                   "final scale": reference.scales[-1], "diagnose's cause": "clip_before_unscale"}
    assert bytes(panel.plot.value).startswith(b"\x89PNG")
    assert "clip_before_unscale" in text(panel.table.value)


def test_applying_the_fix_removes_the_cause_and_the_verdict_says_fixed():
    panel = failure_lab("no_scaler", steps=10)
    assert panel.fix.value == "scaler"  # the lesson's fix is offered first
    panel.run_button.click()
    assert panel.diagnoses["broken"].cause == "no_scaler"
    assert not panel.broken.scales  # no GradScaler ran
    panel.fix_button.click()
    fixed = panel.diagnoses["fixed"]
    assert "no_scaler" not in fixed and fixed.names == diagnose(panel.fixed).names
    assert text(panel.verdict.value).startswith(
        "fixed: diagnose no longer finds fp16 without a GradScaler")
    assert fixed._repr_html_() in panel.views["fixed"].value
    assert [(r["fix"], r["steps"]) for r in panel.rows] == [("none (broken)", 10), ("scaler", 10)]
    assert panel.rows[1]["final scale"] == panel.fixed.scales[-1]
    assert panel.rows[1]["diagnose's cause"] == (fixed.cause or "none")
    assert panel.broken is not None  # both runs kept, overlaid in the plot


def test_a_fix_that_leaves_the_cause_says_still_there(monkeypatch):
    broken_anyway = lab.FAILURES["no_scaler"].runner
    replace_runner(monkeypatch, "no_scaler",
                   lambda fix=None, **settings: broken_anyway(fix=None, **settings))
    panel = failure_lab("no_scaler", steps=10)
    panel.fix_button.click()
    assert "no_scaler" in panel.diagnoses["fixed"]
    said = text(panel.verdict.value)
    assert said == f"still there: diagnose still finds {CAUSES['no_scaler']}"


def test_the_verdict_reads_the_failures_name_not_the_worst_cause():
    failure = lab.FAILURES["no_scaler"]
    units = Finding("no_units", "warning", "slow")
    assert verdict(failure, Diagnosis("run", [units])).startswith("fixed:")  # cause: no_units
    assert verdict(failure, Diagnosis("run", [])) == \
        f"fixed: diagnose no longer finds {CAUSES['no_scaler']}"
    assert verdict(failure, Diagnosis("run", [units, Finding("no_scaler", "warning", "x")])) \
        .startswith("still there:")


def test_a_run_that_breaks_at_the_first_step_still_shows_its_diagnosis():
    panel = failure_lab("fp16_overflow")
    panel.run_button.click()
    assert panel.message.value == "" and panel.broken.losses == []
    assert panel.diagnoses["broken"].cause == "fp16_overflow"
    (row,) = panel.rows
    assert (row["steps"], row["final loss"], row["final scale"]) == (0, "–", "–")
    assert bytes(panel.plot.value).startswith(b"\x89PNG")


def test_changing_the_failure_offers_its_fixes_and_code_and_puts_the_runs_away(monkeypatch):
    replace_runner(monkeypatch, "no_scaler", lambda fix=None, **settings: TrainResult(
        path="own loop", precision="fp16", device="cpu", model="lab", losses=[0.7] * 3))
    panel = failure_lab("no_scaler")
    panel.run_button.click()
    assert panel.broken is not None and len(panel.rows) == 1
    panel.failure.value = "pure_low_precision"
    failure = lab.FAILURES["pure_low_precision"]
    assert panel.fix.options == ("fp32_master", "kahan", "stochastic") == failure.fixes
    assert panel.fix.value == "fp32_master"
    assert text(panel.code.value) == failure.code
    assert failure.symptom in text(panel.symptom.value)
    assert panel.broken is None and panel.fixed is None and panel.diagnoses == {}
    assert panel.plot.value == b"" and "press “run it”" in panel.views["broken"].value
    assert len(panel.rows) == 1  # the table keeps every run pressed


def test_the_buttons_are_disabled_and_running_shown_during_a_run(monkeypatch):
    real = lab.FAILURES["no_scaler"].runner
    seen = []

    def watched(fix=None, **settings):
        seen.append((panel.run_button.disabled, panel.fix_button.disabled,
                     panel.failure.disabled, text(panel.message.value)))
        return real(fix=fix, **settings)

    replace_runner(monkeypatch, "no_scaler", watched)
    panel = failure_lab("no_scaler", steps=4)
    panel.fix_button.click()
    assert seen == [(True, True, True, "running no_scaler with the fix 'scaler'…")]
    assert not panel.run_button.disabled and not panel.fix_button.disabled
    assert panel.message.value == "" and panel.rows[0]["steps"] == 4


def test_an_error_in_a_run_lands_in_the_message_and_the_buttons_come_back(monkeypatch):
    def out_of_memory(fix=None, **settings):
        raise RuntimeError("out of memory")

    replace_runner(monkeypatch, "clip_before_unscale", out_of_memory)
    panel = failure_lab()
    for button in (panel.run_button, panel.fix_button):
        panel.message.value = ""
        button.click()
        assert "RuntimeError: out of memory" in panel.message.value
        assert not panel.run_button.disabled and not panel.fix_button.disabled
        assert not panel.failure.disabled and not panel.fix.disabled
    assert panel.broken is None and panel.fixed is None and len(panel.rows) == 0


def test_a_run_stopped_by_a_non_finite_loss_is_kept_and_diagnosed(monkeypatch):
    partial = TrainResult(path="own loop", precision="fp16", device="cpu", model="lab",
                          losses=[0.7, float("nan")], stopped="the loss became nan at step 2")

    def stops(fix=None, **settings):
        raise NonFiniteLossError(partial.stopped, partial)

    replace_runner(monkeypatch, "fp16_overflow", stops)
    panel = failure_lab("fp16_overflow")
    panel.run_button.click()
    assert panel.broken is partial and panel.diagnoses["broken"].cause == "fp16_overflow"


@pytest.mark.parametrize("bad, words", [
    ({"failure": "no_scalar"}, "unknown failure 'no_scalar'; accepted: 'fp16_overflow', "
                               "'scaler_bypassed', 'diverged', 'no_scaler'"),
    ({"steps": 0}, "steps must be None"), ({"steps": True}, "got True"),
])
def test_bad_input_is_a_clear_error(bad, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        failure_lab(**bad)


def test_the_figure_draws_what_tells_each_failure_apart():
    from mplab.diagnosis import lab
    from mplab.widgets.lesson7 import _telling, runs_figure

    no_scaler = {"broken": lab.run("no_scaler", steps=4),
                 "fixed (scaler)": lab.run("no_scaler", fix="scaler", steps=4)}
    assert _telling(no_scaler) == "zero_grad_fractions"
    fig = runs_figure(no_scaler)
    drawn = fig.axes[1].lines
    assert max(drawn[0].get_ydata()) == max(no_scaler["broken"].zero_grad_fractions) > 0.9
    assert _telling({"broken": lab.run("clip_before_unscale", steps=3)}) == "grad_norms"
    assert _telling({"broken": lab.run("pure_low_precision", steps=3)}) == (
        "unchanged_weight_fractions")
    assert _telling({"broken": lab.run("extra_update", steps=3)}) == "scales"


def test_the_profile_widget_shows_the_profile_and_adds_a_row_per_size_pressed(monkeypatch):
    """What the widget shows is bench.step_profile's and bench.explain_profile's; a press
    profiles the chosen size with the chosen backend; a failure is shown, the rows kept."""
    from mplab import bench
    from mplab.widgets.lesson7 import PROFILE_SIZES, speedup_profile

    first = bench.step_profile(hidden=64, layers=1, batch_size=4, max_length=8, steps=1)
    panel = speedup_profile(first)
    assert text(panel.words.value) == bench.explain_profile(first)
    assert bytes(panel.plot.value).startswith(b"\x89PNG") and len(panel.rows) == 1
    asked, real = [], bench.step_profile

    def small(hidden, layers, attention, **batch):
        asked.append((hidden, layers, attention))
        assert batch == {"batch_size": 4, "max_length": 8}  # the first profile's batch
        return real(hidden=64, layers=layers, batch_size=4, max_length=8,
                                  steps=1, attention=attention)

    monkeypatch.setattr(bench, "step_profile", small)
    panel.size.value, panel.attention.value = "hidden 512, 4 layers", "mplab's choice"
    panel.button.click()
    assert asked == [(*PROFILE_SIZES["hidden 512, 4 layers"], "mplab")]
    assert not panel.message.value, panel.message.value
    row = panel.rows[1]
    found = panel.found
    assert row["bound"] == round(bench.amdahl_bound(found["matmul_share"],
                                                    found["matmul_speedup"]), 2)
    assert row["step's speed-up"] == round(found["step_speedup"], 2)
    assert row["attention in bf16"] == "math"  # mplab's choice on a CPU
    monkeypatch.setattr(bench, "step_profile", lambda **kw: 1 / 0)
    panel.button.click()
    assert "ZeroDivisionError" in panel.message.value and len(panel.rows) == 2
    assert not panel.button.disabled
    with pytest.raises(TypeError, match="bench.step_profile"):
        speedup_profile({"share": 0.8})
    shown = first | {"shape": first["shape"] | {"hidden_size": 512, "num_hidden_layers": 4}}
    assert speedup_profile(shown).size.value == "hidden 512, 4 layers"  # the size it shows
