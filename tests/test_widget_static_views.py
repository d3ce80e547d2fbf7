"""A widget's display carries its first view as plain HTML (text/html beside the widget view),
so a lesson rendered without a kernel (nbconvert, GitHub) shows its figure, table and code;
the HTML render of each executed lesson is checked in test_notebooks."""

import base64
import html

import pytest

widgets = pytest.importorskip("ipywidgets", reason="the lessons' widgets are ipywidgets, "
                              "not installed")

from mplab import fixtures  # noqa: E402
from mplab.diagnosis import lab  # noqa: E402
from mplab.widgets._common import StaticView, static_html  # noqa: E402
from mplab.widgets.lesson1 import precision_explorer  # noqa: E402
from mplab.widgets.lesson2 import loss_scale_explorer, swamping_demo  # noqa: E402
from mplab.widgets.lesson3 import scaler_stepper  # noqa: E402
from mplab.widgets.lesson7 import failure_lab  # noqa: E402
from mplab.widgets.training import training_panel  # noqa: E402

WIDGETS = {
    "precision explorer": lambda: precision_explorer(0.1),
    "loss-scale explorer": lambda: loss_scale_explorer(fixtures.lesson_capture()),
    "swamping demo": lambda: swamping_demo(),
    "scaler stepper": lambda: scaler_stepper(),
    "failure lab": lambda: failure_lab("no_scaler"),
}


def shown(widget) -> str:
    bundle = widget._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle  # JupyterLab's live view
    return bundle["text/html"]


def embedded(image: widgets.Image) -> str:
    return base64.b64encode(image.value).decode("ascii")


@pytest.mark.parametrize("name", WIDGETS)
def test_the_static_view_holds_the_widgets_figure_and_table(name):
    widget = WIDGETS[name]()
    page = shown(widget)
    if widget.plot.value:
        assert embedded(widget.plot) in page
    texts = [getattr(widget, name).value for name in ("table", "summary") if hasattr(widget, name)]
    assert texts and all(text in page for text in texts)
    assert widget.__class__.__name__ + "(" not in page  # not its repr


def test_the_failure_labs_static_view_holds_its_loop_code():
    page = shown(failure_lab("no_scaler"))
    assert html.escape(lab.FAILURES["no_scaler"].code) in page
    assert "<details><summary>the loop that runs" in page  # closed, as the accordion starts


def test_the_static_view_is_the_widget_as_it_is_when_shown():
    explorer = precision_explorer(0.1)
    first = shown(explorer)
    explorer.text.value = "2"  # as a learner types
    again = shown(explorer)
    assert again != first and explorer.table.value in again
    assert embedded(explorer.plot) in again


def test_a_panel_started_with_runs_shows_them_before_any_press():
    from mplab.train import train

    run = train(steps=2, batch_size=4, eval_samples=0, progress=False, device="cpu")
    panel = training_panel(steps=5, runs={"fp32": run})
    page = shown(panel)
    assert embedded(panel.plot) in page and f"{run.final_loss:.4f}" in page
    assert panel.rows.rows[0]["final loss"] == f"{run.final_loss:.4f}"
    with pytest.raises(ValueError, match="runs must be TrainResults .* got str"):
        training_panel(steps=5, runs=["fp32"])


def test_controls_show_their_values_and_hidden_parts_are_left_out():
    class Box(StaticView, widgets.VBox):
        pass

    hidden = widgets.HTML("secret", layout=widgets.Layout(display="none"))
    box = Box([widgets.Dropdown(options=[("two", 2), ("three", 3)], value=3,
                                description="pick"),
               widgets.FloatLogSlider(value=1e-4, min=-6, max=0, description="lr"),
               widgets.Button(description="go"), widgets.Text("abc", description="x"),
               widgets.IntProgress(3, max=7), hidden,
               widgets.Accordion([widgets.HTML("<pre>code</pre>")], titles=("the code",))])
    page = static_html(box)
    assert "pick <select disabled><option selected>three</option>" in page
    assert "lr <b>0.0001</b>" in page and "<button disabled>go</button>" in page
    assert 'value="abc"' in page and '<progress value="3" max="7">' in page
    assert "secret" not in page
    assert "<details><summary>the code</summary><div><pre>code</pre></div></details>" in page
    assert shown(box) == page
