"""kvlab.progress: bars for a person watching, none saved into a page a program executed."""

import types

import IPython
import pytest

from kvlab import progress


def _kernel(monkeypatch, allow_stdin):
    shell = types.SimpleNamespace(kernel=types.SimpleNamespace(_allow_stdin=allow_stdin))
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)


@pytest.mark.parametrize("allow_stdin, shown", [(False, False), (True, True)])
def test_a_kernel_driven_by_a_program_draws_no_bar(monkeypatch, allow_stdin, shown):
    monkeypatch.delenv("KVLAB_PROGRESS", raising=False)
    _kernel(monkeypatch, allow_stdin)
    assert progress.watched() is shown
    assert progress.bar(range(3), desc="x").disable is (not shown)


def test_the_environment_decides_first(monkeypatch):
    _kernel(monkeypatch, True)
    monkeypatch.setenv("KVLAB_PROGRESS", "0")
    assert not progress.watched()
    assert list(progress.bar(range(3))) == [0, 1, 2]       # a disabled bar still iterates
    monkeypatch.setenv("KVLAB_PROGRESS", "1")
    _kernel(monkeypatch, False)
    assert progress.watched()


def test_transformers_loading_bar_follows_the_same_rule(monkeypatch):
    from transformers.utils import logging
    monkeypatch.setenv("KVLAB_PROGRESS", "0")
    bar = logging.tqdm(range(2), desc="Loading weights")
    assert getattr(bar, "disable", True)                   # tqdm disabled (or transformers' empty shim)
    assert list(bar) == [0, 1]
