"""Every piece of kvlab a chapter shows (a ``literalinclude`` with ``:pyobject:``) names that chapter
in its docstring, so a reader of the library knows where it is explained and an editor knows
which page changes with it."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

BOOK = Path(__file__).resolve().parent.parent / "book"
# a literalinclude of a kvlab module, its option lines (":name: value"), among them :pyobject:
INCLUDE = re.compile(r"```\{literalinclude\}\s+\.\./kvlab/(\w+)\.py\s*\n(?::\w+:.*\n)*?:pyobject:\s*([\w.]+)")


def included_objects():
    """(chapter number, module, dotted object name) for every ``:pyobject:`` include in the book."""
    out = []
    for page in sorted(BOOK.glob("ch[0-9][0-9]_*.md")):
        chapter = int(page.name[2:4])
        out += [(chapter, mod, obj) for mod, obj in INCLUDE.findall(page.read_text())]
    return out


def test_the_book_includes_library_code():
    assert len(included_objects()) >= 10


@pytest.mark.parametrize("chapter, module, name", included_objects(),
                         ids=lambda x: str(x))
def test_included_object_names_its_chapter(chapter, module, name):
    obj = importlib.import_module(f"kvlab.{module}")
    for part in name.split("."):
        obj = getattr(obj, part)
    doc = inspect.getdoc(obj) or ""
    assert re.search(rf"\bchapters? (\d+[, and]+)*{chapter}\b", doc, re.I), (
        f"kvlab.{module}.{name} is shown in chapter {chapter}; its docstring must say so "
        f"(e.g. '... (chapter {chapter})'), got: {doc[:120]!r}")


# ---------------------------------------------------------------------------------------------------
# Issue 37, in the sources (the built pages are checked by tests/check_built_book.py): each chapter
# ends with what to take away and "Now do lab N"; each lab links back; chapters link each other.

CHAPTERS = sorted(BOOK.glob("ch[0-9][0-9]_*.md"))
ROOT = BOOK.parent


def _prose(text: str) -> str:
    """The Markdown outside code cells, math blocks, headings and inline code."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"^#.*$", "", text, flags=re.M)                 # headings stay plain (the sidebar)
    text = re.sub(r"\$\$.*?\$\$", "", text, flags=re.S)
    return re.sub(r"`[^`\n]*`", "", text)


@pytest.mark.parametrize("page", CHAPTERS, ids=lambda p: p.stem)
def test_a_chapter_ends_with_take_away_and_its_lab(page):
    n = int(page.name[2:4])
    text = page.read_text()
    tail = text[text.rfind("## What to take away"):]
    assert "## What to take away" in text, f"{page.name}: no '## What to take away' section"
    bullets = re.findall(r"^\* ", tail, re.M)
    assert 3 <= len(bullets) <= 8, f"{page.name}: {len(bullets)} take-away bullets (3 to 5 lines of ideas)"
    lab = next(ROOT.glob(f"labs/lab{n:02d}_*.ipynb"))
    assert f"**Now do [lab {n}](../labs/{lab.name}).**" in tail, f"{page.name}: no 'Now do lab {n}' link"


@pytest.mark.parametrize("page", CHAPTERS, ids=lambda p: p.stem)
def test_a_chapter_links_the_chapters_it_mentions(page):
    own = int(page.name[2:4])
    plain = [m for m in re.findall(r"(?<![\[<\w`])[Cc]hapter (\d)\b(?!\]| <)", _prose(page.read_text()))
             if int(m) != own]
    assert not plain, f"{page.name}: 'chapter {plain[0]}' is plain text; write {{doc}}`chapter N <chNN_slug>`"


@pytest.mark.parametrize("lab", sorted(ROOT.glob("solutions/lab[0-9][0-9]_*.ipynb")), ids=lambda p: p.stem)
def test_a_lab_links_back_to_its_chapter(lab):
    import json
    n = lab.name[3:5]
    chapter = next(BOOK.glob(f"ch{n}_*.md"))
    first = next(c for c in json.loads(lab.read_text())["cells"] if c["cell_type"] == "markdown")
    assert f"](../book/{chapter.name})" in "".join(first["source"]), f"{lab.name}: no link back to {chapter.name}"
    generated = ROOT / "labs" / lab.name
    assert f"](../book/{chapter.name})" in generated.read_text(), f"labs/{lab.name}: regenerate labs/"
