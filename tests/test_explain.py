"""mplab.numerics.explain: what a format stores for a number, field by field, in tables and in
words; every figure against torch's casts or mplab.numerics.formats' exact values."""

import math

import pytest
import torch

from mplab.numerics import explain as E
from mplab.numerics import formats


def test_decompose_explains_the_fields():
    d = E.decompose(0.1, "fp16")
    assert (d.sign, d.exponent, d.mantissa, d.kind) == (0, 11, 614, "normal")
    assert d.value == torch.tensor(0.1).half().item()
    assert d.abs_error == pytest.approx(d.value - 0.1, rel=1e-12)
    assert d.rel_error == pytest.approx(abs(d.value - 0.1) / 0.1, rel=1e-12)
    text = str(d)
    assert "0 01011 1001100110" in text and "2^(11 − 15)" in text
    assert E.decompose(1e-7, "fp16").kind == "subnormal"
    assert E.decompose(0.0, "fp16").kind == "zero"
    assert E.decompose(1e6, "fp16").kind == "inf"
    assert E.decompose(float("nan"), "bf16").kind == "nan"
    # e4m3 has no inf: torch 2.13 and later saturate, earlier releases give NaN
    assert E.decompose(1e6, formats.E4M3_SATURATING).value == 448.0
    assert E.decompose(1e6, formats.E4M3_NAN_ON_OVERFLOW).kind == "nan"
    assert E.decompose(1e6, "fp8_e4m3").kind == ("normal" if formats.TORCH_E4M3_OVERFLOW ==
                                                 "saturate" else "nan")


def test_format_table_lists_every_format_with_its_range():
    table = E.format_table()
    assert table.column("format") == list(formats.FORMATS)
    row = table.rows[table.column("format").index("fp16")]
    assert row["largest finite"] == 65504 and row["smallest subnormal"] == 2.0 ** -24
    assert "<table>" in table._repr_html_() and "65504" in str(table)


def test_compare_shows_what_each_format_stores_and_its_error():
    table = E.compare([0.1, 70000.0], precisions=["fp16", "bf16"])
    assert table.columns == ["x", "fp16 stores", "fp16 rel. error", "bf16 stores",
                             "bf16 rel. error"]
    assert table[0]["fp16 stores"] == torch.tensor(0.1).half().item()
    assert table[1]["fp16 stores"] == math.inf and table[1]["fp16 rel. error"] == math.inf
    assert table[1]["bf16 stores"] == torch.tensor(70000.0).bfloat16().item()


def test_exact_decimal_writes_every_digit_up_to_a_limit():
    assert E.exact_decimal(formats.round_to(0.1, "fp32")) == "0.100000001490116119384765625"
    assert E.exact_decimal(0.1) == "0.100000000000000005551115123125…"
    assert E.exact_decimal(65504.0) == "65504"
    assert E.exact_decimal(2.0 ** -24) == "5.9604644775390625e-8"
    assert E.exact_decimal(-0.0) == "-0.0" and E.exact_decimal(math.inf) == "inf"


@pytest.mark.parametrize("x, precision, note", [
    (1e-8, "fp16", "underflow: became 0"), (70000.0, "fp16", "overflow: became inf"),
    (500.0, formats.E4M3_SATURATING, "overflow: saturated at the largest finite"),
    (500.0, "fp8_e4m3", {"saturate": "overflow: saturated at the largest finite",
                         "nan": "overflow: became NaN"}[formats.TORCH_E4M3_OVERFLOW]),
    (500.0, formats.E4M3_NAN_ON_OVERFLOW, "overflow: became NaN"),
    (1e-6, "fp16", "subnormal: fewer significant bits"), (0.1, "fp16", ""), (0.0, "fp16", ""),
    (math.inf, "fp16", ""),
])
def test_cast_note_says_what_a_cast_did_beyond_rounding(x, precision, note):
    assert E.cast_note(x, E.decompose(x, precision), precision) == note


def test_stored_row_is_the_explorers_row_of_one_format():
    d = E.decompose(1e-8, "fp32")
    row = E.stored_row(1e-8, d, "fp32")
    assert row == {"format": "fp32", "stored value, exactly": E.exact_decimal(d.value),
                   "kind": "normal", "abs. error": d.abs_error, "rel. error": d.rel_error,
                   "spacing here (ulp)": formats.ulp(d.value, "fp32"),
                   "bits": formats.to_bits(1e-8, "fp32"),
                   "note": ""}
    inf = E.stored_row(1e6, E.decompose(1e6, "fp16"), "fp16")
    assert math.isnan(inf["spacing here (ulp)"]) and inf["note"] == "overflow: became inf"
