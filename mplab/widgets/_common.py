"""What every lesson's widgets share: errors shown in the widget, figures as PNG bytes, and a
static first view for pages rendered without a kernel."""

from __future__ import annotations

import base64
import functools
import html
import io

import ipywidgets as widgets

__all__ = ["guarded", "png", "StaticView", "static_html"]


def guarded(callback):
    """Wrap a widget callback: a learner's click or keystroke must never raise into the
    kernel, so an exception is shown in the widget's `message` instead."""
    @functools.wraps(callback)
    def run(self, *args):
        try:
            callback(self, *args)
        except Exception as e:  # shown in the widget, not lost in a log
            text = f"Something went wrong: {type(e).__name__}: {e}"
            self.message.value = f'<span style="color:#b00020">{html.escape(text)}</span>'
    return run


def png(fig) -> bytes:
    """A matplotlib figure as PNG bytes, for a widgets.Image."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


class StaticView:
    """Mixed into a widget: its display also carries `static_html(self)` as text/html.

    JupyterLab draws the live widget (the widget view outranks HTML there); nbconvert, GitHub
    and a notebook opened without its kernel have no widget state and fall back to the HTML,
    so a rendered lesson shows the widget's first view (its figure, table and code), not
    "PrecisionExplorer(children=...)"."""

    def _repr_mimebundle_(self, **kwargs):
        bundle = super()._repr_mimebundle_(**kwargs)
        bundle["text/html"] = static_html(self)
        return bundle


def static_html(widget: widgets.Widget) -> str:
    """What `widget` shows now, as plain HTML: text and tables as they are, figures as
    embedded PNGs, controls as disabled look-alikes showing their value, an accordion as
    <details> (closed, as the widget starts)."""
    if widget.layout.display == "none" or widget.layout.visibility == "hidden":
        return ""
    if isinstance(widget, widgets.Accordion):
        titles = widget.titles or ()
        return "".join(f"<details><summary>{html.escape(titles[i] if i < len(titles) else '')}"
                       f"</summary>{static_html(child)}</details>"
                       for i, child in enumerate(widget.children))
    if isinstance(widget, widgets.Box):
        row = isinstance(widget, widgets.HBox)
        style = "display:flex;gap:6px;align-items:center;flex-wrap:wrap" if row else ""
        return f'<div style="{style}">' + "".join(map(static_html, widget.children)) + "</div>"
    if isinstance(widget, (widgets.HTML, widgets.HTMLMath)):
        return f"<div>{widget.value}</div>" if widget.value else ""
    if isinstance(widget, widgets.Image):
        if not widget.value:
            return ""
        data = base64.b64encode(widget.value).decode("ascii")
        return f'<img src="data:image/{widget.format};base64,{data}" style="max-width:100%">'
    label = f"{html.escape(widget.description)} " if getattr(widget, "description", "") else ""
    if isinstance(widget, (widgets.Button, widgets.ToggleButton)):
        return f"<button disabled>{label.strip()}</button>"
    if isinstance(widget, widgets.widget_selection._Selection):  # dropdowns, toggle buttons
        return (f"<span>{label}<select disabled><option selected>{html.escape(str(widget.label))}"
                "</option></select></span>")
    if isinstance(widget, widgets.IntProgress):
        bar = f'<progress value="{widget.value}" max="{widget.max}"></progress>'
        return f"<span>{label}{bar}</span>"
    if isinstance(widget, widgets.Text):
        return f'<span>{label}<input disabled value="{html.escape(widget.value)}"></span>'
    if hasattr(widget, "value"):  # sliders and the like, shown as their readout shows them
        try:
            text = format(widget.value, getattr(widget, "readout_format", ""))
        except (TypeError, ValueError):
            text = str(widget.value)
        return f"<span>{label}<b>{html.escape(text)}</b></span>"
    return ""
