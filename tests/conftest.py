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
    again as a module of its own, so the helpers it calls are copies too."""
    import inspect
    import sys
    import types

    source = sys.modules[obj.__module__]
    name = f"own_copy_of_{source.__name__.replace('.', '_')}"
    module = sys.modules.get(name)
    if module is None:            # a real module (torch.compile looks functions' modules up)
        module = types.ModuleType(name)
        module.__package__ = source.__package__            # its relative imports still resolve
        sys.modules[name] = module
        code = compile(inspect.getsource(source), f"<own copy of {source.__name__}>", "exec")
        exec(code, module.__dict__)  # noqa: S102 - the library's own source, for the tests
    return getattr(module, obj.__name__)
