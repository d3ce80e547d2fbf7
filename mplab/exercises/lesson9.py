"""Lesson 9, below 16 bits: the exercises.

    from mplab.exercises import lesson9 as ex
    ex.check("9.1", answer); ex.hint("9.1"); ex.solution("9.1")

The references are the libraries users run: torchao 0.18's ``to_mx`` and ``nvfp4_quantize``
(9.1, 9.4) and mplab's recipes, which tests hold equal to torchao's bit for bit (9.2, 9.3).
"""

from __future__ import annotations

import torch

from mplab import lowbit
from mplab.exercises.framework import (
    Exercise,
    Incorrect,
    Lesson,
    as_number,
    call,
    grade_seed,
    in_order,
)
from mplab.lowbit.quantize import DelayedScaling

__all__ = ["check", "hint", "solution", "exercise_cells", "cells", "task_markdown", "reveal",
           "EXERCISES", "LESSON", "block_9_1", "x_9_2", "AMAX_9_3", "steps_9_3"]

# --- 9.1 an MX block's scale by hand ----------------------------------------------------------


def block_9_1() -> torch.Tensor:
    """The 32 values of exercise 9.1's block (float32)."""
    g = torch.Generator().manual_seed(91)
    block = torch.randn(32, generator=g) * 0.02
    block[11] = -0.7373046875  # the block's largest magnitude
    return block


def _torchao_mx_code(block: torch.Tensor, mode: str = "floor") -> int:
    from mplab.lowbit.quantize import load_torchao

    load_torchao()
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    scale, _ = to_mx(block.reshape(1, -1), torch.float8_e4m3fn, 32, ScaleCalculationMode(mode))
    return int(scale.view(torch.uint8).item())


def _check_9_1(answer) -> str | None:
    code = as_number(answer, "The scale's code")
    right = _torchao_mx_code(block_9_1())
    if code == right - 127:
        return ("That is the scale's exponent; E8M0 stores it with a bias of 127 added, as "
                "fp32's exponent field does.")
    if code != int(code) or not 0 <= code <= 255:
        return (f"An E8M0 code is a whole number from 0 to 254 (255 is NaN): the biased "
                f"exponent of the scale, got {answer!r:.30}.")
    code = int(code)
    if code == right:
        return None
    if code == right + 8:
        return ("That is the exponent of the block's amax itself (biased). The OCP rule "
                "scales the amax down to the element format's top binade: subtract e4m3's "
                "largest exponent.")
    if code == _torchao_mx_code(block_9_1(), "rceil") or code == right + 1:
        return ("That rounds the exponent up. The OCP MX spec's rule (torchao's FLOOR) takes "
                "floor(log2(amax)) and subtracts emax, the element format's largest exponent.")
    return ("Find the block's largest magnitude, take floor(log2) of it, subtract e4m3's "
            "largest exponent and add E8M0's bias.")


# --- 9.2 a block size against outliers --------------------------------------------------------

BLOCKS_9_2 = (8, 16, 32, 64, 128)
FLUSH_LIMIT_9_2 = 0.30


def x_9_2() -> torch.Tensor:
    """Exercise 9.2's tensor: small values with one outlier in every 64 along each row."""
    g = torch.Generator().manual_seed(92)
    x = torch.randn(64, 512, generator=g) * 0.01
    cols = torch.arange(0, 512, 64) + torch.randint(0, 64, (64, 8), generator=g)
    x.scatter_(1, cols, 10.0)
    return x


def right_9_2() -> int:
    x = x_9_2()
    ok = [b for b in BLOCKS_9_2 if lowbit.apply("MXFP4", x, b).flushed < FLUSH_LIMIT_9_2]
    return min(ok, key=lambda b: lowbit.apply("MXFP4", x, b).bytes_per_value)


def _check_9_2(answer) -> str | None:
    block = as_number(answer, "The block size")
    if block not in BLOCKS_9_2:
        return (f"Give one of MXFP4's block sizes here: {', '.join(map(str, BLOCKS_9_2))}; got "
                f"{answer!r:.30}.")
    q = lowbit.apply("MXFP4", x_9_2(), int(block))
    if q.flushed >= FLUSH_LIMIT_9_2:
        return (f"With blocks of {int(block)} the outliers set the scale of too many blocks: "
                f"{100 * q.flushed:.1f} % of the values flush to 0.")
    if int(block) != right_9_2():
        return (f"Blocks of {int(block)} keep the flushing under the limit, but a block size "
                "that also does costs fewer bytes per value (fewer scales).")
    return None


# --- 9.3 which steps of a delayed-scaling run saturate ----------------------------------------

AMAX_9_3 = (1.0, 1.5, 0.9, 1.2, 4.0, 1.0, 1.1, 0.8, 1.0, 2.5)
SETTINGS_9_3 = {"history_len": 4, "algo": "max", "margin": 0}


def steps_9_3() -> list[torch.Tensor]:
    """The run's gradients, one tensor a step, with the amaxes AMAX_9_3."""
    g = torch.Generator().manual_seed(93)
    out = []
    for amax in AMAX_9_3:
        t = torch.rand(256, generator=g) * 2 - 1
        out.append(t / t.abs().max() * amax)
    return out


def right_9_3() -> list[int]:
    d = DelayedScaling(**SETTINGS_9_3)
    return [i for i, t in enumerate(steps_9_3()) if d.quantize(t).saturated > 0]


def _check_9_3(answer) -> str | None:
    if isinstance(answer, int) and not isinstance(answer, bool):
        answer = [answer]
    if not isinstance(answer, list | tuple | set) or not all(
            isinstance(s, int) and not isinstance(s, bool) for s in answer):
        raise Incorrect(f"Answer with a list of step numbers (0 to {len(AMAX_9_3) - 1}), like "
                        f"[3, 7]; got {answer!r:.40}.")
    got, right = sorted(set(answer)), right_9_3()
    if got == right:
        return None
    if 0 in got:
        return ("Step 0 has no history: its scale is Transformer Engine's starting scale, 1, "
                "and 1 x its amax is far below 448.")
    missed = [s for s in right if s not in got]
    extra = [s for s in got if s not in right]
    if extra:
        n = SETTINGS_9_3["history_len"]
        return (f"Step {extra[0]} does not saturate: some step among the {n} before it had an "
                "amax at least as large, and the scale comes from the largest of them.")
    return (f"A step you left out saturates: its amax is larger than every amax in the history "
            f"its scale came from ({len(missed)} such step{'s' if len(missed) > 1 else ''}).")


# --- 9.4 NVFP4's two-level scale --------------------------------------------------------------


def _torchao_nvfp4_scales(x: torch.Tensor):
    from mplab.lowbit.quantize import load_torchao

    load_torchao()
    from torchao.prototype.mx_formats.nvfp4_tensor import (
        nvfp4_quantize,
        per_tensor_amax_to_scale,
    )

    ts = per_tensor_amax_to_scale(x.abs().amax())
    scales, _ = nvfp4_quantize(x, 16, ts)
    return ts, scales.float()


def inputs_9_4(seed: int = 94) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(32, 256, generator=g) * torch.logspace(-6, 2, 256)
    outlier = torch.randn(16, 64, generator=g)
    outlier[3, 5] = 500.0
    return [torch.randn(8, 64, generator=g), wide, outlier]


def _scales_match(fn, xs) -> str | None:
    for x in xs:
        got = call(fn, x.clone(), what=f"nvfp4_scales(x) for x of shape {tuple(x.shape)}")
        if not isinstance(got, tuple) or len(got) != 2:
            return f"Return two things, (tensor_scale, block_scales); got {type(got).__name__}."
        ts, blocks = (torch.as_tensor(v).float() for v in got)
        want_ts, want = _torchao_nvfp4_scales(x)
        if ts.numel() != 1 or not torch.equal(ts.reshape(()), want_ts.reshape(())):
            return (f"The tensor scale for x of shape {tuple(x.shape)} is {ts.flatten()[:1]}: "
                    "it is x's amax over (E4M3's largest x fp4's largest).")
        if blocks.shape != want.shape:
            return (f"block_scales should hold one scale per 16 values of a row: shape "
                    f"{tuple(want.shape)} for x of shape {tuple(x.shape)}, got "
                    f"{tuple(blocks.shape)}.")
        differ = blocks != want
        if differ.any():
            i = differ.nonzero()[0].tolist()
            return (f"Block {i} of x (shape {tuple(x.shape)}): your scale {blocks[tuple(i)]:.6g}, "
                    "not what NVFP4 stores. Each is an E4M3 number: the block's amax over fp4's "
                    "largest, divided by the tensor scale, kept within E4M3's normal range, "
                    "then rounded to E4M3.")
    return None


def _check_9_4(fn) -> str | None:
    if not callable(fn):
        raise Incorrect(f"Define a function nvfp4_scales(x); got {type(fn).__name__}.")
    return _scales_match(fn, inputs_9_4())


def _hidden_9_4(fn) -> str | None:
    return _scales_match(fn, inputs_9_4(seed=grade_seed()))


# --- the exercises ----------------------------------------------------------------------------

EXERCISES = {e.id: e for e in in_order([
    Exercise(
        id="9.1", title="An MX block's scale, by hand",
        prompt="`mx_block` above holds the 32 values of one MXFP8 block (elements fp8 e4m3). "
               "Which E8M0 code does its shared scale get under the OCP MX rule, torchao's "
               "`ScaleCalculationMode.FLOOR`? The rule: the scale is 2^(floor(log2(amax)) - "
               "emax), amax the block's largest magnitude and emax the exponent of the largest "
               "power of two e4m3 holds; E8M0 stores the exponent plus a bias of 127. Give "
               "the code, a whole number from 0 to 254; the check asks torchao's `to_mx`.",
        comment="the E8M0 code of the block's scale",
        body="answer = ...  # an integer, 0 to 254",
        key="amax = mx_block.abs().max().item()\n"
            "emax = math.floor(math.log2(448))  # e4m3's largest is 448 = 1.75 x 2^8\n"
            "answer = math.floor(math.log2(amax)) - emax + 127",
        check=_check_9_1,
        hints=(
            "The scale moves the block's largest value into e4m3's top binade; only its "
            "exponent is stored.",
            "math.floor(math.log2(mx_block.abs().max().item())) is the amax's exponent; e4m3's "
            "largest, 448, is 1.75 x 2^8.",
            "floor(log2(amax)) - 8 + 127.",
        )),
    Exercise(
        id="9.2", title="A block size against outliers",
        prompt="`spiky` above (64 x 512) holds small values (normal, standard deviation "
               "0.01) and, in each row, one outlier of 10 at a random place in each aligned run "
               "of 64 values (columns 0-63, 64-127, ...). A block that holds an outlier gets a "
               "scale large enough for it, and its small values flush to 0 in fp4. Of MXFP4's "
               "block "
               f"sizes {', '.join(map(str, BLOCKS_9_2))}, which costs the fewest bytes per "
               f"value while flushing under {FLUSH_LIMIT_9_2:.0%} of its values to 0? "
               "`lowbit.apply(\"MXFP4\", spiky, block)` returns what a block size does "
               "(`.flushed`, `.bytes_per_value`).",
        comment="the cheapest MXFP4 block size that flushes under the limit",
        body="answer = ...  # a block size",
        key="sizes = (8, 16, 32, 64, 128)\n"
            "fine = [b for b in sizes if lowbit.apply(\"MXFP4\", spiky, b).flushed < 0.30]\n"
            "answer = min(fine, key=lambda b: lowbit.apply(\"MXFP4\", spiky, b).bytes_per_value)",
        check=_check_9_2,
        hints=(
            "Smaller blocks mean fewer small values share a scale with an outlier, and more "
            "scales to store.",
            "For each size, lowbit.apply(\"MXFP4\", spiky, block) gives .flushed and "
            ".bytes_per_value; keep the sizes under the limit.",
            "Of the sizes whose .flushed is under 0.30, the largest block is the cheapest.",
        )),
    Exercise(
        id="9.3", title="Which steps saturate",
        prompt="A run casts its gradients to e4m3 with delayed scaling, "
               f"`DelayedScaling(history_len={SETTINGS_9_3['history_len']}, algo=\"max\", "
               f"margin={SETTINGS_9_3['margin']})`: step t's values are multiplied by 448 / (the "
               f"largest amax of the up to {SETTINGS_9_3['history_len']} steps before t) before "
               "the cast, the first step's by 1, and a step's own amax joins the history only "
               "after it is cast. The "
               f"gradients' amax at steps 0 to {len(AMAX_9_3) - 1} (`amaxes` above) are "
               f"{', '.join(f'{a:g}' for a in AMAX_9_3)}. At which steps do values saturate "
               "(get clamped at 448)? Answer with a list of step numbers; the check runs "
               "mplab's DelayedScaling on the gradients.",
        comment="the steps at which the cast clamps values",
        body="answer = [...]  # step numbers",
        key="history, answer = [], []\n"
            "for step, amax in enumerate(amaxes):\n"
            "    if history and amax > max(history[-4:]):\n"
            "        answer.append(step)\n"
            "    history.append(amax)",
        check=_check_9_3,
        blank=lambda a: a is ... or a == [...] or a is None,
        hints=(
            "The scale is set so the largest amax of the history lands at 448; a larger amax "
            "lands past it.",
            "Walk the steps: keep the last 4 amaxes; a step saturates when its amax is above "
            "all of them (step 0's scale of 1 leaves room).",
            "Compare each amax with the max of the 4 before it.",
        )),
    Exercise(
        id="9.4", title="NVFP4's two-level scale", points=2,
        prompt="Write `nvfp4_scales(x)`: for a float32 tensor `x` of shape (rows, cols), cols "
               "a multiple of 16, return `(tensor_scale, block_scales)` as NVFP4 stores them. "
               "`tensor_scale` is one float32 number (a 0-d tensor): x's amax divided by "
               "(448 x 6), E4M3's largest times fp4's largest. `block_scales` has shape "
               "(rows, cols // 16), one "
               "per 16 consecutive values of a row: the block's amax divided by 6, then by "
               "`tensor_scale`, clamped to E4M3's normal range [2^-6, 448] (torchao keeps the "
               "block scales off E4M3's subnormals), rounded to E4M3 "
               "(`.to(torch.float8_e4m3fn)`) and returned as float32. Compute in float32, "
               "dividing in the order given. The check compares with torchao's "
               "`nvfp4_quantize` bit for bit; the grader also tries inputs it draws.",
        comment="NVFP4's fp32 tensor scale and E4M3 block scales",
        body="def nvfp4_scales(x):\n"
             "    return ...  # (tensor_scale, block_scales)",
        key="def nvfp4_scales(x):\n"
            "    tensor_scale = x.abs().max() / (448 * 6)\n"
            "    amax = x.abs().reshape(x.shape[0], -1, 16).amax(dim=-1)\n"
            "    blocks = (amax / 6 / tensor_scale).clamp(2**-6, 448)\n"
            "    return tensor_scale, blocks.to(torch.float8_e4m3fn).float()",
        arg="nvfp4_scales",
        check=_check_9_4, hidden=_hidden_9_4,
        trials=lambda seed: [(x,) for x in inputs_9_4(seed)],
        hints=(
            "Two levels: one fp32 number for the whole tensor, and an 8-bit E4M3 number per "
            "16 values that the tensor scale multiplies.",
            "x.abs().reshape(rows, -1, 16).amax(dim=-1) is each block's amax; .clamp(lo, hi) "
            "and .to(torch.float8_e4m3fn).float() do the rest.",
            "tensor_scale = amax / 2688; blocks = (block_amax / 6 / tensor_scale).clamp(2**-6, "
            "448), cast to E4M3 and back to float32.",
        )),
])}

LESSON = Lesson(9, list(EXERCISES.values()))
check, hint, solution, exercise_cells, cells, task_markdown = LESSON.functions()
reveal = LESSON.reveal
