"""Lesson 5's exercises: learners' loops run with a real Accelerator and compared with the
course's loop, the fp16 question answered by mplab.amp.audit of a real fp16 Accelerator, the audit
to read built for real, the GradScaler's whereabouts read off Accelerate by a spying scaler;
and the feedback the likely mistakes get."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # these tests never reach for the hub

import re  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import failed_saying, optional, run_cell  # noqa: E402

from mplab.amp.audit import Observer, audit  # noqa: E402
from mplab.exercises import HIDDEN_FAILED  # noqa: E402
from mplab.exercises import lesson5 as ex  # noqa: E402
from mplab.fixtures import lesson_batch  # noqa: E402
from mplab.models import lesson_model  # noqa: E402
from mplab.train import compare  # noqa: E402
from mplab.train.accelerate_path import fresh_accelerate  # noqa: E402

nbformat = optional("nbformat")

IDS = list(ex.EXERCISES)


def test_there_are_four_exercises_worth_four_points():
    assert IDS == ["5.1", "5.2", "5.3", "5.4"]
    assert sum(e.points for e in ex.EXERCISES.values()) == 4


def test_the_tasks_show_the_code_to_convert_and_to_read_and_list_every_choice():
    assert f"```python\n{ex.TORCH_LOOP}\n```" in ex.EXERCISES["5.1"].prompt
    assert f"```python\n{ex.COLLEAGUE_CODE}\n```" in ex.EXERCISES["5.3"].prompt
    lines = ex.EXERCISES["5.2"].prompt.splitlines()
    assert all(f"- ({k}) {v}" in lines for k, v in ex.CHOICES_5_2.items())
    lines = ex.EXERCISES["5.3"].prompt.splitlines()
    assert all(f"- ({k}) {text}" in lines for k, (text, _) in ex.FALLBACKS_5_3.items())
    lines = ex.EXERCISES["5.4"].prompt.splitlines()
    for calls in (ex.TORCH_CALLS_5_4, ex.ACCELERATE_CALLS_5_4):
        assert all(f"- `{name}`: `{code}`" in lines for name, code in calls.items())


def test_the_colleagues_code_in_the_task_is_the_code_that_runs():
    import inspect

    body = inspect.getsource(ex.colleague_step)
    assert all(line in body for line in ex.COLLEAGUE_CODE.splitlines())
    assert ex.COLLEAGUE_CODE.splitlines()[0].startswith("accelerator = Accelerator(")
    assert "optimizer.step()" in ex.COLLEAGUE_CODE and "return" not in ex.COLLEAGUE_CODE


# --- 5.1 --------------------------------------------------------------------------------------

def loop(*, prepare="model, optimizer, dataloader", backward="accelerator.backward(loss)",
         step=True, zero_grad=True, extra=""):
    """A learner's train_loop, with one of the likely mistakes."""
    lines = ["def train_loop(accelerator, model, optimizer, dataloader):"]
    if prepare:
        lines.append(f"    {prepare} = accelerator.prepare({prepare})")
    lines += ["    for batch in dataloader:", "        loss = model(**batch).loss",
              f"        {backward}"]
    lines += ["        optimizer.step()"] * step + ["        optimizer.zero_grad()"] * zero_grad
    lines += [f"        {extra}"] * bool(extra)
    _, names = run_cell("\n".join(lines) + "\n0", ex=ex)
    return names["train_loop"]


def test_5_1_the_task_says_what_to_return_and_what_the_check_requires():
    prompt = ex.EXERCISES["5.1"].prompt
    assert "returns nothing" in prompt
    assert "the model, the optimizer and the dataloader each handed to `accelerator.prepare`" \
        in prompt
    result, _ = run_cell(ex.EXERCISES["5.1"].starter, ex=ex)  # the untouched starter cell
    assert result.status == "not attempted"


def test_5_1_the_course_loop_passes_and_so_do_loops_that_train_the_same_way():
    assert ex.check("5.1", loop()).passed

    def one_at_a_time(accelerator, model, optimizer, dataloader):
        model = accelerator.prepare(model)
        optimizer = accelerator.prepare(optimizer)
        dataloader = accelerator.prepare(dataloader)
        for batch in dataloader:
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            optimizer.zero_grad()

    assert ex.check("5.1", one_at_a_time).passed

    def autocast_left_in(accelerator, model, optimizer, dataloader):
        model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
        for batch in dataloader:
            with torch.autocast("cpu", dtype=torch.bfloat16):  # the prepared forward does it
                loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()

    assert ex.check("5.1", autocast_left_in).passed


def test_5_1_feedback_names_what_the_loop_did_not_hand_accelerate():
    failed_saying(ex.check("5.1", loop(prepare="")), "nothing was handed",
                  hiding=["accelerator.prepare("])
    failed_saying(ex.check("5.1", loop(prepare="optimizer, dataloader")),
                  "model was not prepared", "fp32")
    failed_saying(ex.check("5.1", loop(prepare="model, dataloader")), "optimizer was not prepared",
                  "GradScaler")
    failed_saying(ex.check("5.1", loop(prepare="model, optimizer")), "dataloader was not prepared",
                  "accelerate launch")


def test_5_1_a_plain_loss_backward_agrees_in_bf16_and_is_caught_by_the_fp16_runs_weights():
    learner = loop(backward="loss.backward()")
    run, reference = ex.LoopRun(learner), ex.LoopRun(loop())
    assert run.same_weights(reference)  # bf16 on one process: identical, so a second run
    assert (run.backward_calls, reference.backward_calls) == (0, 3)
    assert not ex.LoopRun(learner, **ex.AS_GPU).same_weights(ex.LoopRun(loop(), **ex.AS_GPU))
    failed_saying(ex.check("5.1", learner), "fp16 loss scaling", "loss.backward()",
                  "scaled for fp16", "gradient accumulation")


def test_5_1_feedback_for_a_loop_that_steps_wrong():
    failed_saying(ex.check("5.1", loop(zero_grad=False)), "never cleared")
    failed_saying(ex.check("5.1", loop(step=False)), "never changed")
    failed_saying(ex.check("5.1", loop(extra="accelerator.backward(model(**batch).loss)")),
                  "backward ran 6 times for 3 batches")
    kept_scaler = loop(backward="scaler.scale(loss).backward()")
    result = ex.check("5.1", kept_scaler)
    assert result.status == "error" and "NameError: name 'scaler'" in result.message


def test_5_1_an_unprepared_model_really_trains_in_fp32_and_the_reference_in_bf16():
    def observed(prepared: bool):
        from accelerate import Accelerator

        with fresh_accelerate():
            accelerator = Accelerator(mixed_precision="bf16", cpu=True)
            model = lesson_model()
            if prepared:
                model = accelerator.prepare(model)
            seen = Observer(model)
            model(**lesson_batch(4))
            seen.remove()
        return seen.compute_dtype

    assert observed(True) == torch.bfloat16 and observed(False) == torch.float32
    assert not ex.LoopRun(loop(prepare="optimizer, dataloader")).same_weights(ex.LoopRun(loop()))


def three_batches_only(accelerator, model, optimizer, dataloader):
    """The course's loop, stopped after the public check's 3 batches."""
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    for batch in list(dataloader)[:3]:
        accelerator.backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()


def test_5_1_the_hidden_check_runs_on_other_weights_and_more_batches(monkeypatch):
    assert ex.check("5.1", three_batches_only).passed  # the public runs have 3 batches
    monkeypatch.setenv("MPLAB_GRADING", "1")
    failed_saying(ex.check("5.1", three_batches_only), "hidden check", "4 batches of 4",
                  "backward ran 3 times for 4 batches")
    assert ex.check("5.1", loop()).passed


def test_5_1_runs_leave_accelerates_state_fresh_for_the_notebook():
    from accelerate import Accelerator

    ex.check("5.1", loop())
    with fresh_accelerate():  # a notebook's next Accelerator may ask for another precision
        assert Accelerator(mixed_precision="no", cpu=True).mixed_precision == "no"


def unwatched(accelerator, model, optimizer, dataloader):
    """The course's loop through Accelerator's own methods: what it hands them goes unnoted."""
    model, optimizer, dataloader = type(accelerator).prepare(accelerator, model, optimizer,
                                                             dataloader)
    for batch in dataloader:
        type(accelerator).backward(accelerator, model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()


def forged(accelerator, model, optimizer, dataloader):
    """Hands everything to prepare (and notes a backward), then trains what it was given."""
    from mplab.exercises.answers import note

    accelerator.prepare(model, optimizer, dataloader)
    for batch in dataloader:
        note("backward")
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


LOOPS = {"the course's": dict(), "nothing prepared": dict(prepare=""),
         "the model not prepared": dict(prepare="optimizer, dataloader"),
         "the optimizer not prepared": dict(prepare="model, dataloader"),
         "the dataloader not prepared": dict(prepare="model, optimizer"),
         "loss.backward()": dict(backward="loss.backward()"),
         "no zero_grad": dict(zero_grad=False), "no step": dict(step=False),
         "two backwards": dict(extra="accelerator.backward(model(**batch).loss)"),
         "a scaler kept": dict(backward="scaler.scale(loss).backward()"),
         "accelerator's scaler": dict(backward="accelerator.scaler.scale(loss).backward()")}
#: The run whose weights each wrong loop changes (the bf16 run's ones are there too).
CAUGHT_BY = {"nothing prepared": "bf16", "the model not prepared": "bf16",
             "no zero_grad": "bf16", "no step": "bf16", "two backwards": "bf16",
             "the optimizer not prepared": "fp16", "the dataloader not prepared": "fp16",
             "loss.backward()": "fp16", "accelerator's scaler": "fp16", "forged": "fp16"}


def named(name):
    return {"three batches only": three_batches_only, "unwatched": unwatched,
            "forged": forged}.get(name) or loop(**LOOPS[name])


@pytest.mark.parametrize("name", CAUGHT_BY)
def test_5_1_each_wrong_loop_changes_the_weights_of_a_run(name):
    """Only the weights decide: each wrong loop ends with weights other than the course
    loop's in the run that catches it (and the same in the bf16 run where it hides)."""
    runs = {"bf16": {}, "fp16": ex.AS_GPU}
    learner, settings = named(name), runs[CAUGHT_BY[name]]
    assert not ex.LoopRun(learner, **settings).same_weights(ex._reference_run(**settings))
    if CAUGHT_BY[name] == "fp16" and name != "accelerator's scaler":  # bf16 has none
        assert ex.LoopRun(learner).same_weights(ex._reference_run())
    assert not ex.check("5.1", learner).passed


def test_5_1_notes_decide_nothing_a_loop_that_leaves_none_passes():
    run = ex.LoopRun(unwatched, **ex.AS_GPU)
    assert (run.prepared, run.backward_calls) == ([], 0)
    assert run.same_weights(ex._reference_run(**ex.AS_GPU))
    assert ex.check("5.1", unwatched).passed
    result = ex.check("5.1", forged)  # notes all it should, trains what it was given
    failed_saying(result, "fp16 loss scaling", "weights differ")


@pytest.mark.parametrize("name", [*LOOPS, "three batches only", "unwatched", "forged"])
def test_5_1_the_grader_decides_from_the_record_of_the_loop(name, graded_apart):
    """The kernel's record keeps the weights each run left (and the notes its watched prepare
    and backward made, which only choose the message); the grader replays them into its own
    runs, hidden one included, and compares with the course's loop run there: the kernel's
    verdict, and on the hidden run's weights drawn for each grading, the grader's own."""
    kernel, grader = graded_apart("5.1", named(name))
    if name == "three batches only":  # the kernel ran the hidden run; the grader judged it
        assert kernel.passed and grader.status == "failed"
        assert grader.message.startswith(HIDDEN_FAILED) and "4 batches of 4" in grader.message
    else:
        assert (grader.status, grader.points) == (kernel.status, kernel.points)
        assert grader.passed == (name in ("the course's", "unwatched"))
        if not grader.passed:  # a pass says which checks ran: the grader ran the hidden one
            assert grader.message == kernel.message


# --- 5.2 --------------------------------------------------------------------------------------

def test_5_2_the_answer_is_read_off_a_real_fp16_accelerator_on_this_cpu():
    found = ex.fp16_on_cpu_audit()
    assert found.asked == "fp16" and found.compute_dtype == torch.float32
    assert found.scaler is None and found.autocast["enabled"] is False
    assert found.has("fp16_ignored")
    assert any("Accelerate ignores fp16 on a CPU" in f.text for f in found.fallbacks)
    assert ex.right_5_2() == "b"
    assert ex.check("5.2", " B ").passed


def test_5_2_wrong_choices_say_what_to_look_at_without_the_answer():
    failed_saying(ex.check("5.2", "a"), "observed the matmuls in float32", "fp16 arithmetic",
                  hiding=["(b)", "ignores"])
    failed_saying(ex.check("5.2", "c"), "GradScaler row", hiding=["(b)"])
    failed_saying(ex.check("5.2", "d"), "bf16", "observed its matmuls in float32",
                  hiding=["(b)"])
    assert "one letter" in ex.check("5.2", "z").message


# --- 5.3 --------------------------------------------------------------------------------------

def test_5_3_the_colleagues_run_is_pure_bf16_and_the_audit_names_two_fallbacks():
    report = ex.colleague_audit()
    assert not report.mixed and report.param_dtype == report.optimizer_state_dtype \
        == torch.bfloat16
    assert report.compute_dtype == torch.bfloat16 and report.scaler is None
    assert len(report.fallbacks) == 2 and ex.named_fallbacks(report) == {"c", "d"}
    for answer in ({"mixed": False, "fallbacks": ["d", "C"]}, {"mixed": False,
                                                               "fallbacks": "c, d"}):
        assert ex.check("5.3", answer).passed


def test_5_3_each_choice_is_worded_as_the_audit_words_a_real_case():
    from accelerate import Accelerator

    batch = lesson_batch(8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        float64 = torch.autocast("cpu", dtype=torch.float64)  # torch switches it off
    model = lesson_model()
    bf16_scaled = audit(model, scaler=torch.amp.GradScaler("cpu"), batch=batch,
                        autocast=torch.autocast("cpu", dtype=torch.bfloat16))
    with fresh_accelerate():
        accelerator = Accelerator(mixed_precision="fp16", cpu=True)
        fp16_ignored = audit(accelerator.prepare(lesson_model()), accelerator=accelerator,
                             batch=batch)
    cases = {"a": fp16_ignored, "b": audit(lesson_model(), batch=batch, autocast=float64),
             "c": ex.colleague_audit(), "d": ex.colleague_audit(), "e": bf16_scaled}
    for letter, report in cases.items():
        assert letter in ex.named_fallbacks(report), (letter, report.fallbacks)
    for report in cases.values():  # and each fallback the audit names is one choice
        for fallback in report.fallbacks:
            matched = [k for k, (_, code) in ex.FALLBACKS_5_3.items() if code == fallback.code]
            assert len(matched) == 1, fallback


def test_5_3_feedback_for_the_likely_mistakes():
    failed_saying(ex.check("5.3", {"mixed": True, "fallbacks": ["c", "d"]}), "master weights",
                  hiding=["bfloat16"])
    failed_saying(ex.check("5.3", {"mixed": False, "fallbacks": ["c", "d", "e"]}),
                  "(e) is not among", "GradScaler row")
    failed_saying(ex.check("5.3", {"mixed": False, "fallbacks": ["a", "c", "d"]}),
                  "asked for")
    failed_saying(ex.check("5.3", {"mixed": False, "fallbacks": ["c"]}),
                  "names 2 silent fallbacks here; you listed 1", hiding=["SILENT FALLBACK"])
    assert ex.check("5.3", {"mixed": "no", "fallbacks": []}).status == "failed"
    assert "Not letters" in ex.check("5.3", {"mixed": False, "fallbacks": ["z"]}).message
    assert ex.check("5.3", {"mixed": False, "fallbacks": 3}).status == "failed"
    assert ex.check("5.3", {"mixed": ..., "fallbacks": ...}).status == "not attempted"


# --- 5.4 --------------------------------------------------------------------------------------

def where_accelerate_calls_the_scaler(clip: bool = True) -> dict:
    """A GradScaler that records which Accelerate call it is inside, handed to a real fp16
    Accelerator (forced to act as on a GPU: on a CPU it builds none), then the course's calls;
    and the call inside which the forward first ran under an fp16 autocast."""
    from accelerate import Accelerator

    inside, calls = [None], {}

    class Spy(torch.amp.GradScaler):
        def scale(self, outputs):
            calls.setdefault("scale", inside[0])
            return super().scale(outputs)

        def unscale_(self, optimizer):
            calls.setdefault("unscale_", inside[0])
            return super().unscale_(optimizer)

        def step(self, optimizer, *args, **kwargs):
            calls.setdefault("step", inside[0])
            return super().step(optimizer, *args, **kwargs)

        def update(self, new_scale=None):
            calls.setdefault("update", inside[0])
            return super().update(new_scale)

    def autocast_seen(module, args, output):
        if torch.is_autocast_enabled("cpu") and output.dtype == torch.float16:
            calls.setdefault("autocast", inside[0])

    with fresh_accelerate():
        accelerator = Accelerator(mixed_precision="fp16", cpu=True)
        accelerator.native_amp, accelerator.scaler = True, Spy("cpu", init_scale=2.0**8)
        model = lesson_model()
        optimizer = torch.optim.AdamW(model.parameters())
        inside[0] = "prepare"
        model, optimizer = accelerator.prepare(model, optimizer)
        model.bert.encoder.layer[0].attention.self.query.register_forward_hook(autocast_seen)
        inside[0] = "forward"  # the prepared model's: its own is model._original_forward
        loss = model(**lesson_batch(8)).loss
        inside[0] = "backward"
        accelerator.backward(loss)
        if clip:
            inside[0] = "clip_grad_norm_"
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        inside[0] = "optimizer.step"
        optimizer.step()
        inside[0] = "zero_grad"
        optimizer.zero_grad()
    assert hasattr(model, "_original_forward")
    return calls


def test_5_4_the_answer_is_where_the_real_accelerate_calls_each_gradscaler_method():
    assert where_accelerate_calls_the_scaler(clip=True) == ex.WHERE_5_4
    assert set(ex.WHERE_5_4.values()) <= set(ex.ACCELERATE_CALLS_5_4)
    assert ex.check("5.4", dict(ex.WHERE_5_4)).passed


def test_5_4_the_task_says_the_loop_clips_because_without_clipping_step_unscales():
    # the one answer the task allows: lesson 4's loop clips, so unscale_ is clipping's
    assert where_accelerate_calls_the_scaler(clip=False)["unscale_"] == "optimizer.step"
    prompt = ex.EXERCISES["5.4"].prompt
    assert "clips the gradients" in prompt and "with clipping" in prompt
    failed_saying(ex.check("5.4", dict(ex.WHERE_5_4, unscale_="optimizer.step")),
                  "'unscale_'", "only gradients nothing has unscaled yet", "which clips",
                  hiding=["clip_grad_norm_"])
    failed_saying(ex.check("5.4", dict(ex.WHERE_5_4, autocast="prepare")), "'autocast'",
                  "each time the forward runs")


def test_5_4_feedback_points_at_the_first_call_placed_wrong():
    answer = dict(ex.WHERE_5_4, update="zero_grad")
    failed_saying(ex.check("5.4", answer), "'update'", "right after step()")
    answer = dict(ex.WHERE_5_4, autocast="backward", scale="optimizer.step")
    failed_saying(ex.check("5.4", answer), "'autocast'", "1 more to look at")
    result = ex.check("5.4", dict(ex.WHERE_5_4, step="accelerator.step"))
    assert result.status == "failed" and "not one of the Accelerate calls" in result.message
    assert ex.check("5.4", {"autocast": "forward"}).status == "failed"


# --- what the page shows above each exercise --------------------------------------------------

NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "05_accelerate.ipynb"


def above(xid: str, kind: str) -> list[str]:
    """The sources of the `kind` cells above exercise `xid`'s task cell."""
    nb = nbformat.read(NOTEBOOK, 4)
    at = next(i for i, c in enumerate(nb.cells) if c.metadata.get("mplab", {}).get("exercise")
              == xid)
    return [c.source for c in nb.cells[:at - 1] if c.cell_type == kind]


def test_an_audit_table_without_its_verdict_keeps_the_facts_and_draws_no_conclusion():
    for report in (ex.colleague_audit(), ex.fp16_on_cpu_audit()):
        facts = str(report.table(verdict=False))
        assert report.verdict not in facts and "SILENT" not in facts
        assert not any(f.text in facts or f.text[:30] in facts for f in report.fallbacks)
        assert [r["what"] for r in report.table(verdict=False)] == [
            r["what"] for r in report.table()]  # the same rows
        assert report.verdict in report.table().title  # the default keeps it
    assert "bfloat16" in str(ex.colleague_audit().table(verdict=False))  # the weights row
    assert "float32" in str(ex.fp16_on_cpu_audit().table(verdict=False))  # the matmuls row


def test_above_5_2_no_cell_says_that_fp16_was_ignored():
    text = "\n".join(above("5.2", "markdown")).lower()
    assert "ignore" not in text and "fp32 run under another name" not in text
    code = above("5.2", "code")
    # every run audit above is shown as its facts only (the full audit names the fallback)
    audits = r"(?<!mplab)(?<!mplab\.amp)\.audit\b(.{0,24})"  # not the module's name
    shown = [m for c in code for m in re.finditer(audits, c)]
    assert shown and all(m.group(1).startswith(".table(verdict=False)") for m in shown)
    fp16_run = [c for c in code if 'train(precision="fp16"' in c]
    assert len(fp16_run) == 1
    assert 'catch_warnings(action="ignore", category=TrainWarning)' in fp16_run[0]
    lines = [line.split("#", 1)[0] for c in code for line in c.splitlines()]
    assert not any(".warnings" in line for line in lines)  # nor the run's record of it


def test_the_fp16_runs_fallback_is_said_by_a_trainwarning_alone_and_kept_in_the_record():
    from mplab.train import TrainWarning, train

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        run = train(path="accelerate", precision="fp16", device="cpu", steps=2, batch_size=4,
                    eval_samples=8, progress=False)
    assert any("ignores fp16 on a CPU" in w for w in run.warnings)
    telling = [w for w in said if "ignores fp16" in str(w.message)]
    assert telling and all(issubclass(w.category, TrainWarning) for w in telling)


def test_above_5_3_the_colleagues_audit_is_shown_without_its_verdict():
    code = "\n".join(above("5.3", "code"))
    assert "ex.colleague_audit().table(verdict=False)" in code
    assert not re.search(r"colleague_audit\(\)(?!\.table\(verdict=False\))", code)


def test_above_5_4_no_sentence_pairs_a_scaler_call_with_the_accelerate_call_it_runs_in():
    clauses = [c for text in above("5.4", "markdown") + above("5.4", "code")
               for c in re.split(r"[.;:]\s|\n-|\n\n", text)]
    accelerate = ("accelerator.backward", "clip_grad_norm_", "optimizer.step",
                  "optimizer's step", "optimizer's `step()`")
    for clause in clauses:
        if re.search(r"scal(e|er|es|ed|ing)|unscal", clause):
            assert not any(a in clause for a in accelerate), clause
    # the diff shown above is the code alone: the source's comments say where the scaler went
    calls = [line for c in above("5.4", "code") for line in c.splitlines()
             if "compare.diff(" in line]
    assert calls
    for line in calls:
        shown = eval(line.strip().removeprefix("print(")[:-1], {"compare": compare})
        assert not [x for x in shown.splitlines() if "#" in x], line
