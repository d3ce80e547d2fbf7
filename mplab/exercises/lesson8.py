"""Lesson 8, mixed precision across processes: the exercises.

    from mplab.exercises import lesson8 as ex
    ex.check("8.1", answer); ex.hint("8.1"); ex.solution("8.1")

The references are torch's own `MixedPrecisionPolicy`, the audits of real multi-process runs
(the lesson starts them; `MYSTERY_JOBS` are the two it does not name), and `mplab.train.plan`, which
tests hold within 5 % of the bytes every rank of a real run holds.
"""

from __future__ import annotations

import functools

import torch

from mplab.exercises.framework import (
    Exercise,
    Incorrect,
    Lesson,
    as_number,
    choice_list,
    in_order,
    multiple_choice,
    one_letter,
)
from mplab.train import plan
from mplab.train.plan import RANKS

__all__ = ["check", "hint", "solution", "exercise_cells", "cells", "task_markdown",
           "EXERCISES", "LESSON", "MYSTERY_JOBS"]

# --- 8.1 the policy ---------------------------------------------------------------------------

_FIELDS_8_1 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32,
               "output_dtype": torch.float32}
_WHY_8_1 = {
    "param_dtype": "param_dtype is the dtype FSDP2 all-gathers the weights in and the blocks "
                   "compute in: the compute dtype.",
    "reduce_dtype": "reduce_dtype is the dtype the gradients are reduce-scattered (summed "
                    "across ranks) in.",
    "output_dtype": "output_dtype is the dtype the wrapped module's outputs are cast to on the "
                    "way out (None leaves them in the compute dtype).",
}


def _check_8_1(policy) -> str | None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not isinstance(policy, MixedPrecisionPolicy):
        raise Incorrect(f"Give a torch.distributed.fsdp.MixedPrecisionPolicy(...), not "
                        f"{type(policy).__name__} ({policy!r:.60}).")
    for name, wanted in _FIELDS_8_1.items():
        got = getattr(policy, name)
        if got != wanted:
            shown = "None (left out)" if got is None else str(got)
            return f"{name} is {shown}. {_WHY_8_1[name]}"
    if not policy.cast_forward_inputs:
        return ("cast_forward_inputs=False leaves the inputs in fp32 while the weights are "
                "bf16: keep torch's default, True, so each block's floating inputs are cast "
                "to param_dtype.")
    return None


# --- 8.2 a run whose loss drifts --------------------------------------------------------------

RANKS_8_2 = (8, 256)
CHOICES_8_2 = {
    "a": "`output_dtype=torch.float32`",
    "b": "A `ShardedGradScaler` (FSDP's loss scaler, §5), its scale shared by every rank",
    "c": "`reduce_dtype=torch.float32`",
    "d": "`cast_forward_inputs=False`",
}
_APART_8_2 = (f"alike on {RANKS_8_2[0]} GPUs and on {RANKS_8_2[1]}, so this cannot make one "
              "run drift from the other. Look for the step whose error grows with the number "
              "of ranks.")
_check_8_2 = multiple_choice(CHOICES_8_2, "c", {
    "a": "The logits and the loss are rounded " + _APART_8_2,
    "b": "bf16 has fp32's exponent range: its gradients neither underflow nor overflow, and a "
         "scale does not add mantissa bits to a sum.",
    "d": "A block's inputs are cast " + _APART_8_2,
})


# --- 8.3 read two audits across ranks ---------------------------------------------------------

CHOICES_8_3 = {
    "a": "DDP, its own fp32 all-reduce",
    "b": "DDP with bf16_compress_hook",
    "c": "DDP with fp16_compress_hook",
    "d": "FSDP2, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)",
    "e": "FSDP2, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)",
    "f": "FSDP2, MixedPrecisionPolicy(param_dtype=fp32, reduce_dtype=fp32), under bf16 "
         "autocast",
}
#: The two runs 8.3 shows by letter only: `mplab.train` settings the lesson runs with its own.
MYSTERY_JOBS = {"X": dict(path="fsdp", precision="bf16", reduce_dtype="bf16", steps=2,
                          batch_size=8, eval_samples=16),
                "Y": dict(path="torch", precision="fp32", comm_hook="fp16", steps=2,
                          batch_size=8, eval_samples=16)}
MYSTERY = {"X": "e", "Y": "c"}
_WHY_8_3 = {
    "a": "DDP's own all-reduce sends fp32; look at the dtype the gradients were reduced in.",
    "b": "bf16 and fp16 are both 2 bytes: the dtype's name in the table tells them apart.",
    "c": "bf16 and fp16 are both 2 bytes: the dtype's name in the table tells them apart.",
    "d": "With reduce_dtype=fp32 the reduce-scatter runs in fp32: read the 'reduced in' column.",
    "e": "A policy with reduce_dtype=bf16 reduce-scatters in bf16, and FSDP shards: each rank "
         "holds about half of the weights.",
    "f": "A policy with param_dtype=fp32 all-gathers the weights in fp32.",
}


def _check_8_3(answer) -> str | None:
    if not isinstance(answer, dict):
        raise Incorrect(f"Give a dict from run to letter, like {{\"X\": \"a\", \"Y\": \"b\"}}; "
                        f"got {type(answer).__name__}.")
    keys = {str(k).strip().upper(): v for k, v in answer.items()}
    if set(keys) != set(MYSTERY):
        return f"Name a letter for each of the runs {sorted(MYSTERY)} (got {sorted(keys)})."
    for run in sorted(MYSTERY):
        letter = one_letter(keys[run], CHOICES_8_3)
        if letter != MYSTERY[run]:
            return (f"Run {run} is not ({letter}). Read its rows: how much of the weights each "
                    "rank stores says DDP or FSDP, and the dtypes sent say the rest. "
                    + _WHY_8_3[MYSTERY[run]] if letter in "bc" and MYSTERY[run] in "bc"
                    else f"Run {run} is not ({letter}): " + _WHY_8_3[letter])
    return None


# --- 8.4 bytes per rank, predicted ------------------------------------------------------------

RANKS_8_4 = 4


def _check_8_4(answer, parameters: int) -> str | None:
    got = as_number(answer, "The bytes per rank")
    if not got > 0:
        return "A rank holds a positive number of bytes."
    right = plan.memory(parameters, "fp32", RANKS_8_4, "fsdp").held
    if abs(got - right) / right <= 0.05:
        return None
    per_parameter = got / parameters * RANKS_8_4
    near = {16 * RANKS_8_4: "That is what one rank holds unsharded (DDP): FSDP divides the "
                            "weights, the gradients and the optimizer states by the ranks.",
            12: "12 bytes per parameter: either one of AdamW's two fp32 states (exp_avg, "
                "exp_avg_sq) is missing, or the shard and its gradient were counted in bf16; "
                "under this policy both are fp32.",
            18: "The bf16 copy is gathered for a block's forward and backward and freed: it is "
                "not among what a rank holds between steps.",
            8: "Count the shard, its gradient and AdamW's two states, each at 4 bytes (fp32).",
            4: "Count the gradients and the two AdamW states too, not only the weights."}
    for bytes_, why in near.items():
        if abs(per_parameter - bytes_) / bytes_ < 0.05:
            return why
    return (f"{got:,.0f} B is {per_parameter:.3g} bytes per parameter of the model times "
            f"{RANKS_8_4} ranks; count each part's bytes per parameter, then share them out.")


# --- 8.5 the fewest GPUs ----------------------------------------------------------------------

PLAN_8_5 = dict(parameters=70e9, policy="bf16_master", sharding="zero3", gpu_gb=80)


def right_8_5() -> int:
    """The fewest of the planner's GPU counts at which 8.5's model fits."""
    s = PLAN_8_5
    return next(n for n in RANKS
                if plan.memory(s["parameters"], s["policy"], n, s["sharding"]).fits(s["gpu_gb"]))


def _check_8_5(answer) -> str | None:
    got = as_number(answer, "The number of GPUs")
    if got != int(got) or int(got) not in RANKS:
        return ("Give one of the planner's GPU counts: " + ", ".join(map(str, RANKS))
                + f" (got {answer!r:.30}).")
    n, s = int(got), PLAN_8_5
    m = plan.memory(s["parameters"], s["policy"], n, s["sharding"])
    if not m.fits(s["gpu_gb"]):
        return (f"On {n} GPUs each holds {m.gb_per_rank:.4g} GB: more than {s['gpu_gb']} GB, "
                "before any activation.")
    if n != right_8_5():
        return (f"{m.gb_per_rank:.4g} GB per GPU fits on {n}, but so does a smaller count of "
                "the planner's.")
    return None


# --- the exercises ----------------------------------------------------------------------------

EXERCISES = {e.id: e for e in in_order([
    Exercise(
        id="8.1", title="Write the policy",
        prompt="Write the `MixedPrecisionPolicy` (from `torch.distributed.fsdp`) for FSDP2 "
               "that computes in bf16, sums the gradients across ranks in fp32, and hands the "
               "model's outputs back in fp32. Its four fields are `param_dtype`, "
               "`reduce_dtype`, `output_dtype` and `cast_forward_inputs` (a field you leave "
               "out keeps torch's default). The check reads your policy's fields.",
        comment="bf16 compute, fp32 gradient reduction, fp32 outputs",
        body="answer = ...  # MixedPrecisionPolicy(...)",
        key="answer = MixedPrecisionPolicy(param_dtype=torch.bfloat16,\n"
            "                              reduce_dtype=torch.float32,\n"
            "                              output_dtype=torch.float32)",
        check=_check_8_1,
        hints=(
            "One field per copy of the numbers: the weights a block computes with, the "
            "gradients as they travel, the outputs as the caller gets them.",
            "param_dtype is the compute dtype, reduce_dtype the dtype of the reduce-scatter, "
            "output_dtype the outputs'.",
            "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=..., "
            "output_dtype=...).",
        )),
    Exercise(
        id="8.2", title="A loss that drifts",
        prompt=f"One model is trained twice with FSDP2 and "
               "`MixedPrecisionPolicy(param_dtype=torch.bfloat16)` (every other field left at "
               f"torch's default), on the same data, global batch and seed: once on "
               f"{RANKS_8_2[0]} GPUs, once on {RANKS_8_2[1]}. After a few thousand steps the "
               f"{RANKS_8_2[1]}-GPU run's loss has slowly drifted above the "
               f"{RANKS_8_2[0]}-GPU run's. Which one change to the {RANKS_8_2[1]}-GPU run "
               "stops the drift?\n\n" + choice_list(CHOICES_8_2),
        comment="the setting that stops the drift",
        body="answer = ...  # \"a\", \"b\", \"c\" or \"d\"",
        key="answer = \"c\"",
        check=_check_8_2,
        hints=(
            f"What happens alike on {RANKS_8_2[0]} and on {RANKS_8_2[1]} GPUs cannot make "
            "the runs differ: find the step whose rounding grows with the number of ranks.",
            "A field left out of the policy keeps torch's default (§2 says what a None one "
            "does), and the table of sums across ranks shows a bf16 sum's error growing with "
            "the ranks.",
            "Set, to fp32, the field that says the dtype the gradients are summed across "
            "ranks in.",
        )),
    Exercise(
        id="8.3", title="Read two audits across ranks",
        prompt="Runs X and Y above trained the lesson model on 2 processes for 2 steps. Their "
               "audits across ranks (`ranks_table`) are all you know of them. Which of these "
               "built each?\n\n" + choice_list(CHOICES_8_3)
               + "\n\nAnswer with a dict from run to letter, like {\"X\": \"a\", \"Y\": \"b\"}.",
        comment="which setup made runs X and Y",
        body="answer = {\"X\": ..., \"Y\": ...}  # letters",
        key="answer = {\"X\": \"e\", \"Y\": \"c\"}",
        check=_check_8_3,
        hints=(
            "Two columns say DDP or FSDP; two say the dtypes the run sent.",
            "DDP: every rank stores all of the weights and only all-reduces. FSDP: each stores "
            "a share, all-gathers the weights (in param_dtype) and reduce-scatters the "
            "gradients (in reduce_dtype).",
            "X shards and reduces in bf16; Y stores everything and reduces in fp16.",
        )),
    Exercise(
        id="8.4", title="Bytes per rank at four ranks",
        prompt=f"FSDP2 in fp32 (`precision=\"fp32\"`: mplab's policy `param_dtype=fp32`, "
               f"`reduce_dtype=fp32`) and AdamW trains the lesson model on {RANKS_8_4} ranks "
               "(the run started at the "
               "top; its figures are read after this exercise). How many bytes does each rank "
               "hold after step 1 for the weights, the gradients and the optimizer states "
               "together? Use `parameters`, the model's parameter count printed above, and "
               "give a number; the check takes it within 5 %.",
        comment=f"bytes each of {RANKS_8_4} FSDP2 ranks holds",
        body="answer = ...  # bytes per rank",
        key=f"answer = (4 + 4 + 8) * parameters / {RANKS_8_4}  # fp32 shard, fp32 gradient, "
            "2 AdamW states",
        check=lambda answer: _check_8_4(answer, _lesson_parameters()),
        hints=(
            "What is stored between steps, per parameter, in bytes; then FSDP shares every "
            "part of it out over the ranks.",
            "The stored shard is fp32 (FSDP2 shards the parameters in their own dtype, and the "
            "model's are fp32), the reduced gradient fp32, and AdamW keeps two fp32 states; a "
            "bf16 policy would hold the same between steps (its bf16 copy lives only during "
            "a block's forward and backward).",
            f"(4 + 4 + 2 x 4) x parameters / {RANKS_8_4}.",
        )),
    Exercise(
        id="8.5", title="The fewest GPUs",
        prompt=f"A {PLAN_8_5['parameters'] / 1e9:g}B-parameter model, policy "
               f"`{PLAN_8_5['policy']}`, sharding `{PLAN_8_5['sharding']}`, on "
               f"{PLAN_8_5['gpu_gb']} GB GPUs: on how few GPUs do its weights, gradients, "
               "master and optimizer states fit? Give one of the planner's GPU counts ("
               + ", ".join(map(str, RANKS)) + "); the planner above, or `plan.memory`, "
               "tells you.",
        comment="the fewest GPUs that hold the model",
        body="answer = ...  # a number of GPUs",
        key="answer = 16",
        check=_check_8_5,
        hints=(
            "ZeRO-3 divides every part by the GPUs: the GB per GPU falls as 1/N.",
            "bf16_master holds 2 + 2 + 4 + 8 = 16 bytes per parameter; set the planner to the "
            "model and move the GPUs until it fits.",
            f"{PLAN_8_5['parameters'] / 1e9:g}e9 x 16 B / N must be at most "
            f"{PLAN_8_5['gpu_gb']}e9 B.",
        )),
])}


@functools.cache  # the model is built once, not on every check of 8.4
def _lesson_parameters() -> int:
    from mplab import models

    return sum(p.numel() for p in models.lesson_model(2, seed=0).parameters())


LESSON = Lesson(8, list(EXERCISES.values()))
check, hint, solution, exercise_cells, cells, task_markdown = LESSON.functions()
