"""Lesson 8's checks say why a wrong answer is wrong, against torch's MixedPrecisionPolicy and
mplab.train.plan (which tests/test_train_fsdp.py holds to what real ranks hold)."""

from __future__ import annotations

import pytest
import torch
from conftest import feedback as message
from torch.distributed.fsdp import MixedPrecisionPolicy

from mplab.exercises import lesson8 as ex
from mplab.train import plan

pytestmark = pytest.mark.filterwarnings("ignore")


def test_8_1_the_policy_is_read_field_by_field():
    right = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                 output_dtype=torch.float32)
    assert ex.check("8.1", right).passed
    assert "compute dtype" in message("8.1", MixedPrecisionPolicy(
        param_dtype=torch.float16, reduce_dtype=torch.float32, output_dtype=torch.float32))
    assert "reduce-scattered" in message("8.1", MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, output_dtype=torch.float32))
    assert "None (left out)" in message("8.1", MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    assert "cast_forward_inputs=False" in message("8.1", MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32,
        cast_forward_inputs=False))
    assert "not dict" in message("8.1", {"param_dtype": torch.bfloat16})
    assert ex.check("8.1", ...).status == "not attempted"


def test_8_2_only_the_reduce_dtype_stops_the_drift_and_the_task_does_not_name_it():
    assert ex.CHOICES_8_2["c"] == "`reduce_dtype=torch.float32`" and ex.check("8.2", "c").passed
    assert "cannot make one run drift" in message("8.2", "a")
    assert "exponent range" in message("8.2", "b")
    assert "cannot make one run drift" in message("8.2", "d")
    assert "one letter" in message("8.2", "e")
    # the task names no reduce_dtype and no sum: the learner reads the default off §2
    task = ex.EXERCISES["8.2"].prompt.split("\n\n")[0]
    assert "reduce_dtype" not in task and "sum" not in task
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16)" in task
    for choice in ex.CHOICES_8_2.values():  # no choice says what it does to the sum
        assert "sum" not in choice and "across ranks" not in choice


def test_8_3_the_mystery_runs_are_named_by_letter_and_checked():
    assert ex.check("8.3", {"X": "e", "Y": "c"}).passed
    assert ex.check("8.3", {"x": " E ", "y": "C"}).passed  # as a learner might type them
    assert "dtype's name" in message("8.3", {"X": "e", "Y": "b"})
    assert "reduced in" in message("8.3", {"X": "d", "Y": "c"})
    assert "each of the runs" in message("8.3", {"X": "e"})
    assert "Answer with one letter" in message("8.3", {"X": "z", "Y": "c"})
    assert "Give a dict" in message("8.3", "e")
    # the jobs are what the letters say (tests/test_train_fsdp.py reads their audits)
    assert ex.MYSTERY_JOBS["X"]["reduce_dtype"] == "bf16" and ex.MYSTERY == {"X": "e", "Y": "c"}
    assert ex.MYSTERY_JOBS["Y"]["comm_hook"] == "fp16"


def test_8_4_is_the_plan_at_four_ranks_and_names_the_usual_slips():
    n = ex._lesson_parameters()
    right = plan.memory(n, "fp32", 4, "fsdp").held  # the run is fp32
    assert right == 16 * n / 4 == plan.memory(n, "amp", 4, "fsdp").held  # amp holds the same
    assert ex.check("8.4", right).passed
    assert ex.check("8.4", right * 1.04).passed  # within 5 %
    assert ex.check("8.4", f"{right:.0f}").passed  # a number as text
    assert "unsharded" in message("8.4", 16 * n)
    assert "AdamW's two fp32 states" in message("8.4", 12 * n / 4)
    assert "bf16 copy" in message("8.4", 18 * n / 4)
    assert "not only the weights" in message("8.4", 4 * n / 4)
    assert "bytes per parameter" in message("8.4", 100)
    assert "positive" in message("8.4", -1)


def test_8_4_counts_the_model_the_lesson_trains():
    from mplab.train import train

    result = train(model="lesson-pretrained", steps=1, progress=False, eval_samples=16)
    assert ex._lesson_parameters() == result.parameters


def test_8_5_is_the_fewest_gpus_the_plan_fits():
    s = ex.PLAN_8_5
    fits = {n: plan.memory(s["parameters"], s["policy"], n, s["sharding"]).fits(s["gpu_gb"])
            for n in (8, 16)}
    assert fits == {8: False, 16: True} and ex.right_8_5() == 16
    assert ex.check("8.5", 16).passed and ex.check("8.5", "16").passed
    assert "140 GB" in message("8.5", 8)
    assert "smaller count" in message("8.5", 32)
    assert "planner's GPU counts" in message("8.5", 15)
    assert "planner's GPU counts" in message("8.5", 16.5)


def test_lesson_8_states_torchs_policy_defaults_and_the_4_rank_runs_policy():
    """What §2 says of `MixedPrecisionPolicy()` is torch's: the three dtypes None (a None
    reduce_dtype follows param_dtype), inputs cast; and 8.4 names the policy its 4-rank run
    (fp32) really has."""
    from conftest import optional

    nbformat = optional("nbformat")
    default = MixedPrecisionPolicy()
    assert (default.param_dtype, default.reduce_dtype, default.output_dtype,
            default.cast_forward_inputs) == (None, None, None, True)
    nb = nbformat.read("notebooks/08_across_processes.ipynb", 4)
    text = "\n".join(c.source for c in nb.cells)
    assert "`MixedPrecisionPolicy()`: the three dtypes are all `None`" in text
    assert 'four = start_across(4, TRAIN, [dict(RUN, path="fsdp", precision="fp32"' in text
    assert "FSDP2 in fp32" in ex.EXERCISES["8.4"].prompt and "bf16" not in ex.EXERCISES[
        "8.4"].prompt.split("AdamW")[0]


def test_lesson_8_introduces_its_words_before_it_uses_them():
    """Issue 38's stumbles: each term is explained at (or before) its first use, the policies
    before their names, and the lesson ends on DDP against FSDP2 from its own runs."""
    from conftest import optional

    nbformat = optional("nbformat")
    nb = nbformat.read("notebooks/08_across_processes.ipynb", 4)
    text = "\n".join(c.source for c in nb.cells)

    def first(words: str) -> int:
        assert words in text, words
        return text.index(words)

    assert first("*gloo*") < first("NCCL between them")  # the backends, in the first cell
    assert first("*ZeRO*") < first('"zero3"')
    assert first("`\"bf16_fp32_grads\"`") < first("and `bf16_fp32_grads` against it")
    assert first("*fp32\nmaster weights*") < first("### Exercise 8.5")
    assert first("| `libraries` |") < first("## 1. DDP")  # §0's guide to its jobs
    assert first("side_by_side({") < first("## What to take away")
    assert 'policy="fp32")' in text  # the fp32 runs are held against the fp32 plan
    assert "fsdp.param_dtype" not in text  # the stored dtype is not called param_dtype
    assert "fully_shard` yourself" in text  # §6 says what to do
