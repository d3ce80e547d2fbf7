"""What lesson 7's exercise 7.7 reads: a recorded profile of one training step, its task and its
check (its key lives in lesson7.py with the others, where a release strips it).

The profile is one `mplab.bench.step_profile` measured on a 2-core CPU with bf16 units (the
lesson transformer at hidden 512 / 4 layers, batch 32 x 40 tokens, torch's own attention
backend; benchmarks/RECORDS.md, "step profile"), so that every learner reads the same numbers
whatever their machine; the reference is Amdahl's bound computed from them
(`bench.amdahl_bound`).
"""

from __future__ import annotations

import math

from mplab.bench import amdahl_bound
from mplab.exercises.framework import Incorrect, as_number

__all__ = ["PROFILE_7_7", "PROMPT_7_7", "HINTS_7_7", "check_7_7"]

#: (op, kind, fp32 ms, bf16 ms) per step; the last row sums the ops not listed.
PROFILE_7_7 = (
    ("mm", "matmul", 232.7, 107.8),
    ("addmm", "matmul", 112.1, 51.9),
    ("_scaled_dot_product_flash_attention_for_cpu_backward", "attention", 12.4, 68.5),
    ("_scaled_dot_product_flash_attention_for_cpu", "attention", 7.8, 9.0),
    ("copy_", "cast or copy", 6.7, 7.0),
    ("gelu_backward", "other", 5.1, 2.5),
    ("native_layer_norm", "other", 5.1, 1.8),
    ("_fused_adamw_", "other", 4.3, 5.0),
    ("gelu", "other", 3.9, 1.3),
    ("add", "other", 3.6, 1.7),
    ("(all other ops)", "other", 11.7, 9.9),
)


def _totals() -> tuple[float, float, float, float]:
    fp32 = sum(r[2] for r in PROFILE_7_7)
    bf16 = sum(r[3] for r in PROFILE_7_7)
    mm32 = sum(r[2] for r in PROFILE_7_7 if r[1] == "matmul")
    mm16 = sum(r[3] for r in PROFILE_7_7 if r[1] == "matmul")
    return fp32, bf16, mm32, mm16


def _slowest() -> tuple:
    """The row of the op that cost the bf16 step the most time over fp32's."""
    return max(PROFILE_7_7[:-1], key=lambda r: r[3] - r[2])


def _table() -> str:
    rows = "\n".join(f"| {op} | {kind} | {a:.1f} | {b:.1f} |" for op, kind, a, b in PROFILE_7_7)
    fp32, bf16, *_ = _totals()
    return ("| op | kind | fp32 ms | bf16 ms |\n|---|---|---|---|\n" + rows
            + f"\n| **the step** | | **{fp32:.1f}** | **{bf16:.1f}** |")


def check_7_7(answer) -> str | None:
    if not isinstance(answer, dict):
        raise Incorrect("Give a dict with the keys \"bound\", \"step\" and \"without\"; got "
                        f"{type(answer).__name__}.")
    missing = [k for k in ("bound", "step", "without") if k not in answer]
    if missing:
        return f"The dict lacks {', '.join(map(repr, missing))}."
    fp32, bf16, mm32, mm16 = _totals()
    share, speedup = mm32 / fp32, mm32 / mm16
    bound = as_number(answer["bound"], "answer[\"bound\"]")
    step = as_number(answer["step"], "answer[\"step\"]")
    without = as_number(answer["without"], "answer[\"without\"]")
    if not math.isclose(step, fp32 / bf16, abs_tol=0.02):
        if math.isclose(step, bf16 / fp32, abs_tol=0.02):
            return ("\"step\" is upside down: a speed-up is the fp32 time over the bf16 "
                    "time (above 1 when bf16 is faster).")
        return ("\"step\" is not the step's speed-up: compare the two precisions' times of "
                "the whole step (the table's last row).")
    if not math.isclose(bound, amdahl_bound(share, speedup), abs_tol=0.02):
        if math.isclose(bound, speedup, abs_tol=0.02):
            return ("\"bound\" is the matmuls' own speed-up: the step can gain that only if "
                    "matmuls were all it did. Weigh it by their share of the fp32 step.")
        return ("\"bound\" is not Amdahl's bound: take p, the matmuls' share of the fp32 "
                "step, and g, their own bf16 speed-up, and let every other op keep its fp32 "
                "time.")
    _, _, a, b = _slowest()
    if math.isclose(without, fp32 / (bf16 - b), abs_tol=0.02):
        return ("\"without\" takes the op out of the bf16 step altogether: it still runs, "
                "only as long as it took in fp32.")
    if not math.isclose(without, fp32 / (bf16 - b + a), abs_tol=0.02):
        return ("\"without\" is not the step's speed-up with that op at its fp32 time: find "
                "the op whose bf16 time lies furthest above its fp32 time, give the bf16 step "
                "that op's fp32 time instead, and divide the fp32 step by the result.")
    return None


PROMPT_7_7 = (
    "A learner profiled one training step of the lesson transformer at hidden 512 / 4 "
    "layers (batch 32 x 40 tokens) on a 2-core CPU with bf16 units, with torch's own "
    "choice of attention backend, as `bench.step_profile` does. Each op's own time per "
    "step, in milliseconds:\n\n" + _table()
    + "\n\nThe matmuls are `mm` and `addmm`. From this table (not your machine's), "
    "work out and give as a dict:\n\n"
    "- `\"bound\"`: Amdahl's bound on the step's bf16 speed-up, had every op other "
    "than the matmuls kept its fp32 time (to within 0.02);\n"
    "- `\"step\"`: the step's bf16 speed-up, from the table's last row (to within 0.02);\n"
    "- `\"without\"`: the step's bf16 speed-up had the one op that cost the bf16 step "
    "the most time over fp32 taken only its fp32 time, every other op as measured (to "
    "within 0.02).\n\n"
    "A speed-up is the fp32 time over the bf16 time. The check computes the same from "
    "the table.")

HINTS_7_7 = (
    "A speed-up is a time in fp32 over the same time in bf16. Amdahl's law: if a share p "
    "of the time runs g times faster and the rest as before, the whole runs "
    "1 / ((1 - p) + p / g) times faster.",
    "p is the two matmul rows' fp32 time over the whole fp32 step; g is their fp32 time "
    "over their bf16 time.",
    "For \"without\", subtract each row's fp32 time from its bf16 time: one op stands out. "
    "Put its fp32 time in place of its bf16 time in the bf16 step.",
)
