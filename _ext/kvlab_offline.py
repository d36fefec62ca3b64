"""Sphinx extension of the kvlab book: the built HTML needs no network to show its content.

* MathJax is served from the build, not a CDN: `npm ci` installs it (package.json pins it) into
  node_modules/, and this extension copies it to ``_static/mathjax`` and points Sphinx's
  ``mathjax_path`` at it. Without it the build warns (an error under ``-W``) instead of silently
  falling back to the CDN, so a book that would show raw LaTeX offline never passes the tests.
* ipywidgets outputs: no widget manager is loaded from a CDN (``nb_ipywidgets_js`` is emptied in
  _config.yml), and the widget-view mime type is dropped for HTML builders, so a widget's static
  fallback (its ``text/html``, e.g. the memory calculator's table and figure) is what a page shows.

Launch buttons: sphinx-book-theme offers Colab and Binder on every page it deems a notebook,
chapters' MyST ``.md`` files included, and links them to the ``.md`` (Colab cannot open one; Binder
opens it as text). :func:`_no_md_launch` drops every launch link whose target is a ``.md`` file, so a
chapter page has none (its "Now do lab N" link leads to the lab, whose page launches the notebook);
``tests/check_built_book.py`` fails a page that still has one.

Two console errors of the theme stack that the browser test (tests/browser_check.py) caught:
* sphinx-thebe adds its inline config script twice under Jupyter Book 1 (``const THEBE_JS_URL``
  declared twice: a SyntaxError on every page); identical script entries are dropped here;
* pydata-sphinx-theme logs "Got invalid theme mode" on a reader's first visit unless the
  ``default_mode`` context variable is set; it is set to ``auto`` (follow the system).
"""

import shutil
from pathlib import Path

from sphinx.util import logging

ROOT = Path(__file__).resolve().parent.parent
MATHJAX = ROOT / "node_modules" / "mathjax" / "es5"
logger = logging.getLogger(__name__)


def _config_inited(app, config):
    config.html_context.setdefault("default_mode", "auto")
    if (MATHJAX / "tex-mml-chtml.js").exists():
        config.mathjax_path = "mathjax/tex-mml-chtml.js"   # relative: served from _static/
    else:
        logger.warning(f"MathJax not found at {MATHJAX}: run `npm ci` in {ROOT} (the book would "
                       "load MathJax from a CDN and show raw LaTeX offline)")


def _page_context(app, pagename, templatename, context, doctree):
    """Drop repeated script entries: the same file, or the same inline body (filename None or "")."""
    files = context.get("script_files", [])
    seen, unique = set(), []
    for js in files:
        attrs = getattr(js, "attributes", {}) or {}
        key = (getattr(js, "filename", None) or "", str(attrs.get("body", "")))   # None and "" alike
        if key not in seen:
            seen.add(key)
            unique.append(js)
    files[:] = unique


def _no_md_launch(app, pagename, templatename, context, doctree):
    """Remove launch links that open a ``.md`` file (see the module docstring), and an emptied group."""
    buttons = context.get("header_buttons")
    if not buttons:
        return
    for group in [b for b in buttons if b.get("label") == "launch-buttons"]:
        group["buttons"] = [b for b in group.get("buttons", [])
                            if not str(b.get("url", "")).split("?")[0].split("#")[0].endswith(".md")
                            and not str(b.get("url", "")).endswith(".md")]
        if not group["buttons"]:
            buttons.remove(group)


def _build_finished(app, exc):
    if exc is None and app.builder.format == "html" and MATHJAX.exists():
        shutil.copytree(MATHJAX, Path(app.outdir) / "_static" / "mathjax", dirs_exist_ok=True)


def setup(app):
    app.connect("config-inited", _config_inited)
    app.connect("html-page-context", _page_context, priority=900)   # after the others add theirs
    app.connect("html-page-context", _no_md_launch, priority=600)  # after the theme's (501)
    app.connect("build-finished", _build_finished)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
