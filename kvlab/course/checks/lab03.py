"""Graders for lab 3: a hand-built KV cache and causal attention with a cache.

* ``check_kv_cache(KVCache)``: the cache class, against the concatenation of everything written
  (plain tensor bookkeeping, computed here independently);
* ``check_attention(attention)``: ``attention(q, k, v, past_len)`` against float64 arithmetic;
* ``check_generate_with_cache(KVCache, attention)``: both pieces inside :class:`kvlab.gpt2.GPT2`,
  whose greedy tokens must equal transformers' ``model.generate`` token for token.
"""

from __future__ import annotations

import operator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvlab.reference import hf_greedy
from kvlab.reference import first_difference
from ._common import (GraderFailure, call_unmodified, expect_value_error, fail,
                      fresh_prompts, grading_model, held_tensors, learner_call, misplaced, passed)

from kvlab.configs import kv_dims
from ._attention import float64_attention, name_the_mistake, where_wrong
from kvlab.cache import PreallocatedCache
from kvlab.gpt2 import GPT2, generate, sdpa_attention

NAME = "lab03"
NAME_CACHE = "check_kv_cache"
NAME_ATTENTION = "check_attention"
NAME_GENERATE = "check_generate_with_cache"


# ---------------------------------------------------------------------------------------------------
# KVCache


def _make_cache(KVCache, n_layer, batch, heads, head_dim, max_len, dtype, device="cpu"):
    args = (n_layer, batch, heads, head_dim, max_len, dtype, device)
    return learner_call(NAME_CACHE, f"KVCache{args} (positional: n_layer, batch_size, n_head, "
                                    "head_dim, max_len, dtype, device)", KVCache, *args)


def _seq_len(cache):
    if not hasattr(cache, "seq_len"):
        raise fail(NAME_CACHE, "your cache has no seq_len: the model reads cache.seq_len (the "
                               "number of tokens stored) before every forward pass")
    s = cache.seq_len
    if callable(s):
        raise fail(NAME_CACHE, "seq_len is a method, but the model reads it as a number, "
                               "cache.seq_len, with no parentheses (so does every cache of the "
                               "library): put @property above def seq_len(self)")
    try:
        return operator.index(s)
    except TypeError:
        raise fail(NAME_CACHE, f"seq_len must be an int (the number of tokens stored), got "
                               f"{type(s).__name__} {s!r}") from None


def _find(haystack, needle):
    """Offsets o along dim 2 where haystack[:, :, o:] starts with (as much as fits of) needle."""
    T, S = needle.shape[2], haystack.shape[2]
    return [o for o in range(S) if torch.equal(haystack[:, :, o:o + T], needle[:, :, :min(T, S - o)])]


@dataclass
class _Update:
    """One ``update(layer, k, v)`` as the grader sees it: what was written, what came back."""

    where: str
    keys: torch.Tensor
    values: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    want_k: torch.Tensor
    want_v: torch.Tensor
    written: int
    batch: int
    max_len: int


# The shape/dtype rules of one update's answer: (test, message), first failing test names the mistake.
_UPDATE_SHAPE = [
    (lambda u: u.keys.dim() != 4 or u.values.shape != u.keys.shape,
     "keys/values must be [batch, heads, seq, head_dim]; got {ks} and {vs}. Keep the batch "
     "dimension"),
    (lambda u: u.keys.shape[0] != u.batch,
     "the returned keys have batch size {b}, the cache was made for batch_size={batch}: keep the "
     "batch dimension (no squeeze(0))"),
    (lambda u: u.keys.shape[2] == u.k.shape[2] and u.written > 0,
     "update returned only the {T} new token(s); it must return every key so far ({S}): the past "
     "plus the new ones"),
    (lambda u: u.keys.shape[2] == u.max_len and u.max_len != u.written + u.k.shape[2],
     "update returned the whole buffer ({max_len} positions); return only the filled part, "
     "positions 0 .. {last}"),
    (lambda u: u.keys.shape[2] != u.written + u.k.shape[2],
     "expected {S} keys (cached + new), got {got_S}"),
    (lambda u: u.keys.dtype != u.k.dtype,
     "the cache was made with dtype={dt} but returned {got_dt}: allocate the buffers with the "
     "dtype argument"),
    (lambda u: torch.equal(u.keys, u.values) and not torch.equal(u.want_k, u.want_v),
     "update returned the same tensor for the keys and the values: they share one buffer (or "
     "one is written over the other). Keys and values need a buffer each"),
    (lambda u: torch.equal(u.keys, u.want_v) and torch.equal(u.values, u.want_k)
     and not torch.equal(u.keys, u.want_k),
     "update returned the values where the keys belong and the keys where the values belong "
     "(swapped)"),
]

# Why one returned tensor (keys or values) differs from everything written so far.
_CONTENT = [
    (lambda u, got, want, new: u.batch > 1 and torch.equal(got[0], want[0])
     and torch.equal(got[1], want[0]),
     "every batch row holds row 0's {what}: keep the batch dimension in the buffers ([batch, "
     "heads, max_len, head_dim]), do not squeeze or index it away"),
    (lambda u, got, want, new: bool(_find(got, new)) and u.written not in _find(got, new),
     "the new {what} were written at position {at}, but they belong at the write offset {written} "
     "(= seq_len before this pass): write positions seq_len .. seq_len+T-1"),
    (lambda u, got, want, new: _find(got, new) == [u.written]
     or torch.equal(got[:, :, u.written:], new),
     "the new {what} are right but the earlier ones changed: something overwrote the past (wrong "
     "offset in an earlier pass?)"),
    (lambda u, got, want, new: not torch.equal(got[:, :, :u.written], want[:, :, :u.written]),
     "the cached {what} of earlier passes are wrong; layers must not share storage, and nothing "
     "may overwrite the past"),
    (lambda u, got, want, new: True,
     "the returned {what} are not the ones written (expected the concatenation of every update of "
     "this layer, in order)"),
]

# seq_len after a pass: (test(n, written, T, L), message)
_SEQ_LEN = [
    (lambda n, w, T, L: n == w,
     "after forward pass {p} seq_len is still {n}: it never advances, so the model would give "
     "every new token the positions 0.. again (position embeddings restarting at 0). Advance it "
     "by T after the LAST layer's update"),
    (lambda n, w, T, L: n == w + L * T,
     "after forward pass {p} seq_len is {n}, expected {want}: it advanced once per layer; advance "
     "it once per pass, after the last layer"),
    (lambda n, w, T, L: n != w + T,
     "after forward pass {p} ({T} new tokens after {w}) seq_len should be {want}, got {n}"),
]


def _grade_update(u: _Update) -> None:
    fmt = dict(ks=list(u.keys.shape), vs=list(u.values.shape), b=u.keys.shape[0], batch=u.batch,
               T=u.k.shape[2], S=u.written + u.k.shape[2], max_len=u.max_len,
               last=u.written + u.k.shape[2] - 1, got_S=u.keys.shape[2] if u.keys.dim() == 4 else "?",
               dt=u.k.dtype, got_dt=u.keys.dtype, written=u.written)
    for broken, message in _UPDATE_SHAPE:
        if broken(u):
            raise fail(NAME_CACHE, f"{u.where}: " + message.format(**fmt))
    pairs = ((u.keys, u.want_k, u.k, "keys"), (u.values, u.want_v, u.v, "values"))
    for got, want, new, what in pairs:
        if torch.equal(got, want):
            continue
        at = (_find(got, new) or [None])[0]
        for broken, message in _CONTENT:
            if broken(u, got, want, new):
                raise fail(NAME_CACHE, f"{u.where}: " + message.format(what=what, at=at, **fmt))


def _update_once(cache, layer, k, v, where):
    got = learner_call(NAME_CACHE, f"{where}: cache.update({layer}, k, v)", cache.update, layer,
                       k.clone(), v.clone())
    if not (isinstance(got, (tuple, list)) and len(got) == 2
            and all(isinstance(t, torch.Tensor) for t in got)):
        raise fail(NAME_CACHE, f"{where}: update must return a tuple (keys, values) of tensors")
    return got


def _run_cache(KVCache, batch, steps, max_len, gen):
    """Feed ``steps`` (new tokens per forward pass) through a fresh cache and check every answer."""
    L, H, D, dt = 3, 2, 4, torch.float64
    cache = _make_cache(KVCache, L, batch, H, D, max_len, dt)
    if _seq_len(cache) != 0:
        raise fail(NAME_CACHE, f"a new cache must have seq_len == 0, got {_seq_len(cache)}")
    past = [[torch.zeros(batch, H, 0, D, dtype=dt)] * 2 for _ in range(L)]
    ptrs, written = [None] * L, 0
    for step, T in enumerate(steps):
        for layer in range(L):
            k, v = (torch.randn(batch, H, T, D, dtype=dt, generator=gen) for _ in range(2))
            where = f"forward pass {step + 1} ({T} new token(s) after {written}), layer {layer}"
            keys, values = _update_once(cache, layer, k, v, where)
            want_k, want_v = torch.cat([past[layer][0], k], 2), torch.cat([past[layer][1], v], 2)
            _grade_update(_Update(where, keys, values, k, v, want_k, want_v, written, batch, max_len))
            if ptrs[layer] is not None and keys.data_ptr() != ptrs[layer].data_ptr():
                raise fail(NAME_CACHE, f"{where}: the returned keys are a new tensor at every "
                                       "pass; preallocate one buffer of max_len positions in "
                                       "__init__, write into it in place and return a view, no "
                                       "torch.cat")
            # the tensor itself is kept, not its address: a freed copy's memory could be reused
            ptrs[layer], past[layer] = keys, [want_k, want_v]
        n = _seq_len(cache)
        fmt = dict(p=step + 1, n=n, want=written + T, T=T, w=written)
        for broken, message in _SEQ_LEN:
            if broken(n, written, T, L):
                raise fail(NAME_CACHE, message.format(**fmt))
        written += T
    return cache, written, (L, batch, H, D, dt)


def _run_or_explain(KVCache, steps, max_len, gen):
    """Batch 2; when that raises, does batch 1 work? (then the batch dimension is the problem)"""
    try:
        return _run_cache(KVCache, 2, steps, max_len, gen)
    except GraderFailure as e:
        if not isinstance(e.__cause__, Exception) or "update(" not in str(e):
            raise
        try:
            _run_cache(KVCache, 1, steps, max_len, torch.Generator().manual_seed(1))
        except (GraderFailure, Exception):  # noqa: BLE001
            raise e from None
        raise fail(NAME_CACHE, f"with batch_size=2 your cache raised {e.__cause__!r}. It works "
                               "with batch_size=1: keep the batch dimension, buffers [batch, "
                               "heads, max_len, head_dim], and write k as a whole (no squeeze(0) or "
                               "k[0])") from e


def _check_reset(cache, shape, gen) -> None:
    """reset() must really forget: a second prompt must not see the first one's keys."""
    L, B, H, D, dt = shape
    learner_call(NAME_CACHE, "cache.reset()", cache.reset)
    if _seq_len(cache) != 0:
        raise fail(NAME_CACHE, f"after reset() seq_len is {_seq_len(cache)}, not 0: reset() must "
                               "forget every token (otherwise the next prompt attends to the "
                               "previous prompt's keys and gets shifted positions)")
    lost = misplaced(list(held_tensors(cache)), "cpu", dt)
    for layer in range(L):
        k = torch.randn(B, H, 2, D, dtype=dt, generator=gen)
        keys, values = _update_once(cache, layer, k, k + 1, f"after reset(), layer {layer}")
        if lost or keys.dtype != dt or values.dtype != dt:
            held = "; it holds " + ", ".join(lost) if lost else ""
            raise fail(NAME_CACHE, f"the cache was made with dtype={dt}, but after reset() "
                                   f"update returns {keys.dtype}{held}: reset() must keep the "
                                   "buffers it was made with (set the count back, or zero them "
                                   "in place), not allocate new ones with default arguments")
        if keys.shape[2] != 2 or not torch.equal(keys, k) or not torch.equal(values, k + 1):
            raise fail(NAME_CACHE, f"after reset(), the first update of layer {layer} returned "
                                   f"{keys.shape[2]} keys that are not just the 2 new ones: "
                                   "reset() must empty the cache")
    if _seq_len(cache) != 2:
        raise fail(NAME_CACHE, f"after reset() and one pass of 2 tokens, seq_len should be 2, got "
                               f"{_seq_len(cache)}")


def _check_edges(KVCache) -> None:
    """A cache filled exactly to max_len (no error), and one made on device='meta'."""
    c = _make_cache(KVCache, 2, 1, 2, 4, 6, torch.float32)
    for T in (4, 2):
        for layer in range(2):
            ones = torch.ones(1, 2, T, 4)
            learner_call(NAME_CACHE, "filling a max_len=6 cache EXACTLY (4 tokens, then 2): "
                                     f"update of {T} tokens (T tokens fit when seq_len + T <= "
                                     "max_len)",
                         c.update, layer, ones, ones.clone())
    one, two = (_make_cache(KVCache, 1, 1, 2, 4, 4, torch.float32) for _ in range(2))
    ones = torch.ones(1, 2, 1, 4)
    first, _ = _update_once(one, 0, ones, ones.clone(), "two caches alive at once, the first")
    _update_once(two, 0, ones * 2, ones * 2, "two caches alive at once, the second")
    if not torch.equal(first, ones):
        raise fail(NAME_CACHE, "two caches alive at once: writing into the second one changed "
                               "what the first returned. Every cache needs buffers of its own "
                               "(made in __init__, kept on self; not on the class or a global)")
    meta = _make_cache(KVCache, 1, 1, 2, 4, 8, torch.float16, "meta")
    ones = torch.ones(1, 2, 3, 4, dtype=torch.float16, device="meta")
    keys, _ = learner_call(NAME_CACHE, "update on a cache made with device='meta'", meta.update, 0,
                           ones, ones.clone())
    where = {str(t.device) for _, t in held_tensors(meta)} | {str(keys.device)}
    if where != {"meta"} or keys.dtype != torch.float16:
        raise fail(NAME_CACHE, f"a cache made with device='meta', dtype=float16 keeps tensors on "
                               f"{where} and returns {keys.dtype}: allocate the buffers with the "
                               "device and dtype given")


def check_kv_cache(KVCache) -> None:
    """Grade a preallocated cache class ``KVCache(n_layer, batch_size, n_head, head_dim, max_len,
    dtype, device)``: every answer, overflow (ValueError), reset, exact fill, dtype and device."""
    gen = torch.Generator().manual_seed(3003)
    max_len, steps = 13, [5, 1, 1, 3, 1]
    cache, written, shape = _run_or_explain(KVCache, steps, max_len, gen)
    L, B, H, D, dt = shape
    room = max_len - written
    k = torch.randn(B, H, room + 1, D, dtype=dt, generator=gen)
    expect_value_error(NAME_CACHE, f"writing {room + 1} tokens when only {room} of "
                                   f"max_len={max_len} positions are free", cache.update, 0, k,
                       k.clone())
    _check_reset(cache, shape, gen)
    _check_edges(KVCache)
    passed(NAME_CACHE, f"batch 2, {L} layers, passes of {steps} tokens: every update returns "
                       "exactly what was written, in place; seq_len, overflow (ValueError), "
                       "reset(), an exact fill, fp16 on device='meta' behave")


# ---------------------------------------------------------------------------------------------------
# attention


_MISTAKES = [
    (dict(mask="none"), "there is no causal mask: a new token at position past_len+i may only "
                        "attend to keys 0 .. past_len+i; mask the scores of later keys with -inf "
                        "before the softmax"),
    (dict(mask="topleft"), "the causal mask ignores past_len: query i is the token at position "
                           "past_len+i, so it sees keys 0 .. past_len+i, not 0 .. i (torch.tril "
                           "on a [T, S] matrix, or is_causal=True, aligns the mask to the wrong "
                           "corner when past_len > 0)"),
    (dict(mask="strict"), "the mask hides each query's own key: key j is allowed when j <= "
                          "past_len+i (<=, not <)"),
    (dict(scale="D"), "wrong softmax scale: the scores are divided by D; divide by sqrt(D) "
                      "(head_dim ** 0.5)"),
    (dict(scale="none"), "the scores are not scaled: divide q @ k^T by sqrt(D) before the softmax"),
    (dict(scale="D", mask="none"), "no causal mask AND the scores are divided by D instead of "
                                   "sqrt(D)"),
    (dict(scale="none", mask="none"), "no causal mask AND no 1/sqrt(D) scaling of the scores"),
    (dict(scale="D", mask="topleft"), "wrong scale (1/D, use 1/sqrt(D)) AND the mask ignores "
                                      "past_len"),
    (dict(scale="none", mask="topleft"), "no 1/sqrt(D) scaling AND the mask ignores past_len"),
]


# (B, H, T, past_len, D): a prefill, decode steps, a chunk after a past, a tall batch
_ATTENTION_CASES = [(2, 3, 6, 0, 8), (2, 3, 1, 9, 8), (3, 2, 4, 5, 16), (1, 4, 7, 0, 32),
                    (2, 2, 1, 0, 4),
                    (2, 1, 3, 2, 8)]


@contextmanager
def _no_fused_attention():
    """The exercise is the arithmetic and the mask: PyTorch's fused attention is refused inside it."""
    import torch.nn.functional as F

    def refuse(*args, **kwargs):
        raise fail(NAME_ATTENTION, "do not call scaled_dot_product_attention: the exercise is to "
                                   "write softmax(q @ k^T / sqrt(D) + mask) @ v and the mask yourself")
    inner, F.scaled_dot_product_attention = F.scaled_dot_product_attention, refuse
    try:
        yield
    finally:
        F.scaled_dot_product_attention = inner


def _attention_output(attention, q, k, v, past, where):
    with _no_fused_attention():
        out = call_unmodified(NAME_ATTENTION, f"{where}: attention(q, k, v, {past})" + (
            " (does it only work for batch 1?)" if q.shape[0] > 1 else ""), attention, q, k, v, past)
    B, H, T, D = q.shape
    if not isinstance(out, torch.Tensor) or list(out.shape) != [B, H, T, D]:
        shape = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        lost = isinstance(out, torch.Tensor) and (out.dim() != 4 or out.shape[0] != B)
        hint = " Keep the batch dimension (no squeeze / q[0])." if lost else ""
        raise fail(NAME_ATTENTION, f"{where}: expected an output [B, H, T, D] = {[B, H, T, D]}, "
                                   f"got {shape}.{hint}")
    if out.dtype != q.dtype:
        raise fail(NAME_ATTENTION, f"{where}: output dtype {out.dtype}, expected the inputs' "
                                   f"{q.dtype}")
    if out.device != q.device:
        raise fail(NAME_ATTENTION, f"{where}: the output is on {out.device}, the inputs on "
                                   f"{q.device}: build every tensor on q's device")
    return out


def _inputs(B, H, T, past, D, gen):
    q = torch.randn(B, H, T, D, generator=gen) * 1.5
    k = torch.randn(B, H, past + T, D, generator=gen) * 1.5
    v = torch.randn(B, H, past + T, D, generator=gen)
    return q, k, v


def _explain_attention(attention, got, q, k, v, past, where, gen) -> None:
    """Right within 1e-5 of float64, or a failure: a mistake is named only when it explains the
    output on this input AND on a second one of the same shape; otherwise say where it differs."""
    want = float64_attention(q, k, v, past)
    if torch.isnan(got).any():
        raise fail(NAME_ATTENTION, f"{where}: the output has NaN: some query row has every key "
                                   "masked (each query must at least see its own key, j <= "
                                   "past_len + i)")
    if (got - want).abs().max().item() <= 1e-5:
        return
    q2, k2, v2 = _inputs(*q.shape[:3], past, q.shape[3], gen)
    got2 = _attention_output(attention, q2, k2, v2, past, where + ", other values").double()
    name_the_mistake(NAME_ATTENTION, where, [(got, q, k, v), (got2, q2, k2, v2)], past, _MISTAKES,
                     f"your output differs from float64 attention (tolerance 1e-5): "
                     f"{where_wrong(got, want, past, 'past_len')}. Expected softmax(q @ k^T / sqrt(D) + causal "
                     "mask) @ v")


# Low precision is judged against float64 within a stated tolerance: TOL_UNITS units of the
# dtype's rounding (2**-8 for bf16, 2**-11 for fp16) times the largest |v|. Straightforward
# implementations in these dtypes (matmul or einsum, masked_fill or torch.where, softmax in the
# dtype or in float32) stay under a quarter of it.
TOL_UNITS = 16
_UNIT = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def _check_low_precision(attention, gen) -> None:
    for dt, unit in _UNIT.items():
        # the contract's shapes: k and v hold past_len + T positions (a learner may take past_len = S - T)
        q = torch.randn(2, 2, 3, 8, generator=gen).to(dt)
        k, v = (torch.randn(2, 2, 4, 8, generator=gen).to(dt) for _ in range(2))
        where = f"{dt} inputs q [2, 2, 3, 8], k/v [2, 2, 4, 8], past_len=1"
        out = _attention_output(attention, q, k, v, 1, where)
        err = (out.double() - float64_attention(q, k, v, 1)).abs().max().item()
        tol = TOL_UNITS * unit * v.double().abs().max().item()
        if not err <= tol:
            raise fail(NAME_ATTENTION, f"{where}: max abs error {err:.3g} against float64 "
                                       f"attention, above the {dt} tolerance {tol:.3g} "
                                       f"({TOL_UNITS} x {unit:g} rounding x max |v|): with no "
                                       "mistake in float32, look for an overflow in this dtype "
                                       "(a mask value like -1e9 in float16, exp without "
                                       "subtracting the max)")


def _check_meta(attention) -> None:
    """Inputs on the meta device (shapes and dtypes, no data): every tensor the attention makes
    must follow q's device, or the same code fails on a GPU."""
    q, k, v = (torch.empty(2, 2, 3, 8, device="meta") for _ in range(3))
    where = "q, k, v on device='meta' (shapes only), past_len=0"
    try:
        with _no_fused_attention():
            out = attention(q, k, v, 0)
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - the learner's error, named
        raise fail(NAME_ATTENTION, f"{where}: your attention raised {type(e).__name__}: {e}. "
                                   "On a GPU the same happens: a tensor your code creates must be "
                                   "created on q's device, not on the default one") from e
    if not isinstance(out, torch.Tensor) or out.device.type != "meta" or out.shape != q.shape:
        raise fail(NAME_ATTENTION, f"{where}: expected a [2, 2, 3, 8] output on meta, got "
                                   f"{getattr(out, 'shape', type(out).__name__)} on "
                                   f"{getattr(out, 'device', '?')}")


def check_attention(attention) -> None:
    """Grade ``attention(q, k, v, past_len) -> [B, H, T, D]`` against float64 arithmetic, in fp32 on
    every shape of the table (the first one twice: a remembered answer shows), in bf16/fp16 within
    a stated tolerance (the output keeps the inputs' dtype), and on the meta device."""
    gen = torch.Generator().manual_seed(3103)
    for n, (B, H, T, past, D) in enumerate(_ATTENTION_CASES):
        q, k, v = _inputs(B, H, T, past, D, gen)
        where = f"q [{B}, {H}, {T}, {D}], k/v [{B}, {H}, {past + T}, {D}], past_len={past}"
        out = _attention_output(attention, q, k, v, past, where)
        _explain_attention(attention, out.double(), q, k, v, past, where, gen)
        if n == 0:                              # the same shapes again, other values
            q, k, v = _inputs(B, H, T, past, D, gen)
            out = _attention_output(attention, q, k, v, past, where + ", other values")
            _explain_attention(attention, out.double(), q, k, v, past, where, gen)
    _check_low_precision(attention, gen)
    _check_meta(attention)
    passed(NAME_ATTENTION, f"{len(_ATTENTION_CASES)} shapes (prefill, decode, chunks after a past, "
                           "batch > 1) match float64 attention within 1e-5; bf16/fp16 keep their "
                           f"dtype and stay within {TOL_UNITS} rounding units x max |v|; meta "
                           "inputs give a meta output")


# ---------------------------------------------------------------------------------------------------
# end to end


def _batch_prompts(tok, idx, T):
    rows = [fresh_prompts(tok)[i][0, :T] for i in idx]
    return torch.stack(rows)


def _which_piece(hf, KVCache, attention, ids, n, want, detail, second: bool) -> None:
    """Swap each piece for the library's and look again: name the piece that is wrong."""

    cfg = hf.config
    n_layer, n_head, head_dim = kv_dims(cfg)
    ref_cache = PreallocatedCache(n_layer, ids.shape[0], n_head, head_dim, ids.shape[1] + n)
    with_ref_cache = GPT2.from_hf(hf, attention_fn=attention)
    if not torch.equal(generate(with_ref_cache, ids, n, cache=ref_cache), want):
        raise fail(NAME_GENERATE, f"{detail}. It goes wrong with the library's cache too, so the "
                                  "problem is your attention: run check_attention(attention)")
    with_ref_attention = GPT2.from_hf(hf, attention_fn=sdpa_attention, cache_cls=KVCache)
    fresh = with_ref_attention.new_cache(ids.shape[0])
    if second and torch.equal(generate(with_ref_attention, ids, n, cache=fresh), want):
        raise fail(NAME_GENERATE, f"{detail}. With a NEW cache object this prompt comes out "
                                  "right, so the cache is not emptied between prompts: reset() "
                                  "must forget every token and set seq_len back to 0 (generate "
                                  "calls it before each prompt)")
    raise fail(NAME_GENERATE, f"{detail}. It goes wrong with your KVCache (the library's "
                              "attention does not fix it): run check_kv_cache(KVCache); look at "
                              "seq_len (the position of the new tokens) and at where update writes")


def check_generate_with_cache(KVCache, attention) -> None:
    """Your ``KVCache`` and ``attention`` inside :class:`kvlab.gpt2.GPT2`: greedy tokens must equal
    transformers' ``model.generate`` (batch of 2; two prompts in a row through one cache object;
    a one-token prompt in a cache filled exactly). ``generate`` calls ``cache.reset()`` first."""

    hf, tok = grading_model()
    model = GPT2.from_hf(hf, attention_fn=attention, cache_cls=KVCache)
    cache = learner_call(NAME_GENERATE, "KVCache(n_layer, 2, n_head, head_dim, n_positions, "
                                        "float32, 'cpu')", model.new_cache, batch_size=2)
    one = fresh_prompts(tok, lengths=[1])[-1]
    runs = [(_batch_prompts(tok, (0, 2), 9), 12, "first prompt batch", cache),
            (_batch_prompts(tok, (4, 5), 5), 10, "second prompt batch, same cache object", cache),
            (one, 8, "a 1-token prompt, batch 1, max_len=8: the prompt and 7 fed tokens fill "
                     "it exactly", None)]
    for ids, n, which, c in runs:
        # generate writes T + n - 1 positions (the last token is never fed back)
        c = c if c is not None else learner_call(NAME_GENERATE, "KVCache(..., max_len=8)",
                                                 model.new_cache, 1, max_len=ids.shape[1] + n - 1)
        want = torch.cat([hf_greedy(hf, row[None], n) for row in ids])
        where = f"{which} ({ids.shape[0]} x {ids.shape[1]} tokens, {n} new)"
        try:
            out = generate(model, ids, n, cache=c)
        except ValueError as e:
            if "exactly" not in which:
                raise fail(NAME_GENERATE, f"{where}: generation with your pieces raised "
                                          f"ValueError: {e}") from e
            raise fail(NAME_GENERATE, f"{where}: your cache raised ValueError ({e}) although "
                                      "every write fits: T new tokens fit when seq_len + T <= "
                                      "max_len (a write that fills the cache exactly is "
                                      "allowed; > not >=)") from e
        except Exception as e:  # noqa: BLE001 - the learner's error, named
            raise fail(NAME_GENERATE, f"{where}: generation with your pieces raised "
                                      f"{type(e).__name__}: {e}") from e
        if torch.equal(out, want):
            continue
        row = int((out != want).any(1).nonzero()[0])
        i = first_difference(out[row], want[row])
        detail = (f"{where}: row {row}, new token #{i - ids.shape[1] + 1} is {int(out[row, i])}, "
                  f"transformers' greedy token is {int(want[row, i])}")
        _which_piece(hf, KVCache, attention, ids, n, want, detail, second="second" in which)
    passed(NAME_GENERATE, "GPT2 with your KVCache and attention generates transformers' greedy "
                          "tokens exactly (batch 2, two prompts through one cache, a 1-token "
                          "prompt)")


def check_cache_bytes_prediction(KVCache, predicted_bytes) -> None:
    """Grade a predicted byte count for ``KVCache`` at real GPT-2 small's sizes (12 layers, 12 heads
    of 64, 1,024 positions, batch 1, fp32) against the bytes its buffers hold, built on ``meta``."""
    name = "check_cache_bytes_prediction"
    try:
        cache = KVCache(12, 1, 12, 64, 1024, torch.float32, "meta")
    except NotImplementedError:                     # a stub not filled in yet
        raise
    except Exception as e:  # noqa: BLE001
        raise fail(name, f"KVCache(12, 1, 12, 64, 1024, float32, 'meta') raised "
                         f"{type(e).__name__}: {e}") from e
    tensors = list(held_tensors(cache))
    held = sum(t.numel() * t.element_size() for _, t in tensors)
    if not isinstance(predicted_bytes, int) or isinstance(predicted_bytes, bool):
        raise fail(name, "predict a whole number of bytes (an int), got "
                         f"{type(predicted_bytes).__name__}")
    if predicted_bytes != held:
        ratio = predicted_bytes / held if held else float("inf")
        parts = "; ".join(f"{n} {list(t.shape)} {str(t.dtype).replace('torch.', '')}: "
                          f"{t.numel() * t.element_size():,}" for n, t in tensors[:6])
        off = (f"{abs(held - predicted_bytes):,} bytes "
               + ("short" if predicted_bytes < held else "too many")
               + ("" if abs(ratio - 1) < 0.01 else f"; your prediction is {ratio:.3g} times that"))
        raise fail(name, f"you predicted {predicted_bytes:,} bytes; your cache's buffers hold "
                         f"{held:,} ({off}). They are: {parts}"
                         + ("; ..." if len(tensors) > 6 else "") + ". Count keys AND values, "
                         "every layer, max_len positions (it is preallocated), 4 bytes per float32, "
                         "and anything else your class keeps")
    passed(name, f"{held:,} bytes, exactly what the buffers of your KVCache hold at GPT-2 small's "
                 "sizes")
