"""Lab 7 graders: every mistake the issue lists is rejected by name; unusual correct answers pass."""

import numpy as np
import pytest
import torch

from conftest import expect_rejected
from kvlab.checks import check_decode_step_bytes, check_step_time_floor
from kvlab.roofline import decode_step_flops


def _kv(model, B, S, heads_field=("num_key_value_heads", "num_attention_heads"), itemsize=None):
    cfg = model.config
    heads = next(getattr(cfg, f) for f in heads_field if getattr(cfg, f, None))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    item = itemsize or next(model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * heads * head_dim * S * B * item


def _weights(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


def right(model, B, S):
    return _weights(model) + _kv(model, B, S)


# ---- decode_step_bytes: the wrong ones, each with the words its message must contain

WRONG_BYTES = {
    "weights once per row": (lambda m, B, S: _weights(m) * B + _kv(m, B, S), ["once per row"]),
    "cache left out": (lambda m, B, S: _weights(m), ["left the KV cache out"]),
    "cache for one row": (lambda m, B, S: _weights(m) + _kv(m, 1, S), ["cache of ONE row"]),
    "tied head twice (state_dict)": (
        lambda m, B, S: sum(t.numel() * t.element_size() for t in m.state_dict().values()) + _kv(m, B, S),
        ["tied LM head twice"]),
    "parameters, not bytes": (
        lambda m, B, S: sum(p.numel() for p in m.parameters()) + _kv(m, B, S, itemsize=1),
        ["parameters", "not bytes"]),
    "query heads": (lambda m, B, S: _weights(m) + _kv(m, B, S, heads_field=("num_attention_heads",)),
                    ["QUERY heads", "num_key_value_heads"]),
    "fp32 assumed": (lambda m, B, S: 4 * sum(p.numel() for p in m.parameters()) + _kv(m, B, S, itemsize=4),
                     ["4 bytes"]),
    "returns a float": (lambda m, B, S: float(right(m, B, S)), ["Python int"]),
    "off by the position table": (lambda m, B, S: right(m, B, S) - 1, ["off by -1"]),
}


@pytest.mark.parametrize("name", WRONG_BYTES)
def test_bytes_mistakes_rejected_by_name(name):
    impl, needles = WRONG_BYTES[name]
    expect_rejected(check_decode_step_bytes, impl, *needles)


def test_bytes_learner_exception_is_wrapped():
    def broken(model, B, S):
        return model.config.n_layer   # Llama configs have no n_layer
    msg = expect_rejected(check_decode_step_bytes, broken, "raised AttributeError", "batch")
    assert "llama" in msg.lower() or "Llama" in msg


def test_bytes_data_ptr_dedup_on_meta_is_explained():
    def by_data_ptr(model, B, S):
        seen = {p.data_ptr(): p for _, p in model.named_parameters(remove_duplicate=False)}
        return sum(p.numel() * p.element_size() for p in seen.values()) + _kv(model, B, S)
    expect_rejected(check_decode_step_bytes, by_data_ptr, "meta device", "data_ptr")


# ---- unusual correct ones

def numpy_ints(model, B, S):
    return np.int64(_weights(model)) + np.int64(_kv(model, B, S))


def named_parameters_dedup(model, B, S):
    # storage address where there is storage; identity on the meta device (every data_ptr is 0 there)
    seen = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[p.data_ptr() if p.device.type != "meta" else id(p)] = p
    return sum(p.numel() * p.element_size() for p in seen.values()) + _kv(model, B, S)


def with_kvlab_memory(model, B, S):
    from kvlab.memory import kv_cache_bytes
    dtype = next(model.parameters()).dtype
    return model.num_parameters() * dtype.itemsize + kv_cache_bytes(model.config, S, B, dtype)


@pytest.mark.parametrize("impl", [right, numpy_ints, named_parameters_dedup, with_kvlab_memory])
def test_bytes_unusual_correct_pass(impl, capsys):
    check_decode_step_bytes(impl)
    assert "PASSED" in capsys.readouterr().out


# ---- step_time_floor

def floor(model, B, S, bw, fl):
    return max(right(model, B, S) / bw, decode_step_flops(model, B, S) / fl)


WRONG_FLOOR = {
    "min": (lambda m, B, S, bw, fl: min(right(m, B, S) / bw, decode_step_flops(m, B, S) / fl), ["SMALLER"]),
    "sum": (lambda m, B, S, bw, fl: right(m, B, S) / bw + decode_step_flops(m, B, S) / fl, ["added"]),
    "milliseconds": (lambda m, B, S, bw, fl: 1e3 * floor(m, B, S, bw, fl), ["milliseconds"]),
    "no cache": (lambda m, B, S, bw, fl: max(_weights(m) / bw, decode_step_flops(m, B, S) / fl), ["cache out"]),
    "swapped rates": (lambda m, B, S, bw, fl: max(right(m, B, S) / fl, decode_step_flops(m, B, S) / bw),
                      ["check decode_step_bytes first"]),
    "a tensor": (lambda m, B, S, bw, fl: torch.tensor(floor(m, B, S, bw, fl)), ["float number of seconds"]),
}


@pytest.mark.parametrize("name", WRONG_FLOOR)
def test_floor_mistakes_rejected_by_name(name):
    impl, needles = WRONG_FLOOR[name]
    expect_rejected(check_step_time_floor, impl, *needles)


def numpy_floor(model, B, S, bw, fl):
    return np.maximum(np.float64(right(model, B, S)) / bw, decode_step_flops(model, B, S) / np.float32(fl))


@pytest.mark.parametrize("impl", [floor, numpy_floor])
def test_floor_unusual_correct_pass(impl, capsys):
    check_step_time_floor(impl)
    assert "PASSED" in capsys.readouterr().out
