"""What every lesson's widgets share: errors shown in the widget, and figures as PNG bytes."""

from __future__ import annotations

import functools
import html
import io


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
