"""Helpers that many test modules share, each defined once (fixtures live in conftest.py).

Import them by module name: pytest puts this folder on ``sys.path`` (``from utils import raises``).
"""

import inspect
import math
import re
import sys
import types

import pytest
import torch


def raises(exc, call, *needles):
    """``call()`` raises ``exc`` whose message contains every needle (case-insensitive); returns the message."""
    with pytest.raises(exc) as err:
        call()
    msg = str(err.value).lower()
    for n in needles:
        assert n.lower() in msg, f"message does not mention {n!r}: {err.value}"
    return str(err.value)


def expect_rejected(check, impl, *needles):
    """A grader ``check(impl)`` must fail (AssertionError) with a message that contains every needle
    (case-insensitive)."""
    return raises(AssertionError, lambda: check(impl), *needles)


def own_copy(obj):
    """A copy of a kvlab function or class defined outside kvlab, as a learner's own would be (the
    graders refuse the library's code, and code that calls it): the source of its whole module run
    again as a module of its own, and so are the kvlab modules it takes helpers from (input checks,
    config readers), so every helper it calls is a copy too."""
    return getattr(_copied_module(obj.__module__), obj.__name__)


def _copied_module(name: str):
    source = sys.modules[name]
    copy_name = f"own_copy_of_{name.replace('.', '_')}"
    module = sys.modules.get(copy_name)
    if module is not None:
        return module
    module = types.ModuleType(copy_name)   # a real module (torch.compile looks functions' modules up)
    module.__package__ = source.__package__               # its relative imports still resolve
    sys.modules[copy_name] = module                       # before the helpers: modules that import each other
    code = compile(inspect.getsource(source), f"<own copy of {name}>", "exec")
    exec(code, module.__dict__)  # noqa: S102 - the library's own source, for the tests
    for key, value in list(vars(module).items()):         # helpers taken from other kvlab modules: copies too
        if inspect.ismodule(value) and value.__name__.startswith("kvlab.") and value.__name__ != name:
            module.__dict__[key] = _copied_module(value.__name__)
        elif (inspect.isfunction(value) or inspect.isclass(value)) and \
                getattr(value, "__module__", "").startswith("kvlab.") and value.__module__ != name:
            module.__dict__[key] = getattr(_copied_module(value.__module__), value.__name__)
    return module


def one_step_removed(fn) -> dict:
    """The library's ``fn`` reached without its name in the learner's code (issue 34, kind 1): looked up
    on its module inside a lambda, and bound as a default argument. Either is the library's code run
    on the learner's behalf; only a check that watches what runs sees it."""
    module = sys.modules[fn.__module__]
    through_module = lambda *args, **kwargs: getattr(module, fn.__name__)(*args, **kwargs)  # noqa: E731

    def default_argument(*args, _impl=fn, **kwargs):
        return _impl(*args, **kwargs)
    return {"an attribute of its module, in a lambda": through_module, "a default argument": default_argument}


# Code that hands a learner the fix (issue 34): an attribute or method of the learner's own object, a
# slice, a call of a builtin that picks or orders (min, max, list, reversed, popitem), index arithmetic,
# a torch call. A grader's message names the mistake and the rule in words, not the line that fixes it.
_FIX_AS_CODE = re.compile(r"\bself\.\w+|\[[^\]]*:[^\]]*\]|popitem|\b(reversed|min|max|list|sorted)\(|\w \+?//|"
                          r"\w+ % \w+|\btorch\.\w+\(|\.(append|pop|expand|repeat|cumsum|amin|amax|clamp)\(")


def hands_over_code(message: str) -> list[str]:
    """The pieces of ``message`` that read as code fixing the mistake (empty: none)."""
    return [m.group(0) for m in _FIX_AS_CODE.finditer(message)]


def attention_without_mask(q, k, v, past_len):
    """Lab 3's attention contract with the causal mask forgotten (article C's prefill bug): every
    query sees every key, the future included."""
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), -1) @ v
