"""Lab 7 graders: wrong implementations are rejected with the mistake named (or, when no single
known mistake explains them, with what differs and where); unusual correct ones pass."""

import itertools
import math

import numpy as np
import pytest
import torch

from utils import expect_rejected, hands_over_code, own_copy
from kvlab import memory as _ch4_memory
from kvlab import roofline
from kvlab.course.checks import (check_bound_and_critical, check_decode_step_bytes, check_overhead_fit,
                          check_step_time_floor, check_sweep_plan)
from kvlab.course.checks._common import grading_model
from kvlab.course.checks.lab07 import _BYTE_CASES
from kvlab.roofline import decode_step_flops


# ---- a right answer written as a learner would, and its parts (each mistake changes one)

def _kv(model, B, S, heads_field=("num_key_value_heads", "num_attention_heads"), itemsize=None,
        explicit_head_dim=True):
    cfg = model.config
    heads = next(getattr(cfg, f) for f in heads_field if getattr(cfg, f, None))
    head_dim = (getattr(cfg, "head_dim", None) if explicit_head_dim else None) \
        or cfg.hidden_size // cfg.num_attention_heads
    item = itemsize or next(model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * heads * head_dim * S * B * item


def _tables(model, include_tied=False):
    head = model.get_output_embeddings().weight
    return [m.weight for m in model.modules()
            if isinstance(m, torch.nn.Embedding) and (include_tied or m.weight is not head)]


def _weights(model, B, rows=None, include_tied=False):
    """Every tensor once, with each look-up table replaced by ``rows`` (default B) of its rows."""
    rows = B if rows is None else rows
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for t in _tables(model, include_tied):
        total += (rows - t.shape[0]) * t.shape[1] * t.element_size()
    return total


def right(model, B, S):
    return _weights(model, B) + _kv(model, B, S)


def _tied_head(model):
    head = model.get_output_embeddings().weight
    tied = head is model.get_input_embeddings().weight
    return head.numel() * head.element_size() if tied else 0


# ---- decode_step_bytes: the wrong ones, each with the words its message must contain

def _stale():
    memo = {}

    def impl(model, B, S):                       # keyed on the model only: another size's answer
        return memo.setdefault(id(model), right(model, B, S))
    return impl


def _memo_on(key):
    memo = {}
    return lambda model, B, S: memo.setdefault(key(model, B, S), right(model, B, S))


def _stateful():
    calls = itertools.count()
    first = len(_BYTE_CASES)
    return lambda model, B, S: right(model, B, S) + (next(calls) >= first)   # drifts on the second pass


def _one_coincidence(model, B, S):
    """Right everywhere but on one case, where it gives the query-heads answer: a coincidence on one
    case must not be named as that mistake."""
    if getattr(model.config, "num_key_value_heads", 0) == 8 and S == 4096:
        return _weights(model, B) + _kv(model, B, S, heads_field=("num_attention_heads",))
    return right(model, B, S)


WRONG_BYTES = {
    "tables whole (every tensor once)": (
        lambda m, B, S: sum(p.numel() * p.element_size() for p in m.parameters()) + _kv(m, B, S),
        ["look-up tables", "whole"]),
    "one row of each table": (lambda m, B, S: _weights(m, B, rows=1) + _kv(m, B, S), ["ONE row of each"]),
    "no table rows": (lambda m, B, S: _weights(m, B, rows=0) + _kv(m, B, S), ["left out the rows"]),
    "tied head read by rows": (lambda m, B, S: _weights(m, B, include_tied=True) + _kv(m, B, S),
                               ["tied token embedding", "whole"]),
    "weights once per row": (lambda m, B, S: _weights(m, B) * B + _kv(m, B, S), ["once per row"]),
    "cache left out": (lambda m, B, S: _weights(m, B), ["left the KV cache out"]),
    "cache for one row": (lambda m, B, S: _weights(m, B) + _kv(m, 1, S), ["cache of ONE row"]),
    "tied head twice": (lambda m, B, S: right(m, B, S) + _tied_head(m), ["tied LM head twice"]),
    "state_dict() summed": (lambda m, B, S: sum(t.numel() * t.element_size() for t in m.state_dict().values())
                            + _kv(m, B, S), ["state_dict()", "second time", "whole"]),
    "state_dict() summed, the cache of one row": (
        lambda m, B, S: sum(t.numel() * t.element_size() for t in m.state_dict().values()) + _kv(m, 1, S),
        ["2 mistakes at once", "state_dict()", "cache of ONE row"]),
    "parameters, not bytes": (lambda m, B, S: right(m, B, S) // next(m.parameters()).element_size(),
                              ["parameters", "not bytes"]),
    "query heads": (lambda m, B, S: _weights(m, B) + _kv(m, B, S, heads_field=("num_attention_heads",)),
                    ["QUERY heads", "num_key_value_heads"]),
    "fp32 assumed": (lambda m, B, S: right(m, B, S) * 4 // next(m.parameters()).element_size(), ["4 bytes"]),
    "head_dim from the width": (lambda m, B, S: _weights(m, B) + _kv(m, B, S, explicit_head_dim=False),
                                ["head_dim", "explicitly"]),
    # two mistakes at once: each named (a combined answer is not "no single known mistake")
    "tables whole and the cache of one row": (
        lambda m, B, S: sum(p.numel() * p.element_size() for p in m.parameters()) + _kv(m, 1, S),
        ["2 mistakes at once", "look-up tables", "whole", "cache of ONE row"]),
    "weights once per row, counted in parameters": (
        lambda m, B, S: (_weights(m, B) * B + _kv(m, B, S)) // next(m.parameters()).element_size(),
        ["2 mistakes at once", "once per row", "not bytes"]),
    "no table rows, query heads, fp32 assumed": (
        lambda m, B, S: (_weights(m, B, rows=0) + _kv(m, B, S, heads_field=("num_attention_heads",)))
        * 4 // next(m.parameters()).element_size(),
        ["3 mistakes at once", "left out the rows", "QUERY heads", "4 bytes"]),
    "returns a float": (lambda m, B, S: float(right(m, B, S)), ["Python int"]),
    "off by one byte everywhere": (lambda m, B, S: right(m, B, S) - 1,
                                   ["no single known mistake", "Wrong on 13 of 13", "(-1)"]),
    "one coincidence is not a diagnosis": (_one_coincidence, ["no single known mistake", "Llama-3.1-8B",
                                                              "Right on"]),
    "stale (memoised on the model)": (_stale(), ["kept from another call"]),
    # issue 34, kind 2: memos keyed on part of the arguments, each caught by a pair differing in one
    "memoised on (model, seq_len)": (_memo_on(lambda m, B, S: (id(m), S)), ["kept from another call", "batch_size only"]),
    "memoised on (batch_size, seq_len)": (_memo_on(lambda m, B, S: (B, S)), ["kept from another call",
                                                                             "the model only"]),
    "state between calls": (_stateful(), ["called twice with the same arguments"]),
    "the library handed in": (roofline.decode_step_bytes, ["library's own", "write it"]),
    "the library called": (lambda m, B, S: roofline.decode_step_bytes(m, B, S),
                           ["ran kvlab.roofline.decode_step_bytes", "write it yourself"]),
    "the library's helper called": (lambda m, B, S: roofline.weight_read_bytes(m, B) + _kv(m, B, S),
                                    ["kvlab.roofline.weight_read_bytes"]),
    # chapter 4's formula is not on lab 7's list (only decode_step_flops is given): refused when it runs
    "chapter 4's formula from the library": (lambda m, B, S: _weights(m, B) + _ch4_memory.kv_cache_bytes(
        m.config, S, B, next(m.parameters()).dtype), ["ran kvlab.memory.kv_cache_bytes"]),
    "the library bound as a default argument": (lambda m, B, S, _f=roofline.step_bytes: _f(m, B, B, B * S),
                                                ["ran kvlab.roofline.step_bytes"]),
}


@pytest.mark.parametrize("name", WRONG_BYTES)
def test_bytes_mistakes_rejected_by_name(name):
    impl, needles = WRONG_BYTES[name]
    if name == "one coincidence is not a diagnosis":
        msg = expect_rejected(check_decode_step_bytes, impl, *needles)
        assert "QUERY" not in msg
        return
    expect_rejected(check_decode_step_bytes, impl, *needles)


def test_bytes_learner_exception_is_wrapped():
    def broken(model, B, S):
        return model.config.n_layer   # Llama configs have no n_layer
    msg = expect_rejected(check_decode_step_bytes, broken, "raised AttributeError", "batch")
    assert "llama" in msg.lower()


def test_bytes_data_ptr_dedup_on_meta_is_explained():
    def by_data_ptr(model, B, S):
        seen = {p.data_ptr(): p for p in model.parameters()}     # every data_ptr is 0 on the meta device
        total = sum(p.numel() * p.element_size() for p in seen.values())
        for t in _tables(model):
            if any(t is p for p in seen.values()):
                total -= (t.shape[0] - B) * t.shape[1] * t.element_size()
        return total + _kv(model, B, S)
    expect_rejected(check_decode_step_bytes, by_data_ptr, "meta device", "data_ptr")


def test_failure_shows_no_grader_frames():
    with pytest.raises(AssertionError) as err:
        check_decode_step_bytes(lambda m, B, S: right(m, B, S) - 1)
    frames = [f.name for f in err.traceback]
    assert not any(name.startswith("_grade") or name == "_explain" for name in frames), frames


# ---- unusual correct ones

def numpy_ints(model, B, S):
    return np.int64(_weights(model, B)) + np.int64(_kv(model, B, S))


def named_parameters_dedup(model, B, S):
    # storage address where there is storage; identity on the meta device (every data_ptr is 0 there)
    seen = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[p.data_ptr() if p.device.type != "meta" else id(p)] = p
    total = sum(p.numel() * p.element_size() for p in seen.values())
    for t in _tables(model):
        total -= t.numel() * t.element_size() - B * t[0].numel() * t.element_size()
    return total + _kv(model, B, S)


def with_own_lab4_formula(model, B, S):
    kv_cache_bytes = own_copy(_ch4_memory.kv_cache_bytes)      # the learner's own lab 4 answer, copied in
    dtype = next(model.parameters()).dtype
    rows = sum(B * t.shape[1] for t in _tables(model))
    table = sum(t.numel() for t in _tables(model))
    return (model.num_parameters() - table + rows) * dtype.itemsize + kv_cache_bytes(model.config, S, B, dtype)


def memoised_correctly(model, B, S, _memo={}):    # noqa: B006 - a cache keyed on every argument is fine
    key = (id(model), B, S)
    if key not in _memo:
        _memo[key] = right(model, B, S)
    return _memo[key]


@pytest.mark.parametrize("impl", [right, numpy_ints, named_parameters_dedup, with_own_lab4_formula, memoised_correctly])
def test_bytes_unusual_correct_pass(impl, capsys):
    check_decode_step_bytes(impl)
    assert "PASSED" in capsys.readouterr().out


# ---- step_time_floor

def floor(model, B, S, bw, fl):
    return max(right(model, B, S) / bw, decode_step_flops(model, B, S) / fl)


def _floor_memo_without_bandwidth():
    memo = {}
    return lambda m, B, S, bw, fl: memo.setdefault((id(m), B, S, fl), floor(m, B, S, bw, fl))


def _floor_memo_without_flops():
    memo = {}
    return lambda m, B, S, bw, fl: memo.setdefault((id(m), B, S, bw), floor(m, B, S, bw, fl))


WRONG_FLOOR = {
    # issue 34, kind 2: a memo that ignores one of the machine's rates, caught by a pair differing in it
    "memoised without the bandwidth": (_floor_memo_without_bandwidth(), ["kept from another call", "bandwidth only"]),
    "memoised without the flops": (_floor_memo_without_flops(), ["kept from another call", "flops only"]),
    "min": (lambda m, B, S, bw, fl: min(right(m, B, S) / bw, decode_step_flops(m, B, S) / fl), ["SMALLER"]),
    "sum": (lambda m, B, S, bw, fl: right(m, B, S) / bw + decode_step_flops(m, B, S) / fl, ["added"]),
    "milliseconds": (lambda m, B, S, bw, fl: 1e3 * floor(m, B, S, bw, fl), ["milliseconds"]),
    "no cache": (lambda m, B, S, bw, fl: max(_weights(m, B) / bw, decode_step_flops(m, B, S) / fl), ["cache out"]),
    "swapped rates": (lambda m, B, S, bw, fl: max(right(m, B, S) / fl, decode_step_flops(m, B, S) / bw),
                      ["bytes go with bandwidth"]),
    "bandwidth taken as GB/s": (lambda m, B, S, bw, fl: max(right(m, B, S) / (bw * 1e9),
                                                             decode_step_flops(m, B, S) / fl),
                                ["compute time", "bytes/s"]),
    "FLOPs halved": (lambda m, B, S, bw, fl: max(right(m, B, S) / bw, decode_step_flops(m, B, S) / 2 / fl),
                     ["wherever the FLOPs do", "compute term"]),
    "bytes convention of the old chapter": (
        lambda m, B, S, bw, fl: max((sum(p.numel() * p.element_size() for p in m.parameters()) + _kv(m, B, S)) / bw,
                                    decode_step_flops(m, B, S) / fl),
        ["wherever the bytes do", "decode_step_bytes"]),
    "nanoseconds": (lambda m, B, S, bw, fl: 1e9 * floor(m, B, S, bw, fl), ["factor 1e9", "unit"]),
    "a tensor": (lambda m, B, S, bw, fl: torch.tensor(floor(m, B, S, bw, fl)), ["float number of seconds"]),
    "the library handed in": (roofline.step_time_floor, ["library's own"]),
    "the library's bytes": (lambda m, B, S, bw, fl: max(roofline.decode_step_bytes(m, B, S) / bw,
                                                        decode_step_flops(m, B, S) / fl),
                            ["ran kvlab.roofline.decode_step_bytes"]),
}


@pytest.mark.parametrize("name", WRONG_FLOOR)
def test_floor_mistakes_rejected_by_name(name):
    impl, needles = WRONG_FLOOR[name]
    msg = expect_rejected(check_step_time_floor, impl, *needles)
    assert "SMALLER" not in msg or name == "min"          # units are not "the smaller of the two"
    assert not hands_over_code(msg), msg                  # the mistake, not the answer's formula


def numpy_floor(model, B, S, bw, fl):
    return np.maximum(np.float64(right(model, B, S)) / bw, decode_step_flops(model, B, S) / np.float32(fl))


@pytest.mark.parametrize("impl", [floor, numpy_floor])
def test_floor_unusual_correct_pass(impl, capsys):
    check_step_time_floor(impl)
    assert "PASSED" in capsys.readouterr().out


# ---- bound_and_critical

def _terms(model, B, S, bw, fl):
    cache = (right(model, B, S) - right(model, B, 0)) / bw
    weights = right(model, B, 0) / bw
    compute = decode_step_flops(model, B, S) / fl
    return weights, cache, compute


def _bound(model, B, S, bw, fl):
    weights, cache, compute = _terms(model, B, S, bw, fl)
    return "compute" if compute > weights + cache else ("cache" if cache > weights else "weights")


def _over(model, S, bw, fl):
    return lambda b: decode_step_flops(model, b, S) / fl > right(model, b, S) / bw


def by_bisection(model, B, S, bw, fl):
    """Decide 'never' from the per-row terms, then bisect (an unusual but right way)."""
    row_bytes = right(model, 2, S) - right(model, 1, S)
    if decode_step_flops(model, 1, S) / fl <= row_bytes / bw:
        return [_bound(model, B, S, bw, fl), None]               # a list, not a tuple
    over, hi = _over(model, S, bw, fl), 1
    while not over(hi):
        hi *= 2
    lo = 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if not over(mid) else (lo, mid)
    return _bound(model, B, S, bw, fl), np.int64(lo)              # a numpy int


def closed_form(model, B, S, bw, fl):
    one, two = right(model, 1, S), right(model, 2, S)
    row, shared, f = two - one, 2 * one - two, decode_step_flops(model, 1, S)
    gain = f / fl - row / bw
    if gain <= 0:
        return _bound(model, B, S, bw, fl), None
    b = max(1, math.floor(shared / bw / gain))
    over = _over(model, S, bw, fl)
    while b > 1 and over(b - 1):
        b -= 1
    while not over(b):
        b += 1
    return _bound(model, B, S, bw, fl), b


def _shift(impl, by):
    def wrong(model, B, S, bw, fl):
        bound, crit = impl(model, B, S, bw, fl)
        return bound, None if crit is None else max(1, crit + by)
    return wrong


def _at_zero(model, B, S, bw, fl):
    return _bound(model, B, S, bw, fl), closed_form(model, B, 0, bw, fl)[1]


def _all_shared(model, B, S, bw, fl):
    w, f = right(model, 1, S) / bw, decode_step_flops(model, 1, S) / fl
    return _bound(model, B, S, bw, fl), math.floor(w / f) + 1


def _never_none(model, B, S, bw, fl):
    bound, crit = closed_form(model, B, S, bw, fl)
    return bound, crit or 10**6


def _memory(model, B, S, bw, fl):
    bound, crit = closed_form(model, B, S, bw, fl)
    return ("memory" if bound != "compute" else bound), crit


def _weights_vs_compute(model, B, S, bw, fl):      # compares compute with the weights alone
    weights, cache, compute = _terms(model, B, S, bw, fl)
    bound = "compute" if compute > weights else ("cache" if cache > weights else "weights")
    return bound, closed_form(model, B, S, bw, fl)[1]


def _no_none_test(model, B, S, bw, fl):
    """The closed form without deciding 'never' first: a negative batch where none exists."""
    one, two = right(model, 1, S), right(model, 2, S)
    row, shared, f = two - one, 2 * one - two, decode_step_flops(model, 1, S)
    return _bound(model, B, S, bw, fl), math.ceil(shared / bw / (f / fl - row / bw))


def _crit_memo_without(arg):
    memo = {}

    def impl(m, B, S, bw, fl):
        key = {"bandwidth": (id(m), S, fl), "flops": (id(m), S, bw), "seq_len": (id(m), bw, fl)}[arg]
        return _bound(m, B, S, bw, fl), memo.setdefault(key, closed_form(m, B, S, bw, fl)[1])
    return impl


def _capped(limit, last=False):
    """A search over batch sizes that gives up at ``limit`` (real critical batches reach thousands),
    returning None there or (``last``) the last batch it tried."""
    def impl(m, B, S, bw, fl):
        crit = closed_form(m, B, S, bw, fl)[1]
        return _bound(m, B, S, bw, fl), crit if crit is None or crit <= limit else (limit if last else None)
    return impl


def _tie_bound(compute_ties, cache_ties):
    """The bound with a tie broken the wrong way: '>=' where the lab's rule says '>'."""
    def bound(model, B, S, bw, fl):
        weights, cache, compute = _terms(model, B, S, bw, fl)
        if compute > weights + cache or (compute_ties and compute == weights + cache):
            return "compute"
        return "cache" if cache > weights or (cache_ties and cache == weights) else "weights"
    return bound


def _tie_crit(model, B, S, bw, fl):
    """A search whose test is 'compute >= memory': a batch at an exact tie is called critical."""
    bound, crit = closed_form(model, B, S, bw, fl)
    at = lambda b: decode_step_flops(model, b, S) / fl >= right(model, b, S) / bw
    while crit is not None and crit > 1 and at(crit - 1):
        crit -= 1
    return bound, crit


WRONG_CRIT = {
    # ties broken the wrong way (the lab's rule: strictly greater is compute-bound; 'weights' wins a byte tie)
    "a compute tie called compute-bound": (lambda *a: (_tie_bound(True, False)(*a), closed_form(*a)[1]),
                                           ["exactly as long as all the bytes", "a tie is not compute-bound"]),
    "a byte tie given to the cache": (lambda *a: (_tie_bound(False, True)(*a), closed_form(*a)[1]),
                                      ["same number of bytes", "a tie between the two byte terms to 'weights'"]),
    "a tie counted as critical": (_tie_crit, ["a tie is not compute-bound", "STRICTLY greater"]),
    # issue 34, kinds 2 and 3: memos keyed on part of the arguments; a loop capped below real critical batches
    "memoised without the bandwidth": (_crit_memo_without("bandwidth"), ["kept from another call", "bandwidth only"]),
    "memoised without the flops": (_crit_memo_without("flops"), ["kept from another call", "flops only"]),
    "memoised without the context": (_crit_memo_without("seq_len"), ["kept from another call", "seq_len only"]),
    "a search capped at 1,000": (_capped(1000), ["the critical batch is 16712", "you said None", "looks capped",
                                                 "at most 518"]),
    "a search capped at 10,000": (_capped(10_000), ["the critical batch is 16712", "you said None", "looks capped"]),
    "a search capped at 1,024 returning its last batch": (_capped(1024, last=True),
                                                          ["looks capped", "(1024), the step there is still memory-bound"]),
    "critical batch at zero context": (_at_zero, ["ZERO context"]),
    "every byte shared by the batch": (_all_shared, ["every byte", "own cache"]),
    "one too many": (_shift(closed_form, 1), ["off by one, too large"]),
    "one too few": (_shift(closed_form, -1), ["off by one, too small"]),
    "a number where there is none": (_never_none, ["NO batch is compute-bound", "None"]),
    "'memory' for a bound": (_memory, ["'weights' or 'cache'"]),
    "compute against the weights alone": (_weights_vs_compute, ["ALL the bytes"]),
    "the linear solve without the None test": (_no_none_test, ["a batch below 1", "NO batch is compute-bound"]),
    "a float batch": (lambda *a: (closed_form(*a)[0], float(closed_form(*a)[1] or 1)), ["positive int or None"]),
    "not a pair": (lambda *a: closed_form(*a)[1], ["pair (bound, critical_batch)"]),
    "the library called": (lambda m, B, S, bw, fl: (_bound(m, B, S, bw, fl), roofline.critical_batch(m, S, bw, fl)),
                           ["ran kvlab.roofline.critical_batch"]),
}


def test_crit_endless_loop_is_stopped(monkeypatch):
    from kvlab.course.checks import lab07
    monkeypatch.setattr(lab07, "TIME_LIMIT_S", 0.5)

    def brute_force(model, B, S, bw, fl):
        b = 1
        while decode_step_flops(model, b, S) / fl <= right(model, b, S) / bw:
            b += 1                    # never ends where no batch is compute-bound
        return _bound(model, B, S, bw, fl), b
    expect_rejected(check_bound_and_critical, brute_force, "did not return within", "no batch is compute-bound")


def _slow_walk(model, B, S, bw, fl):
    """Right, but walks batch by batch on counters of its own (not the notebook's names, so nothing
    stands in for them): far too slow where the critical batch is in the thousands."""
    row = right(model, 2, S) - right(model, 1, S)
    if decode_step_flops(model, 1, S) / fl <= row / bw:
        return _bound(model, B, S, bw, fl), None
    b = 1
    while not _over(model, S, bw, fl)(b):
        b += 1
    return _bound(model, B, S, bw, fl), b


def test_crit_slow_walk_is_told_the_batch_it_walks_to(monkeypatch):
    """Issue 34 walkthrough: a walk toward 16,712 was told about loops that never end."""
    from kvlab.course.checks import lab07
    monkeypatch.setattr(lab07, "TIME_LIMIT_S", 0.5)
    msg = expect_rejected(check_bound_and_critical, _slow_walk, "did not return within", "a critical batch exists",
                          "walks one batch at a time")
    assert "never ends" not in msg


def bound_and_critical_walking(model, B, S, bw, fl):
    """Right, walking one batch at a time from 1 with the notebook's own names (its decode_step_bytes, the
    decode_step_flops the lab hands out): while graded, exact stand-ins make each step cheap, so it passes
    within the time limit even toward 16,712 (issue 34 walkthrough: 2.5 s alone, past 20 s in the grader)."""
    bound = _bound(model, B, S, bw, fl)
    row = decode_step_bytes(model, 2, S) - decode_step_bytes(model, 1, S)
    if decode_step_flops(model, 1, S) / fl <= row / bw:
        return bound, None
    b = 1
    while decode_step_flops(model, b, S) / fl <= decode_step_bytes(model, b, S) / bw:
        b += 1
    return bound, b


def test_crit_walk_on_the_notebooks_counters_passes_in_time(capsys):
    import time
    t = time.perf_counter()
    check_bound_and_critical(bound_and_critical_walking)
    assert "PASSED" in capsys.readouterr().out
    assert time.perf_counter() - t < 60
    assert globals()["decode_step_flops"] is roofline.decode_step_flops       # put back


@pytest.mark.parametrize("name", WRONG_CRIT)
def test_crit_mistakes_rejected_by_name(name):
    impl, needles = WRONG_CRIT[name]
    expect_rejected(check_bound_and_critical, impl, *needles)


@pytest.mark.parametrize("impl", [closed_form, by_bisection])
def test_crit_unusual_correct_pass(impl, capsys):
    check_bound_and_critical(impl)
    assert "PASSED" in capsys.readouterr().out


# ---- the sweep plan

def test_sweep_plan(capsys):
    tiny = grading_model()[0]
    bw, fl = 20e9, 200e9
    crit = roofline.critical_batch(tiny, 64, bw, fl)
    assert crit and crit > 3
    check_sweep_plan([1, 2, crit + 1, 2 * crit], tiny, 64, bw, fl)
    with pytest.raises(AssertionError, match=f"with a critical batch of {crit}"):
        check_sweep_plan([1, 2, crit + 1], tiny, 64, bw, fl)             # stops short of twice the batch
    with pytest.raises(AssertionError, match="grow strictly"):
        check_sweep_plan([1, 8, 4, 64], tiny, 64, bw, fl)
    with pytest.raises(AssertionError, match="positive ints"):
        check_sweep_plan([1, 2.0, 64], tiny, 64, bw, fl)
    # the message says which part is short (issue 34 walkthrough: the critical batch itself counted as above)
    with pytest.raises(AssertionError, match=rf"1 above it \(\[{2 * crit}\]; {crit} itself is neither\)"):
        check_sweep_plan([1, 2, crit, 2 * crit], tiny, 64, bw, fl)
    with pytest.raises(AssertionError, match=rf"the largest is {crit + 2}, below {2 * crit}"):
        check_sweep_plan([1, 2, crit + 1, crit + 2], tiny, 64, bw, fl)
    with pytest.raises(AssertionError, match=r"0 below it \(none\), 2 needed"):
        check_sweep_plan([crit + 1, crit + 2, 2 * crit], tiny, 64, bw, fl)
    # a range and a numpy array are lists of batches too (issue 34, kind 8)
    check_sweep_plan(range(1, 2 * crit + 1), tiny, 64, bw, fl)
    check_sweep_plan(np.array([1, 2, crit + 1, 2 * crit]), tiny, 64, bw, fl)


def test_sweep_plan_can_fail_where_there_is_no_bend(capsys):
    """Issue 34, kind 5: with no critical batch, or one whose twice does not fit, any list used to pass."""
    tiny = grading_model()[0]
    with pytest.raises(AssertionError, match="no batch is compute-bound.*4 batches spanning a factor of 8"):
        check_sweep_plan([1, 2], tiny, 64, 1e9, 1e15)
    with pytest.raises(AssertionError, match="4 batches spanning"):
        check_sweep_plan([3, 4, 5, 6], tiny, 500, 1e9, 1e15)                # a second input: too narrow
    check_sweep_plan([1, 2, 4, 8], tiny, 64, 1e9, 1e15)
    assert "no batch is compute-bound" in capsys.readouterr().out
    llama = roofline.meta_model("Llama-3.1-8B", torch.bfloat16)
    with pytest.raises(AssertionError, match="beyond the lab's budget"):
        check_sweep_plan([1, 2, 4, 8], llama, 100_000, 1e12, 1e12)          # batch 8 does not fit
    # at 128 positions the critical batch (439 at these rates) is past what fits (128 rows): no bend
    assert roofline.critical_batch(llama, 128, 3.35e12, 990e12) > 128
    with pytest.raises(AssertionError, match="would not fit"):
        check_sweep_plan([1, 2], llama, 128, 3.35e12, 990e12)
    check_sweep_plan([1, 4, 16, 128], llama, 128, 3.35e12, 990e12)


# ---- the sweep planned by a function of (crit, fits): called on critical batches the lab never showed

def _plan_ok(crit, fits):
    if crit is not None and 2 * crit <= fits:
        return sorted({b for b in (1, crit // 2, crit - 1) if 1 <= b < crit}
                      | {b for b in (crit + 1, crit + 2, 2 * crit) if b <= fits})
    top = fits if crit is None or crit > fits else max(crit, min(8, fits))
    return sorted({1, 2, 4, 8, top} - {b for b in (2, 4, 8) if b > top}) if top >= 8 else list(range(1, top + 1))


def _plan_range(crit, fits):
    """Unusual but right: a numpy array, every batch from 1 up to twice the critical batch (or up to 16)."""
    top = min(fits, max(2 * crit, crit + 2)) if crit is not None and 2 * crit <= fits else \
        min(fits, max(16, crit or 0))
    return np.arange(1, top + 1)


def _typed(crit, fits):
    return [1, 2, 51, 100]                     # this run's plan (CRIT=50), typed in


def _capped(crit, fits):
    return _plan_ok(min(crit, 512), fits) if crit is not None else _plan_ok(None, fits)


def _none_unhandled(crit, fits):
    return [1, crit // 2, crit + 1, 2 * crit]


def _ignores_fits(crit, fits):
    return _plan_ok(crit, 10 ** 9)


def _four_above_only(crit, fits):                # the old "two above" where only one fits
    if crit is not None and 2 * crit <= fits:
        return [1, crit + 1, crit + 2, 2 * crit] if crit > 1 else [2, 3]
    return _plan_ok(crit, fits)


WRONG_PLANS = {
    "typed in": (_typed, ["whatever crit and fits", "typed in"]),
    "capped below the thousands": (_capped, ["CRIT=3000", "the largest is"]),
    "None not handled": (_none_unhandled, ["raised TypeError", "CRIT is None"]),
    "the budget ignored": (_ignores_fits, ["beyond the largest batch whose cache fits"]),
    "too few below": (_four_above_only, ["1 below it", "2 needed"]),
}


@pytest.mark.parametrize("name", WRONG_PLANS)
def test_sweep_plan_function_mistakes_rejected_by_name(name):
    impl, needles = WRONG_PLANS[name]
    tiny = grading_model()[0]
    assert roofline.critical_batch(tiny, 64, 20e9, 200e9) == 50           # what _typed typed in
    expect_rejected(lambda f: check_sweep_plan(f, tiny, 64, 20e9, 200e9), impl, *needles)


@pytest.mark.parametrize("impl", [_plan_ok, _plan_range])
def test_sweep_plan_function_unusual_correct_pass(impl, capsys):
    tiny = grading_model()[0]
    check_sweep_plan(impl, tiny, 64, 20e9, 200e9)
    assert "other critical batches" in capsys.readouterr().out
    check_sweep_plan(impl, tiny, 64, 1e9, 1e15)                          # no critical batch on this machine
    assert "no batch is compute-bound" in capsys.readouterr().out


def test_sweep_plan_function_right_elsewhere_wrong_here():
    """A plan right on every unseen case but not on this run's numbers is named for this run."""
    tiny = grading_model()[0]
    crit = roofline.critical_batch(tiny, 64, 20e9, 200e9)

    def wrong_here(c, fits):
        return [1, 2, c, 2 * c] if c == crit else _plan_ok(c, fits)
    expect_rejected(lambda f: check_sweep_plan(f, tiny, 64, 20e9, 200e9), wrong_here, f"CRIT={crit}",
                    "itself is neither")


# ---- overhead_fit

def fit(floors, measured):
    n = len(floors)
    mf, mm = sum(floors) / n, sum(measured) / n
    k = sum((f - mf) * (m - mm) for f, m in zip(floors, measured)) / sum((f - mf) ** 2 for f in floors)
    return mm - k * mf, k


def polyfit(floors, measured):
    k, overhead = np.polyfit(np.array(floors), np.array(measured), 1)
    return overhead, k                                            # numpy floats


WRONG_FIT = {
    "through the origin": (lambda f, m: (0.0, sum(a * b for a, b in zip(f, m)) / sum(a * a for a in f)),
                           ["through the origin", "intercept"]),
    "axes swapped": (lambda f, m: fit(m, f), ["against the measurement"]),
    "mean ratio": (lambda f, m: (0.0, sum(b / a for a, b in zip(f, m)) / len(f)), ["averaged measured / floor"]),
    "not a pair": (lambda f, m: fit(f, m)[1], ["pair of numbers"]),
    "np.polyfit's order kept (k, overhead)": (lambda f, m: tuple(np.polyfit(f, m, 1)), ["you returned (k, overhead)"]),
    "in-place sort changes the input order": (lambda f, m: fit(sorted(f), m), ["least-squares line"]),
    # issue 34, kind 4: right on noise-free lines, several per cent off at a real run's noise
    "swapped and inverted": (lambda f, m: (lambda a, b: (-a / b, 1 / b))(*fit(m, f)),
                             ["against the measurement and inverted", "off by"]),
    "through the end points": (lambda f, m: _ends(f, m), ["smallest and the largest", "every point"]),
}


def _ends(f, m):
    (f0, m0), (f1, m1) = min(zip(f, m)), max(zip(f, m))
    return m0 - (m1 - m0) / (f1 - f0) * f0, (m1 - m0) / (f1 - f0)


def theil_sen(floors, measured):
    """A robust line (median of pairwise slopes): a fine estimator, but not the least squares asked for."""
    pairs = [(b2 - b1) / (a2 - a1) for i, (a1, b1) in enumerate(zip(floors, measured))
             for a2, b2 in list(zip(floors, measured))[i + 1:] if a2 != a1]
    k = float(np.median(pairs))
    return float(np.median([b - k * a for a, b in zip(floors, measured)])), k


def test_fit_is_graded_on_a_real_runs_noise():
    """Another estimator agrees on an exact line, not on noisy ones: rejected, with how far off."""
    expect_rejected(check_overhead_fit, theil_sen, "least-squares line", "off by")


def lstsq_normal_equations(floors, measured):         # unusual, correct: numpy's solver
    A = np.stack([np.ones(len(floors)), np.array(floors)], 1)
    a, k = np.linalg.lstsq(A, np.array(measured), rcond=None)[0]
    return float(a), float(k)


@pytest.mark.parametrize("name", WRONG_FIT)
def test_fit_mistakes_rejected_by_name(name):
    impl, needles = WRONG_FIT[name]
    expect_rejected(check_overhead_fit, impl, *needles)


@pytest.mark.parametrize("impl", [fit, polyfit, lstsq_normal_equations])
def test_fit_unusual_correct_pass(impl, capsys):
    check_overhead_fit(impl)
    assert "PASSED" in capsys.readouterr().out


# ---- issue 34: each exercise graded on its own (the right answers to the earlier ones stand in)

def decode_step_bytes(model, B, S):             # a learner's exercise 1, off by the tables (wrong)
    return sum(p.numel() * p.element_size() for p in model.parameters()) + _kv(model, B, S)


def step_time_floor(model, B, S, bw, fl):       # a right exercise 2 on top of the wrong exercise 1
    return max(decode_step_bytes(model, B, S) / bw, decode_step_flops(model, B, S) / fl)


def bound_and_critical_on_own_floor(model, B, S, bw, fl):   # right exercise 3, calling the learner's floor
    step_time_floor(model, B, S, bw, fl)
    return closed_form(model, B, S, bw, fl)


def test_each_exercise_is_graded_on_its_own(capsys):
    """A wrong exercise 1 is reported by its own check only: exercises 2 and 3, right, pass, and say
    that the right answers stood in; the learner's function is put back afterwards."""
    expect_rejected(check_decode_step_bytes, decode_step_bytes, "look-up tables")
    check_step_time_floor(step_time_floor)
    check_bound_and_critical(bound_and_critical_on_own_floor)
    out = capsys.readouterr().out
    assert "the right decode_step_bytes stood in" in out
    assert "the right decode_step_bytes and step_time_floor stood in" in out
    assert globals()["decode_step_bytes"].__module__ == __name__          # put back


def _off_by_one_once(model, B, S, bw, fl):
    """Right everywhere but one case (kvlab-tiny at 50 positions), one too large there: one case names no
    mistake, so the message must show the times at both batches."""
    bound, crit = closed_form(model, B, S, bw, fl)
    return bound, crit + 1 if S == 50 and B == 24 else crit


def test_an_unexplained_critical_batch_shows_the_times_at_both_batches():
    msg = expect_rejected(check_bound_and_critical, _off_by_one_once, "strictly greater")
    assert msg.count("the FLOPs take") == 2 and "memory-bound" in msg and "compute-bound" in msg


# ---- the walkthrough of issue 34 (a new learner, from a fresh clone): what it found, held

_SHARED_AT_ZERO = '''
def bound_and_critical(model, B, S, bw, fl):
    shared = decode_step_bytes(model, 0, 0)              # the weights, read off batch 0
    row = decode_step_bytes(model, 1, S) - shared        # one row's own bytes
    over = lambda b: decode_step_flops(model, b, S) / fl > (shared + b * row) / bw
    t_w = decode_step_bytes(model, B, 0) / bw            # everything but the cache (the rows looked up too)
    t_c = decode_step_bytes(model, B, S) / bw - t_w
    bound = "compute" if decode_step_flops(model, B, S) / fl > t_w + t_c else ("cache" if t_c > t_w else "weights")
    gain = decode_step_flops(model, 1, S) / fl - row / bw
    if gain <= 0:
        return bound, None
    b = max(1, int(shared / bw / gain))                 # where the two lines cross, then settled
    while b > 1 and over(b - 1):
        b -= 1
    while not over(b):
        b += 1
    return bound, b
'''


def test_crit_right_answer_reading_the_shared_bytes_off_batch_zero_passes(capsys):
    """Exercise 3 graded on exercise 1's reference: a right answer that reads the shared bytes off
    ``decode_step_bytes(model, 0, 0)`` (outside exercise 1's contract, but what "shared + batch x row"
    invites) is accepted, not diagnosed as a memo."""
    ns = {"decode_step_bytes": right, "decode_step_flops": decode_step_flops}
    exec(compile(_SHARED_AT_ZERO, "<learner cell>", "exec"), ns)
    check_bound_and_critical(ns["bound_and_critical"])
    assert "PASSED" in capsys.readouterr().out


@pytest.mark.parametrize("shift", [dict(S=1), dict(B=1), dict(S=-1)])
def test_an_off_by_one_is_not_called_a_memo(shift):
    """A function off by one in one argument returns, for some case, the answer of its neighbour: that
    is not a result kept from another call (a memo returns the same value for both cases)."""
    def wrong(model, B, S):
        return right(model, max(B + shift.get("B", 0), 0), max(S + shift.get("S", 0), 0))
    with pytest.raises(Exception) as e:
        check_decode_step_bytes(wrong)
    assert "kept from another call" not in str(e.value)


def test_a_refused_check_never_prints_passed(capsys):
    """The watch rules after the check body ran: a check that passed on library code it then refuses
    must not have printed PASSED first."""
    with pytest.raises(Exception, match="kvlab"):
        check_step_time_floor(lambda m, B, S, bw, fl: roofline.step_time_floor(m, B, S, bw, fl))
    assert "PASSED" not in capsys.readouterr().out


def test_the_fit_sentence_flags_a_fit_that_does_not_fit():
    from kvlab import rooflineview
    measured, floors = [5.63e-3, 9.53e-3, 6.46e-3, 8.09e-3], [1e-3, 2e-3, 4e-3, 8e-3]
    big = rooflineview.fit_sentence(6.7e-3, 0.8, measured, floors)
    assert "larger than the whole step of the smallest batch swept" in big
    assert "out of order" in big and "no. 3 at 6.460 ms" not in big and "no. 3 ran in 6.460 ms" in big
    in_order = rooflineview.fit_sentence(-1e-3, 1.2, [5e-3, 6e-3, 9e-3, 20e-3], floors)
    assert "out of order" not in in_order and "measured/floor falls" in in_order
    assert "negative" in rooflineview.fit_sentence(-1e-3, 1.2, measured, floors)
    assert "faster than the floor" in rooflineview.fit_sentence(1e-3, 0.8, measured, floors)
    ok = rooflineview.fit_sentence(2e-3, 1.5, measured, floors)
    assert ok.startswith("fixed overhead per step: 2.000 ms") and "1.50x the floor" in ok


def test_a_clamped_fit_is_rejected_by_name():
    """The walkthrough of issue 34: an overhead clamped at zero passed while no graded set had a
    negative intercept; one now has, and the mistake is named."""
    def clamped(floors, measured):
        overhead, k = fit(floors, measured)
        return max(overhead, 0.0), k
    expect_rejected(check_overhead_fit, clamped, "clamped the overhead at zero")
