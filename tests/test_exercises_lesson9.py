"""Lesson 9's checks say why a wrong answer is wrong, against torchao's to_mx and
nvfp4_quantize (9.1, 9.4) and mplab's recipes, which tests/test_quantize.py holds equal to
torchao bit for bit (9.2, 9.3)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import feedback as message
from conftest import skip_unless_checkable

from mplab import lowbit
from mplab.exercises import lesson9 as ex
from mplab.lowbit import quantize

pytestmark = pytest.mark.filterwarnings("ignore")


def test_9_1_is_torchaos_floor_scale_and_names_the_usual_slips():
    skip_unless_checkable("9.1")
    amax = ex.block_9_1().abs().max().item()
    right = math.floor(math.log2(amax)) - 8 + 127
    assert ex.check("9.1", right).passed and ex.check("9.1", float(right)).passed
    assert "bias of 127" in message("9.1", right - 127)
    assert "subtract e4m3's largest exponent" in message("9.1", right + 8)
    assert "rounds the exponent up" in message("9.1", right + 1)
    assert "whole number" in message("9.1", 300)
    assert "number" in message("9.1", "many")
    # the reference is torchao's own to_mx, not a formula of ours
    quantize.load_torchao()
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    scale, _ = to_mx(ex.block_9_1().reshape(1, 32), torch.float8_e4m3fn, 32)
    assert scale.view(torch.uint8).item() == right


def test_9_2_is_the_cheapest_block_under_the_limit():
    x = ex.x_9_2()
    flushed = {b: lowbit.apply("MXFP4", x, b).flushed for b in ex.BLOCKS_9_2}
    fine = [b for b, f in flushed.items() if f < ex.FLUSH_LIMIT_9_2]
    assert fine and max(fine) == ex.right_9_2()  # larger blocks, fewer scales, fewer bytes
    assert ex.check("9.2", ex.right_9_2()).passed
    too_big = min(b for b in ex.BLOCKS_9_2 if b not in fine)
    assert "flush to 0" in message("9.2", too_big)
    assert len(fine) >= 2 and "fewer bytes" in message("9.2", min(fine))
    assert "block sizes here" in message("9.2", 24)


def test_9_3_the_saturating_steps_are_those_past_the_history():
    right = ex.right_9_3()
    hist, by_hand = [], []
    for step, amax in enumerate(ex.AMAX_9_3):  # the rule the prompt states, by hand
        if hist and amax * 448 / max(hist[-4:]) > 464:  # past 448 by more than rounding
            by_hand.append(step)
        hist.append(amax)
    assert right == by_hand and len(right) >= 2
    assert ex.check("9.3", right).passed and ex.check("9.3", tuple(reversed(right))).passed
    assert "no history" in message("9.3", [0, *right])
    assert "does not saturate" in message("9.3", sorted({*right, right[0] + 1}))
    assert "left out" in message("9.3", right[:-1])
    assert "list of step numbers" in message("9.3", "4")
    assert ex.check("9.3", [...]).status == "not attempted"


def reference_9_4(x):
    tensor_scale = x.abs().max() / (448 * 6)
    amax = x.abs().reshape(x.shape[0], -1, 16).amax(dim=-1)
    return tensor_scale, (amax / 6 / tensor_scale).clamp(2**-6, 448).to(
        torch.float8_e4m3fn).float()


def test_9_4_compares_with_torchao_and_says_which_part_is_off(monkeypatch):
    skip_unless_checkable("9.4")
    assert ex.check("9.4", reference_9_4).passed
    monkeypatch.setenv("MPLAB_GRADING", "1")
    ex.LESSON.reset()
    assert ex.check("9.4", reference_9_4).passed  # and on inputs the grader draws
    monkeypatch.delenv("MPLAB_GRADING")
    assert "amax over" in message("9.4", lambda x: (x.abs().max() / 448, reference_9_4(x)[1]))
    def unrounded(x):  # the block scales left in fp32
        ts = reference_9_4(x)[0]
        return ts, (x.abs().reshape(x.shape[0], -1, 16).amax(-1) / 6 / ts).clamp(2**-6, 448)

    assert "E4M3" in message("9.4", unrounded)
    assert "shape" in message("9.4", lambda x: (reference_9_4(x)[0], reference_9_4(x)[1].T))
    assert "two things" in message("9.4", lambda x: reference_9_4(x)[1])
    result = ex.check("9.4", lambda x: 1 / 0)
    assert result.status == "error" and "ZeroDivisionError" in result.message


def test_lesson_9_says_which_recipe_casts_the_output_gradient_to_which_format():
    """§6's words against torchao's recipes: tensorwise casts the output gradient to e5m2,
    the rowwise ones to e4m3, and rowwise_with_gw_hp leaves the weight-gradient matmul's
    gradient uncast (high precision)."""
    from conftest import optional

    float8, nbformat = optional("torchao.float8"), optional("nbformat")
    recipe = {name: float8.Float8LinearConfig.from_recipe_name(name)
              for name in ("tensorwise", "rowwise", "rowwise_with_gw_hp")}
    assert recipe["tensorwise"].cast_config_grad_output.target_dtype == torch.float8_e5m2
    assert recipe["rowwise"].cast_config_grad_output.target_dtype == torch.float8_e4m3fn
    assert recipe["rowwise_with_gw_hp"].cast_config_grad_output.target_dtype == \
        torch.float8_e4m3fn
    gw = recipe["rowwise_with_gw_hp"].cast_config_grad_output_for_grad_weight
    assert gw.scaling_type == float8.config.ScalingType.DISABLED
    nb = nbformat.read("notebooks/09_below_16_bits.ipynb", 4)
    text = " ".join(" ".join(c.source.split()) for c in nb.cells)
    assert ("Under `tensorwise` the input and weight are cast to e4m3 and the output gradient "
            "to e5m2") in text
    assert "the `rowwise` recipes cast the output gradient to e4m3 too" in text


def test_a_cell_that_shows_an_answer_waits_until_it_passed_or_its_solution_was_asked(capsys):
    """`ex.reveal`: 9.3's worked table only once 9.3 passed (or its solution was shown); a
    failed answer does not open it; a fresh session closes it again."""
    ex.LESSON.reset()
    shown = []
    assert ex.reveal("9.3", lambda: shown.append(1) or "table") is None and not shown
    assert "runs once your answer has passed" in capsys.readouterr().out
    ex.check("9.3", [0])  # wrong
    assert ex.reveal("9.3", lambda: "table") is None
    namespace = {"amaxes": list(ex.AMAX_9_3)}
    exec(ex.EXERCISES["9.3"].key, namespace)  # the reference answer
    assert ex.check("9.3", namespace["answer"]).passed
    assert ex.reveal("9.3", lambda: "table") == "table"
    ex.LESSON.reset()
    assert ex.reveal("9.3", lambda: "table") is None
    ex.solution("9.3")
    assert ex.reveal("9.3", lambda: "table") == "table"
    with pytest.raises(ValueError, match="unknown exercise"):
        ex.reveal("9.9", lambda: None)
