"""Progress bars for people watching, none in a page nobody watched being made.

A bar drawn while a book page is executed is saved with the page, frozen at the state it was in when
it was first displayed (``0/52``): noise a reader cannot use. A kernel driven by a program
(jupyter-book, nbclient, nbval) refuses input, which no notebook a person runs does; kvlab's bars and
transformers' (``Loading weights``) are switched off in such a kernel. ``KVLAB_PROGRESS=1`` or ``0``
decides instead. Outside a notebook (a script, a terminal) the bars are drawn as usual.
"""

from __future__ import annotations

import os

from tqdm.auto import tqdm

from .tables import in_notebook


def watched() -> bool:
    """Whether a person can see this run's progress bars (see the module's docstring)."""
    env = os.environ.get("KVLAB_PROGRESS", "").strip()
    if env in ("0", "1"):
        return env == "1"
    if not in_notebook():
        return True                                  # a terminal or plain Python: tqdm decides
    from IPython import get_ipython
    return bool(getattr(get_ipython().kernel, "_allow_stdin", True))  # False while nbclient executes a cell


def bar(iterable=None, **kwargs):
    """``tqdm.auto.tqdm(iterable, **kwargs)``, disabled when nobody watches (:func:`watched`)."""
    kwargs["disable"] = kwargs.get("disable", False) or not watched()
    return tqdm(iterable, **kwargs)


def _transformers_hook(factory, args, kwargs):
    kwargs = dict(kwargs)
    kwargs["disable"] = kwargs.get("disable", False) or not watched()
    return factory(*args, **kwargs)


def install() -> None:
    """Route transformers' progress bars (``Loading weights``) through :func:`watched`."""
    try:
        from transformers.utils import logging
    except ImportError:
        return
    if hasattr(logging, "set_tqdm_hook"):
        logging.set_tqdm_hook(_transformers_hook)


install()
