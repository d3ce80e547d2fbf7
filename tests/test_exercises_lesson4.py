"""Lesson 4's exercises: learners' orders and steps run with torch, trace answers against
mplab.amp.trace's classification, and the feedback their likely mistakes get."""

import itertools

import pytest
import torch
from conftest import failed_saying, run_cell

from mplab.amp.trace import FP32_AUTOCAST, OTHER, VIEW
from mplab.exercises import lesson4 as ex
from mplab.fixtures import lesson_trace
from mplab.numerics.failures import overflow_demo
from mplab.numerics.formats import get_format

IDS = list(ex.EXERCISES)


def test_there_are_five_exercises_worth_five_points():
    assert IDS == ["4.1", "4.2", "4.3", "4.4", "4.5"]
    assert sum(e.points for e in ex.EXERCISES.values()) == 5


def test_4_2_task_lists_each_call_with_its_name():
    lines = ex.EXERCISES["4.2"].prompt.splitlines()
    assert all(f"- `{name}`: `{code}`" in lines for name, code in ex.CALLS.items())


def test_4_3_task_shows_the_fp32_step_to_convert_as_python():
    assert f"```python\n{ex.FP32_STEP}\n```" in ex.EXERCISES["4.3"].prompt


@pytest.mark.parametrize("xid, choices", [("4.4", ex.CHOICES_4_4), ("4.1", ex.REASONS_4_1)])
def test_4_4_and_4_1_tasks_list_every_choice_on_its_own_line(xid, choices):
    lines = ex.EXERCISES[xid].prompt.splitlines()
    assert all(f"- ({k}) {v}" in lines for k, v in choices.items())


def test_4_2_every_order_passes_exactly_when_it_trains_like_the_course_loop():
    reference = ex.run_order(list(ex.RIGHT_4_2[0]))
    for order in itertools.permutations(ex.CALLS):
        if list(order) == ex.SHUFFLED_4_2:
            continue  # the starter: not attempted
        result = ex.check("4.2", list(order))
        try:
            same = all(torch.equal(a, b) for a, b in zip(ex.run_order(list(order)), reference))
        except Exception as e:
            same = False
            assert type(e).__name__ in result.message, (order, result.message)
        assert result.passed == same, (order, result.message)
    untouched = ex.check("4.2", ex.SHUFFLED_4_2)
    assert untouched.status == "not attempted"
    assert "..." not in untouched.message and "change `answer`" in untouched.message  # no ... there
    failed_saying(ex.check("4.2", ["forward", "backward", "zero_grad", "step", "update"]),
                  "cleared between backward() and step()")
    failed_saying(ex.check("4.2", ["forward", "backward", "step"]), "exactly once")
    failed_saying(ex.check("4.2", ["fwd", "backward", "step", "update", "zero_grad"]),
                  "not call names")
    assert ex.check("4.2", "forward backward").status == "failed"


def test_4_3_feedback_names_what_is_missing():
    _, ns = run_cell(f"{ex.FP32_STEP}\n0", ex=ex)
    failed_saying(ex.check("4.3", ns["train_step"]), "never used")

    def no_scaler(model, optimizer, scaler, x, y):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    failed_saying(ex.check("4.3", no_scaler), "not scaled")

    def no_autocast(model, optimizer, scaler, x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()

    failed_saying(ex.check("4.3", no_autocast), "still runs in fp32")
    assert ex.check("4.3", lambda *a: 1 / 0).status == "error"


def test_4_3_the_reference_step_really_runs_the_linear_in_fp16():
    model, optimizer, x, y = ex._tiny()
    seen = []
    model.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    ex._course_step(model, optimizer, torch.amp.GradScaler("cpu"), x, y)
    assert seen == [torch.float16]


def test_4_4_wrong_choices_explain_themselves():
    assert ex.check("4.4", "B").passed
    for letter in "acd":
        assert ex.check("4.4", letter).status == "failed"
    assert "one letter" in ex.check("4.4", "z").message


def test_4_4_evidence_shows_the_stages_but_neither_fp16s_limit_nor_the_cause():
    """The learner links the largest value with fp16's range: neither the table above the
    exercise nor its task names the limit."""
    demo, table = overflow_demo("fp16"), ex.overflow_evidence("fp16")
    assert table.rows == demo.table().rows  # the demo's own measurements, as they are
    top = float(get_format("fp16").max_finite)
    page = str(table) + ex.EXERCISES["4.4"].prompt
    assert all(s not in page for s in (f"{top:g}", f"{top:,.0f}", "largest finite value"))
    # ...yet the evidence is there: an inf where fp32's value is past the limit, then NaNs
    first = next(r for r in table if r["inf"])
    assert first["fp32 max |x|"] > top
    assert any(r["NaN"] for r in table.rows[table.rows.index(first) + 1:])
    assert all(not (r["inf"] or r["NaN"]) for r in ex.overflow_evidence("bf16"))


def test_4_1_task_points_at_the_trace_column_that_settles_the_reason():
    prompt = ex.EXERCISES["4.1"].prompt
    assert "`autocast cast inputs`" in prompt and "autocast cast inputs" in str(lesson_trace()
                                                                               .summary())


def test_4_1_the_right_reason_is_true_of_the_trace_and_the_others_are_not():
    t = lesson_trace()
    fwd = [r for r in t.select("forward") if r.kind not in (VIEW, OTHER)]
    norms = [i for i, r in enumerate(fwd) if r.op == "aten::native_layer_norm"]
    assert norms
    for i in norms:  # (b): the add before each produced fp32, and autocast cast nothing for it
        assert fwd[i - 1].op == "aten::add" and fwd[i - 1].outputs == (torch.float32,)
        assert fwd[i].autocast_cast is False and fwd[i].kind != FP32_AUTOCAST  # not (a)
    addmm = [r for r in fwd if r.op == "aten::addmm"]
    assert addmm and all(r.outputs == (torch.bfloat16,) for r in addmm)  # not (c), not (d)
    failed_saying(ex.check("4.1", {"forced": next(iter(t.fp32_ops)), "layer_norm": "d"}),
                  "weights do not decide")


def test_4_1_answers_follow_the_trace():
    t = lesson_trace()
    forced = {r.op for r in t.records if r.kind == FP32_AUTOCAST}
    assert forced == t.fp32_ops and forced  # the loss's ops, on this torch
    for op in forced:
        assert ex.check("4.1", {"forced": op, "layer_norm": "b"}).passed
        assert ex.check("4.1", {"forced": op.removeprefix("aten::"), "layer_norm": "b"}).passed
    # what the trace prints settles the reason: layer_norm was given fp32 and autocast cast
    # nothing for it (not a), while matmul results stay bf16 (not c)
    norm = [r for r in t.select("forward") if r.op == "aten::native_layer_norm"]
    assert norm and all(r.inputs[0] == torch.float32 and r.kind != FP32_AUTOCAST
                        and r.autocast_cast is False for r in norm)
    assert all(r.outputs == (torch.bfloat16,) for r in t.select("forward")
               if r.op == "aten::addmm")
    assert all(r.autocast_cast for r in t.select("forward", kinds=FP32_AUTOCAST))
    failed_saying(ex.check("4.1", {"forced": "aten::addmm", "layer_norm": "b"}), "ran in bf16")
    failed_saying(ex.check("4.1", {"forced": "aten::add", "layer_norm": "b"}), "promotion")
    failed_saying(ex.check("4.1", {"forced": next(iter(forced)), "layer_norm": "a"}),
                  "autocast cast inputs", "what fed it fp32")
    failed_saying(ex.check("4.1", {"forced": next(iter(forced)), "layer_norm": "c"}),
                  "never results")
    failed_saying(ex.check("4.1", {"forced": "aten::nope", "layer_norm": "b"}),
                  "does not appear")
    assert ex.check("4.1", {"forced": 3, "layer_norm": "b"}).status == "failed"


def test_4_5_the_loop_warns_because_its_steps_were_skipped_and_the_fix_stops_it():
    """run_4_5 is torch's own warning from the loop the task shows, its scale halving at each
    step (torch's GradScaler skipping them); stepping the scheduler only after a real
    optimizer step, as answer (b) says, raises none."""
    import warnings

    from mplab.diagnosis import lab
    from mplab.train.watch import StepCounter

    found = ex.run_4_5()
    assert any("`lr_scheduler.step()` before `optimizer.step()`" in w for w in found["warnings"])
    assert found["scales"] == [ex.INIT_SCALE_4_5 / 2 ** k for k in (1, 2, 3)]  # all skipped
    model = lab.lab_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=100)
    scaler, stepped = torch.amp.GradScaler("cpu", init_scale=ex.INIT_SCALE_4_5), \
        StepCounter(optimizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in lab.lab_batches(3):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(**batch).loss
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            if stepped.stepped():
                scheduler.step()
    assert not any("lr_scheduler" in str(w.message) for w in caught)
    ex.LESSON.reset()
    assert ex.check("4.5", "b").passed
    assert "already comes before" in ex.check("4.5", "a").message
    assert "lesson 3" in ex.check("4.5", "a").message
    assert "whether the optimizer's step ran" in ex.check("4.5", "d").message
    assert "def loop_4_5" in ex.EXERCISES["4.5"].prompt  # the whole loop, before the answer
