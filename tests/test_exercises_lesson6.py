"""Lesson 6's exercises: step names against mplab.train.compare's measurement, learners'
TrainingArguments built by the installed transformers and trained one step by a real Trainer,
fixes of a bf16-loaded model audited, and the feedback their likely mistakes get."""

import pytest
import torch
from conftest import failed_saying

from mplab import models
from mplab.exercises import lesson6 as ex
from mplab.train import compare

IDS = list(ex.EXERCISES)
ON_GPU = torch.cuda.is_available()


def test_there_are_four_exercises_worth_four_points():
    assert IDS == ["6.1", "6.2", "6.3", "6.4"]
    assert sum(e.points for e in ex.EXERCISES.values()) == 4


def test_tasks_show_what_they_ask_for():
    assert f"```python\ntraining_args = {ex.COURSE_LINE}\n```" in ex.EXERCISES["6.1"].prompt
    assert "def course_arguments(output_dir):" in ex.EXERCISES["6.1"].starter
    lines = ex.EXERCISES["6.2"].prompt.splitlines()
    assert all(f"- `{name}`" in lines for name in compare.STEPS)
    assert "Leave out the parts Accelerate already did out of sight" in ex.EXERCISES["6.2"].prompt
    assert "def fix(model):" in ex.EXERCISES["6.4"].starter


def test_the_answers_to_6_1_and_6_3_are_not_on_the_page_above_them():
    """The course's line is fixed, and the steps changed, before the lesson shows either: the
    rename, the accumulation and the clipping arguments appear only after the exercise."""
    from pathlib import Path

    import nbformat

    nb = nbformat.read(Path(__file__).parent.parent / "notebooks" / "06_trainer.ipynb", 4)
    at = {c.metadata.get("mplab", {}).get("exercise"): i for i, c in enumerate(nb.cells)}
    above_6_1 = "\n".join(c.source for c in nb.cells[:at["6.1"] - 1])
    assert "eval_strategy" not in above_6_1 and "renamed(" not in above_6_1
    above_6_3 = "\n".join(c.source for c in nb.cells[:at["6.3"] - 1])
    assert "max_grad_norm=" not in above_6_3 and "gradient_accumulation_steps=" not in above_6_3
    assert "`max_grad_norm`" not in above_6_3 and "`gradient_accumulation_steps`" not in above_6_3


# --- 6.1 the course's line, today -------------------------------------------------------------

def test_6_1_todays_name_with_the_courses_fp16_passes():
    from transformers import TrainingArguments

    def today(output_dir):
        return TrainingArguments(output_dir=output_dir, eval_strategy="epoch", fp16=True)

    assert ex.check("6.1", today).passed


def test_6_1_feedback_for_each_mistake():
    from transformers import TrainingArguments

    def course(output_dir):
        return TrainingArguments(output_dir=output_dir, evaluation_strategy="epoch", fp16=True)

    failed_saying(ex.check("6.1", course), "evaluation_strategy", "removed in 4.51",
                  "help(TrainingArguments)", hiding=("eval_strategy",))

    def no_fp16(output_dir):
        return TrainingArguments(output_dir=output_dir, eval_strategy="epoch")

    failed_saying(ex.check("6.1", no_fp16), "keep its fp16=true")

    def no_evaluation(output_dir):
        return TrainingArguments(output_dir=output_dir, fp16=True)

    failed_saying(ex.check("6.1", no_evaluation), "after every epoch", "'no'")

    def elsewhere(output_dir):
        return TrainingArguments(output_dir="out", eval_strategy="epoch", fp16=True)

    failed_saying(ex.check("6.1", elsewhere), "not to the output_dir given")

    def old_device(output_dir):
        return TrainingArguments(output_dir=output_dir, eval_strategy="epoch", fp16=True,
                                 no_cuda=True)

    failed_saying(ex.check("6.1", old_device), "no_cuda", "deprecated in transformers 4.32")
    assert ex.check("6.1", lambda output_dir: "TrainingArguments(...)").status == "failed"
    assert ex.check("6.1", lambda output_dir: 1 / 0).status == "error"


# --- 6.2 what the Trainer takes over ----------------------------------------------------------

def test_6_2_the_answer_is_what_compare_measures_in_the_two_paths():
    accelerate, trainer = compare.profile("accelerate"), compare.profile("trainer")
    assert ex.taken_over() == set(accelerate.steps_written) - set(trainer.steps_written)
    assert ex.taken_over() == {"backward", "unscale + clip", "optimizer step", "zero_grad",
                               "lr schedule", "accumulation"}
    assert ex.check("6.2", sorted(ex.taken_over(), reverse=True)).passed  # any order
    assert ex.check("6.2", [" Backward ", *sorted(ex.taken_over() - {"backward"})]).passed


def test_6_2_the_diff_above_it_is_code_alone_and_no_text_above_pairs_a_call_with_its_part():
    from pathlib import Path

    import nbformat

    nb = nbformat.read(Path(__file__).parent.parent / "notebooks" / "06_trainer.ipynb", 4)
    at = {c.metadata.get("mplab", {}).get("exercise"): i for i, c in enumerate(nb.cells)}
    cells = nb.cells[:at["6.2"] - 1]
    calls = [line.strip() for c in cells if c.cell_type == "code" for line in
             c.source.splitlines() if "compare.diff(" in line]
    assert calls
    for call in calls:
        shown = eval(call.removeprefix("print(")[:-1], {"compare": compare})
        assert "-    with accelerator.accumulate(model):" in shown  # the loop is there
        assert not [line for line in shown.splitlines() if "#" in line], call
    # a step's name in a tag or in brackets after its call is the answer, line by line
    text = "\n".join(c.source for c in cells)
    assert "user_code(" not in text and "steps_written" not in text
    for name in ex.taken_over():
        assert f"[{name}]" not in text and f"({name})" not in text, name
    with pytest.raises(ValueError, match="bookkeeping=False"):
        compare.diff("accelerate", "trainer", tags=False)  # the full source keeps comments
    tagged = compare.diff("accelerate", "trainer", bookkeeping=False)
    assert all(f"[{name}]" in tagged for name in ex.taken_over())  # the default: tags kept


def test_6_2_feedback_names_what_was_missed_without_the_missing_names():
    everything = list(compare.STEPS)
    failed_saying(ex.check("6.2", everything), "accelerate already does it")
    failed_saying(ex.check("6.2", ["backward", "optimizer step"]), "4 of the steps",
                  "- lines", hiding=("zero_grad", "lr schedule", "accumulation"))
    failed_saying(ex.check("6.2", ["backward", "step"]), "not step names")
    assert ex.check("6.2", "backward").status == "failed"


# --- 6.3 change the steps through the arguments -----------------------------------------------

ASKED = {"bf16": True, "use_cpu": True, "gradient_accumulation_steps": 4}


def test_6_3_passes_after_a_real_step_of_four_micro_batches_unclipped_in_bf16():
    from transformers import TrainingArguments

    assert ex.check("6.3", {**ASKED, "max_grad_norm": 0.0}).passed
    assert ex.check("6.3", {**ASKED, "max_grad_norm": -1}).passed  # never above 0 either

    run = ex.one_step(TrainingArguments(output_dir="unused", **ASKED, max_grad_norm=0.0,
                                        **{**ex.ONE_STEP, "per_device_train_batch_size": 2}))
    assert (run.forwards, run.clipped) == (4, 0)
    assert run.audit.mixed and run.audit.compute_dtype == torch.bfloat16
    assert run.audit.param_dtype == torch.float32 and run.audit.scaler is None


def test_6_3_the_trainers_defaults_are_measured_one_micro_batch_and_clipping():
    from transformers import TrainingArguments

    run = ex.one_step(TrainingArguments(output_dir="unused", bf16=True, use_cpu=True,
                                        **ex.ONE_STEP))
    assert (run.forwards, run.clipped) == (1, 1)
    failed_saying(ex.check("6.3", {"bf16": True, "use_cpu": True, "max_grad_norm": 0.0}),
                  "ran 1 forward pass", "the task is 4", hiding=("gradient_accumulation",))
    failed_saying(ex.check("6.3", ASKED), "clipped the gradients", "1.0",
                  hiding=("max_grad_norm",))
    failed_saying(ex.check("6.3", {**ASKED, "max_grad_norm": None}), "TypeError")


def test_6_3_fp16_on_a_cpu_trains_one_real_step_in_fp32_and_the_feedback_says_so():
    from transformers import TrainingArguments

    found = ex.one_step_audit(TrainingArguments(output_dir="unused", fp16=True, use_cpu=True,
                                                **ex.ONE_STEP))
    assert found.compute_dtype == torch.float32 and not found.mixed
    failed_saying(ex.check("6.3", {**ASKED, "bf16": False, "fp16": True, "max_grad_norm": 0}),
                  "ran in float32", "ignores fp16 on a CPU", hiding=("bf16",))


@pytest.mark.skipif(ON_GPU, reason="on a GPU with bf16, bf16=True alone trains on the GPU")
def test_6_3_bf16_alone_quotes_transformers_refusal_which_names_use_cpu():
    failed_saying(ex.check("6.3", {"bf16": True}), "refused", "use_cpu", "meant for the CPU")


def test_6_3_other_mistakes_get_their_own_feedback():
    failed_saying(ex.check("6.3", {"use_cpu": True}), "nothing in these arguments asks")
    failed_saying(ex.check("6.3", {}), "nothing in these arguments asks")
    failed_saying(ex.check("6.3", {"bf16": True, "no_cuda": True}), "no_cuda",
                  "deprecated in transformers 4.32", hiding=("use_cpu",))
    failed_saying(ex.check("6.3", {"bf16": True, "fp16": True, "use_cpu": True}),
                  "at most one")
    failed_saying(ex.check("6.3", {"bf16": True, "use_cpus": True}), "use_cpus")
    failed_saying(ex.check("6.3", {**ASKED, "gradient_accumulation_steps": 1000}),
                  "accumulate over 1000")
    assert ex.check("6.3", {1: True}).status == "failed"
    assert ex.check("6.3", [("bf16", True)]).status == "failed"


def test_6_3_the_checks_own_run_settings_win_over_the_learners():
    # a learner's output_dir or max_steps must not make the check write there or run long
    result = ex.check("6.3", {**ASKED, "max_grad_norm": 0.0, "output_dir": "/nonexistent/x",
                              "max_steps": 10_000, "per_device_train_batch_size": 64})
    assert result.passed, result


# --- 6.4 the missing master weights -----------------------------------------------------------

def test_6_4_the_model_given_is_the_lesson_model_as_a_bf16_checkpoint_loads_it():
    model = ex.bf16_checkpoint_model()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config.dtype == torch.bfloat16  # as saved: transformers' dtype="auto"
    reference = models.lesson_model()
    assert all(torch.equal(p, q.to(torch.bfloat16))
               for p, q in zip(model.parameters(), reference.parameters()))
    assert ex.bf16_checkpoint_model() is not ex.bf16_checkpoint_model()  # a fresh copy each


def test_6_4_float_and_to_float32_pass():
    assert ex.check("6.4", lambda model: model.float()).passed
    assert ex.check("6.4", lambda model: model.to(torch.float32)).passed


def test_6_4_feedback_for_the_likely_mistakes():
    failed_saying(ex.check("6.4", lambda model: model), "still bfloat16", "pure bfloat16",
                  hiding=(".float()",))
    failed_saying(ex.check("6.4", lambda model: model.half()), "float16", "master copy")
    failed_saying(ex.check("6.4", lambda model: model.double()), "float64",
                  "autocast leaves float64")
    failed_saying(ex.check("6.4", lambda model: models.lesson_model(seed=1)),
                  "not the loaded ones")

    def head_only(model):
        model.classifier.float()
        return model

    failed_saying(ex.check("6.4", head_only), "only part of the weights", "bfloat16",
                  "float32")

    def forgot_return(model):
        model.float()

    failed_saying(ex.check("6.4", forgot_return), "returned none")
    failed_saying(ex.check("6.4", lambda model: "fp32"), "must return a torch model")
    failed_saying(ex.check("6.4", lambda model: torch.nn.Sequential(model.float())),
                  "other weights than the one it was given")
    assert ex.check("6.4", lambda model: 1 / 0).status == "error"


# --- the grader decides 6.1 and 6.4 from what the function returned ---------------------------

def _arguments(**kwargs):
    from transformers import TrainingArguments

    return lambda output_dir: TrainingArguments(**{"output_dir": output_dir, **kwargs})


def _head_only(model):
    model.classifier.float()
    return model


def _forgot_return(model):
    model.float()


def _a_copy(model):
    import copy

    return copy.deepcopy(model).float()


GRADED_APART = {
    "6.1 today's name": ("6.1", _arguments(eval_strategy="epoch", fp16=True)),
    "6.1 the course's name": ("6.1", _arguments(evaluation_strategy="epoch", fp16=True)),
    "6.1 no fp16": ("6.1", _arguments(eval_strategy="epoch")),
    "6.1 another folder": ("6.1", lambda output_dir: _arguments(
        eval_strategy="epoch", fp16=True)("out")),
    "6.1 no_cuda": ("6.1", _arguments(eval_strategy="epoch", fp16=True, no_cuda=True)),
    "6.1 bf16 and fp16": ("6.1", _arguments(eval_strategy="epoch", fp16=True, bf16=True)),
    "6.1 text": ("6.1", lambda output_dir: "TrainingArguments(...)"),
    "6.4 float": ("6.4", lambda model: model.float()),
    "6.4 a fixed copy": ("6.4", _a_copy),
    "6.4 as loaded": ("6.4", lambda model: model),
    "6.4 half": ("6.4", lambda model: model.half()),
    "6.4 double": ("6.4", lambda model: model.double()),
    "6.4 a new model": ("6.4", lambda model: models.lesson_model(seed=1)),
    "6.4 the head only": ("6.4", _head_only),
    "6.4 no return": ("6.4", _forgot_return),
    "6.4 text": ("6.4", lambda model: "fp32"),
    "6.4 another model": ("6.4", lambda model: torch.nn.Linear(2, 2)),
    "6.4 the model wrapped": ("6.4", lambda model: torch.nn.Sequential(model.float())),
    "6.4 raises": ("6.4", lambda model: 1 / 0),
}


@pytest.mark.parametrize("name", GRADED_APART)
def test_the_grader_gives_a_function_answer_the_kernels_verdict_from_its_record(name,
                                                                               graded_apart):
    """6.1 returns a TrainingArguments and 6.4 a model: the kernel's record keeps the first as
    the arguments its constructor takes and the second as its weights (or as the argument it
    was given), and the grader's check of that record, in its own process, says what the
    kernel's said."""
    kernel, grader = graded_apart(*GRADED_APART[name])
    assert (grader.status, grader.points, grader.message) == (
        kernel.status, kernel.points, kernel.message)
    assert kernel.passed == name.endswith(("today's name", "float", "a fixed copy"))
