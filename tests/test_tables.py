"""kvlab.tables: one call shows rows as HTML in a notebook and aligned text elsewhere."""

import pytest

from kvlab import tables


def test_dict_rows_render_as_html_markdown_and_text(capsys):
    rows = [{"cache": "dynamic", "MiB": 12.5, "ok": True}, {"cache": "static <fixed>", "MiB": 3, "ok": False}]
    assert tables.show(rows, caption="memory") is None     # shown once, not also as a cell's result
    printed = capsys.readouterr().out                       # outside a notebook: printed as text
    t = tables.show(rows, caption="memory", display=False)
    assert printed.strip() == str(t)
    lines = str(t).splitlines()
    assert lines[0] == "memory" and lines[1].split() == ["cache", "MiB", "ok"]
    assert lines[3].startswith("dynamic") and "12.5" in lines[3]
    html = t._repr_html_()
    assert "<caption>memory</caption>" in html and "static &lt;fixed&gt;" in html
    assert '<td style="text-align:right">12.5</td>' in html    # numbers right-aligned
    md = t._repr_markdown_()
    assert "| cache | MiB | ok |" in md and "|---|---:|---|" in md


def test_columns_select_and_formats_apply():
    t = tables.show([{"a": 1.23456, "b": 2, "c": "x"}], columns=["c", "a"], formats={"a": ".1f"}, display=False)
    assert t.header == ["c", "a"] and t.rows == [["x", "1.2"]]
    t = tables.show([[1, 0.5]], columns=["n", "share"], formats={"share": lambda v: f"{v:.0%}"}, display=False)
    assert t.rows == [["1", "50%"]]


def test_bad_rows_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="need columns"):
        tables.show([[1, 2]], display=False)
    with pytest.raises(ValueError, match="every row needs 2 cells"):
        tables.show([[1, 2], [3]], columns=["a", "b"], display=False)


def test_a_collapsed_table_is_one_line_until_opened():
    t = tables.show([{"a": i} for i in range(54)], caption="54 caches, all equal", collapsed=True, display=False)
    html = t._repr_html_()
    assert html.startswith('<details class="kvlab-table"><summary>54 caches, all equal</summary><table')
    assert html.count("<tr>") == 55 and "<caption>" not in html


@pytest.mark.parametrize("cell, right", [("1,049,600", True), ("2.50x", True), ("+0.04%", True), ("72.0 MiB*", True),
                                         ("1.8e-06", True), ("per tensor", False), ("True", False), ("", True)])
def test_numbers_shown_as_text_are_right_aligned(cell, right):
    t = tables.show([{"c": cell}, {"c": "3"}], display=False)
    assert t.align == ["right" if right else "left"]


def test_headers_wrap_between_words_never_inside_one():
    """Issue 37: "criti cal batc h". The page's CSS may not break a word of a table (no
    `overflow-wrap: anywhere`, no `word-break: break-all`); a header joined by a slash or an
    underscore gets a break opportunity there instead."""
    from pathlib import Path
    from kvlab import tables
    html = tables.show([{"measured/floor": "1.0x", "e2e_p90": 2.0, "bit/s": 3}], display=False)._repr_html_()
    assert "measured/<wbr>floor" in html and "e2e_<wbr>p90" in html and ">bit/s<" in html
    import re
    css = re.sub(r"/\*.*?\*/", "", (Path(__file__).parents[1] / "_static" / "wrap-code.css").read_text(), flags=re.S)
    rules = [r for r in css.split("}") if "table" in r.split("{")[0]]
    assert rules and not any("anywhere" in r or "break-all" in r for r in rules)


def test_a_change_that_rounds_to_zero_has_no_sign():
    """Issue 37 reread: chapter 5 printed "-0.00%" for a perplexity change of -2e-6."""
    from kvlab.tables import signed_pct
    assert signed_pct(-2e-6) == "0.00%" and signed_pct(2e-6) == "0.00%"
    assert signed_pct(0.0031) == "+0.31%" and signed_pct(-0.0031) == "-0.31%"
    assert signed_pct(-0.00004, digits=3) == "-0.004%"
