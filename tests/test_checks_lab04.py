"""The lab-4 graders accept the reference and reject each known mistake with a pointed message."""

import math

import pytest
import torch

from kvlab.course.checks import check_kv_cache_bytes, check_max_batch_size

from utils import expect_rejected, one_step_removed, own_copy


def _shape(config):
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return layers, heads, kv, head_dim


def correct(config, seq_len, batch_size, dtype):
    layers, _, kv, head_dim = _shape(config)
    return 2 * layers * kv * head_dim * seq_len * batch_size * dtype.itemsize


def no_factor_2(config, seq_len, batch_size, dtype):
    layers, _, kv, head_dim = _shape(config)
    return layers * kv * head_dim * seq_len * batch_size * dtype.itemsize


def no_layers(config, seq_len, batch_size, dtype):
    # article B: 2 x batch x seq_len x n_heads x head_dim x bytes, the size of ONE layer
    _, _, kv, head_dim = _shape(config)
    return 2 * kv * head_dim * seq_len * batch_size * dtype.itemsize


def query_heads(config, seq_len, batch_size, dtype):
    layers, heads, _, head_dim = _shape(config)
    return 2 * layers * heads * head_dim * seq_len * batch_size * dtype.itemsize


def fixed_two_bytes(config, seq_len, batch_size, dtype):
    layers, _, kv, head_dim = _shape(config)
    return 2 * layers * kv * head_dim * seq_len * batch_size * 2


def hidden_over_heads(config, seq_len, batch_size, dtype):
    layers, heads, kv, _ = _shape(config)
    return 2 * layers * kv * (config.hidden_size // heads) * seq_len * batch_size * dtype.itemsize


def returns_float(config, seq_len, batch_size, dtype):
    return float(correct(config, seq_len, batch_size, dtype))


def finfo_bits(config, seq_len, batch_size, dtype):
    layers, _, kv, head_dim = _shape(config)
    return 2 * layers * kv * head_dim * seq_len * batch_size * torch.finfo(dtype).bits // 8


def mb(config, seq_len, dtype, free_bytes):
    return free_bytes // correct(config, seq_len, 1, dtype)


def rounds_up(config, seq_len, dtype, free_bytes):
    return math.ceil(free_bytes / correct(config, seq_len, 1, dtype))


def strict_fit(config, seq_len, dtype, free_bytes):
    per = correct(config, seq_len, 1, dtype)
    b = 0
    while (b + 1) * per < free_bytes:   # '<' where '<=' belongs
        b += 1
    return b


def float_batch(config, seq_len, dtype, free_bytes):
    return free_bytes / correct(config, seq_len, 1, dtype)


def test_accepts_reference(capsys):
    check_kv_cache_bytes(correct)
    check_max_batch_size(mb)
    out = capsys.readouterr().out
    assert "PASSED check_kv_cache_bytes" in out and "PASSED check_max_batch_size" in out


def test_refuses_library_accepts_a_copy(capsys):
    """The library's own functions are refused (write your own); a copy of their code passes."""
    from kvlab.memory import kv_cache_bytes, max_batch_size

    expect_rejected(check_kv_cache_bytes, kv_cache_bytes, "kvlab.memory.kv_cache_bytes",
                    "write it yourself")
    expect_rejected(check_max_batch_size, max_batch_size, "library's own")
    check_kv_cache_bytes(own_copy(kv_cache_bytes))
    check_max_batch_size(own_copy(max_batch_size))
    assert capsys.readouterr().out.count("PASSED") == 2


@pytest.mark.parametrize("impl, needles", [
    (no_factor_2, ["keys and values", "multiply by 2"]),
    (no_layers, ["one layer", "article b", "layer count"]),
    (query_heads, ["query heads", "num_key_value_heads"]),
    (fixed_two_bytes, ["2 bytes per element", "itemsize"]),
    (hidden_over_heads, ["sets head_dim explicitly"]),
    (returns_float, ["return a python int"]),
    (finfo_bits, ["int8", "itemsize"]),
])
def test_rejects_kv_cache_bytes(impl, needles):
    expect_rejected(check_kv_cache_bytes, impl, *needles)


@pytest.mark.parametrize("impl, needles", [
    (rounds_up, ["rounded the batch up", "round down"]),
    (strict_fit, ["exactly", "does fit"]),
    (float_batch, ["return a python int"]),
])
def test_rejects_max_batch_size(impl, needles):
    expect_rejected(check_max_batch_size, impl, *needles)


# ------------------------------------------------ issue 18: configs without head_dim, max_seq_len

from kvlab.course.checks import check_max_seq_len  # noqa: E402
from kvlab.memory import kv_cache_bytes as reference_bytes

reference_bytes = own_copy(reference_bytes)


def head_dim_attribute(config, seq_len, batch_size, dtype):
    """Reads config.head_dim directly: Qwen2-style configs have no such attribute."""
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv * config.head_dim * seq_len * batch_size * dtype.itemsize


def head_dim_default(config, seq_len, batch_size, dtype):
    """getattr with a default still returns None when the config sets head_dim=None (Mixtral)."""
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    hd = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    return 2 * config.num_hidden_layers * kv * hd * seq_len * batch_size * dtype.itemsize


@pytest.mark.parametrize("impl, needles", [
    (head_dim_attribute, ["raised AttributeError"]),
    (head_dim_default, ["raised TypeError"]),
])
def test_rejects_configs_without_head_dim(impl, needles):
    expect_rejected(check_kv_cache_bytes, impl, *needles)


def max_seq_len(config, batch_size, dtype, free_bytes, cap=True, ceil=False):
    per = reference_bytes(config, 1, batch_size, dtype)
    n = -(-free_bytes // per) if ceil else free_bytes // per
    return min(n, config.max_position_embeddings) if cap else n


def test_max_seq_len():
    check_max_seq_len(max_seq_len)
    expect_rejected(check_max_seq_len, lambda *a: max_seq_len(*a, cap=False), "context")
    expect_rejected(check_max_seq_len, lambda *a: max_seq_len(*a, ceil=True), "round down")
    expect_rejected(check_max_seq_len, lambda *a: float(max_seq_len(*a)), "int")


# ------------------------------------------------ issue 24: an explicit head_dim, stale answers

def mb_hidden_over_heads(config, seq_len, dtype, free_bytes):
    return free_bytes // hidden_over_heads(config, seq_len, 1, dtype)


def seq_hidden_over_heads(config, batch_size, dtype, free_bytes):
    per = hidden_over_heads(config, 1, batch_size, dtype)
    return min(free_bytes // per, config.max_position_embeddings)


_SEEN: dict = {}


def bytes_remembered_per_config_class(config, seq_len, batch_size, dtype):
    """Remembers the first answer per config object: the same config asked twice shows it."""
    key = (type(config).__name__, id(config))
    return _SEEN.setdefault(key, correct(config, seq_len, batch_size, dtype))


def test_rejects_hidden_over_heads_in_batch_and_length():
    expect_rejected(check_max_batch_size, mb_hidden_over_heads, "sets head_dim = 256 explicitly")
    expect_rejected(check_max_seq_len, seq_hidden_over_heads, "sets head_dim = 256 explicitly")


def test_rejects_a_remembered_answer():
    _SEEN.clear()
    expect_rejected(check_kv_cache_bytes, bytes_remembered_per_config_class, "twice the tokens")


def test_the_library_one_step_removed_is_refused_by_what_runs():
    """Issue 34, kind 1, in lab 4: the library's byte count without its name is refused, and so is a
    max_batch_size built on it (a default argument); built on the learner's own count it passes (above)."""
    from kvlab import memory

    for how, impl in one_step_removed(memory.kv_cache_bytes).items():
        expect_rejected(check_kv_cache_bytes, impl, "ran kvlab.memory.kv_cache_bytes", "write it yourself")

    def max_batch(config, seq_len, dtype, free_bytes, _bytes=memory.kv_cache_bytes):
        return free_bytes // _bytes(config, seq_len, 1, dtype)
    expect_rejected(check_max_batch_size, max_batch, "ran kvlab.memory.kv_cache_bytes", "from max_batch (line")
