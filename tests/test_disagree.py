"""The disagreement table against the libraries themselves: every cell is recomputed here by a
fresh call to torch, ml_dtypes, torchao or the OCP MX rule, every row shown really differs, and
the disagreements lesson 9 names are there with the values the installed libraries give."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from mplab.lowbit import disagree as D
from mplab.lowbit import microscaling as M
from mplab.lowbit.quantize import load_torchao
from mplab.numerics import formats

pytest.importorskip("torchao", reason="needs torchao, which is not installed")
load_torchao()
from torchao.float8.float8_utils import to_fp8_saturated  # noqa: E402
from torchao.prototype.mx_formats import kernels  # noqa: E402
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import to_mx  # noqa: E402

ML = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2,
      "fp8_e4m3fnuz": ml_dtypes.float8_e4m3fnuz, "fp8_e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
      "fp6_e2m3": ml_dtypes.float6_e2m3fn, "fp6_e3m2": ml_dtypes.float6_e3m2fn,
      "fp4_e2m1": ml_dtypes.float4_e2m1fn, "e8m0": ml_dtypes.float8_e8m0fnu}
TORCH = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
         "fp8_e4m3fnuz": torch.float8_e4m3fnuz, "fp8_e5m2fnuz": torch.float8_e5m2fnuz,
         "e8m0": torch.float8_e8m0fnu}
#: torchao's element casts: to codes, read back by ml_dtypes (not by torchao's own decoder)
TORCHAO_CODES = {"fp4_e2m1": kernels.f32_to_f4_unpacked,
                 "fp6_e2m3": kernels.f32_to_f6_e2m3_unpacked,
                 "fp6_e3m2": kernels.f32_to_f6_e3m2_unpacked}
E4M3_EMAX = 8  # 448 = 1.75 * 2^8


def same(a: float, b: float) -> bool:
    """Equal as bit patterns go: NaN equals NaN, 0.0 differs from -0.0."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b and math.copysign(1, a) == math.copysign(1, b)


def by_torch(x, name):
    return torch.tensor([x], dtype=torch.float32).to(TORCH[name]).float().item()


def by_ml_dtypes(x, name):
    return float(np.float32(x).astype(ML[name]))


def decode(code: int, name: str) -> float:
    return float(np.array([code], np.uint8).view(ML[name])[0])


def by_torchao(x, name):
    t = torch.tensor([x], dtype=torch.float32)
    if name in TORCHAO_CODES:
        return decode(int(TORCHAO_CODES[name](t)), name)
    return to_fp8_saturated(t, TORCH[name]).float().item()


def torchao_scale(x, mode):
    block = torch.zeros(1, 32)
    block[0, 0] = x * 2.0 ** E4M3_EMAX
    scale, _ = to_mx(block, torch.float8_e4m3fn, 32, ScaleCalculationMode(mode))
    return decode(int(scale.view(torch.uint8)), "e8m0")


def ocp_floor(x):
    """The OCP MX v1.0 scale, 2^(floor(log2 amax) - emax), for amax = |x| * 2^emax; mplab's
    rule where the spec has none (amax 0)."""
    if x == 0:
        k = int(M.mx_scale_exponent(torch.tensor(0.0), "fp8_e4m3", "floor"))
        return decode(k + 127, "e8m0")
    return 2.0 ** (math.frexp(abs(x) * 2.0 ** E4M3_EMAX)[1] - 1 - E4M3_EMAX)


@pytest.fixture(scope="module")
def every_probe():
    return D.disagreement_rows(include_agreeing=True)


@pytest.fixture(scope="module")
def table():
    return D.disagreements()


def row_of(rows, name, x):
    found = [r for r in rows if r["cast to"] == name and same(r["input"], x)]
    assert len(found) <= 1
    return found[0] if found else None


def test_every_cell_is_a_fresh_call_to_that_library(every_probe):
    assert len(every_probe) == sum(map(len, D.PROBES.values()))
    for r in every_probe:
        name, x = r["cast to"], r["input"]
        where = (name, x)
        if name in TORCH:
            assert same(r["torch"], by_torch(x, name)), where
        else:  # torch has fp4 only packed, and cannot cast to it; no fp6 at all
            assert r["torch"] == "—", where
            assert not hasattr(torch, ML[name].__name__) or name == "fp4_e2m1"
        assert same(r["ml_dtypes"], by_ml_dtypes(x, name)), where
        assert same(r["mplab"], formats.round_to(x, name)), where
        if name == "e8m0":
            assert r["torchao"] == "—", where
            assert same(r["torchao FLOOR"], torchao_scale(x, "floor")), where
            assert same(r["torchao RCEIL"], torchao_scale(x, "rceil")), where
            assert same(r["OCP MX floor"], ocp_floor(x)), where
        else:
            assert same(r["torchao"], by_torchao(x, name)), where
            assert [r[c] for c in D.MX_COLUMNS] == ["—"] * 3, where


def test_torch_really_has_no_fp4_cast():
    with pytest.raises((NotImplementedError, RuntimeError)):
        torch.tensor([1.0]).to(torch.float4_e2m1fn_x2)


def test_every_row_shows_a_real_disagreement(table, every_probe):
    assert len(table) > 0
    for r in table:
        answers = [r[c] for c in D.CAST_COLUMNS + D.MX_COLUMNS if r[c] != "—"]
        assert any(not same(answers[0], a) for a in answers[1:]), r
    shown = {(r["cast to"], r["input"]) for r in table}
    for r in every_probe:  # and no disagreeing probe is left out
        answers = [r[c] for c in D.CAST_COLUMNS + D.MX_COLUMNS if r[c] != "—"]
        differ = any(not same(answers[0], a) for a in answers[1:])
        assert differ == ((r["cast to"], r["input"]) in shown), r


def test_cells_differ_reads_nan_and_the_sign_of_zero_as_bits():
    row = dict.fromkeys(D.CAST_COLUMNS + D.MX_COLUMNS, "—")
    assert not D.cells_differ({**row, "torch": math.nan, "ml_dtypes": math.nan})
    assert D.cells_differ({**row, "torch": 0.0, "ml_dtypes": -0.0})
    assert D.cells_differ({**row, "torch": 448.0, "ml_dtypes": math.nan})
    assert not D.cells_differ({**row, "torch": 2.0, "mplab": 2.0})


def test_e4m3fn_torch_saturates_where_ml_dtypes_gives_nan_past_464(table, every_probe):
    top = torch.finfo(torch.float8_e4m3fn).max
    for x in (465.0, 480.0, 1e9, math.inf):
        r = row_of(table, "fp8_e4m3", x)
        assert r is not None, x
        assert r["torch"] == by_torch(x, "fp8_e4m3") == top  # even inf saturates
        assert math.isnan(r["ml_dtypes"]) and math.isnan(by_ml_dtypes(x, "fp8_e4m3"))
        assert r["mplab"] == r["torch"]  # mplab follows torch
    for x in (449.0, 464.0):  # both round these to 448: 464 is the tie, and 448 is even
        assert row_of(table, "fp8_e4m3", x) is None
        r = row_of(every_probe, "fp8_e4m3", x)
        assert r["torch"] == r["ml_dtypes"] == by_ml_dtypes(x, "fp8_e4m3") == top
    just_past = float(np.nextafter(np.float32(464), np.float32(np.inf)))
    assert math.isnan(by_ml_dtypes(just_past, "fp8_e4m3"))
    assert by_torch(just_past, "fp8_e4m3") == top


def test_fp8_overflow_torch_and_ml_dtypes_agree_torchao_saturates(table):
    for name, x in (("fp8_e5m2", 1e9), ("fp8_e5m2", math.inf), ("fp8_e4m3fnuz", 1e9),
                    ("fp8_e5m2fnuz", math.inf)):
        r = row_of(table, name, x)
        assert r is not None, (name, x)
        assert same(r["torch"], r["ml_dtypes"]), (name, x)  # e5m2: inf; fnuz: NaN
        assert math.isinf(r["torch"]) if name == "fp8_e5m2" else math.isnan(r["torch"])
        assert r["torchao"] == torch.finfo(TORCH[name]).max  # it clamps before the cast


def test_e8m0_cast_of_zero_and_negatives_is_nan_only_in_ml_dtypes(table):
    for x in (0.0, -2.0):
        r = row_of(table, "e8m0", x)
        assert r is not None and math.isnan(r["ml_dtypes"]), x
        assert r["torch"] == by_torch(abs(x), "e8m0") > 0  # the sign dropped
    smallest = float(ml_dtypes.finfo(ml_dtypes.float8_e8m0fnu).smallest_normal)
    assert row_of(table, "e8m0", 0.0)["torch"] == smallest  # no zero: 0 becomes 2^-127


def test_e8m0_cast_rounds_to_nearest_where_the_mx_scale_rounds_down(table):
    for x in (3.0, 0.75, 1.875):
        r = row_of(table, "e8m0", x)
        assert r is not None, x
        assert r["torch"] == r["ml_dtypes"] == by_ml_dtypes(x, "e8m0")
        assert r["OCP MX floor"] == 2.0 ** math.floor(math.log2(x)) < r["torch"]
        assert r["torchao FLOOR"] == r["OCP MX floor"]
    r = row_of(table, "e8m0", 1.875)  # amax 480 is past 448: RCEIL takes the next power up
    assert r["torchao RCEIL"] == 2 * r["torchao FLOOR"] == torchao_scale(1.875, "rceil")


def test_fp4_nan_is_a_zero_in_ml_dtypes_and_not_in_torchao(table, every_probe):
    r = row_of(table, "fp4_e2m1", math.nan)
    assert r is not None and r["ml_dtypes"] == 0 and r["mplab"] == 0
    assert r["torchao"] != 0 and not math.isnan(r["torchao"])
    inf = row_of(every_probe, "fp4_e2m1", math.inf)  # saturates to 6 everywhere: left out
    assert inf["ml_dtypes"] == float(ml_dtypes.finfo(ml_dtypes.float4_e2m1fn).max)
    assert row_of(table, "fp4_e2m1", math.inf) is None


def test_note_counts_the_rows_and_names_what_agreed(table, every_probe):
    note = table.note
    assert f"{len(table)} of {len(every_probe)} probes disagree" in note
    pairs = sum(1 for r in every_probe if "—" not in (r["torch"], r["ml_dtypes"])
                and not same(r["torch"], r["ml_dtypes"]))
    assert f"torch vs ml_dtypes: {pairs} (" in note
    agreed = [r for r in every_probe if not D.cells_differ(r)]
    assert agreed
    for r in agreed:
        assert f"{r['cast to']} of {r['input']!r}" in note
    assert f"torchao {load_torchao().__version__}" in table.title


def test_the_table_prints_every_row(table):
    text, page = str(table), table._repr_html_()
    assert text.count("\n") == len(table) + 3  # title, header, rule, rows, note
    for r in table:
        assert r["cast to"] in text and r["cast to"] in page
