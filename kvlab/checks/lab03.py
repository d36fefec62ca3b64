"""Graders for lab 3: a hand-built KV cache and causal attention with a cache.

* ``check_kv_cache(KVCache)``: the cache class, against the concatenation of everything written
  (plain tensor bookkeeping, computed here independently);
* ``check_attention(attention)``: ``attention(q, k, v, past_len)`` against float64 arithmetic;
* ``check_generate_with_cache(KVCache, attention)``: both pieces inside :class:`kvlab.gpt2.GPT2`,
  whose greedy tokens must equal transformers' ``model.generate`` token for token.
"""

from __future__ import annotations

import math

import torch

from ..generate import hf_greedy
from ._common import expect_value_error, fail, first_difference, fresh_prompts, grading_model, passed

NAME = "lab03"
NAME_CACHE = "check_kv_cache"
NAME_ATTENTION = "check_attention"
NAME_GENERATE = "check_generate_with_cache"


# ---------------------------------------------------------------------------------------------------
# KVCache


def _make_cache(KVCache, n_layer, batch, heads, head_dim, max_len, dtype):
    try:
        return KVCache(n_layer, batch, heads, head_dim, max_len, dtype, "cpu")
    except Exception as e:  # noqa: BLE001 - any failure is the learner's to fix
        raise fail(NAME_CACHE, f"KVCache({n_layer}, {batch}, {heads}, {head_dim}, {max_len}, {dtype}, 'cpu') "
                               f"raised {type(e).__name__}: {e}. The constructor takes (n_layer, batch_size, "
                               "n_head, head_dim, max_len, dtype, device), positionally") from e


def _seq_len(cache):
    s = cache.seq_len
    return int(s() if callable(s) else s)


def _find(haystack, needle):
    """Offsets o along dim 2 where haystack[:, :, o:] starts with (as much as fits of) needle."""
    T, S = needle.shape[2], haystack.shape[2]
    return [o for o in range(S) if torch.equal(haystack[:, :, o:o + T], needle[:, :, :min(T, S - o)])]


def _run_cache(KVCache, batch, steps, max_len, gen):
    """Feed ``steps`` (new tokens per forward pass) through a fresh cache and check every answer."""
    L, H, D, dt = 3, 2, 4, torch.float64
    cache = _make_cache(KVCache, L, batch, H, D, max_len, dt)
    if _seq_len(cache) != 0:
        raise fail(NAME_CACHE, f"a new cache must have seq_len == 0, got {_seq_len(cache)}")
    past_k = [torch.zeros(batch, H, 0, D, dtype=dt) for _ in range(L)]
    past_v = [torch.zeros(batch, H, 0, D, dtype=dt) for _ in range(L)]
    ptrs = [None] * L
    written = 0
    for step, T in enumerate(steps):
        for layer in range(L):
            k = torch.randn(batch, H, T, D, dtype=dt, generator=gen)
            v = torch.randn(batch, H, T, D, dtype=dt, generator=gen)
            got = cache.update(layer, k.clone(), v.clone())
            want_k = torch.cat([past_k[layer], k], 2)
            want_v = torch.cat([past_v[layer], v], 2)
            where = f"forward pass {step + 1} ({T} new token(s) after {written}), layer {layer}"
            if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
                raise fail(NAME_CACHE, f"{where}: update must return a tuple (keys, values) of tensors")
            keys, values = got
            S = written + T
            if keys.dim() != 4 or values.shape != keys.shape:
                raise fail(NAME_CACHE, f"{where}: keys/values must be [batch, heads, seq, head_dim]; got "
                                       f"{list(keys.shape)} and {list(values.shape)}. Keep the batch dimension")
            if keys.shape[0] != batch:
                raise fail(NAME_CACHE, f"{where}: the returned keys have batch size {keys.shape[0]}, the cache was "
                                       f"made for batch_size={batch}: keep the batch dimension (no squeeze(0))")
            if keys.shape[2] != S:
                if keys.shape[2] == T and S > T:
                    raise fail(NAME_CACHE, f"{where}: update returned only the {T} new token(s); it must "
                                           f"return every key so far ({S}): the past plus the new ones")
                if keys.shape[2] == max_len:
                    raise fail(NAME_CACHE, f"{where}: update returned the whole buffer ({max_len} positions); "
                                           f"return only the filled part, positions 0 .. {S - 1}")
                raise fail(NAME_CACHE, f"{where}: expected {S} keys (cached + new), got {keys.shape[2]}")
            if keys.dtype != dt:
                raise fail(NAME_CACHE, f"{where}: the cache was made with dtype={dt} but returned {keys.dtype}: "
                                       "allocate the buffers with the dtype argument")
            if torch.equal(keys, want_v) and not torch.equal(keys, want_k):
                raise fail(NAME_CACHE, f"{where}: update returned the values where the keys belong (swapped)")
            for got_t, want_t, new, what in ((keys, want_k, k, "keys"), (values, want_v, v, "values")):
                if torch.equal(got_t, want_t):
                    continue
                if batch > 1 and torch.equal(got_t[0], want_t[0]) and torch.equal(got_t[1], want_t[0]):
                    raise fail(NAME_CACHE, f"{where}: every batch row holds row 0's {what}: keep the batch "
                                           "dimension in the buffers ([batch, heads, max_len, head_dim]), do "
                                           "not squeeze or index it away")
                at = _find(got_t, new)
                if at and written not in at:
                    raise fail(NAME_CACHE, f"{where}: the new {what} were written at position {at[0]}, but they "
                                           f"belong at the write offset {written} (= seq_len before this pass): "
                                           f"write positions seq_len .. seq_len+T-1")
                if at == [written] or torch.equal(got_t[:, :, written:], new):
                    raise fail(NAME_CACHE, f"{where}: the new {what} are right but the earlier ones changed: "
                                           "something overwrote the past (wrong offset in an earlier pass?)")
                if not torch.equal(got_t[:, :, :written], want_t[:, :, :written]):
                    raise fail(NAME_CACHE, f"{where}: the cached {what} of earlier passes are wrong; layers must "
                                           "not share storage, and nothing may overwrite the past")
                raise fail(NAME_CACHE, f"{where}: the returned {what} are not the ones written (expected the "
                                       "concatenation of every update of this layer, in order)")
            if ptrs[layer] is not None and keys.data_ptr() != ptrs[layer]:
                raise fail(NAME_CACHE, f"{where}: the returned keys are a new tensor at every pass; preallocate "
                                       "one buffer of max_len positions in __init__, write into it in place and "
                                       "return a view (buffer[..., :seq_len+T, :]), no torch.cat")
            ptrs[layer] = keys.data_ptr()
            past_k[layer], past_v[layer] = want_k, want_v
        n = _seq_len(cache)
        if n != written + T:
            if n == written:
                raise fail(NAME_CACHE, f"after forward pass {step + 1} seq_len is still {n}: it never advances, so "
                                       "the model would give every new token the positions 0.. again (position "
                                       "embeddings restarting at 0). Advance it by T after the LAST layer's update")
            if n == written + L * T:
                raise fail(NAME_CACHE, f"after forward pass {step + 1} seq_len is {n}, expected {written + T}: it "
                                       "advanced once per layer; advance it once per pass, after the last layer")
            raise fail(NAME_CACHE, f"after forward pass {step + 1} ({T} new tokens after {written}) seq_len should "
                                   f"be {written + T}, got {n}")
        written += T
    return cache, written, (L, batch, H, D, dt)


def _tensors(obj):
    """Every tensor an object holds in its attributes (directly, or in lists/tuples/dicts)."""
    for v in vars(obj).values():
        items = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else [v]
        yield from (t for t in items if isinstance(t, torch.Tensor))


def _check_edges(KVCache) -> None:
    """A cache filled exactly to max_len (no error), and one made on device='meta'."""
    c = _make_cache(KVCache, 2, 1, 2, 4, 6, torch.float32)
    for T in (4, 2):
        for layer in range(2):
            try:
                c.update(layer, torch.ones(1, 2, T, 4), torch.ones(1, 2, T, 4))
            except Exception as e:  # noqa: BLE001
                raise fail(NAME_CACHE, f"filling a max_len=6 cache EXACTLY (4 tokens, then 2) raised "
                                       f"{type(e).__name__}: {e}: the last position is max_len - 1, and "
                                       "T tokens fit when seq_len + T <= max_len") from e
    try:
        meta = KVCache(1, 1, 2, 4, 8, torch.float16, "meta")
        keys, _ = meta.update(0, torch.ones(1, 2, 3, 4, dtype=torch.float16, device="meta"),
                              torch.ones(1, 2, 3, 4, dtype=torch.float16, device="meta"))
    except Exception as e:  # noqa: BLE001
        raise fail(NAME_CACHE, f"KVCache(..., torch.float16, 'meta') raised {type(e).__name__}: {e}") from e
    where = {str(t.device) for t in _tensors(meta)} | {str(keys.device)}
    if where != {"meta"} or keys.dtype != torch.float16:
        raise fail(NAME_CACHE, f"a cache made with device='meta', dtype=float16 keeps tensors on {where}, "
                               f"returns {keys.dtype}: allocate the buffers with the device and dtype given")


def check_kv_cache(KVCache) -> None:
    """Grade a preallocated cache class ``KVCache(n_layer, batch_size, n_head, head_dim, max_len, dtype, device)``."""
    gen = torch.Generator().manual_seed(3003)
    max_len = 13
    steps = [5, 1, 1, 3, 1]
    try:
        cache, written, (L, B, H, D, dt) = _run_cache(KVCache, 2, steps, max_len, gen)
    except AssertionError:
        raise
    except Exception as e:  # noqa: BLE001
        try:  # does it at least work for one prompt? Then the batch dimension is the problem.
            _run_cache(KVCache, 1, steps, max_len, torch.Generator().manual_seed(1))
            works_b1 = True
        except Exception:  # noqa: BLE001
            works_b1 = False
        if works_b1:
            raise fail(NAME_CACHE, f"with batch_size=2 your cache raised {type(e).__name__}: {e}. It works with "
                                   "batch_size=1: keep the batch dimension, buffers [batch, heads, max_len, "
                                   "head_dim], and write k as a whole (no squeeze(0) or k[0])") from e
        raise fail(NAME_CACHE, f"your cache raised {type(e).__name__}: {e}") from e

    # One more token than fits must be refused, not silently dropped or wrapped around.
    room = max_len - written
    k = torch.randn(B, H, room + 1, D, dtype=dt, generator=gen)
    expect_value_error(NAME_CACHE, f"writing {room + 1} tokens when only {room} of max_len={max_len} "
                                   "positions are free", cache.update, 0, k, k.clone())
    _check_edges(KVCache)

    # reset() must really forget: a second prompt must not see the first one's keys.
    cache.reset()
    if _seq_len(cache) != 0:
        raise fail(NAME_CACHE, f"after reset() seq_len is {_seq_len(cache)}, not 0: reset() must forget every token "
                               "(otherwise the next prompt attends to the previous prompt's keys and gets "
                               "shifted positions)")
    for layer in range(L):
        k = torch.randn(B, H, 2, D, dtype=dt, generator=gen)
        keys, values = cache.update(layer, k, k + 1)
        if keys.shape[2] != 2 or not torch.equal(keys, k) or not torch.equal(values, k + 1):
            raise fail(NAME_CACHE, f"after reset(), the first update of layer {layer} returned {keys.shape[2]} "
                                   "keys that are not just the 2 new ones: reset() must empty the cache")
    if _seq_len(cache) != 2:
        raise fail(NAME_CACHE, f"after reset() and one pass of 2 tokens, seq_len should be 2, got {_seq_len(cache)}")
    # A batch-1, float32 cache works too (the dtype argument is honoured).
    c1 = _make_cache(KVCache, 1, 1, 1, 8, 4, torch.float32)
    keys, _ = c1.update(0, torch.ones(1, 1, 4, 8), torch.ones(1, 1, 4, 8))
    if keys.dtype != torch.float32 or _seq_len(c1) != 4:
        raise fail(NAME_CACHE, f"a float32 cache with one layer returned dtype {keys.dtype} and seq_len "
                               f"{_seq_len(c1)} after 4 tokens (expected float32, 4)")
    passed(NAME_CACHE, f"batch 2, {L} layers, passes of {steps} tokens: every update returns exactly what was "
                       "written, in place; seq_len, overflow and reset() behave")


# ---------------------------------------------------------------------------------------------------
# attention


def reference_attention(q, k, v, past_len, scale="sqrt", mask="causal"):
    """float64 attention (and the usual mistakes, for diagnosis)."""
    q, k, v = q.double(), k.double(), v.double()
    T, S, D = q.shape[2], k.shape[2], q.shape[3]
    s = {"sqrt": 1 / math.sqrt(D), "D": 1 / D, "none": 1.0}[scale]
    scores = torch.einsum("bhtd,bhsd->bhts", q, k) * s
    qpos = torch.arange(T)[:, None] + (past_len if mask in ("causal", "strict") else 0)
    kpos = torch.arange(S)[None, :]
    allowed = {"causal": kpos <= qpos, "topleft": kpos <= qpos, "strict": kpos < qpos,
               "none": torch.ones(T, S, dtype=torch.bool)}[mask]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("bhts,bhsd->bhtd", torch.softmax(scores, -1), v)


_MISTAKES = [
    (dict(mask="none"), "there is no causal mask: a new token at position past_len+i may only attend to keys "
                        "0 .. past_len+i; mask the scores of later keys with -inf before the softmax"),
    (dict(mask="topleft"), "the causal mask ignores past_len: query i is the token at position past_len+i, so it "
                           "sees keys 0 .. past_len+i, not 0 .. i (torch.tril on a [T, S] matrix, or "
                           "is_causal=True, aligns the mask to the wrong corner when past_len > 0)"),
    (dict(mask="strict"), "the mask hides each query's own key: key j is allowed when j <= past_len+i (<=, not <)"),
    (dict(scale="D"), "wrong softmax scale: the scores are divided by D; divide by sqrt(D) (head_dim ** 0.5)"),
    (dict(scale="none"), "the scores are not scaled: divide q @ k^T by sqrt(D) before the softmax"),
    (dict(scale="D", mask="none"), "no causal mask AND the scores are divided by D instead of sqrt(D)"),
    (dict(scale="none", mask="none"), "no causal mask AND no 1/sqrt(D) scaling of the scores"),
    (dict(scale="D", mask="topleft"), "wrong scale (1/D, use 1/sqrt(D)) AND the mask ignores past_len"),
    (dict(scale="none", mask="topleft"), "no 1/sqrt(D) scaling AND the mask ignores past_len"),
]


def check_attention(attention) -> None:
    """Grade ``attention(q, k, v, past_len) -> [B, H, T, D]`` against float64 arithmetic."""
    gen = torch.Generator().manual_seed(3103)
    # (B, H, T, past_len, D): a prefill, decode steps, a chunk after a past, a tall batch
    cases = [(2, 3, 6, 0, 8), (2, 3, 1, 9, 8), (3, 2, 4, 5, 16), (1, 4, 7, 0, 32), (2, 2, 1, 0, 4),
             (2, 1, 3, 2, 8)]
    for B, H, T, past, D in cases:
        S = past + T
        q = torch.randn(B, H, T, D, generator=gen) * 1.5
        k = torch.randn(B, H, S, D, generator=gen) * 1.5
        v = torch.randn(B, H, S, D, generator=gen)
        saved = [t.clone() for t in (q, k, v)]
        where = f"q [{B}, {H}, {T}, {D}], k/v [{B}, {H}, {S}, {D}], past_len={past}"
        try:
            out = attention(q, k, v, past)
        except Exception as e:  # noqa: BLE001
            hint = " (does it only work for batch 1?)" if B > 1 else ""
            raise fail(NAME_ATTENTION, f"{where}: attention raised {type(e).__name__}: {e}{hint}") from e
        if not all(torch.equal(a, b) for a, b in zip((q, k, v), saved)):
            raise fail(NAME_ATTENTION, f"{where}: attention modified its inputs in place; compute new tensors")
        if not isinstance(out, torch.Tensor) or list(out.shape) != [B, H, T, D]:
            shape = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            lost_batch = isinstance(out, torch.Tensor) and (out.dim() != 4 or out.shape[0] != B)
            hint = " Keep the batch dimension (no squeeze / q[0])." if lost_batch else ""
            raise fail(NAME_ATTENTION, f"{where}: expected an output [B, H, T, D] = {[B, H, T, D]}, got {shape}.{hint}")
        if out.dtype != q.dtype:
            raise fail(NAME_ATTENTION, f"{where}: output dtype {out.dtype}, expected the inputs' {q.dtype}")
        want = reference_attention(q, k, v, past)
        got = out.double()
        if torch.isnan(got).any():
            raise fail(NAME_ATTENTION, f"{where}: the output has NaN: some query row has every key masked "
                                       "(each query must at least see its own key, j <= past_len + i)")
        err = (got - want).abs().max().item()
        if err <= 1e-5:
            continue
        if B > 1 and torch.allclose(got[0], want[0], atol=1e-5) and not torch.allclose(got[1:], want[1:], atol=1e-5):
            raise fail(NAME_ATTENTION, f"{where}: batch row 0 is right but the other rows are not: it only works "
                                       "for batch size 1; keep the batch dimension in every operation")
        for kwargs, message in _MISTAKES:
            if torch.allclose(got, reference_attention(q, k, v, past, **kwargs), atol=1e-5):
                raise fail(NAME_ATTENTION, f"{where}: {message}")
        raise fail(NAME_ATTENTION, f"{where}: max abs error {err:.2e} against float64 attention (tolerance 1e-5); "
                                   "expected softmax(q @ k^T / sqrt(D) + causal mask) @ v")
    for dt in (torch.bfloat16, torch.float16):
        q, k, v = (torch.randn(2, 2, 3, 8, generator=gen).to(dt) for _ in range(3))
        out = attention(q, k, v, 0)
        if not isinstance(out, torch.Tensor) or out.dtype != dt:
            raise fail(NAME_ATTENTION, f"{dt} inputs: the output must be {dt} too, got "
                                       f"{getattr(out, 'dtype', type(out).__name__)}")
        if (out.double() - reference_attention(q, k, v, 0)).abs().max() > 3e-2:
            raise fail(NAME_ATTENTION, f"{dt} inputs: the output is far from float64 attention")
    passed(NAME_ATTENTION, f"{len(cases)} shapes (prefill, decode, chunks after a past, batch > 1) match float64 "
                           "attention within 1e-5")


# ---------------------------------------------------------------------------------------------------
# end to end


def _batch_prompts(tok, idx, T):
    rows = [fresh_prompts(tok)[i][0, :T] for i in idx]
    return torch.stack(rows)


def check_generate_with_cache(KVCache, attention) -> None:
    """Your ``KVCache`` and ``attention`` inside :class:`kvlab.gpt2.GPT2`: greedy tokens must equal
    transformers' ``model.generate`` (batch of 2; two prompts in a row through one cache object;
    a one-token prompt). ``kvlab.gpt2.generate`` calls ``cache.reset()`` at the start of every call."""
    from ..cache import PreallocatedCache
    from ..gpt2 import GPT2, generate, sdpa_attention

    hf, tok = grading_model()
    model = GPT2.from_hf(hf, attention_fn=attention, cache_cls=KVCache)
    try:
        cache = model.new_cache(batch_size=2)
    except Exception as e:  # noqa: BLE001
        raise fail(NAME_GENERATE, f"KVCache(n_layer, 2, n_head, head_dim, n_positions, float32, 'cpu') raised "
                                  f"{type(e).__name__}: {e}") from e
    runs = [(_batch_prompts(tok, (0, 2), 9), 12, "first"), (_batch_prompts(tok, (4, 5), 5), 10, "second")]
    for ids, n, which in runs:
        want = torch.cat([hf_greedy(hf, row[None], n) for row in ids])
        where = (f"{which} prompt batch ({ids.shape[0]} x {ids.shape[1]} tokens, {n} new), through the same "
                 "cache object as the " + ("previous batch" if which == "second" else "next one"))
        try:
            out = generate(model, ids, n, cache=cache)
        except Exception as e:  # noqa: BLE001
            raise fail(NAME_GENERATE, f"{where}: generation with your pieces raised {type(e).__name__}: {e}") from e
        if torch.equal(out, want):
            continue
        row = int((out != want).any(1).nonzero()[0])
        i = first_difference(out[row], want[row])
        detail = (f"{where}: row {row}, new token #{i - ids.shape[1] + 1} is {int(out[row, i])}, "
                  f"transformers' greedy token is {int(want[row, i])}")
        # Which piece? Swap each one for the library's and look again.
        with_ref_cache = GPT2.from_hf(hf, attention_fn=attention)
        if not torch.equal(generate(with_ref_cache, ids, n, cache=PreallocatedCache(
                hf.config.n_layer, ids.shape[0], hf.config.n_head, hf.config.n_embd // hf.config.n_head,
                ids.shape[1] + n)), want):
            raise fail(NAME_GENERATE, f"{detail}. It goes wrong with the library's cache too, so the problem is "
                                      "your attention: run check_attention(attention) for details")
        with_ref_attention = GPT2.from_hf(hf, attention_fn=sdpa_attention, cache_cls=KVCache)
        if which == "second" and torch.equal(generate(with_ref_attention, ids, n, cache=model.new_cache(2)), want):
            raise fail(NAME_GENERATE, f"{detail}. With a NEW cache object this prompt comes out right, so the "
                                      "cache is not emptied between prompts: reset() must forget every token and "
                                      "set seq_len back to 0 (generate calls it before each prompt)")
        raise fail(NAME_GENERATE, f"{detail}. It goes wrong with your KVCache (the library's attention does not "
                                  "fix it): run check_kv_cache(KVCache); look at seq_len (the position of the new "
                                  "tokens) and at where update writes")
    # A one-token prompt, batch 1, in a cache exactly as long as the text.
    ids = fresh_prompts(tok, lengths=[1])[-1]
    n = 8
    try:
        out = generate(model, ids, n, cache=model.new_cache(1, max_len=1 + n))
    except Exception as e:  # noqa: BLE001
        raise fail(NAME_GENERATE, f"a 1-token prompt, 8 new tokens, batch 1, max_len=9: raised "
                                  f"{type(e).__name__}: {e}") from e
    if not torch.equal(out, hf_greedy(hf, ids, n)):
        raise fail(NAME_GENERATE, "a 1-token prompt, batch 1: the tokens differ from transformers' greedy tokens")
    passed(NAME_GENERATE, "GPT2 with your KVCache and attention generates transformers' greedy tokens exactly "
                          "(batch 2, two prompts through one cache, a 1-token prompt)")


def check_cache_bytes_prediction(KVCache, predicted_bytes) -> None:
    """Grade a predicted byte count for ``KVCache`` at real GPT-2 small's sizes (12 layers, 12 heads
    of 64, 1,024 positions, batch 1, fp32) against the bytes its buffers hold, built on ``meta``."""
    name = "check_cache_bytes_prediction"
    try:
        cache = KVCache(12, 1, 12, 64, 1024, torch.float32, "meta")
    except Exception as e:  # noqa: BLE001
        raise fail(name, f"KVCache(12, 1, 12, 64, 1024, float32, 'meta') raised {type(e).__name__}: {e}") from e
    held = sum(t.numel() * t.element_size() for t in _tensors(cache))
    if not isinstance(predicted_bytes, int) or isinstance(predicted_bytes, bool):
        raise fail(name, f"predict a whole number of bytes (an int), got {type(predicted_bytes).__name__}")
    if predicted_bytes != held:
        ratio = predicted_bytes / held if held else float("inf")
        raise fail(name, f"you predicted {predicted_bytes:,} bytes; your cache's buffers hold {held:,} "
                         f"(your prediction is {ratio:.3g} times that): count keys AND values, every "
                         "layer, max_len positions (it is preallocated), 4 bytes per float32")
    passed(name, f"{held:,} bytes, exactly what the buffers of your KVCache hold at GPT-2 small's sizes")
