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
