"""One step's cost per precision, side by side (lesson 7); what the lesson's bench leaves out."""

from types import SimpleNamespace

import pytest
import torch

from mplab import bench, hardware
from mplab._display import Table
from mplab.bench.steps import FORWARD_BACKWARD, SCALER_PASS
from mplab.bench.sweep import Plan, matmul_sweep
from mplab.diagnosis import lab


def test_step_costs_time_each_precision_and_leave_the_model_as_it_was():
    model = lab.lab_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    threads = torch.get_num_threads()
    # fp16 (the row with a scaler pass) and fp32; bf16 runs the same code as fp32's row, and
    # takes seconds on a CPU without bf16 units
    costs = bench.step_costs(model, next(lab.lab_batches(1, batch_size=2)), repeats=1,
                             precisions=("fp16", "fp32"), device="cpu")
    assert costs.column("precision") == ["fp16", "fp32"]
    assert all(r[FORWARD_BACKWARD] > 0 for r in costs)
    # only fp16 has a GradScaler pass to time
    assert [r[SCALER_PASS] is None for r in costs] == [False, True]
    assert costs.rows[0][SCALER_PASS] > 0
    assert [r["units"] for r in costs] == [hardware.has_units(p) for p in ("fp16", "fp32")]
    assert torch.get_num_threads() == threads
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_step_costs_name_bad_input():
    model, batch = lab.lab_model(), next(lab.lab_batches(1, batch_size=2))
    with pytest.raises(ValueError, match="repeats must be a whole number >= 1, got 0"):
        bench.step_costs(model, batch, repeats=0)
    with pytest.raises(ValueError, match="unknown precision 'fp8'; accepted: 'fp32'"):
        bench.step_costs(model, batch, precisions=("fp32", "fp8"))
    with pytest.raises(ValueError, match="no fp32 row"):
        bench.explain_step_costs(Table([{"precision": "bf16", FORWARD_BACKWARD: 1.0}]))


def _costs(machine, ms=(10.0, 100.0, 105.0), scaler=2.0) -> Table:
    return Table([{"precision": p, FORWARD_BACKWARD: t, SCALER_PASS: scaler if p == "fp16"
                   else None, "units": machine.units(p) if machine.device == "cpu" else None,
                   "device": machine.device, "threads": 1}
                  for p, t in zip(("fp32", "bf16", "fp16"), ms)])


def test_the_words_follow_the_measurement_and_the_units(machine):
    text = bench.explain_step_costs(_costs(machine))
    assert "10.0 ms in fp32, 100.0 ms in bf16, 105.0 ms in fp16" in text
    for p, times in (("bf16", "10.0"), ("fp16", "10.5")):
        emulated = machine.device == "cpu" and not machine.units(p)
        assert (f"{p} took {times}× fp32's time" in text) == emulated, text
        assert (f"{p} ran at {1 / float(times):.2f}× fp32's speed" in text) == (not emulated)
    assert "fp16 and bf16 cost about the same (fp16 1.05× bf16's time)" in text
    assert "took 2.00 ms, 2% of fp16's forward and backward" in text
    slower = bench.explain_step_costs(_costs(machine, ms=(10.0, 10.0, 30.0)))
    assert "fp16 is the slower of the two here: 3.00× bf16's time" in slower


def test_recorded_steps_are_set_beside_the_side_by_side_ratio(machine):
    def run(precision, steps):
        return SimpleNamespace(precision=precision, steady_step_seconds=steps[1],
                               step_seconds=steps)

    text = bench.explain_step_costs(_costs(machine), {
        "the fp16 lab loop": run("fp16", [0.5, 0.3, 0.2, 0.4]),
        "your bf16 loop": run("bf16", [0.2, 0.1, 0.1, 0.1])})
    assert "300.0 ms (the fp16 lab loop) and 100.0 ms (your bf16 loop)" in text
    assert "3.00× apart, against 1.05× side by side" in text
    assert "ranged 200-400 ms and 100-100 ms" in text


def test_the_machine_name_leaves_the_units_to_the_learner():
    said, name = hardware.describe("cpu"), bench.machine_name("cpu")
    assert "bf16 units:" in said and "units" not in name
    assert said.startswith(name.removesuffix(")"))
    assert bench.machine_name(said) == name  # a record's stored line reads the same
    assert bench.record_table({"device": said, "rows": []}).title.endswith(name)


def test_the_lesson_plan_times_fp32_only_beside_another_precision(machine):
    """Past the size a precision without units is timed at, the lesson's plan leaves fp32 out
    too (it would have nothing to compare with) and says so; the CLI's plan keeps it."""
    kept = {}
    for alone in (False, True):
        plan = Plan("cpu", ("fp32", "bf16"), (8, 16), (), 1, 1, matmul_budget_s=0.0,
                    slow_matmul_limit=8, fp32_alone=alone)
        kept[alone] = [(r.n, r.precision) for r in matmul_sweep(plan)]
        assert any("not timed" in s for s in plan.skipped) == (not alone
                                                              and not machine.units("bf16"))
    full = [(8, "fp32"), (8, "bf16"), (16, "fp32"), (16, "bf16")]
    if machine.units("bf16"):
        assert kept[False] == kept[True] == full
    else:
        assert kept[False] == [(8, "fp32"), (8, "bf16")]
        assert kept[True] == [(8, "fp32"), (8, "bf16"), (16, "fp32")]
    only_fp32 = Plan("cpu", ("fp32",), (16,), (), 1, 1, matmul_budget_s=0.0,
                     slow_matmul_limit=8, fp32_alone=False)
    assert [r.n for r in matmul_sweep(only_fp32)] == [16]
