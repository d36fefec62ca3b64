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


@pytest.fixture(scope="module")
def ours(tiny):
    """Chapter 3's hand-built GPT-2 (``kvlab.gpt2.GPT2.from_hf``) with the bundled model's weights, fp32 on
    the CPU; one per test module, so a module that compiles or wraps it never shares it with another."""
    from kvlab.gpt2 import GPT2

    return GPT2.from_hf(tiny[0])
