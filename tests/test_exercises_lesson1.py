"""Lesson 1's exercises: each reference against mplab.numerics.formats and torch's own casts, and
the feedback a learner's likely mistakes get (the concept missed, never the answer)."""

import ast
import math
import re
from pathlib import Path

import pytest
import torch
from conftest import failed_saying, optional

from mplab.exercises import lesson1 as ex
from mplab.numerics import formats
from mplab.numerics.explain import decompose

nbformat = optional("nbformat")

IDS = list(ex.EXERCISES)
DTYPE = {(5, 10): torch.float16, (8, 7): torch.bfloat16, (5, 2): torch.float8_e5m2}


def torch_decode(bits, exp_bits, man_bits, bias):
    """A decoder that asks torch: reinterpret the bits as the matching dtype."""
    dtype = DTYPE[(exp_bits, man_bits)]
    if dtype.itemsize == 1:
        return torch.tensor([bits], dtype=torch.uint8).view(dtype).item()
    signed = bits - (1 << 16) if bits >= 1 << 15 else bits
    return torch.tensor([signed], dtype=torch.int16).view(dtype).item()


def fp16_only_decode(bits, exp_bits, man_bits, bias):
    """Right for fp16, but ignores the format it is given."""
    return torch_decode(bits, 5, 10, 15)


def test_there_are_five_exercises_worth_six_points():
    assert IDS == ["1.1", "1.2", "1.3", "1.4", "1.5"]
    assert sum(e.points for e in ex.EXERCISES.values()) == 6


@pytest.mark.parametrize("xid", IDS)
def test_the_second_hint_names_the_api_in_mplab(xid):
    hint = ex.EXERCISES[xid].hints[1]
    assert "mplab.numerics.formats" in hint or "mplab.numerics.explain" in hint


def test_hints_do_not_state_the_answer():
    answers = {"1.1": formats.from_bits(ex.P11, "fp16"), "1.2": float(formats.FP16.max_finite)}
    for xid, value in answers.items():
        for text in ex.EXERCISES[xid].hints:
            assert f"{value:g}" not in text


def test_1_4_task_names_every_number_to_choose_for():
    prompt = ex.EXERCISES["1.4"].prompt
    assert all(f"`{x!r}`" in prompt for x in ex.NUMBERS_1_4)


def test_1_5_task_gives_the_signature_and_every_case_to_cover():
    prompt = ex.EXERCISES["1.5"].prompt
    assert "`decode(bits, exp_bits, man_bits, bias)`" in prompt
    for case in ["normal", "subnormal", "-0.0", "infinities", "NaN"]:
        assert case in prompt


# --- what the lesson shows before each exercise -----------------------------------------------

NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "01_float_formats.ipynb"


def _shown_before(xid: str) -> str:
    """The source of every cell above exercise xid's task cell: what a learner has read (and
    run) before the exercise."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    at = next(i for i, c in enumerate(nb.cells)
              if c.metadata.get("mplab", {}).get("exercise") == xid)
    return "\n".join(c.source for c in nb.cells[:at - 1])


@pytest.mark.parametrize("xid, answer", [("1.2", formats.FP16.max_finite),
                                         ("1.3", formats.FP16.min_subnormal)])
def test_1_2_and_1_3_answers_are_not_on_the_page_before_them(xid, answer):
    shown, value = _shown_before(xid), float(answer)
    forms = {f"{value:g}", f"{value:.3g}", f"{value:.2g}", f"{value:.1g}",
             f"2**{math.log2(value):.0f}", f"2^{math.log2(value):.0f}"}
    forms |= {form.replace("e-0", "e-") for form in forms}
    for form in forms:
        assert form not in shown and form not in ex.EXERCISES[xid].prompt, form
    # nor a call that prints fp16's range: the range table, finfo, the range landmarks
    for call in ("format_table(", "finfo", "max_finite", "min_subnormal", "min_normal"):
        assert call not in shown, f"{call} runs before exercise {xid} and prints its answer"


def test_the_lesson_explains_the_special_exponent_fields_before_the_exercises_need_them():
    shown = _shown_before("1.1")
    for rule in ["1 − bias", "infinity", "NaN", "e4m3fn", "binade"]:
        assert rule in shown, rule


def test_1_4_numbers_are_not_in_any_table_or_text_before_it():
    shown = _shown_before("1.4")
    for x in ex.NUMBERS_1_4:
        forms = {repr(x), f"{x:g}", f"{x:.0e}"}
        for form in forms | {f.replace("e-0", "e-").replace("e+0", "e") for f in forms}:
            if float(form) == x:
                assert not re.search(rf"(?<![\d.]){re.escape(form)}(?![\d])", shown), form


FP16_EDGES = [float(formats.FP16.max_finite), float(formats.FP16.min_normal),
              float(formats.FP16.min_subnormal)]


def _binades_from_fp16_edges(x: float) -> float:
    return min(abs(math.log2(abs(x) / edge)) for edge in FP16_EDGES)


def _compare_values_before_1_4() -> list[float]:
    """The values of the explain.compare(...) table the lesson shows before 1.4."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    at = next(i for i, c in enumerate(nb.cells)
              if c.metadata.get("mplab", {}).get("exercise") == "1.4")
    calls = [node for c in nb.cells[:at - 1] if c.cell_type == "code"
             for node in ast.walk(ast.parse(c.source))
             if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "compare"]
    assert len(calls) == 1, "one compare() table before 1.4"
    return [float(v) for v in eval(ast.unparse(calls[0].args[0]), {"math": math})]


def test_the_compare_table_teaches_range_first_then_precision():
    values = _compare_values_before_1_4()
    kinds = {x: decompose(x, "fp16").kind for x in values}
    # the text after it: fp16 turns the largest value into inf and the smallest into zero, bf16
    # holds both; inside both ranges fp16's extra mantissa bits give the smaller error
    assert kinds[max(values)] == "inf" and kinds[min(values)] == "zero"
    assert all(decompose(x, "bf16").kind == "normal" for x in (max(values), min(values)))
    inside = [x for x in values if kinds[x] == "normal"]
    assert inside and all(torch_error(x, torch.float16) < torch_error(x, torch.bfloat16)
                          for x in inside)


def test_no_row_of_the_table_answers_a_1_4_number_by_lookup():
    # The table's rows sit far (10+ binades) from fp16's range edges; 1.4's numbers sit near an
    # edge or among fp16's subnormals, so each must be compared with fp16's limits.
    for x in _compare_values_before_1_4():
        assert _binades_from_fp16_edges(x) >= 10, x
    for x in ex.NUMBERS_1_4:
        assert (_binades_from_fp16_edges(x) <= 2 or decompose(x, "fp16").kind == "subnormal"), x
    # nor does any other number on the page before 1.4 sit near an edge, bar the edges themselves
    for token in re.findall(r"(?<![\w.])\d+(?:\.\d+)?(?:e[-+]?\d+)?", _shown_before("1.4")):
        if float(token) != 0:
            assert not 1 / 64 < _binades_from_fp16_edges(float(token)) <= 2, token


# --- 1.1 decode a pattern by hand -------------------------------------------------------------

def test_1_1_accepts_the_value_torch_reads_from_the_pattern():
    value = torch_decode(ex.P11, 5, 10, 15)
    assert value == formats.from_bits(ex.P11, "fp16")
    assert ex.check("1.1", value).passed


def _wrong_1_1():
    sign, exponent, mantissa = formats.field_bits(ex.P11, "fp16")
    fraction = mantissa / 2**10
    return [(+(1 + fraction) * 2.0 ** (exponent - 15), "sign"),
            (-fraction * 2.0 ** (exponent - 15), "hidden leading 1"),
            (-(1 + fraction) * 2.0**exponent, "bias"),
            (-(1 + mantissa) * 2.0 ** (exponent - 15), "fraction"),
            (12345.0, "exactly")]


@pytest.mark.parametrize("answer, concept", _wrong_1_1())
def test_1_1_wrong_answer_names_the_step_that_was_missed(answer, concept):
    right = formats.from_bits(ex.P11, "fp16")
    failed_saying(ex.check("1.1", answer), concept, hiding=(f"{right:g}", f"{abs(right):g}"))


# --- 1.2 the largest finite fp16 --------------------------------------------------------------

def test_1_2_accepts_torch_finfo_max():
    assert ex.check("1.2", torch.finfo(torch.float16).max).passed


@pytest.mark.parametrize("answer, concept", [
    (2**16 - 1, "unsigned integer"),
    ((2 - 2**-10) * 2.0**16, "reserved"),
    (2.0**16, "reserved"),
    (2.0**15, "mantissa can be all ones"),
    (math.inf, "finite"),
    (torch.finfo(torch.bfloat16).max, "bf16"),
    (-torch.finfo(torch.float16).max, "sign"),
    (60000, "larger finite"),
])
def test_1_2_wrong_answer_explains_the_concept(answer, concept):
    failed_saying(ex.check("1.2", answer), concept, hiding=("65504", "65,504"))


@pytest.mark.parametrize("answer", ["sixty", [65504], True, torch.ones(3)])
def test_1_2_an_answer_of_the_wrong_type_fails_and_says_what_to_give(answer):
    failed_saying(ex.check("1.2", answer), "number")


# --- 1.3 the smallest positive fp16 -----------------------------------------------------------

def test_1_3_accepts_the_smallest_subnormal_within_the_stated_tolerance():
    smallest = torch.tensor([1], dtype=torch.int16).view(torch.float16).item()
    assert smallest == float(formats.FP16.min_subnormal) > 0
    assert ex.check("1.3", smallest).passed
    assert ex.check("1.3", smallest * (1 + 0.9e-3)).passed
    assert ex.check("1.3", "2**-24").passed


@pytest.mark.parametrize("answer, concept", [
    (torch.finfo(torch.float16).tiny, "subnormal"),
    (torch.finfo(torch.float16).eps, "epsilon"),
    (0, "not positive"),
    (6e-8, "more significant digits"),
    (2.0**-26, "rounds it to zero"),
    (torch.finfo(torch.float32).smallest_normal, "fp32"),
])
def test_1_3_wrong_answer_explains_the_concept_and_states_the_tolerance(answer, concept):
    result = ex.check("1.3", answer)
    failed_saying(result, concept, hiding=("5.96", "2**-24", "2^-24", "2^(-24)"))
    assert "relative tolerance of 0.001" in result.message


# --- 1.4 fp16 or bf16 -------------------------------------------------------------------------

def torch_error(x: float, dtype) -> float:
    return abs(torch.tensor(x, dtype=torch.float64).to(dtype).double().item() - x)


def test_1_4_reference_agrees_with_torch_casts_and_has_no_ties():
    reference = {x: ex.better_format(x) for x in ex.NUMBERS_1_4}
    for x, fmt in reference.items():
        errors = {"fp16": torch_error(x, torch.float16), "bf16": torch_error(x, torch.bfloat16)}
        assert errors[fmt] < errors["bf16" if fmt == "fp16" else "fp16"], (x, errors)
    assert set(reference.values()) == {"fp16", "bf16"}  # both range and precision cases
    assert ex.check("1.4", reference).passed
    dtypes = {x: {"fp16": torch.float16, "bf16": torch.bfloat16}[f] for x, f in reference.items()}
    assert ex.check("1.4", dtypes).passed


@pytest.mark.parametrize("x", ex.NUMBERS_1_4)
def test_1_4_each_wrong_entry_gets_range_or_precision_feedback(x):
    answer = {k: ex.better_format(k) for k in ex.NUMBERS_1_4}
    answer[x] = "fp16" if answer[x] == "bf16" else "bf16"
    result = ex.check("1.4", answer)
    failed_saying(result, "range" if ex.better_format(x) == "bf16" else "precision")
    lines = result.message.splitlines()
    assert lines[0].startswith("1 of 5") and lines[1].startswith(f"- {x!r}")
    assert "fp16" not in lines[1] and "bf16" not in lines[1]  # the concept, not the answer


def test_1_4_partial_or_malformed_answers_fail_and_say_what_is_accepted():
    partial = {x: ... for x in ex.NUMBERS_1_4} | {0.1: "fp16"}
    failed_saying(ex.check("1.4", partial), "still blank")
    failed_saying(ex.check("1.4", {0.1: "fp16"}), "missing")
    failed_saying(ex.check("1.4", {x: "fp32" for x in ex.NUMBERS_1_4}), 'accepted: "fp16"')
    failed_saying(ex.check("1.4", ["fp16"]), "dict")


# --- 1.5 a general decoder --------------------------------------------------------------------

def test_1_5_a_torch_backed_decoder_passes_public_and_hidden_checks(monkeypatch):
    result = ex.check("1.5", torch_decode)
    assert result.passed and result.message.startswith("Public checks passed")
    monkeypatch.setenv("MPLAB_GRADING", "1")
    result = ex.check("1.5", torch_decode)
    assert result.passed and "hidden" in result.message and result.points == 2


def test_1_5_hidden_checks_catch_a_decoder_that_only_knows_fp16(monkeypatch):
    assert ex.check("1.5", fp16_only_decode).passed
    monkeypatch.setenv("MPLAB_GRADING", "1")
    result = ex.check("1.5", fp16_only_decode)
    failed_saying(result, "hidden check")


def test_1_5_checks_only_the_ieee_style_formats_its_task_names():
    prompt = ex.EXERCISES["1.5"].prompt
    for name, _ in ex.PUBLIC_1_5 + ex._hidden_patterns():
        assert formats.get_format(name).has_inf and name in prompt, name
    no_inf = [f for f in formats.FORMATS.values() if not f.has_inf]
    assert no_inf and all(f"not `{f.name}`" in prompt for f in no_inf)
    # the exclusion is real: e4m3's all-ones exponent holds numbers an IEEE decoder reads as inf
    assert formats.from_bits(0b0_1111_000, "fp8_e4m3") == 256.0
    assert formats.kind_of(0b0_1111_000, "fp8_e4m3") == "normal"


def _without(case):
    def decode(bits, exp_bits, man_bits, bias):
        exponent = (bits >> man_bits) & ((1 << exp_bits) - 1)
        mantissa = bits & ((1 << man_bits) - 1)
        value = torch_decode(bits, exp_bits, man_bits, bias)
        if case == "subnormal" and exponent == 0 and mantissa:
            return value / 2  # the exponent taken as 0 - bias, not 1 - bias
        if case == "signed zero" and value == 0:
            return 0.0
        if case == "NaN" and value != value:
            return math.inf
        if case == "infinity" and math.isinf(value):
            return float(formats.FP16.max_finite)
        return value
    return decode


@pytest.mark.parametrize("case, concept", [
    ("subnormal", "no hidden 1"), ("signed zero", "-0.0"), ("NaN", "isnan"),
    ("infinity", "infinity")])
def test_1_5_a_decoder_that_misses_a_case_is_told_which_concept(case, concept):
    failed_saying(ex.check("1.5", _without(case)), concept)


def test_1_5_a_decoder_that_raises_is_an_error_with_the_exception_not_a_traceback():
    def decode(bits, exp_bits, man_bits, bias):
        return 1 / 0

    result = ex.check("1.5", decode)
    assert result.status == "error" and result.points == 0
    assert "ZeroDivisionError" in result.message and "Traceback" not in result.message


@pytest.mark.parametrize("decode, concept", [
    (lambda *args: None, "return statement"),
    (lambda *args: "1.0", "text"),
    (lambda *args: [1.0], "number"),
    (1.0, "function itself"),
])
def test_1_5_a_decoder_of_the_wrong_shape_fails_with_what_to_do(decode, concept):
    failed_saying(ex.check("1.5", decode), concept)
