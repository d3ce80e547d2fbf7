"""The precision explorer, driven from Python as a learner drives it in the browser.

Every expected number comes from mplab.formats; the widget must agree with it."""

import io
import math
import time

import pytest
import torch
from matplotlib.figure import Figure
from PIL import Image

from mplab import explain, lessons, plots
from mplab import formats as F
from mplab.widgets import lesson1
from mplab.widgets.lesson1 import precision_explorer


def same(a: float, b: float) -> bool:
    """Equal as floats go, where NaN equals NaN and 0.0 differs from -0.0."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b and math.copysign(1, a) == math.copysign(1, b)


def shown_bits(explorer, fmt: str) -> str:
    """The bit boxes of a row read left to right, as a string of 0s and 1s."""
    buttons = explorer.rows[fmt].buttons
    return "".join(buttons[i].description for i in sorted(buttons, reverse=True))


def assert_rows_show(explorer, x: float) -> None:
    for name in F.FORMATS:
        d = explain.decompose(x, name)
        assert shown_bits(explorer, name) == d.bit_string.replace(" ", ""), name
        assert f"= {d.value!r}" in explorer.rows[name].value.value, name


@pytest.fixture
def explorer():
    return precision_explorer(0.1)


def test_starts_at_its_value_with_every_format_in_bits(explorer):
    assert explorer.value == 0.1
    assert list(explorer.rows) == list(F.FORMATS)
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
    assert explorer.value == -F.round_to(0.1, "fp16")
    assert_rows_show(explorer, explorer.value)
    assert explorer.text.value == repr(explorer.value)


@pytest.mark.parametrize("fmt", list(F.FORMATS))
def test_flipping_an_exponent_bit_gives_the_value_of_the_flipped_pattern(fmt):
    f = F.get_format(fmt)
    for bit in (f.man_bits, f.bits - 2):  # lowest and highest exponent bit
        explorer = precision_explorer(0.1)
        explorer.rows[fmt].buttons[bit].click()
        flipped = F.to_bits(0.1, fmt) ^ (1 << bit)
        assert same(explorer.value, F.from_bits(flipped, fmt))
        assert explorer.rows[fmt].bits == flipped


def test_flipping_into_nan_keeps_the_clicked_pattern_and_flipping_back_undoes_it(explorer):
    explorer.value = math.inf
    explorer.rows["fp16"].buttons[0].click()  # 0 11111 0000000000 -> 0 11111 0000000001
    assert math.isnan(explorer.value)
    assert explorer.rows["fp16"].bits == 0x7C01
    assert shown_bits(explorer, "fp32") == format(F.to_bits(math.nan, "fp32"), "032b")
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
    stored = F.round_to(0.1, fmt)
    explorer.rows[fmt].up.click()
    assert explorer.value == F.next_up(stored, fmt)
    explorer.rows[fmt].down.click()
    assert explorer.value == stored
    explorer.rows[fmt].down.click()
    assert explorer.value == F.next_down(stored, fmt)
    assert F.to_bits(explorer.value, fmt) == F.to_bits(stored, fmt) - 1


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
    assert explorer.value == float(F.parse_number(text))
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
    assert float(text) == lessons.layer_weight()
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
    assert [r["format"] for r in explorer.table_rows] == list(F.FORMATS)
    for name, row in zip(F.FORMATS, explorer.table_rows):
        d = explain.decompose(1e-8, name)
        assert row == explain.stored_row(1e-8, d, name)
        assert row["stored value, exactly"] == explain.exact_decimal(d.value)
        assert row["bits"] == F.to_bits(1e-8, name)
        for cell in (row["stored value, exactly"], d.kind, f"{d.rel_error:.3g}",
                     f"{F.ulp(d.value, name):.3g}"):
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


# --- plots.ulp_plot --------------------------------------------------------------------------

def lines_by_gid(ax) -> dict:
    return {line.get_gid(): line for line in ax.lines}


def test_ulp_plot_draws_each_format_as_a_staircase_of_its_ulps():
    fig = plots.ulp_plot(0.1, pyplot=False)
    whole, closeup = fig.axes
    lines = lines_by_gid(whole)
    for name, f in F.FORMATS.items():
        xs, ys = (list(a) for a in lines[f"ulp-{name}"].get_data())
        assert xs[0] == float(f.min_subnormal) and xs[-1] == float(f.max_finite)
        assert ys == [F.ulp(x, name) for x in xs]
        for attr in ("min_subnormal", "min_normal", "max_finite"):  # underflow / overflow edges
            assert lines[f"edge-{name}-{attr}"].get_xdata()[0] == float(getattr(f, attr))
    lo, hi = closeup.get_xlim()
    assert lo < float(F.FORMATS["fp16"].min_subnormal) and hi > float(F.FORMATS["fp16"].max_finite)


def test_ulp_plot_marks_x_on_every_curve_that_holds_it():
    fig = plots.ulp_plot(1e-8, pyplot=False)
    lines = lines_by_gid(fig.axes[0])
    assert list(lines["ulp-marker-line"].get_xdata()) == [1e-8, 1e-8]
    assert list(lines["ulp-marker-fp32"].get_data()) == [[1e-8], [F.ulp(1e-8, "fp32")]]
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
