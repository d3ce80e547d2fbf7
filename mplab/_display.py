"""A small table record that prints as text and renders as HTML in a notebook."""

from __future__ import annotations

import html
import math

__all__ = ["Table"]


def _cell(v) -> str:
    if isinstance(v, float):
        if v == 0 or not math.isfinite(v):
            return repr(v)
        return f"{v:.6g}" if 1e-4 <= abs(v) < 1e7 else f"{v:.4g}"
    return str(v)


class Table:
    """Rows of dicts with the same keys; `rows` stays plain data for code and tests."""

    def __init__(self, rows: list[dict], title: str = "", note: str = ""):
        self.rows = list(rows)
        self.title = title
        self.note = note  # what the rows say, in words, shown under them

    @property
    def columns(self) -> list[str]:
        return list(self.rows[0]) if self.rows else []

    def column(self, name: str) -> list:
        return [r[name] for r in self.rows]

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

    def __str__(self) -> str:
        cols = self.columns
        cells = [[_cell(r[c]) for c in cols] for r in self.rows]
        widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
        line = "  ".join(c.ljust(w) for c, w in zip(cols, widths))
        out = ([self.title] if self.title else []) + [line, "-" * len(line)]
        out += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
        return "\n".join(out + ([self.note] if self.note else []))

    __repr__ = __str__

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(_cell(r[c]))}</td>" for c in self.columns) + "</tr>"
            for r in self.rows)
        caption = f"<caption>{html.escape(self.title)}</caption>" if self.title else ""
        note = f"<p>{html.escape(self.note)}</p>" if self.note else ""
        return (f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
                + note)
