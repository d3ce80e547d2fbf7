"""Lesson 2's exercises: each reference answer against direct torch casts, and the feedback a
learner's likely mistakes get."""

from pathlib import Path

import pytest
import torch
from conftest import failed_saying, optional

from mplab.exercises import lesson2 as ex
from mplab.exercises.answers import code_names
from mplab.fixtures import lesson_capture
from mplab.numerics import casts
from mplab.numerics.casts import cast_stats as measure
from mplab.numerics.formats import dtype_of

nbformat = optional("nbformat")

IDS = list(ex.EXERCISES)
NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "02_underflow_overflow.ipynb"
FP16_TINY = torch.finfo(torch.float16).tiny  # the smallest normal


@pytest.fixture(scope="module")
def cap():
    return lesson_capture()


def test_there_are_five_exercises_worth_six_points():
    assert IDS == ["2.1", "2.2", "2.3", "2.4", "2.5"]
    assert sum(e.points for e in ex.EXERCISES.values()) == 6


# --- 2.1 ----------------------------------------------------------------------------------------

def test_2_1_reference_is_the_first_power_of_two_torch_stores_as_normal():
    g = torch.tensor(ex.G_2_1)
    normal = [k for k in range(40) if (g * 2.0**k).half().abs() >= FP16_TINY]
    nonzero = [k for k in range(40) if (g * 2.0**k).half() != 0]
    assert ex.check("2.1", 2.0 ** normal[0]).passed
    assert nonzero[0] < normal[0]
    failed_saying(ex.check("2.1", 2.0 ** nonzero[0]), "subnormal")
    failed_saying(ex.check("2.1", 2.0 ** (normal[0] - 1)), "too small")
    failed_saying(ex.check("2.1", 2.0 ** (normal[0] + 3)), "smallest")
    failed_saying(ex.check("2.1", normal[0]), "exponent k")
    failed_saying(ex.check("2.1", 25000), "power of two")
    assert ex.check("2.1", -4).status == "failed"
    assert ex.check("2.1", "lots").status == "failed"


# --- 2.2 ----------------------------------------------------------------------------------------

def test_2_2_reference_is_the_largest_power_of_two_torch_casts_without_inf(cap):
    g = cap.all("activation_grads")
    want = next(2.0**k for k in range(40, -1, -1) if torch.isfinite((g * 2.0**k).half()).all())
    assert ex.check("2.2", want).passed
    assert not torch.isfinite((g * (2 * want)).half()).all()
    failed_saying(ex.check("2.2", 2 * want), "overflow")
    failed_saying(ex.check("2.2", want / 2), "larger")
    failed_saying(ex.check("2.2", 65504 / g.abs().max().item()), "power of two")


# --- 2.4 ----------------------------------------------------------------------------------------

def test_2_4_reference_agrees_with_torch_and_has_both_answers():
    for w, u, precision in ex.CASES_2_4:
        stored = torch.tensor(w, dtype=dtype_of(precision))
        assert ex.is_swamped(w, u, precision) == bool(stored + u == stored), (w, u, precision)
    assert {ex.is_swamped(*c) for c in ex.CASES_2_4} == {True, False}
    from mplab.widgets.lesson2 import swamping_demo  # needs ipywidgets (skips without)

    demo = swamping_demo()  # the lesson shows this weight and update in fp16 and fp32 above 2.4
    shown = (demo.w0, -demo.lr.value * demo.grad)
    assert not any((w, u) == shown for w, u, _ in ex.CASES_2_4)


def test_2_4_feedback_names_the_wrong_cases_and_the_spacing():
    right = {c: ex.is_swamped(*c) for c in ex.CASES_2_4}
    assert ex.check("2.4", right).passed
    flipped = dict(right)
    case = ex.CASES_2_4[3]  # 2048 + 1 in fp16: a tie, rounded to even
    flipped[case] = not flipped[case]
    message = failed_saying(ex.check("2.4", flipped), "1 of 6", "half that spacing", "tie")
    assert repr(case) in message and repr(ex.CASES_2_4[0]) not in message
    failed_saying(ex.check("2.4", {**right, case: "yes"}), "not true or false")
    failed_saying(ex.check("2.4", {c: right[c] for c in ex.CASES_2_4[:2]}), "missing")
    assert ex.check("2.4", [True] * 6).status == "failed"
    assert ex.check("2.4", {c: ... for c in ex.CASES_2_4}).status == "not attempted"


# --- 2.3 ----------------------------------------------------------------------------------------

def test_2_3_reference_is_the_layer_torch_flushes_most_at_the_safe_scale(cap):
    g = cap.all("activation_grads")
    safe = next(2.0**k for k in range(40, -1, -1) if torch.isfinite((g * 2.0**k).half()).all())
    assert ex.safe_scale() == safe  # 2.2's answer

    def lost_share(t, scale):
        x = t.float() * scale
        alive = x != 0
        return float((alive & (x.half() == 0)).sum()) / max(int(alive.sum()), 1)

    shares = {n: lost_share(t, safe) for n, t in cap.activation_grads.items()}
    best = max(shares, key=shares.get)
    assert ex.worst_layer() == best
    assert ex.check("2.3", best).passed
    assert ex.check("2.3", f"  {best} ").passed
    # the lesson's table is at scale 1: its worst layer is another, so it does not give 2.3 away
    at_one = max(cap.activation_grads, key=lambda n: lost_share(cap.activation_grads[n], 1.0))
    assert at_one != best and ex.worst_layer(1.0) == at_one
    failed_saying(ex.check("2.3", at_one), "no loss scale", "largest safe scale", hiding=(best,))
    other = min(shares, key=shares.get)
    failed_saying(ex.check("2.3", other), "larger share", hiding=(best,))
    failed_saying(ex.check("2.3", "layer.99"), "not one of the captured layers")
    assert ex.check("2.3", 3).status == "failed"
    assert ex.check("2.3", ...).status == "not attempted"


def test_2_2_and_2_3_answers_are_not_shown_before_them():
    """The lesson shows the safe scale (the sweep, the explorer's summary) only after 2.2, and
    per-layer shares at that scale (the explorer) only after 2.3."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    at = {c.metadata.get("mplab", {}).get("exercise"): i for i, c in enumerate(nb.cells)}
    code = [c.source if c.cell_type == "code" else "" for c in nb.cells]
    shows_safe = ("largest_safe_scale", "scale_sweep", "loss_scale_explorer(")
    assert not any(w in src for src in code[:at["2.2"]] for w in shows_safe)
    assert not any("loss_scale_explorer(" in src for src in code[:at["2.3"]])
    assert any("scale_sweep" in src for src in code[at["2.2"]:at["2.3"]])  # 2.3 needs it above
    assert at["2.1"] < at["2.2"] < at["2.3"] < at["2.4"]


# --- 2.5 ----------------------------------------------------------------------------------------

def right(t, dtype, scale):
    x = t.float() * scale
    alive = (x != 0) & torch.isfinite(x)
    return float((alive & (x.to(dtype) == 0)).sum() / alive.sum()) if alive.any() else 0.0


def of_all_values(t, dtype, scale):
    x = t.float() * scale
    return float(((x != 0) & (x.to(dtype) == 0)).sum()) / x.numel()


def always_fp16(t, dtype, scale):
    return right(t, torch.float16, scale)


def divides_by_zero(t, dtype, scale):
    x = t.float() * scale
    alive = x != 0
    return int((alive & (x.to(dtype) == 0)).sum()) / int(alive.sum())


def test_2_5_public_and_hidden_checks(monkeypatch):
    assert ex.check("2.5", right).message.startswith("Public checks passed")
    failed_saying(ex.check("2.5", of_all_values), "share of all values")
    assert ex.check("2.5", always_fp16).passed  # public checks are fp16 only ...
    monkeypatch.setenv("MPLAB_GRADING", "1")
    assert ex.check("2.5", right).passed
    failed_saying(ex.check("2.5", always_fp16), "hidden check")  # ... grading tries the rest
    result = ex.check("2.5", divides_by_zero)  # an all-zero tensor: ZeroDivisionError
    assert result.status == "error" and "ZeroDivisionError" in result.message
    failed_saying(ex.check("2.5", lambda t, d, s: None), "return statement")
    assert ex.check("2.5", right(*ex.PUBLIC_2_5[0])).status == "failed"  # called, not passed


def wraps_mplab(t, dtype, scale):  # gives the right numbers: cast_stats is the reference
    return casts.cast_stats(t, dtype, scale).lost_frac


def imported_earlier(t, dtype, scale):  # a name bound before the check: no attribute to patch
    return measure(t, dtype, scale).lost_frac


def through_getattr(t, dtype, scale):  # its code names no part of the library
    stats = getattr(casts, "cast_" + "stats")(t, dtype, scale)
    return stats.underflow / stats.nonzero if stats.nonzero else 0.0


def sorted_magnitudes(t, dtype, scale):
    return getattr(casts, "Magni" + "tudes")(t).stats(dtype, scale, rel_error=False).lost_frac


def from_the_sweep(t, dtype, scale):
    return casts.scale_sweep(t, dtype, [scale]).rows[0]["lost (of nonzero)"]


def from_a_thread(t, dtype, scale):  # the stand-in is global: another thread gets it too
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(wraps_mplab, t, dtype, scale).result()


MPLABS = [wraps_mplab, imported_earlier, through_getattr, sorted_magnitudes, from_the_sweep,
          from_a_thread]
lost_frac = 0.0  # a learner's own global of that name: its code names it, and it is honest


def named_like_the_library(t, dtype, scale):
    global lost_frac
    lost_frac = right(t, dtype, scale)
    return lost_frac


@pytest.mark.parametrize("answer", MPLABS, ids=lambda f: f.__name__)
def test_2_5_an_answer_that_relies_on_mplabs_measurement_fails_on_its_outputs(answer,
                                                                             graded_apart):
    """However it reaches cast_stats (or Magnitudes), its outputs are right outside the check
    and wrong inside it, in the kernel and so in the grader's replay of the record."""
    for case in [*ex.PUBLIC_2_5, *ex._hidden_2_5(7)][::5]:
        assert answer(*case) == pytest.approx(ex.reference_lost_fraction(*case), abs=1e-6)
    failed_saying(ex.check("2.5", answer), "mplab's own measurement", "cast_stats")
    kernel, grader = graded_apart("2.5", answer)
    failed_saying(kernel, "mplab's own measurement")
    assert (grader.status, grader.message) == (kernel.status, kernel.message)
    assert casts.cast_stats(torch.tensor([1e-9, 1.0]), "fp16").lost_frac == 0.5  # restored


def test_2_5_a_name_alone_decides_nothing(graded_apart, monkeypatch):
    assert "lost_frac" in code_names(named_like_the_library)
    kernel, grader = graded_apart("2.5", named_like_the_library)
    assert kernel.passed and grader.passed and grader.message.startswith("Passed: public and")
    monkeypatch.setattr(ex, "reference_lost_fraction", lambda t, d, s: 0.5)  # can fail
    failed_saying(ex.check("2.5", named_like_the_library), "mplab's own measurement")


def test_2_5_prompt_names_each_dtype_as_the_checks_use_it():
    import re

    prompt = ex.EXERCISES["2.5"].prompt
    named = set(re.findall(r"`(torch\.\w+)`", prompt))  # every dtype, as torch spells it
    assert named == {str(d) for d in ex.HIDDEN_DTYPES_2_5}
    assert {str(d) for _, d, _ in ex.PUBLIC_2_5} == {"torch.float16"}
    assert f"`dtype` = `{ex.PUBLIC_2_5[0][1]}`" in prompt  # the check's dtype, said as such
    assert {t.dtype for t, _, _ in ex.PUBLIC_2_5} == {torch.float32}  # as the prompt says
    assert torch.int32 in {t.dtype for t, _, _ in ex._hidden_2_5()}
    assert "`t.float()`" in prompt and "`.to(dtype)`" in prompt  # the cast before, and after
    assert "before scaling and casting" in prompt  # which values the share is of


def test_2_5_hidden_cases_cover_every_format_and_the_awkward_tensors():
    cases = ex._hidden_2_5()
    assert {d for _, d, _ in cases} == set(ex.HIDDEN_DTYPES_2_5) == {
        torch.float16, torch.bfloat16, torch.float8_e5m2, torch.float8_e4m3fn}
    for t, dtype, scale in cases:  # the reference is torch's own cast
        assert ex.reference_lost_fraction(t, dtype, scale) == pytest.approx(
            right(t, dtype, scale), abs=1e-6)
