"""The training panel (lessons 4-6), driven from Python as a learner drives it in the browser.

The reference is mplab.train.train called directly with the same settings."""

import re

import pytest

pytest.importorskip("ipywidgets", reason="needs ipywidgets, which is not installed")
import torch  # noqa: E402

from mplab.train import NonFiniteLossError, TrainResult, train  # noqa: E402
from mplab.widgets import lesson4  # noqa: E402
from mplab.widgets.training import training_panel  # noqa: E402

TINY = {"batch_size": 8, "eval_samples": 16, "warmup_steps": 0}


def test_pressing_train_runs_mplab_train_and_adds_a_row():
    panel = training_panel(steps=3, precision="fp32", device="cpu", **TINY)
    assert "No runs yet" in panel.table.value
    panel.button.click()
    assert panel.message.value == "" and not panel.button.disabled
    assert panel.progress.value == 3
    (result,) = panel.results
    direct = train(precision="fp32", device="cpu", steps=3, progress=False, **TINY)
    assert result.losses == direct.losses  # the same seeded run, bit for bit
    assert result.compute_dtype == torch.float32
    (row,) = panel.rows
    assert (row["run"], row["path"], row["precision"], row["matmuls ran in"], row["steps"]) == (
        1, "torch", "fp32", "float32", 3)
    assert row["final loss"] == f"{direct.final_loss:.4f}" and row["vs fp32"] == "1.00×"
    assert f"<td style=\"padding:1px 8px\">{row['final loss']}</td>" in panel.table.value
    assert bytes(panel.plot.value).startswith(b"\x89PNG")


def test_a_bf16_run_sits_beside_the_fp32_one_with_its_observed_dtype():
    panel = training_panel(steps=2, precision="fp32", device="cpu", **TINY)
    panel.button.click()
    panel.precision.value = "bf16"
    panel.button.click()
    assert [r.precision for r in panel.results] == ["fp32", "bf16"]
    assert panel.results[1].compute_dtype == torch.bfloat16
    bf16 = panel.rows[1]
    assert bf16["matmuls ran in"] == "bfloat16"
    assert panel.rows[0]["really mixed?"] == "no" and bf16["really mixed?"] == "yes"
    speedup = panel.results[1].samples_per_s / panel.results[0].samples_per_s
    assert bf16["vs fp32"] == f"{speedup:.2f}×"
    panel.clear.click()
    assert panel.results == [] and "No runs yet" in panel.table.value


def test_a_nan_loss_is_shown_and_its_partial_run_kept(monkeypatch):
    partial = TrainResult(path="torch", precision="fp16", device="cpu", model="lesson",
                          losses=[0.7, float("nan")], stopped="the loss became nan at step 2")

    def nan_run(**kwargs):
        raise NonFiniteLossError(partial.stopped, partial)

    monkeypatch.setattr(lesson4, "train", nan_run)
    panel = training_panel(steps=2, precision="fp16", device="cpu", **TINY)
    panel.button.click()
    assert panel.results == [partial]
    assert "the loss became nan at step 2" in panel.message.value
    assert not panel.button.disabled


def test_any_other_failure_is_shown_not_raised(monkeypatch):
    def broken(**kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(lesson4, "train", broken)
    panel = training_panel(steps=2, device="cpu", **TINY)
    panel.button.click()
    assert "RuntimeError: out of memory" in panel.message.value
    assert panel.results == [] and not panel.button.disabled


@pytest.mark.parametrize("bad, words", [
    ({"precision": "fp8"}, "'fp32', 'fp16', 'bf16'"), ({"device": "tpu"}, "'auto', 'cpu'"),
    ({"steps": 0}, "1 to 5000"), ({"lr": -1.0}, "lr must be"),
    ({"steps_per_epoch": 3}, "steps_per_epoch"), ({"on_step": print}, "panel's own controls"),
    ({"path": "keras"}, "unknown path 'keras'; accepted: 'torch'"),
])
def test_bad_settings_say_what_is_accepted(bad, words):
    with pytest.raises((ValueError, TypeError), match=re.escape(words)):
        training_panel(**bad)


def test_fp16_through_accelerate_on_a_cpu_is_shown_as_not_really_mixed():
    """Accelerate ignores fp16 on a CPU without a word; the panel's row and message say so."""
    panel = training_panel(steps=2, precision="fp16", device="cpu", path="accelerate", **TINY)
    panel.button.click()
    (row,) = panel.rows
    assert row["path"] == "accelerate" and row["matmuls ran in"] == "float32"
    assert row["really mixed?"].startswith("no (") and "fallback" in row["really mixed?"]
    assert "fp16" in panel.message.value


