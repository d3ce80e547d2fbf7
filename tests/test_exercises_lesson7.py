"""Lesson 7's checks say why a wrong answer is wrong, from the machine and the real runs."""

from __future__ import annotations

import pytest
import torch
from conftest import run_cell

from mplab.exercises import lesson7 as ex

pytestmark = pytest.mark.filterwarnings("ignore")


def message(xid, answer):
    ex.LESSON.reset()
    return ex.check(xid, answer).message


def test_7_1_the_right_answer_follows_this_cpus_units(machine):
    right = "b" if machine.cpu_bf16 else "a"  # the question is about this CPU
    assert ex.check("7.1", right).passed
    wrong = "a" if right == "b" else "b"
    assert "bf16 units" in message("7.1", wrong)
    assert "GradScaler" in message("7.1", "c")


def test_7_4_the_mystery_runs_are_what_diagnose_says_and_a_swap_is_caught():
    from mplab.diagnosis import diagnose

    runs = ex._mystery_runs()
    assert {k: diagnose(r).cause for k, r in runs.items()} == ex.MYSTERY
    table = ex.mystery_records()
    assert [r["run"] for r in table.rows] == ["A", "B", "C"]
    assert table.rows[0]["unscale_ / step / update per iteration"] == "2 / 2 / 2"
    assert table.rows[2]["scaler"] == "none"
    swapped = {"A": "clip_before_unscale", "B": "extra_update", "C": "no_scaler"}
    assert message("7.4", swapped).startswith("2 of 3 wrong, among them run A")
    assert "not a cause" in message("7.4", {"A": "nan", "B": "x", "C": "y"})


def test_7_4_the_loops_it_shows_are_the_lab_code_that_made_the_records():
    from mplab.diagnosis import lab

    code = {k: lab.FAILURES[name].code for k, name in ex.MYSTERY.items()}
    loops = ex.MYSTERY_LOOPS
    assert code["A"].count("torch.optim.AdamW(") == 2 and "lr=10 * LR" in code["A"]
    assert "growth_interval=10" in code["A"] and "`GradScaler(growth_interval=10)`" in loops["A"]
    assert "two AdamW" in loops["A"] and f"lr {10 * lab.LR:g}" in loops["A"]
    assert "GradScaler(device.type, init_scale=init_scale)" in code["B"]
    assert "max_norm=1.0" in code["B"] and "max_norm=1.0" in loops["B"]
    # B's scale is not the clipping demo's 65536, and the loop says the one it ran with
    assert "`GradScaler(init_scale=2**12)`" in loops["B"] and "4096" in loops["B"]
    assert "* 2**-16" in code["C"] and "2**-16" in loops["C"]
    # the loops say nothing of their cause, and the counts say what they count
    for loop in loops.values():
        assert not any(name in loop for name in ex.CAUSES)
    prompt = ex.EXERCISES["7.4"].prompt
    assert all(loop in prompt for loop in loops.values())
    assert "the one `scaler.step` makes itself" in prompt
    runs = ex._mystery_runs()
    assert {len(r.losses) for r in runs.values()} == {ex.MYSTERY_STEPS}
    assert runs["B"].config["init_scale"] == 4096 and runs["B"].scales[0] == 4096
    assert f"{ex.MYSTERY_STEPS} iterations" in prompt


def _buggy():
    namespace = {}
    exec("import torch\n" + ex.BUGGY_7_5, namespace)
    return namespace["train_step"]


def test_7_5_the_buggy_loop_fails_with_the_counted_calls_and_no_clip_is_caught():
    assert "unscale_ 2× and update 2×" in message("7.5", _buggy())

    def no_unscale(model, optimizer, scaler, micro_batches, autocast):
        for micro in micro_batches:
            with autocast:
                loss = model(**micro).loss / len(micro_batches)
            scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()

    assert "not unscaled before clipping" in message("7.5", no_unscale)


def test_7_5_unscale_twice_is_torchs_refusal():
    def twice(model, optimizer, scaler, micro_batches, autocast):
        for micro in micro_batches:
            with autocast:
                loss = model(**micro).loss
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()

    assert "torch refused" in message("7.5", twice)


STEP_7_5 = """def train_step(model, optimizer, scaler, micro_batches, autocast):
    for micro in micro_batches:
        with autocast:
            loss = model(**micro).loss / len(micro_batches)
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
{step}
    optimizer.zero_grad()"""


def step_7_5(step: str):
    from mplab.exercises.answers import note

    namespace = {"note": note}
    exec("import torch\n" + STEP_7_5.format(step=step), namespace)
    return namespace["train_step"]


#: The optimizer stepped behind the scaler's back (and its calls' notes forged), the scaler's
#: calls made through its class (no notes at all), an update too many.
OPTIMIZER_STEP = "    optimizer.step()\n    scaler.update()"
FORGED = "    note('scaler.step')\n    optimizer.step()\n    scaler.update()"
UNNOTED = "    type(scaler).step(scaler, optimizer)\n    type(scaler).update(scaler)"
EXTRA_UPDATE = ("    scaler.step(optimizer)\n    scaler.update()\n"
                "    type(scaler).update(scaler, scaler.get_scale() * 2)")


def test_7_5_the_first_step_overflows_and_a_correct_loop_skips_it():
    trials = ex._trials_7_5()
    before = [p.detach().clone() for p in trials[0][0].parameters()]
    ex._reference_7_5(*trials[0])  # the first step: its gradients overflow at 2**40
    assert all(torch.equal(a, b) for a, b in zip(before, trials[0][0].parameters()))
    assert trials[0][2].get_scale() == 2.0**10  # backed off for the next steps
    weights, states = ex._reference_run_7_5()
    assert [(s["scale"], s["_growth_tracker"]) for s in states] == [(2.0**10, i) for i in
                                                                     range(3)]
    assert not all(torch.equal(a, b) for a, b in zip(before, weights))  # the next two train


@pytest.mark.parametrize("step, words", [(OPTIMIZER_STEP, ["scaler.step ran 0×", "overflowed"]),
                                         (FORGED, ["After 3 steps"]),
                                         (EXTRA_UPDATE, ["After 3 steps"])],
                         ids=["optimizer.step", "forged notes", "extra update"])
def test_7_5_a_wrong_step_fails_on_its_weights_or_scaler_whatever_its_notes(step, words,
                                                                            graded_apart):
    learner = step_7_5(step)
    weights, states, _ = ex._run_7_5(learner)
    assert (not all(torch.equal(a, b) for a, b in zip(weights, ex._reference_run_7_5()[0]))
            or states != ex._reference_run_7_5()[1])
    kernel, grader = graded_apart("7.5", learner)
    assert kernel.status == grader.status == "failed" and grader.message == kernel.message
    assert all(w in kernel.message for w in words), kernel.message


def test_7_5_a_right_step_passes_though_it_leaves_no_notes(graded_apart):
    kernel, grader = graded_apart("7.5", step_7_5(UNNOTED))
    assert kernel.passed and grader.passed


def test_7_3_a_plain_cast_and_a_biased_rounding_are_caught():
    assert "plain cast" in message("7.3", lambda x, g: x.to(torch.bfloat16))

    def always_up(x, g):  # up whenever any dropped bit is set: every result a neighbour
        bits = x.contiguous().view(torch.int32)
        return ((bits + 0xFFFF) & -65536).view(torch.float32).to(torch.bfloat16)

    assert "averages" in message("7.3", always_up)

    def unseeded(x, g):
        noise = torch.randint(0, 2**16, x.shape, dtype=torch.int32)
        return ((x.view(torch.int32) + noise) & -65536).view(torch.float32).to(torch.bfloat16)

    assert "same generator seed" in message("7.3", unseeded)


def test_7_3_the_reference_agrees_with_mplabs_stochastic_round_in_distribution():
    from mplab.numerics.bf16_updates import stochastic_round

    _, namespace = run_cell(ex.EXERCISES["7.3"].solution_code, ex=ex)
    mine = namespace["round_stochastic"]
    x = torch.full((20000,), 1.0 + 3 * 2**-10)  # 3/8 of the way from 1 to the next bf16
    ours = mine(x, torch.Generator().manual_seed(0)).float()
    theirs = stochastic_round(x, generator=torch.Generator().manual_seed(0)).float()
    for r in (ours, theirs):
        assert set(r.unique().tolist()) == {1.0, 1.0 + 2**-7}
        assert (r > 1).float().mean().item() == pytest.approx(3 / 8, abs=0.02)


def test_7_2_each_wrong_fix_says_why():
    assert "forward pass itself" in message("7.2", "a")
    assert "step 1" in message("7.2", "c")


def test_7_6_the_runs_are_what_diagnose_says_and_the_table_shows_where_each_began():
    from mplab.diagnosis import diagnose

    runs = ex.origin_runs()
    assert {k: diagnose(r).cause for k, r in runs.items()} == ex.ORIGINS
    table = {r["run"]: r for r in ex.origin_records().rows}
    assert table["W"]["first seen at"].endswith("the loss")
    assert table["W"]["loss dtype"] == "float16" and table["W"]["module outputs finite"] == "yes"
    assert table["X"]["min / max there"] == "-inf / inf"
    assert table["Y"]["first seen at"].endswith("after optimizer.step()")
    assert table["Y"]["optimizer states"] == "float16"
    low, high = table["Z"]["min / max there"].split(" / ")
    assert low == "-inf" and 0 < float(high) < 1  # a constant beside small values
    # the loops and the table say nothing of the cause
    for loop in ex.ORIGIN_LOOPS.values():
        assert not any(name in loop for name in ex.CAUSES)
    assert all(loop in ex.EXERCISES["7.6"].prompt for loop in ex.ORIGIN_LOOPS.values())
    assert not any(name in str(ex.origin_records()) for name in ex.CAUSES)


def test_7_6_a_wrong_reading_is_told_where_to_look_never_the_answer():
    swapped = ex.ORIGINS | {"X": "fill_out_of_range", "Z": "fp16_overflow"}
    said = message("7.6", swapped)
    assert said.startswith("2 of 4 wrong, among them run X")
    assert not any(name in said for name in ex.CAUSES)
    assert "one of the four causes" in message("7.6", ex.ORIGINS | {"W": "no_units"})
    assert message("7.6", {"W": "fp16_loss"}).startswith("Name a cause for each")
    assert ex.check("7.6", dict(ex.ORIGINS)).passed


def test_7_7_the_bound_the_step_and_the_step_without_its_worst_op_come_from_the_table():
    from mplab.bench import amdahl_bound
    from mplab.exercises.speedup import PROFILE_7_7

    fp32 = sum(r[2] for r in PROFILE_7_7)
    bf16 = sum(r[3] for r in PROFILE_7_7)
    mm = [r for r in PROFILE_7_7 if r[0] in ("mm", "addmm")]
    p = sum(r[2] for r in mm) / fp32
    g = sum(r[2] for r in mm) / sum(r[3] for r in mm)
    flash = next(r for r in PROFILE_7_7
                 if r[0] == "_scaled_dot_product_flash_attention_for_cpu_backward")
    right = {"bound": amdahl_bound(p, g), "step": fp32 / bf16,
             "without": fp32 / (bf16 - flash[3] + flash[2])}
    ex.LESSON.reset()
    assert ex.check("7.7", right).passed
    # the record's figures: the step without the flash backward passes the bound
    assert 1.8 < right["bound"] < 1.9 < right["without"] < 1.95 and 1.5 < right["step"] < 1.55
    assert "upside down" in message("7.7", right | {"step": bf16 / fp32})
    assert "matmuls' own speed-up" in message("7.7", right | {"bound": g})
    assert "Amdahl" in message("7.7", right | {"bound": 1.6})
    assert "out of the bf16 step altogether" in message(
        "7.7", right | {"without": fp32 / (bf16 - flash[3])})
    assert "furthest above" in message("7.7", right | {"without": right["step"]})
    assert "lacks 'without'" in message("7.7", {"bound": 1.84, "step": 1.52})
    assert "dict" in message("7.7", 1.84)
    assert "number" in message("7.7", right | {"bound": [1.84]})
    assert all(f"| {op} |" in ex.EXERCISES["7.7"].prompt for op, *_ in PROFILE_7_7)
