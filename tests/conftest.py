import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLBACKEND", "Agg")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session")
def tiny():
    """The bundled model and tokenizer, fp32 on the CPU."""
    from kvlab import models

    return models.load("kvlab-tiny", device="cpu")


def expect_rejected(check, impl, *needles):
    """``check(impl)`` must raise AssertionError whose message contains every needle (case-insensitive)."""
    with pytest.raises(AssertionError) as err:
        check(impl)
    msg = str(err.value).lower()
    for n in needles:
        assert n.lower() in msg, f"message does not mention {n!r}: {err.value}"
    return str(err.value)
