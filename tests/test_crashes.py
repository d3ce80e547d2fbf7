"""diagnose(err): a run that raised is named by its cause, from errors torch itself raises (each
reproduced here or by the failure lab's CRASHES), with where in the user's code it was raised;
an error mplab does not know is still a diagnosis, never a traceback from inside mplab."""

import warnings

import pytest
import torch

from mplab import diagnose
from mplab.diagnosis import CAUSES, CRASH_CHECKS, lab
from mplab.diagnosis.crashes import Crash, diagnose_crash
from mplab.train import errors

warnings.filterwarnings("ignore", category=UserWarning)  # fp16 on a CPU without its units


def raised(fn) -> BaseException:
    with pytest.raises(Exception) as info:
        fn()
    return info.value


def test_every_crash_cause_is_declared_by_one_check_and_known_to_diagnose():
    declared = [c for check in CRASH_CHECKS for c in check.causes]
    assert len(declared) == len(set(declared)) and set(declared) <= set(CAUSES)
    assert CRASH_CHECKS[-1].causes == ("crashed",)  # the last knows every error
    assert set(lab.CRASHES) <= set(declared)


@pytest.mark.parametrize("name", list(lab.CRASHES))
def test_each_lab_crash_is_named_where_it_was_raised_and_its_fix_runs_clean(name):
    failure = lab.CRASHES[name]
    found = diagnose(raised(failure.run))
    assert found.cause == name and found.findings[0].severity == "broken", found
    where = found.findings[0].evidence[-1]
    assert where.startswith("raised at lab_crashes.py:"), where  # the loop, not mplab's hooks
    assert (", in backward" in where) == (name == "mixed_dtypes")
    fixed = diagnose(failure.run(failure.fixes[0]))
    assert name not in fixed and all(f.severity != "broken" for f in fixed.findings), fixed


def _scaled_step(model, optimizer, scaler):
    scaler.scale(model(torch.randn(2, 4)).sum()).backward()
    scaler.step(optimizer)


def test_a_second_step_or_a_step_without_scale_names_the_scalers_order():
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")

    def step_twice():
        _scaled_step(model, optimizer, scaler)
        scaler.step(optimizer)

    found = diagnose(raised(step_twice))
    assert found.cause == "scaler_called_twice" and "scaler.step()" in found.findings[0].cause

    def unscaled():
        model(torch.randn(2, 4)).sum().backward()
        torch.amp.GradScaler("cpu").step(optimizer)

    assert diagnose(raised(unscaled)).cause == "scaler_unused"


@pytest.mark.parametrize("op", ["linear", "conv", "index_put"])
def test_two_dtypes_met_outside_a_backward_is_a_hand_cast(op):
    calls = {
        "linear": lambda: torch.nn.functional.linear(torch.randn(2, 4).half(), torch.randn(4, 4)),
        "conv": lambda: torch.nn.Conv1d(2, 2, 1).half()(torch.randn(1, 2, 3)),
        "index_put": lambda: torch.zeros(4).half().index_put_((torch.tensor([0]),),
                                                                torch.tensor([1.0])),
    }
    found = diagnose(raised(calls[op]))
    assert found.cause == "mixed_dtypes", found
    assert "by hand" in found.findings[0].cause and "custom_fwd" in found.findings[0].fix


def test_a_gpu_without_bf16_and_a_machine_without_cuda_are_refusals(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (7, 5))
    err = raised(lambda: errors.check_precision("bf16", torch.device("cuda", 0)))
    assert diagnose(err).cause == "precision_refused"
    refused = AssertionError("Torch not compiled with CUDA enabled")  # torch's own words
    assert diagnose(refused).cause == "precision_refused"


def test_an_error_raised_from_a_known_one_is_read_through_the_chain():
    def wrapped():
        try:
            torch.randn(2, 4).half().masked_fill(torch.zeros(2, 4, dtype=torch.bool), -1e9)
        except RuntimeError as err:
            raise ValueError("the training step failed") from err

    found = diagnose(raised(wrapped))
    assert found.cause == "fill_out_of_range" and "Half" in found.findings[0].cause
    assert any(e.startswith("raised from: value cannot be converted") for e in
               found.findings[0].evidence)


def test_an_unknown_error_is_still_a_diagnosis_with_its_message_and_place():
    found = diagnose(raised(lambda: {}["learning_rate"]))
    assert found.cause == "crashed" and not found.ok
    evidence = found.findings[0].evidence
    assert evidence[0] == "KeyError: 'learning_rate'"
    assert evidence[-1].startswith("raised at test_crashes.py:")
    assert "KeyError" in str(found) and "KeyError" in found._repr_html_()
    bare = diagnose(RuntimeError("x" * 1000))  # never raised: no traceback, a long message
    assert bare.cause == "crashed" and bare.findings[0].evidence[-1] == "raised outside your code"
    assert len(bare.findings[0].evidence[0]) < 320
    with pytest.raises(TypeError, match="reads an exception, got str"):
        diagnose_crash("not an error")


def test_the_crash_is_read_the_same_whatever_the_error_class():
    """torch raises its dtype errors as RuntimeError; a wrapper may re-raise them as another
    class: the message decides, not the class."""
    message = "expected m1 and m2 to have the same dtype, but got: c10::Half != float"
    for kind in (RuntimeError, TypeError, ValueError):
        assert diagnose(kind(message)).cause == "mixed_dtypes"
    crash = Crash.of(TypeError(message))
    assert crash.kind == "TypeError" and crash.where is None and not crash.in_backward
