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
    lines = ex.EXERCISES["6.1"].prompt.splitlines()
    assert all(f"- `{name}`" in lines for name in compare.STEPS)
    assert f"```python\ntraining_args = {ex.COURSE_LINE}\n```" in ex.EXERCISES["6.3"].prompt
    assert "def course_arguments(output_dir):" in ex.EXERCISES["6.3"].starter
    assert "def fix(model):" in ex.EXERCISES["6.4"].starter


# --- 6.1 what the Trainer takes over ----------------------------------------------------------

def test_6_1_the_answer_is_what_compare_measures_in_the_two_paths():
    accelerate, trainer = compare.profile("accelerate"), compare.profile("trainer")
    assert ex.taken_over() == set(accelerate.steps_written) - set(trainer.steps_written)
    assert ex.taken_over() == {"backward", "unscale + clip", "optimizer step", "zero_grad",
                               "lr schedule", "accumulation"}
    assert ex.check("6.1", sorted(ex.taken_over(), reverse=True)).passed  # any order
    assert ex.check("6.1", [" Backward ", *sorted(ex.taken_over() - {"backward"})]).passed


def test_6_1_feedback_names_what_was_missed_without_the_missing_names():
    everything = list(compare.STEPS)
    failed_saying(ex.check("6.1", everything), "accelerate already does it")
    failed_saying(ex.check("6.1", ["backward", "optimizer step"]), "4 of the steps",
                  "- lines", hiding=("zero_grad", "lr schedule", "accumulation"))
    failed_saying(ex.check("6.1", ["backward", "step"]), "not step names")
    assert ex.check("6.1", "backward").status == "failed"


# --- 6.2 bf16 on a CPU ------------------------------------------------------------------------

def test_6_2_bf16_with_use_cpu_passes_after_a_real_one_step_run_in_bf16():
    from transformers import TrainingArguments

    assert ex.check("6.2", {"bf16": True, "use_cpu": True}).passed

    args = TrainingArguments(output_dir="unused", bf16=True, use_cpu=True, **ex.ONE_STEP)
    found = ex.one_step_audit(args)
    assert found.mixed and found.compute_dtype == torch.bfloat16
    assert found.param_dtype == torch.float32 and found.scaler is None


def test_6_2_fp16_on_a_cpu_trains_one_real_step_in_fp32_and_the_feedback_says_so():
    from transformers import TrainingArguments

    found = ex.one_step_audit(TrainingArguments(output_dir="unused", fp16=True, use_cpu=True,
                                                **ex.ONE_STEP))
    assert found.compute_dtype == torch.float32 and not found.mixed
    failed_saying(ex.check("6.2", {"fp16": True, "use_cpu": True}), "ran in float32",
                  "ignores fp16 on a CPU", hiding=("bf16",))


@pytest.mark.skipif(ON_GPU, reason="on a GPU with bf16, bf16=True alone trains on the GPU")
def test_6_2_bf16_alone_quotes_transformers_refusal_which_names_use_cpu():
    failed_saying(ex.check("6.2", {"bf16": True}), "refused", "use_cpu", "meant for the CPU")


def test_6_2_other_mistakes_get_their_own_feedback():
    failed_saying(ex.check("6.2", {"use_cpu": True}), "nothing in these arguments asks")
    failed_saying(ex.check("6.2", {}), "nothing in these arguments asks")
    failed_saying(ex.check("6.2", {"bf16": True, "no_cuda": True}), "no_cuda",
                  "deprecated in transformers 4.32", hiding=("use_cpu",))
    failed_saying(ex.check("6.2", {"bf16": True, "fp16": True, "use_cpu": True}),
                  "at most one")
    failed_saying(ex.check("6.2", {"bf16": True, "use_cpus": True}), "use_cpus")
    assert ex.check("6.2", {1: True}).status == "failed"
    assert ex.check("6.2", [("bf16", True)]).status == "failed"


def test_6_2_the_checks_own_run_settings_win_over_the_learners():
    # a learner's output_dir or max_steps must not make the check write there or run long
    result = ex.check("6.2", {"bf16": True, "use_cpu": True, "output_dir": "/nonexistent/x",
                              "max_steps": 10_000})
    assert result.passed, result


# --- 6.3 the course's line, today -------------------------------------------------------------

def test_6_3_feedback_for_each_change_the_course_line_needs():
    from transformers import TrainingArguments

    def course(output_dir):
        return TrainingArguments(output_dir=output_dir, evaluation_strategy="epoch", fp16=True)

    failed_saying(ex.check("6.3", course), "evaluation_strategy", "removed in 4.51",
                  "section 2", hiding=("eval_strategy",))

    def renamed_only(output_dir):
        return TrainingArguments(output_dir=output_dir, eval_strategy="epoch", fp16=True)

    failed_saying(ex.check("6.3", renamed_only), "fp16=true is still there", "fp32")

    def no_evaluation(output_dir):
        return TrainingArguments(output_dir=output_dir, bf16=True, use_cpu=True)

    failed_saying(ex.check("6.3", no_evaluation), "after every epoch", "'no'")

    def elsewhere(output_dir):
        return TrainingArguments(output_dir="out", eval_strategy="epoch", bf16=True,
                                 use_cpu=True)

    failed_saying(ex.check("6.3", elsewhere), "not to the output_dir given")
    assert ex.check("6.3", lambda output_dir: "TrainingArguments(...)").status == "failed"
    assert ex.check("6.3", lambda output_dir: 1 / 0).status == "error"


@pytest.mark.skipif(ON_GPU, reason="on a GPU with bf16, bf16=True alone trains on the GPU")
def test_6_3_bf16_without_use_cpu_quotes_the_refusal():
    from transformers import TrainingArguments

    def no_cpu(output_dir):
        return TrainingArguments(output_dir=output_dir, eval_strategy="epoch", bf16=True)

    failed_saying(ex.check("6.3", no_cpu), "use_cpu", "meant for the CPU")


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
    assert ex.check("6.4", lambda model: 1 / 0).status == "error"
