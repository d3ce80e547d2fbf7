"""mplab.exercises and lesson 1's exercises, with mplab.formats and torch casts as the reference."""

import ast
import json
import math

import pytest
import torch

from mplab import formats as F
from mplab.exercises import Result
from mplab.exercises import lesson1 as ex

IDS = list(ex.EXERCISES)
DTYPE = {(5, 10): torch.float16, (8, 7): torch.bfloat16, (5, 2): torch.float8_e5m2}


@pytest.fixture(autouse=True)
def fresh_session(monkeypatch):
    monkeypatch.delenv("MPLAB_GRADING", raising=False)
    monkeypatch.delenv("MPLAB_GRADE_LOG", raising=False)
    ex.LESSON.reset()


def run_cell(source: str):
    """Run a notebook cell the way Jupyter does: the last expression is the cell's value."""
    tree = ast.parse(source)
    last = tree.body.pop()
    namespace = {"ex": ex}
    exec(compile(tree, "<cell>", "exec"), namespace)
    return eval(compile(ast.Expression(last.value), "<cell>", "eval"), namespace)


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


def assert_explains(result: Result, concept: str, *not_shown: str):
    assert result.status == "failed" and result.points == 0, result
    assert concept.lower() in result.message.lower(), result.message
    for text in not_shown:
        assert text not in result.message, f"the feedback gives away {text!r}: {result.message}"
    assert "Traceback" not in result.message


# --- the framework, for every exercise --------------------------------------------------------

@pytest.mark.parametrize("xid", IDS)
def test_untouched_starter_cell_is_not_attempted(xid):
    result = run_cell(ex.EXERCISES[xid].starter)
    assert (result.id, result.status, result.points) == (xid, "not attempted", 0)


@pytest.mark.parametrize("xid", IDS)
@pytest.mark.parametrize("blank", [..., None])
def test_blank_answer_is_not_attempted(xid, blank):
    assert ex.check(xid, blank).status == "not attempted"


@pytest.mark.parametrize("xid", IDS)
def test_solution_cell_passes_with_full_points(xid):
    result = run_cell(ex.EXERCISES[xid].solution_code)
    assert result.status == "passed", result
    assert result.points == result.max_points == ex.EXERCISES[xid].points


def test_exercise_cells_are_the_starters_in_order_and_check_their_own_id():
    assert [xid for xid, _ in ex.exercise_cells()] == IDS == ["1.1", "1.2", "1.3", "1.4", "1.5"]
    for xid, starter in ex.exercise_cells():
        assert starter.rstrip().splitlines()[-1].startswith(f'ex.check("{xid}", ')
        assert ex.EXERCISES[xid].solution_code.rstrip().splitlines()[-1] == \
            starter.rstrip().splitlines()[-1]
    assert [c.metadata["mplab"]["exercise"] for c in ex.cells()] == IDS
    assert [c.source for c in ex.cells(solutions=True)] == \
        [e.solution_code for e in ex.EXERCISES.values()]


def test_unknown_exercise_id_names_the_accepted_ids():
    with pytest.raises(ValueError, match=r"'1\.9'.*accepted: '1\.1', '1\.2'"):
        ex.check("1.9", 1)
    with pytest.raises(ValueError, match="accepted"):
        ex.hint("2.1")


def test_result_prints_as_text_and_renders_as_a_coloured_box():
    result = ex.check("1.2", 65535)
    assert str(result).startswith("✗ Exercise 1.2: failed (0/1 points)")
    assert repr(result) == str(result)
    page = ex.solution("1.4")._repr_html_()
    assert "border-left:6px solid" in page and "<pre" in page
    assert '"fp16"' not in page and "&quot;fp16&quot;" in page  # the code is escaped


def test_every_check_and_reveal_is_logged_for_the_grader(tmp_path, monkeypatch):
    log = tmp_path / "grade.jsonl"
    monkeypatch.setenv("MPLAB_GRADE_LOG", str(log))
    ex.check("1.2", 65535)
    ex.solution("1.3")
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert records[0] | {"message": ""} == {"event": "check", "id": "1.2", "status": "failed",
                                             "points": 0, "max_points": 1, "message": "",
                                             "code": ""}
    assert records[1] == {"event": "solution", "id": "1.3"}


def test_an_answer_that_raises_while_checked_is_an_error_not_a_traceback():
    class Broken(dict):
        def __contains__(self, key):
            raise RuntimeError("broken container")

    result = ex.check("1.4", Broken({0.1: "fp16"}))
    assert result.status == "error" and "RuntimeError: broken container" in result.message


@pytest.mark.parametrize("answer", ["sixty", [65504], True, torch.ones(3)])
def test_an_answer_of_the_wrong_type_fails_and_says_what_to_give(answer):
    result = ex.check("1.2", answer)
    assert result.status == "failed" and "number" in result.message


# --- hints and solutions ----------------------------------------------------------------------

@pytest.mark.parametrize("xid", IDS)
def test_hints_go_one_stage_further_per_call_then_run_out(xid):
    messages = [ex.hint(xid).message for _ in range(4)]
    assert [m.split(":")[0] for m in messages[:3]] == ["Hint 1 of 3", "Hint 2 of 3", "Hint 3 of 3"]
    assert len(set(messages)) == 4 and "No more hints" in messages[3]
    # the second stage names the API
    assert "mplab.formats" in messages[1] or "mplab.explain" in messages[1]
    assert ex.hint(xid).status == "hint"


def test_hint_stages_are_kept_per_exercise():
    ex.hint("1.2")
    ex.hint("1.2")
    assert ex.hint("1.1").message.startswith("Hint 1 of 3")
    assert ex.hint("1.2").message.startswith("Hint 3 of 3")


def test_hints_do_not_state_the_answer():
    answers = {"1.1": F.from_bits(ex.P11, "fp16"), "1.2": float(F.FP16.max_finite)}
    for xid, value in answers.items():
        for text in ex.EXERCISES[xid].hints:
            assert f"{value:g}" not in text


def test_solution_reveals_the_reference_code_and_records_the_reveal():
    result = ex.solution("1.3")
    assert result.status == "solution" and result.code == ex.EXERCISES["1.3"].solution_code
    assert ex.LESSON.revealed == {"1.3"}


# --- 1.1 decode a pattern by hand -------------------------------------------------------------

def test_1_1_accepts_the_value_torch_reads_from_the_pattern():
    value = torch_decode(ex.P11, 5, 10, 15)
    assert value == F.from_bits(ex.P11, "fp16")
    assert ex.check("1.1", value).passed


def _wrong_1_1():
    sign, exponent, mantissa = F.field_bits(ex.P11, "fp16")
    fraction = mantissa / 2**10
    return [(+(1 + fraction) * 2.0 ** (exponent - 15), "sign"),
            (-fraction * 2.0 ** (exponent - 15), "hidden leading 1"),
            (-(1 + fraction) * 2.0**exponent, "bias"),
            (-(1 + mantissa) * 2.0 ** (exponent - 15), "fraction"),
            (12345.0, "exactly")]


@pytest.mark.parametrize("answer, concept", _wrong_1_1())
def test_1_1_wrong_answer_names_the_step_that_was_missed(answer, concept):
    right = F.from_bits(ex.P11, "fp16")
    assert_explains(ex.check("1.1", answer), concept, f"{right:g}", f"{abs(right):g}")


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
    assert_explains(ex.check("1.2", answer), concept, "65504", "65,504")


# --- 1.3 the smallest positive fp16 -----------------------------------------------------------

def test_1_3_accepts_the_smallest_subnormal_within_the_stated_tolerance():
    smallest = torch.tensor([1], dtype=torch.int16).view(torch.float16).item()
    assert smallest == float(F.FP16.min_subnormal) > 0
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
    assert_explains(result, concept, "5.96", "2**-24", "2^-24", "2^(-24)")
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
    assert_explains(result, "range" if ex.better_format(x) == "bf16" else "precision")
    lines = result.message.splitlines()
    assert lines[0].startswith("1 of 5") and lines[1].startswith(f"- {x!r}")
    assert "fp16" not in lines[1] and "bf16" not in lines[1]  # the concept, not the answer


def test_1_4_partial_or_malformed_answers_fail_and_say_what_is_accepted():
    partial = {x: ... for x in ex.NUMBERS_1_4} | {0.1: "fp16"}
    assert_explains(ex.check("1.4", partial), "still blank")
    assert_explains(ex.check("1.4", {0.1: "fp16"}), "missing")
    assert_explains(ex.check("1.4", {x: "fp32" for x in ex.NUMBERS_1_4}), 'accepted: "fp16"')
    assert_explains(ex.check("1.4", ["fp16"]), "dict")


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
    assert_explains(result, "hidden check")


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
            return float(F.FP16.max_finite)
        return value
    return decode


@pytest.mark.parametrize("case, concept", [
    ("subnormal", "no hidden 1"), ("signed zero", "-0.0"), ("NaN", "isnan"),
    ("infinity", "infinity")])
def test_1_5_a_decoder_that_misses_a_case_is_told_which_concept(case, concept):
    assert_explains(ex.check("1.5", _without(case)), concept)


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
    assert_explains(ex.check("1.5", decode), concept)
