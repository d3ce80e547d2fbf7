"""The quantisers' cost, mplab against torchao (mplab.bench.quantizers): every recipe is timed
both ways on the same input, the two sides are the real quantisers and agree bit for bit, the
note says what was measured, and `python -m mplab.bench --json` keeps the table. The speed
target itself is printed by the benchmark, never asserted here (the machine is shared)."""

import json

import pytest

pytest.importorskip("torchao", reason="needs torchao, which is not installed")

import torch  # noqa: E402

from mplab.bench import quantizers as B  # noqa: E402
from mplab.lowbit import microscaling as M  # noqa: E402
from mplab.lowbit import quantize as Q  # noqa: E402


@pytest.fixture(scope="module")
def table():
    return B.quantizer_speed((32, 256), repeats=3, budget_s=0.05)


def test_the_table_times_every_recipe_both_ways(table):
    assert table.column("recipe") == list(B.RECIPES)
    for row in table:
        mine, theirs = row["mplab M values/s"], row["torchao M values/s"]
        assert mine > 0 and theirs > 0, row
        # the ratio is of the median times: torchao's rate over mplab's, up to the rounding
        assert row[B.RATIO] == pytest.approx(theirs / mine, rel=0.02, abs=0.01), row
        assert row["same bits"] == "yes" and row["turns"] == 3, row
    assert "32×256" in table.title and "torchao 0.18" in table.title


def test_the_note_states_every_measured_ratio(table):
    for row in table:
        assert f"{row['recipe']} {row[B.RATIO]:.2f}×" in table.note
    over = [r for r in table if r[B.RATIO] > B.TARGET_RATIO]
    assert ("NOT within 2×" in table.note) == bool(over)
    assert ("on every recipe" in table.note) == (not over)
    rows = [{"recipe": "a", B.RATIO: 1.5, "same bits": "yes"},
            {"recipe": "b", B.RATIO: 2.5, "same bits": "NO"}]
    note = B.quantizer_note(rows)
    assert "within 2× of torchao's time on 1 of 2 recipes (a 1.50×)" in note
    assert "NOT within 2×: b 2.50×" in note and "bits DIFFER for b" in note


def test_the_timed_functions_are_the_real_quantisers_and_agree_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-3, 3, 256)
    recipes = B.quantizer_recipes()
    assert list(recipes) == list(B.RECIPES)
    direct = {"tensorwise e4m3": Q.tensorwise(x), "rowwise e4m3": Q.rowwise(x),
              "MXFP8 floor": M.mx(x, "fp8_e4m3"), "MXFP8 rceil": M.mx(x, "fp8_e4m3", mode="rceil"),
              "MXFP4": M.mx(x, "fp4_e2m1"), "NVFP4": M.nvfp4(x)}
    for name, r in recipes.items():
        mine, theirs = r.mplab(x), r.torchao(x)
        assert mine.recipe == direct[name].recipe, name
        assert torch.equal(mine.values, direct[name].values), name
        assert r.same_bits(mine, theirs), name
        # the comparison can tell: torchao's result for another input differs
        assert not r.same_bits(mine, r.torchao(x * 1.5)), name
    # and, read another way, torchao's float8 tensors dequantise to mplab's values
    for name in ("tensorwise e4m3", "rowwise e4m3"):
        r = recipes[name]
        assert torch.equal(r.torchao(x).to_original_precision(), r.mplab(x).dequantized)


def test_the_record_entry_prints_the_table_it_came_from(table):
    entry = B.quantizer_record(table)
    assert json.loads(json.dumps(entry)) == entry
    assert str(B.quantizer_table(entry)) == str(table)


@pytest.mark.parametrize("kwargs, match", [
    ({"size": (16, 100)}, "multiple of 32"),
    ({"size": 4096}, "two positive ints"),
    ({"repeats": 0}, "repeats must be a positive int, got 0"),
    ({"budget_s": -1}, "budget_s must be a positive number of seconds, got -1"),
])
def test_bad_arguments_say_what_is_accepted(kwargs, match):
    with pytest.raises(ValueError, match=match):
        B.quantizer_speed(**kwargs)


def test_the_cli_prints_the_table_and_its_json_keeps_it(tmp_path, capsys):
    from mplab.bench.__main__ import parse_args, run

    out = tmp_path / "bench.json"
    printed = run(parse_args(["--tiny", "--device", "cpu", "--json", str(out)]))
    said = capsys.readouterr().out
    written = json.loads(out.read_text())
    assert written == printed
    entry = written["quantizers"]
    assert [r["recipe"] for r in entry["rows"]] == list(B.RECIPES)
    assert all(r["mplab M values/s"] > 0 and r["same bits"] == "yes" for r in entry["rows"])
    assert entry["title"] in said and entry["note"] in said
    assert "quantisers, mplab against torchao, a 32×256 tensor on one CPU thread:" in said
    assert written["rows"] and written["crossover"]  # the rest of the record as it was
