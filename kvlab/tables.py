"""Tables that fit the page: rows shown as an HTML table in a notebook, as aligned text elsewhere.

A table printed with f-strings is as wide as its widest row and, on a book page, hides its right-hand
columns behind a scroll bar. :func:`show` hands the rows to the notebook as HTML (and Markdown), so the
page lays them out in its column and wraps long cells; in a terminal or a test the same call prints
plain aligned text.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field


_NUMBER = re.compile(r"[+-]?[\d,]*\.?\d+(e[+-]?\d+)?\s*(x|%|ms|s|µs|[KMG]i?B)?\*?")


def _numeric(value) -> bool:
    """A number, or text that shows one ("1,024", "2.5x", "12%", "3.1 MiB"): right-aligned."""
    if isinstance(value, bool):
        return False
    return isinstance(value, (int, float)) or (isinstance(value, str) and bool(_NUMBER.fullmatch(value.strip())))


def _cell(value, fmt) -> str:
    if fmt is not None and value is not None and value != "":
        return fmt(value) if callable(fmt) else format(value, fmt)
    if isinstance(value, bool) or value is None:
        return "" if value is None else str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def signed_pct(x: float, digits: int = 2) -> str:
    """A relative change as a signed percentage, ``"+0.31%"``; one that rounds to zero at ``digits``
    is ``"0.00%"``, never ``"-0.00%"``."""
    text = f"{x:+.{digits}%}"
    return text[1:] if float(text[1:-1]) == 0 else text


_JOINT = re.compile(r"(?<=\w{3})([/_])(?=\w{3})")


def _breakable(text: str) -> str:
    """``text`` escaped for HTML, with a line-break opportunity (``<wbr>``) after a slash or an
    underscore joining two words ("measured/floor", "e2e_p90"): a header may wrap there, never inside
    a word (the page's CSS forbids that)."""
    return _JOINT.sub(r"\1<wbr>", html.escape(text))


@dataclass
class Table:
    """Rows of text cells under a header; its repr is the notebook's (HTML) or the console's (text)."""

    header: list[str]
    rows: list[list[str]]
    caption: str = ""
    align: list[str] = field(default_factory=list)
    collapsed: bool = False

    def _repr_html_(self) -> str:
        e = html.escape
        cap = f"<caption>{e(self.caption)}</caption>" if self.caption else ""
        head = "".join(f'<th style="text-align:{a}">{_breakable(h)}</th>' for h, a in zip(self.header, self.align))
        body = "".join("<tr>" + "".join(f'<td style="text-align:{a}">{e(c)}</td>'
                                        for c, a in zip(r, self.align)) + "</tr>" for r in self.rows)
        table = (f'<table class="kvlab-table">{"" if self.collapsed else cap}<thead><tr>{head}</tr></thead>'
                 f"<tbody>{body}</tbody></table>")
        if self.collapsed:   # one line on the page; the rows one click away
            summary = e(self.caption or f"{len(self.rows)} rows")
            return f'<details class="kvlab-table"><summary>{summary}</summary>{table}</details>'
        return table

    def _repr_markdown_(self) -> str:
        def line(cells):
            return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
        rule = "|" + "|".join("---:" if a == "right" else "---" for a in self.align) + "|"
        text = "\n".join([line(self.header), rule] + [line(r) for r in self.rows])
        return f"{self.caption}\n\n{text}" if self.caption else text

    def __str__(self) -> str:
        width = [max(len(c) for c in col) for col in zip(self.header, *self.rows)]

        def line(cells):
            return "  ".join(c.rjust(w) if a == "right" else c.ljust(w)
                             for c, w, a in zip(cells, width, self.align)).rstrip()
        out = [line(self.header), "  ".join("-" * w for w in width)] + [line(r) for r in self.rows]
        return "\n".join(([self.caption] if self.caption else []) + out)

    __repr__ = __str__


def in_notebook() -> bool:
    """Whether this code runs in a Jupyter kernel (a notebook, or a book page being executed), where
    rich output (HTML) is shown; False in a terminal, a script or a test. The one such check of kvlab
    (:mod:`kvlab.progress` asks it before deciding whether anyone watches)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return getattr(get_ipython(), "kernel", None) is not None


def show(rows, columns=None, caption: str = "", formats: dict | None = None, display: bool = True,
         collapsed: bool = False) -> Table | None:
    """Show ``rows`` as a table and return it.

    ``rows``: dicts (the union of their keys, in order of appearance, is the header unless
    ``columns`` names the columns to show) or sequences (then ``columns`` names them). ``columns``
    may map each column to the header to print (``{"ms": "median ms"}``): rows keep short keys.
    ``formats`` maps a column to a format spec (``".2f"``) or a function; floats default to 4
    significant digits. Numbers are right-aligned. In a notebook the table is displayed as HTML
    (``collapsed``: folded under its caption, for a long table whose gist a line above states), else
    printed, and nothing is returned (a cell ending in ``show(...)`` would show it twice);
    ``display=False`` only returns it.
    """
    rows, formats = list(rows), formats or {}
    headers = [str(h) for h in columns.values()] if isinstance(columns, dict) else None
    if rows and isinstance(rows[0], dict):
        columns = list(columns or dict.fromkeys(k for r in rows for k in r))
        rows = [[r.get(c) for c in columns] for r in rows]
    elif columns is None:
        raise ValueError("rows that are not dicts need columns=[...] to name them")
    columns = [str(c) for c in columns]
    if any(len(r) != len(columns) for r in rows):
        raise ValueError(f"every row needs {len(columns)} cells (one per column: {columns})")
    numeric = [all(_numeric(r[i]) for r in rows if r[i] not in (None, ""))
               and any(r[i] not in (None, "") for r in rows) for i in range(len(columns))]
    table = Table(headers or columns, [[_cell(v, formats.get(c)) for v, c in zip(r, columns)] for r in rows], caption,
                  ["right" if n else "left" for n in numeric], collapsed)
    if not display:
        return table
    if in_notebook():
        from IPython.display import display as ipy_display
        ipy_display(table)
    else:
        print(table)
    return None
