"""Lesson 4, mixed precision training in plain PyTorch: the exercises.

    from mplab.exercises import lesson4 as ex
    ex.check("4.2", order); ex.hint("4.2"); ex.solution("4.2")

The references are runs: a learner's order of calls is executed with torch.amp.GradScaler (and
its real error, if any, is quoted), a learner's training step is compared bit for bit with a
reference fp16 step, and the trace questions are answered by :func:`mplab.fixtures.lesson_trace`,
the same trace the notebook shows. `overflow_evidence` is what 4.4 is asked about;
`run_4_5` runs 4.5's loop and catches the warning it raises.
"""

from __future__ import annotations

import functools
import inspect
import warnings

import torch

from mplab._display import Table
from mplab.amp.trace import FP32, FP32_AUTOCAST, LOW, PROMOTE
from mplab.exercises.framework import (
    Exercise,
    Incorrect,
    Lesson,
    call,
    choice_list,
    grade_seed,
    in_order,
    multiple_choice,
    one_letter,
    python_block,
    same_tensors,
)
from mplab.fixtures import lesson_trace
from mplab.numerics.failures import overflow_demo

__all__ = ["check", "hint", "solution", "exercise_cells", "cells", "task_markdown",
           "EXERCISES", "LESSON", "overflow_evidence", "loop_4_5", "run_4_5"]

# --- 4.2 order the calls ----------------------------------------------------------------------

CALLS = {
    "forward": "with torch.autocast(device, dtype=torch.float16): loss = model(x, y)",
    "backward": "scaler.scale(loss).backward()",
    "step": "scaler.step(optimizer)",
    "update": "scaler.update()",
    "zero_grad": "optimizer.zero_grad()",
}
SHUFFLED_4_2 = ["update", "forward", "zero_grad", "step", "backward"]
RIGHT_4_2 = (["forward", "backward", "step", "update", "zero_grad"],
             ["zero_grad", "forward", "backward", "step", "update"])


def _tiny(seed: int = 0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 1)
        x, y = torch.randn(8, 4), torch.randn(8, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), x, y


def run_order(order: list[str], iterations: int = 3):
    """Run the calls in this order with a real model, optimizer and torch.amp.GradScaler on
    the CPU; returns the weights after `iterations` iterations. torch's errors propagate."""
    model, optimizer, x, y = _tiny()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    loss = None
    for _ in range(iterations):
        for name in order:
            if name == "forward":
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = torch.nn.functional.mse_loss(model(x).float(), y)
            elif name == "backward":
                if loss is None:
                    raise RuntimeError("there is no loss yet: backward() needs the forward pass "
                                       "first.")
                scaler.scale(loss).backward()
            elif name == "step":
                scaler.step(optimizer)
            elif name == "update":
                scaler.update()
            else:
                optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _check_4_2(answer) -> str | None:
    if not isinstance(answer, list | tuple):
        raise Incorrect(f"Give a list of the five names in order, like {SHUFFLED_4_2!r}; got "
                        f"{type(answer).__name__}.")
    order = [str(a).strip() for a in answer]
    unknown = [a for a in order if a not in CALLS]
    if unknown:
        return (f"Not call names: {unknown!r}. Use the names {list(CALLS)!r}, each once.")
    if sorted(order) != sorted(CALLS):
        return f"Use each of the five names exactly once; got {order!r}."
    try:
        weights = run_order(order)
    except Exception as e:  # what torch itself says about this order
        said = f"Run in that order, torch stops with {type(e).__name__}: {str(e).splitlines()[0]}"
        if order.index("backward") < order.index("zero_grad") < order.index("step"):
            return (said + " The gradients are cleared between backward() and step(), so the "
                    "optimizer has none to step with.")
        return said + " Put each call after the one whose result it needs."
    if same_tensors(weights, run_order(list(RIGHT_4_2[0]))):
        return None  # any order that trains exactly as the right one does
    return ("That order runs, but the model does not train as the right order does: which "
            "call needs the result of which?")


# --- 4.3 make a step mixed precision ----------------------------------------------------------

FP32_STEP = '''def train_step(model, optimizer, scaler, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()'''


def _course_step(model, optimizer, scaler, x, y, *, autocast=True, scaled=True):
    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    (scaler.scale(loss) if scaled else loss).backward()
    if scaled:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad()


def _trials_4_3(seed: int, iterations: int = 3) -> list[tuple]:
    """The calls 3 steps make: the same model, optimizer and scaler, stepped in turn."""
    model, optimizer, x, y = _tiny(seed)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    return [(model, optimizer, scaler, x, y)] * iterations


def _weights_after(step, seed: int = 0):
    trials = _trials_4_3(seed)
    for args in trials:
        step(*args)
    model, _, scaler, _, _ = trials[0]
    return [p.detach().clone() for p in model.parameters()], scaler


def _check_4_3(fn, seed: int = 0) -> str | None:
    got, scaler = call(_weights_after, fn, seed,
                       what="train_step(model, optimizer, scaler, x, y)")
    if scaler._scale is None:  # scaler.scale() never ran (torch creates the scale lazily)
        if same_tensors(got, _weights_after(functools.partial(_course_step, scaled=False),
                                            seed)[0]):
            return ("The forward runs in fp16, but the loss is not scaled: small fp16 "
                    "gradients underflow. Use scaler.scale(loss).backward(), "
                    "scaler.step(optimizer) and scaler.update().")
        return ("The scaler given to train_step is never used: scale the loss with it, and "
                "step and update through it.")
    if same_tensors(got, _weights_after(_course_step, seed)[0]):
        return None
    if same_tensors(got, _weights_after(functools.partial(_course_step, autocast=False),
                                        seed)[0]):
        return ("The scaler is in, but the forward pass still runs in fp32: wrap the model "
                "call and the loss in torch.autocast(\"cpu\", dtype=torch.float16).")
    return ("After 3 steps the weights differ from the reference step's. Keep the same loss "
            "(computed under autocast), then scale, step, update, zero_grad.")


def _hidden_4_3(fn) -> str | None:
    """The same 3 steps from weights and data drawn for this grading run."""
    return _check_4_3(fn, grade_seed())


# --- 4.4 why does the loss go NaN? ------------------------------------------------------------

CHOICES_4_4 = {
    "a": "The learning rate is too high, so the weights diverge.",
    "b": "A feed-forward activation is larger than fp16 can hold: it becomes inf, and the "
         "LayerNorm after it turns the inf into NaN.",
    "c": "The GradScaler's scale is too large, so the gradients overflow.",
    "d": "The loss must be computed outside autocast.",
}
WHY_NOT_4_4 = {
    "a": "The same weights give a finite loss in fp32 and in bf16 (the tables' loss rows): "
         "nothing has been trained yet, so no step diverged.",
    "c": "An overflowing *gradient* is what a GradScaler handles: it skips the step and backs "
         "off. Here the *forward* pass (the loss itself) is NaN, before any scaling happens.",
    "d": "Losses like cross-entropy run in fp32 under autocast anyway (it is on autocast's "
         "fp32 list); the NaN appears several stages before the loss.",
}


_check_4_4 = multiple_choice(CHOICES_4_4, "b", WHY_NOT_4_4)


# --- 4.5 the scheduler's warning after a skipped step -----------------------------------------

def loop_4_5(model, optimizer, scheduler, scaler, batches):
    for batch in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(**batch).loss
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        scheduler.step()


#: 4.5's GradScaler starts this high, so that its first steps' gradients overflow in fp16.
INIT_SCALE_4_5 = 2.0**32


def run_4_5(steps: int = 3) -> dict:
    """`loop_4_5` on the failure lab's model for `steps` batches, its GradScaler starting at
    `INIT_SCALE_4_5`: {"warnings": what torch warned, "scales": the scale after each step}."""
    from mplab.diagnosis import lab

    model = lab.lab_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=100)
    scales = []

    class Scaler(torch.amp.GradScaler):  # torch's, noting its scale after each update
        def update(self, new_scale=None):
            super().update(new_scale)
            scales.append(self.get_scale())

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop_4_5(model, optimizer, scheduler, Scaler("cpu", init_scale=INIT_SCALE_4_5),
                 lab.lab_batches(steps))
    return {"warnings": sorted({str(w.message) for w in caught}), "scales": scales}


CHOICES_4_5 = {
    "a": "The loop calls `scheduler.step()` before `optimizer.step()`, as the warning says: "
         "put `scheduler.step()` after `scaler.step(optimizer)`.",
    "b": "The GradScaler skipped the optimizer's step (the scaled gradients overflowed) and "
         "the scheduler stepped anyway: call `scheduler.step()` only when the optimizer "
         "really stepped.",
    "c": "A learning-rate scheduler cannot be used with a GradScaler: train fp16 at a "
         "constant learning rate.",
    "d": "`scaler.update()` must come after `scheduler.step()`.",
}
WHY_NOT_4_5 = {
    "a": "In the loop, scaler.step(optimizer) already comes before scheduler.step(), and "
         "torch still says optimizer.step() was not called. Read the scale after each step: "
         "what does a GradScaler do to its scale when it skips a step (lesson 3)?",
    "c": "Schedulers and scalers go together (torch's own recipe uses both): the warning is "
         "about particular steps, the ones where something did not happen.",
    "d": "update() only changes the scale for the next step; the warning is about whether "
         "the optimizer's step ran.",
}
_check_4_5 = multiple_choice(CHOICES_4_5, "b", WHY_NOT_4_5)


def overflow_evidence(precision: str = "fp16") -> Table:
    """The table 4.4 asks about: :func:`mplab.numerics.failures.overflow_demo` in `precision`,
    stage by stage beside fp32 (largest |value|, infs, NaNs), its rows as they are, under a title
    that names neither the format's limit nor a cause: linking the two is the learner's step."""
    demo = overflow_demo(precision)
    return Table(demo.table().rows, title=f"{demo.block} in {demo.precision}, stage by stage "
                                          "beside fp32")


# --- 4.1 read the trace -----------------------------------------------------------------------

REASONS_4_1 = {
    "a": "It is on CPU autocast's fp32 list: autocast cast its bf16 input up to fp32.",
    "b": "The add before each one already produced fp32, and autocast left that input as it was.",
    "c": "Autocast hands every op's result back in fp32, whatever the op computed in.",
    "d": "Its weight and bias are fp32, and autocast runs each op in its weights' dtype.",
}


def _kinds_of(op: str) -> set[str]:
    return {r.kind for r in lesson_trace().records if r.op == op}


def _check_4_1(answer) -> str | None:
    if not isinstance(answer, dict) or set(answer) != {"forced", "layer_norm"}:
        raise Incorrect("Give a dict with two keys, like the starter's: {\"forced\": an op "
                        "name, \"layer_norm\": a letter}.")
    op = answer["forced"]
    if not isinstance(op, str):
        raise Incorrect(f"\"forced\" is an op name as the trace prints it, such as "
                        f"\"aten::addmm\"; got {op!r:.40}.")
    op = op.strip() if op.strip().startswith("aten::") else "aten::" + op.strip()
    forced = lesson_trace().fp32_ops
    reason = one_letter(answer["layer_norm"], REASONS_4_1)
    if op not in forced:
        kinds = _kinds_of(op)
        if not kinds:
            return (f"{op} does not appear in the trace. Look at the rows whose kind is "
                    f"\"{FP32_AUTOCAST}\".")
        if LOW in kinds:
            return f"{op} ran in bf16 (kind \"{LOW}\"): autocast lowered it, not raised it."
        if PROMOTE in kinds:
            return (f"{op} ran in fp32 because its inputs mixed bf16 and fp32 (kind "
                    f"\"{PROMOTE}\"): type promotion, not autocast's fp32 list.")
        return (f"{op} ran in fp32, but only because it was given fp32: autocast did nothing "
                f"to it. Look for the kind \"{FP32_AUTOCAST}\".")
    if reason != "b":
        return {"a": f"Look at native_layer_norm's row: \"autocast cast inputs\" says no, and "
                     f"its kind is \"{FP32}\", not \"{FP32_AUTOCAST}\" as the loss's ops "
                     "after their bf16 -> fp32 cast. What fed it fp32?",
                "c": "Look at addmm's row: its output is bf16, and the next op gets it as "
                     "bf16. Autocast casts inputs, never results. What was layer_norm "
                     "given?",
                "d": "Look at addmm: its weight is an fp32 parameter too, yet it ran in bf16 "
                     "after autocast cast the weight. Weights do not decide; what was "
                     "layer_norm given?"}[reason]
    return None


# --- the exercises ----------------------------------------------------------------------------

EXERCISES = {e.id: e for e in in_order([
    Exercise(
        id="4.2", title="Order the calls",
        prompt="One iteration of the course's fp16 loop is five calls, named here:\n\n"
               + "\n".join(f"- `{k}`: `{v}`" for k, v in CALLS.items())
               + "\n\nPut the five names in the order they run, as a list. Your order is run "
               "with torch for 3 iterations: if torch refuses it, you see torch's own error; "
               "if it runs, the weights are compared bit for bit with the right order's "
               "(`zero_grad` has more than one right place: any that trains the same passes).",
        comment="the five calls of one iteration, in order",
        body=f"answer = {SHUFFLED_4_2!r}  # reorder this list",
        key=f"answer = {list(RIGHT_4_2[0])!r}  # zero_grad may also come first",
        check=_check_4_2,
        hints=(
            "Each call needs something the one before it made: a loss, then gradients, then "
            "an inf check, then a new scale.",
            "scaler.update() decides the next scale from what scaler.step() found, so it comes "
            "after step; zero_grad clears the gradients, so it must not sit between backward "
            "and step.",
            "forward, backward, step, update, and zero_grad at the very end (or the very "
            "start).",
        )),
    Exercise(
        id="4.3", title="Make a loop mixed precision",
        prompt="Turn this fp32 training step into the course's fp16 step, using the `scaler` "
               f"it is given (a `torch.amp.GradScaler`):\n\n{python_block(FP32_STEP)}\n\n"
               "Write the new `train_step(model, optimizer, scaler, x, y)`; it need return "
               "nothing. Autocast on the device the tensors are on (`x.device.type`: \"cpu\" "
               "here). It is run for 3 steps on a small model on the CPU and compared, weights "
               "bit for bit, with a reference fp16 step (the grader also starts from weights "
               "and data drawn for each grading run).",
        comment="the fp16 version of train_step (autocast + the given scaler)",
        body="def train_step(model, optimizer, scaler, x, y):\n"
             "    return ...  # the fp16 version",
        key="def train_step(model, optimizer, scaler, x, y):\n"
            "    with torch.autocast(\"cpu\", dtype=torch.float16):\n"
            "        loss = torch.nn.functional.mse_loss(model(x).float(), y)\n"
            "    scaler.scale(loss).backward()\n"
            "    scaler.step(optimizer)\n"
            "    scaler.update()\n"
            "    optimizer.zero_grad()",
        arg='train_step',
        check=_check_4_3, hidden=_hidden_4_3, trials=_trials_4_3,
        hints=(
            "Two changes: the forward pass (model and loss) runs under autocast, and the "
            "backward/step go through the scaler.",
            "with torch.autocast(\"cpu\", dtype=torch.float16): around the forward; "
            "model(x).float() gives mse_loss an fp32 input; scaler.scale(loss).backward(), "
            "scaler.step(optimizer), scaler.update().",
            "Forward under autocast; then scale(loss).backward(), step(optimizer), update(), "
            "zero_grad() outside it.",
        )),
    Exercise(
        id="4.4", title="Why does the loss go NaN?",
        prompt="A feed-forward block whose weights came from bf16 training gives a NaN loss "
               "from its very first forward pass in fp16, but a finite one in fp32 and bf16 "
               f"(the tables above). Why? Pick the reason:\n\n{choice_list(CHOICES_4_4)}\n\n"
               "Answer with its letter.",
        comment="\"a\", \"b\", \"c\" or \"d\"",
        body="answer = ...",
        key="answer = \"b\"  # 66,246 > 65,504: inf, then NaN in LayerNorm",
        check=_check_4_4,
        hints=(
            "Follow the table stage by stage: where does the first inf appear, and where the "
            "first NaN?",
            "A GradScaler acts on gradients, in the backward pass; this NaN is in the forward "
            "pass. fp16's largest value is 65,504.",
            "The feed-forward output stage overflows; LayerNorm computes inf − inf.",
        )),
    Exercise(
        id="4.5", title="A scheduler warning",
        prompt="This fp16 loop (the cell above ran it for 3 steps, its GradScaler started at "
               "2**32, and printed what torch warned and the scale after each step):\n\n"
               + python_block(inspect.getsource(loop_4_5)) + "\n\nWhy does torch warn "
               "that `lr_scheduler.step()` was called before `optimizer.step()`, and what "
               f"is the fix?\n\n{choice_list(CHOICES_4_5)}\n\nAnswer with its letter.",
        comment="\"a\", \"b\", \"c\" or \"d\"",
        body="answer = ...",
        key="answer = \"b\"  # the scale halved: the step was skipped",
        check=_check_4_5,
        hints=(
            "The order of the calls in the loop is the one torch asks for. So when would "
            "optimizer.step() not have been called, though scaler.step(optimizer) was?",
            "A GradScaler halves its scale each time it finds inf/NaN gradients, and then "
            "skips optimizer.step() (lesson 3).",
            "Step the scheduler only on the iterations whose optimizer step ran (mplab.train "
            "counts the optimizer's steps with a hook for that).",
        )),
    Exercise(
        id="4.1", title="Read the trace",
        prompt="Read the lesson model's bf16 trace above (`t`). Name one op that autocast "
               "**forced** to fp32, by its name in the trace (an `aten::` name), and say "
               "why `native_layer_norm` ran in fp32 too. Each row of `t.summary()` gives an "
               "op's input and output dtypes, its kind, and whether autocast cast its inputs "
               "before it ran (the column `autocast cast inputs`); `t.by_layer()` shows each "
               "module's ops in the order they ran (a tag's tooltip gives its dtypes). "
               "Which of these is true of `native_layer_norm`?\n\n"
               f"{choice_list(REASONS_4_1)}\n\n"
               "Answer with a dict: `{\"forced\": the op's name, \"layer_norm\": the "
               "reason's letter}`.",
        comment="an op autocast forced to fp32, and why layer_norm ran in fp32",
        body="answer = {\"forced\": ..., \"layer_norm\": ...}",
        key="answer = {\"forced\": \"aten::_log_softmax\",  # cross-entropy: fp32 list\n"
            "          \"layer_norm\": \"b\"}  # its input came from a promoting add",
        check=_check_4_1,
        hints=(
            f"The trace's summary has a `kind` column: \"{FP32_AUTOCAST}\" marks ops autocast "
            f"upcast (their `autocast cast inputs` says yes); \"{FP32}\" ones just got "
            "fp32 inputs.",
            "t.fp32_ops lists the forced ones. For layer_norm, look at the op right before it "
            "in t.by_layer() (or t.table(phase=\"forward\")): what did it produce, and from "
            "what?",
            "The loss (cross-entropy) is forced to fp32; layer_norm follows a residual add of "
            "a bf16 and an fp32 tensor.",
        )),
])}

LESSON = Lesson(4, list(EXERCISES.values()))
check, hint, solution, exercise_cells, cells, task_markdown = LESSON.functions()
