import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLBACKEND", "Agg")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session")
def tiny():
    """The bundled model and tokenizer, fp32 on the CPU."""
    from kvlab import loading

    return loading.load("kvlab-tiny", device="cpu")


def expect_rejected(check, impl, *needles):
    """``check(impl)`` must raise AssertionError whose message contains every needle (case-insensitive)."""
    with pytest.raises(AssertionError) as err:
        check(impl)
    msg = str(err.value).lower()
    for n in needles:
        assert n.lower() in msg, f"message does not mention {n!r}: {err.value}"
    return str(err.value)


def own_copy(obj):
    """A copy of a kvlab function or class defined outside kvlab, as a learner's own would be (the
    graders refuse the library's code, and code that calls it): the source of its whole module run
    again as a module of its own, and so are the kvlab modules it takes helpers from (input checks,
    config readers), so every helper it calls is a copy too."""
    return getattr(_copied_module(obj.__module__), obj.__name__)


def _copied_module(name: str):
    import inspect
    import sys
    import types

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
