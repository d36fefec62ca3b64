"""Argument checks shared by the commands (``python -m kvlab.bench``, ``python -m kvlab.report``).

A bad argument is refused by argparse before anything is loaded or measured: exit status 2 and a
one-line message naming the argument and what it accepts, never a traceback after the work.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

from . import validate


def at_least(minimum: int):
    """An argparse ``type``: an integer >= ``minimum``."""
    def parse(text: str) -> int:
        try:
            return validate.int_from_text(text, "the value", minimum)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err).replace("the value must be an int", "must be an integer")) from None
    parse.__name__ = f"integer >= {minimum}"
    return parse


def positive_seconds(text: str) -> float:
    """An argparse ``type``: a finite number of seconds > 0."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (x > 0 and math.isfinite(x)):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text}")
    return x


def check_writable(path, suffix: str) -> str | None:
    """Why ``path`` (a file ending in ``suffix``) cannot be written here, or None if it can.

    Tried for real, before any work: a file is created and removed in its folder (which is made if
    missing, as the command would), so a read-only place or a file standing where a folder should
    be is found before the first measurement, not after the last.
    """
    path = Path(path).expanduser()
    if path.suffix != suffix:
        return f"must name a {suffix} file, got {str(path)!r}"
    if path.is_dir():
        return f"{path} is a folder; name a {suffix} file inside it (e.g. {path / ('result' + suffix)})"
    blocker = next((p for p in path.parents if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        return f"{blocker} is a file, so {path} cannot be made inside it; pick another folder"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as e:
        return (f"cannot write {path}: creating a file in {path.parent} failed ({e.strerror or e}); "
                "pick a folder you can write")
    return None
