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


def test_8_2_only_the_reduce_dtype_stops_the_drift():
    assert ex.check("8.2", "a").passed
    assert "compute dtype is the same" in message("8.2", "b")
    assert "exponent range" in message("8.2", "c")
    assert "one letter" in message("8.2", "e")


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
    right = plan.memory(n, "amp", 4, "fsdp").held
    assert right == 16 * n / 4
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
