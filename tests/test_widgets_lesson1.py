"""The precision explorer, driven from Python as a learner drives it in the browser.

Every expected number comes from mplab.numerics.formats; the widget must agree with it."""

import io
import math
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import optional

pytest.importorskip("ipywidgets", reason="needs ipywidgets, which is not installed")
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from PIL import Image  # noqa: E402

from mplab import fixtures, plots  # noqa: E402
from mplab.numerics import explain, formats  # noqa: E402
from mplab.widgets import lesson1  # noqa: E402
from mplab.widgets.lesson1 import precision_explorer  # noqa: E402

nbformat = optional("nbformat")


def same(a: float, b: float) -> bool:
    """Equal as floats go, where NaN equals NaN and 0.0 differs from -0.0."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b and math.copysign(1, a) == math.copysign(1, b)


def shown_bits(explorer, fmt: str) -> str:
    """The bit boxes of a row read left to right, as a string of 0s and 1s."""
    buttons = explorer.rows[fmt].buttons
    return "".join(buttons[i].description for i in sorted(buttons, reverse=True))


def assert_rows_show(explorer, x: float, names=formats.FORMATS) -> None:
    for name in names:
        bits = formats.to_bits(x, name)
        width = formats.get_format(name).bits
        assert shown_bits(explorer, name) == format(bits, f"0{width}b"), name
        assert f"= {formats.from_bits(bits, name)!r}" in explorer.rows[name].value.value, name


@pytest.fixture
def explorer():
    return precision_explorer(0.1)


def test_starts_at_its_value_with_every_format_in_bits(explorer):
    assert explorer.value == 0.1
    assert list(explorer.rows) == list(formats.FORMATS)
    assert_rows_show(explorer, 0.1)
    assert explorer.text.value == "0.1"
    assert "could not" not in explorer.message.value


def test_bit_boxes_are_coloured_by_field_and_findable_by_class(explorer):
    row = explorer.rows["fp16"]
    colours = {i: row.buttons[i].style.button_color for i in row.buttons}
    sign, exponent, mantissa = colours[15], colours[10], colours[0]
    assert len({sign, exponent, mantissa}) == 3
    # 0.1 in fp16 is 0 01011 1001100110: bits 12 and 13 differ, so their shades differ
    assert colours[13] != colours[12]
    assert "mplab-bit-fp16-15" in row.buttons[15]._dom_classes
    assert "sign" in row.buttons[15].tooltip


def test_flipping_fp16_sign_bit_negates_the_fp16_value(explorer):
    explorer.rows["fp16"].buttons[15].click()
    assert explorer.value == -formats.round_to(0.1, "fp16")
    assert_rows_show(explorer, explorer.value)
    assert explorer.text.value == repr(explorer.value)


@pytest.mark.parametrize("fmt", list(formats.FORMATS))
def test_flipping_an_exponent_bit_gives_the_value_of_the_flipped_pattern(fmt):
    f = formats.get_format(fmt)
    for bit in (f.man_bits, f.bits - 2):  # lowest and highest exponent bit
        explorer = precision_explorer(0.1)
        explorer.rows[fmt].buttons[bit].click()
        flipped = formats.to_bits(0.1, fmt) ^ (1 << bit)
        assert same(explorer.value, formats.from_bits(flipped, fmt))
        assert explorer.rows[fmt].bits == flipped


def test_flipping_into_nan_keeps_the_clicked_pattern_and_flipping_back_undoes_it(explorer):
    explorer.value = math.inf
    explorer.rows["fp16"].buttons[0].click()  # 0 11111 0000000000 -> 0 11111 0000000001
    assert math.isnan(explorer.value)
    assert explorer.rows["fp16"].bits == 0x7C01
    assert shown_bits(explorer, "fp32") == format(formats.to_bits(math.nan, "fp32"), "032b")
    explorer.rows["fp16"].buttons[0].click()
    assert explorer.value == math.inf


def test_flipping_the_sign_of_zero_gives_negative_zero(explorer):
    explorer.value = 0.0
    explorer.rows["bf16"].buttons[15].click()
    assert same(explorer.value, -0.0)
    assert shown_bits(explorer, "fp32") == "1" + "0" * 31


def test_e4m3_nan_pattern_is_handled(explorer):
    explorer.value = 448.0  # 0 1111 110 in e4m3; the next pattern up is its only NaN
    explorer.rows["fp8_e4m3"].buttons[0].click()
    assert math.isnan(explorer.value)
    assert explorer.rows["fp8_e4m3"].bits == 0x7F
    assert "nan" in explorer.rows["fp8_e4m3"].value.value


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp8_e5m2", "fp32"])
def test_step_buttons_move_to_the_neighbours_in_that_format(explorer, fmt):
    stored = formats.round_to(0.1, fmt)
    explorer.rows[fmt].up.click()
    assert explorer.value == formats.next_up(stored, fmt)
    explorer.rows[fmt].down.click()
    assert explorer.value == stored
    explorer.rows[fmt].down.click()
    assert explorer.value == formats.next_down(stored, fmt)
    assert formats.to_bits(explorer.value, fmt) == formats.to_bits(stored, fmt) - 1


def test_stepping_past_the_largest_finite_number(explorer):
    explorer.value = 65504.0
    explorer.rows["fp16"].up.click()
    assert explorer.value == math.inf
    explorer.rows["fp16"].down.click()
    assert explorer.value == 65504.0
    explorer.value = 448.0
    explorer.rows["fp8_e4m3"].up.click()  # e4m3 has no inf: the next pattern is NaN
    assert math.isnan(explorer.value)
    explorer.rows["fp8_e4m3"].up.click()
    assert math.isnan(explorer.value)
    assert "no neighbours" in explorer.message.value


@pytest.mark.parametrize("text", ["0.1", "1e-8", "1/3", "2**-24", "pi", "-65504", "inf"])
def test_typed_numbers_are_read_by_parse_number(explorer, text):
    explorer.text.value = text
    assert explorer.value == float(formats.parse_number(text))
    assert explorer.text.value == text
    assert explorer.message.value.count("could not") == 0
    assert_rows_show(explorer, explorer.value)


@pytest.mark.parametrize("text", ["abc", "", "1+2j", "1e400", "1e99999999", "x" * 200])
def test_bad_input_shows_a_message_and_keeps_the_value(explorer, text):
    explorer.value = 0.25
    start = time.perf_counter()
    explorer.text.value = text
    assert time.perf_counter() - start < 1
    assert explorer.value == 0.25
    message = explorer.message.value
    assert repr(text[:30]).replace("'", "&#x27;") in message  # what was given
    assert "1/3" in message or "inf" in message  # what is accepted
    assert "0.25" in message  # what is still shown
    assert_rows_show(explorer, 0.25)
    explorer.text.value = "0.5"  # and the next good input clears the message
    assert explorer.value == 0.5 and explorer.message.value.count("could not") == 0


def test_read_number_names_the_input_and_the_accepted_forms():
    with pytest.raises(ValueError, match=r"'abc'.*1/3"):
        lesson1.read_number("abc")
    with pytest.raises(ValueError, match="largest Python float"):
        lesson1.read_number("1e400")
    assert lesson1.read_number("2**-24") == (2.0 ** -24, "")


def test_a_number_too_small_for_a_python_float_says_so(explorer):
    explorer.text.value = "1e-400"
    assert explorer.value == 0.0
    assert "smallest Python float" in explorer.message.value


def test_presets_set_the_value_and_the_text(explorer):
    for label, text in lesson1.presets():
        explorer.preset.value = text
        assert explorer.value == lesson1.read_number(text).value, label
        assert explorer.text.value == text
    explorer.rows["fp16"].up.click()  # the value no longer is the preset's
    assert explorer.preset.value is None


def test_the_weight_preset_is_an_initialised_linear_layer_weight(explorer):
    label, text = lesson1.presets()[-1]
    assert "nn.Linear(768, 768)" in label and "initialised" in label
    torch.manual_seed(0)
    assert float(text) == torch.nn.Linear(768, 768).weight[0, 0].item()
    assert float(text) == fixtures.layer_weight()
    explorer.preset.value = text
    assert explain.decompose(explorer.value, "fp32").abs_error == 0  # a weight already is fp32


def test_setting_value_from_python_updates_every_row(explorer):
    explorer.value = 0.0
    explorer.value = -0.0  # equal to 0.0 as floats go, but a different pattern
    assert shown_bits(explorer, "fp16") == "1" + "0" * 15
    explorer.value = 70000
    assert explorer.value == 70000.0 and explorer.text.value == "70000.0"
    assert_rows_show(explorer, 70000.0)
    notes = {r["format"]: r["note"] for r in explorer.table_rows}
    assert notes["fp16"] == "overflow: became inf"
    assert notes["fp8_e4m3"] == "overflow: saturated at the largest finite"  # as torch casts it
    assert "overflow: became inf" in explorer.table.value  # and the table shows it


def test_table_shows_stored_value_kind_errors_and_ulp(explorer):
    explorer.text.value = "1e-8"
    assert [r["format"] for r in explorer.table_rows] == list(formats.FORMATS)
    for name, row in zip(formats.FORMATS, explorer.table_rows):
        d = explain.decompose(1e-8, name)
        assert row == explain.stored_row(1e-8, d, name)
        assert row["stored value, exactly"] == explain.exact_decimal(d.value)
        assert row["bits"] == formats.to_bits(1e-8, name)
        for cell in (row["stored value, exactly"], d.kind, f"{d.rel_error:.3g}",
                     f"{formats.ulp(d.value, name):.3g}"):
            assert cell in explorer.table.value, (name, cell)  # what the learner reads
    assert {r["format"] for r in explorer.table_rows if r["note"] == "underflow: became 0"} == {
        "fp16", "fp8_e4m3", "fp8_e5m2"}


def test_a_nan_pattern_made_by_a_click_stays_in_the_table(explorer):
    explorer.value = math.inf
    explorer.rows["fp16"].buttons[0].click()  # inf with a mantissa bit: a NaN pattern
    row = next(r for r in explorer.table_rows if r["format"] == "fp16")
    assert row["bits"] == 0x7C01 and row["kind"] == "nan"


def test_formats_can_be_chosen():
    explorer = precision_explorer("1/3", precisions=["fp16", torch.bfloat16])
    assert list(explorer.rows) == ["fp16", "bf16"]
    assert explorer.value == 1 / 3


def test_plot_image_follows_the_value(explorer):
    first = explorer.plot.value
    assert Image.open(io.BytesIO(first)).format == "PNG"
    explorer.value = 1e-8
    assert explorer.plot.value != first


# --- every format of ALL_FORMATS: lesson 9's below 8 bits and the e8m0 scale --------------------

ALL = list(formats.ALL_FORMATS)
NEW = list(formats.LOW_BIT_FORMATS)
ML_DTYPES = {"fp8_e4m3fnuz": ml_dtypes.float8_e4m3fnuz, "fp8_e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
             "fp6_e3m2": ml_dtypes.float6_e3m2fn, "fp6_e2m3": ml_dtypes.float6_e2m3fn,
             "fp4_e2m1": ml_dtypes.float4_e2m1fn, "e8m0": ml_dtypes.float8_e8m0fnu}


def library_cast(x: float, name: str) -> float:
    """What a library stores for the double x: torch's cast where torch has the dtype (the
    formats follow it), ml_dtypes' where it has not (fp4, fp6)."""
    f = formats.get_format(name)
    if f.torch_dtype:
        return torch.tensor([x], dtype=torch.float64).to(f.dtype()).double().item()
    return float(np.float64(x).astype(ML_DTYPES[name]))


def library_value(bits: int, name: str) -> float:
    """The value ml_dtypes reads in a bit pattern."""
    return float(np.array([bits], np.uint8).view(ML_DTYPES[name])[0])


@pytest.fixture
def everything():
    return precision_explorer(0.1, formats.ALL_FORMATS)


def test_over_all_formats_each_row_shows_what_the_cast_stores(everything):
    assert list(everything.rows) == ALL
    assert_rows_show(everything, 0.1, ALL)
    for name in ALL[2:]:  # tf32 is a matmul mode: no library casts to it
        assert f"= {library_cast(0.1, name)!r}" in everything.rows[name].value.value, name
    for name in NEW:
        assert sorted(everything.rows[name].buttons) == list(range(formats.get_format(name).bits))
    assert [r["format"] for r in everything.table_rows] == ALL
    for name, row in zip(ALL, everything.table_rows):
        assert row == explain.stored_row(0.1, explain.decompose(0.1, name), name)
        assert f"<b>{name}</b>" in everything.table.value


def test_0_1_in_fp4_is_its_nearest_value_a_zero(everything):
    values = [library_value(p, "fp4_e2m1") for p in range(16)]
    nearest = min(values, key=lambda v: abs(v - 0.1))  # 0.0 (and -0.0) against 0.5
    assert nearest == 0 == library_cast(0.1, "fp4_e2m1")
    assert shown_bits(everything, "fp4_e2m1") == "0000"
    assert "= 0.0" in everything.rows["fp4_e2m1"].value.value
    row = next(r for r in everything.table_rows if r["format"] == "fp4_e2m1")
    assert row["note"] == "underflow: became 0" and row["bits"] == 0


def test_typing_448_5_shows_fnuz_nan_e4m3_saturated_and_fp4_at_its_top(everything):
    everything.text.value = "448.5"
    assert everything.value == 448.5
    assert_rows_show(everything, 448.5, ALL)
    assert math.isnan(library_cast(448.5, "fp8_e4m3fnuz"))  # past 240: FNUZ's overflow is NaN
    assert shown_bits(everything, "fp8_e4m3fnuz") == "10000000"  # the pattern of -0
    assert "= nan" in everything.rows["fp8_e4m3fnuz"].value.value
    for name in ("fp8_e4m3", "fp4_e2m1", "fp6_e3m2", "e8m0"):
        assert f"= {library_cast(448.5, name)!r}" in everything.rows[name].value.value, name
    notes = {r["format"]: r["note"] for r in everything.table_rows}
    assert notes["fp8_e4m3fnuz"] == "overflow: became NaN"
    assert notes["fp4_e2m1"] == "overflow: saturated at the largest finite"
    assert "overflow: became NaN" in everything.table.value


@pytest.mark.parametrize("text", ["-2", "0", "7", "1e-8", "1/3", "-65504", "inf", "nan"])
def test_typed_numbers_update_every_row_of_all_formats(everything, text):
    everything.text.value = text
    x = float(formats.parse_number(text))
    assert same(everything.value, x)
    assert_rows_show(everything, x, ALL)
    for name in ALL[2:]:
        assert f"= {library_cast(x, name)!r}" in everything.rows[name].value.value, name
    assert [r["bits"] for r in everything.table_rows] == [formats.to_bits(x, n) for n in ALL]


def test_e8m0_has_no_sign_bit_and_fp4_has_one_of_its_four(everything):
    def field_of(row, bit):
        colour = row.buttons[bit].style.button_color
        return next(k for k, pair in lesson1.FIELD_COLORS.items() if colour in pair)

    e8m0, fp4 = everything.rows["e8m0"], everything.rows["fp4_e2m1"]
    assert [field_of(e8m0, b) for b in range(8)] == ["exponent"] * 8
    assert not any("sign" in b.tooltip for b in e8m0.buttons.values())
    assert "no sign, 8 exponent, 0 mantissa bits" in e8m0.box.children[0].value
    assert [field_of(fp4, b) for b in (3, 2, 1, 0)] == ["sign", "exponent", "exponent",
                                                        "mantissa"]
    everything.value = -2.0  # e8m0 drops the sign, as torch's cast does
    assert shown_bits(everything, "e8m0") == format(formats.to_bits(2.0, "e8m0"), "08b")
    assert "= 2.0" in e8m0.value.value and library_cast(-2.0, "e8m0") == 2.0


def test_fnuz_has_no_negative_zero_its_pattern_is_the_nan(everything):
    everything.value = -0.0
    for name in ("fp8_e4m3fnuz", "fp8_e5m2fnuz"):
        assert shown_bits(everything, name) == "00000000", name
        assert same(library_cast(-0.0, name), 0.0)
    assert shown_bits(everything, "fp8_e4m3") == "10000000"  # where -0 exists
    everything.value = 0.0
    row = everything.rows["fp8_e4m3fnuz"]
    row.buttons[7].click()
    assert math.isnan(everything.value) and math.isnan(library_value(0x80, "fp8_e4m3fnuz"))
    assert row.bits == 0x80 and "nan" in row.value.value
    row.buttons[7].click()
    assert same(everything.value, 0.0)


@pytest.mark.parametrize("name", NEW)
def test_flipping_any_bit_of_a_new_format_gives_the_value_of_that_pattern(everything, name):
    for start in (1.0, 0.1, -3.0):
        for bit in range(formats.get_format(name).bits):
            everything.value = start
            before = everything.rows[name].bits
            everything.rows[name].buttons[bit].click()
            flipped = before ^ (1 << bit)
            assert same(everything.value, library_value(flipped, name)), (start, bit)
            assert everything.rows[name].bits == flipped, (start, bit)
            assert "went wrong" not in everything.message.value
            others = [n for n in ALL if n != name]
            assert_rows_show(everything, everything.value, others)


def test_stepping_walks_every_fp4_number_and_stops_at_the_ends(everything):
    values = sorted({library_value(p, "fp4_e2m1") for p in range(16)})  # -6 ... 6, one zero
    row = everything.rows["fp4_e2m1"]
    everything.value = 0.0
    upward = [v for v in values if v >= 0]
    walked = [0.0]
    for _ in upward:  # one click more than there are steps
        row.up.click()
        walked.append(everything.value)
    assert walked[:-1] == upward and walked[-1] == upward[-1] == 6.0
    assert "fp4_e2m1 has no number above 6.0" in everything.message.value
    assert "no inf and no NaN" in everything.message.value
    everything.value = 0.0
    row.down.click()
    assert everything.value == -0.5 == values[values.index(0.0) - 1]
    everything.value = -6.0
    row.down.click()
    assert everything.value == -6.0 and "no number below -6.0" in everything.message.value


def test_stepping_below_the_smallest_e8m0_stays_it_has_no_zero(everything):
    smallest = float(ml_dtypes.finfo(ml_dtypes.float8_e8m0fnu).smallest_normal)
    everything.value = smallest
    everything.rows["e8m0"].down.click()
    assert everything.value == smallest and "no zero" in everything.message.value
    everything.rows["e8m0"].up.click()
    assert everything.value == library_value(1, "e8m0") == 2 * smallest
    everything.value = 0.1  # stored 0.125; the next power of two up
    everything.rows["e8m0"].up.click()
    assert everything.value == library_value(formats.to_bits(0.1, "e8m0") + 1, "e8m0") == 0.25


def test_fnuz_steps_past_its_top_into_its_nan(everything):
    top = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fnuz).max)
    everything.value = top
    everything.rows["fp8_e4m3fnuz"].up.click()  # the pattern after 0x7F is 0x80, the NaN
    assert math.isnan(everything.value)


def test_the_plot_over_all_formats_draws_each_of_them(everything):
    fig = plots.ulp_plot(0.1, formats.ALL_FORMATS, pyplot=False)
    lines = lines_by_gid(fig.axes[0])
    for name in ALL:
        f = formats.get_format(name)
        xs, ys = (list(a) for a in lines[f"ulp-{name}"].get_data())
        assert xs[0] == float(f.min_subnormal) and xs[-1] == float(f.max_finite), name
        assert ys == [formats.ulp(x, name) for x in xs], name
    first = everything.plot.value
    assert Image.open(io.BytesIO(first)).format == "PNG"
    everything.value = 3e30  # past every format but fp32, bf16 and e8m0
    assert everything.plot.value != first


def test_the_standalone_notebook_explores_all_formats_and_lesson_1_the_six():
    notebooks = Path(__file__).parent.parent / "notebooks"
    page = nbformat.read(notebooks / "precision_explorer.ipynb", as_version=4)
    ns: dict = {}
    for cell in page.cells:
        if cell.cell_type == "code":
            exec(cell.source, ns)
    assert list(ns["explorer"].rows) == ALL
    lesson = nbformat.read(notebooks / "01_float_formats.ipynb", as_version=4)
    cell = next(c for c in lesson.cells if c.cell_type == "code"
                and "precision_explorer(" in c.source and "import" not in c.source)
    ns = {"precision_explorer": precision_explorer}
    exec(cell.source, ns)
    assert list(ns["explorer"].rows) == list(formats.FORMATS)


# --- plots.ulp_plot --------------------------------------------------------------------------

def lines_by_gid(ax) -> dict:
    return {line.get_gid(): line for line in ax.lines}


def test_ulp_plot_draws_each_format_as_a_staircase_of_its_ulps():
    fig = plots.ulp_plot(0.1, pyplot=False)
    whole, closeup = fig.axes
    lines = lines_by_gid(whole)
    for name, f in formats.FORMATS.items():
        xs, ys = (list(a) for a in lines[f"ulp-{name}"].get_data())
        assert xs[0] == float(f.min_subnormal) and xs[-1] == float(f.max_finite)
        assert ys == [formats.ulp(x, name) for x in xs]
        for attr in ("min_subnormal", "min_normal", "max_finite"):  # underflow / overflow edges
            assert lines[f"edge-{name}-{attr}"].get_xdata()[0] == float(getattr(f, attr))
    lo, hi = closeup.get_xlim()
    fp16 = formats.FORMATS["fp16"]
    assert lo < float(fp16.min_subnormal) and hi > float(fp16.max_finite)


def test_ulp_plot_marks_x_on_every_curve_that_holds_it():
    fig = plots.ulp_plot(1e-8, pyplot=False)
    lines = lines_by_gid(fig.axes[0])
    assert list(lines["ulp-marker-line"].get_xdata()) == [1e-8, 1e-8]
    assert list(lines["ulp-marker-fp32"].get_data()) == [[1e-8], [formats.ulp(1e-8, "fp32")]]
    assert list(lines["ulp-marker-fp16"].get_xdata()) == []  # 1e-8 underflows in fp16


def test_ulp_plot_hides_the_marker_for_zero_and_draws_into_a_given_axes():
    fig = Figure()
    ax = fig.add_subplot()
    assert plots.ulp_plot(0.0, precisions=["fp16", "bf16"], ax=ax) is fig
    lines = lines_by_gid(ax)
    assert {"ulp-fp16", "ulp-bf16"} <= set(lines) and "ulp-fp32" not in lines
    assert not lines["ulp-marker-line"].get_visible()
    plots.mark_ulp(ax, -3.0, ["fp16", "bf16"])
    assert lines["ulp-marker-line"].get_visible()
    assert list(lines["ulp-marker-line"].get_xdata()) == [3.0, 3.0]


def test_marker_png_frames_are_pngs_that_move_with_x():
    frames = plots.MarkerPng(plots.ulp_plot(pyplot=False))
    a, b = frames.png(0.1), frames.png(1000.0)
    assert Image.open(io.BytesIO(a)).size == Image.open(io.BytesIO(b)).size
    assert a != b and frames.png(0.1) == a
