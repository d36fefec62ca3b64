"""Graders for lab 8: a static KV cache, attention over it, and a decode step compiled once.

* ``check_static_cache(StaticKVCache)``: fixed-shape buffers written in place at a position held
  in a tensor, against plain slicing bookkeeping done here (float64, batch 3, a rewind included);
* ``check_static_attention(static_attention)``: attention over all ``max_len`` slots, the slots
  after each query's position hidden, against float64 arithmetic with stale keys in those slots;
* ``check_no_recompile(StaticKVCache, static_attention)``: both pieces in the hand-built GPT-2's
  decode step (:class:`kvlab.static.StaticDecoder`), compiled; 50 decode steps must give
  transformers' greedy tokens, and torch's own counters must show one graph, no graph break;
* ``check_static_generate(static_generate)``: the learner's decode loop (the prompt eagerly, then
  every token through a compiled step at a position held in a tensor), token for token, one graph;
* ``check_hidden_nan(static_attention, nan_in_keys, nan_in_values)``: the learner's prediction of
  what a NaN left in a hidden slot does to the output, against what their attention really does.

Each check also watches for reads of a tensor's value back into Python (``int(pos)``,
``pos.item()``, slicing with ``pos``, ``.tolist()``, ``.numpy()``, iterating over a tensor): eager
code does not mind, ``torch.compile`` does (a graph break, then a new graph or guard for every new
value); for the caller's ``pos`` changed in place; and for tensors made on the wrong device (on
``meta``: no GPU needed).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from types import SimpleNamespace

import torch

from kvlab.reference import hf_greedy
from kvlab.reference import first_difference
from ._common import (ValueReads, call_unmodified, confirmed, fail, fresh_prompts, grading_model,
                      held_tensors, learner_call, misplaced, passed)
from kvlab.gpt2 import GPT2
from ._attention import float64_attention, name_the_mistake, where_wrong
from kvlab.static import StaticKVCache, StaticDecoder

NAME_CACHE = "check_static_cache"
NAME_ATTENTION = "check_static_attention"
NAME_COMPILE = "check_no_recompile"
NAME_LOOP = "check_static_generate"
NAME_NAN = "check_hidden_nan"

_READS_POS = ("reads the position back into Python (seen: {how}; int(pos), pos.item(), pos.tolist(), slicing a "
              "buffer at pos all do). Eagerly that works; under torch.compile it is a graph break, "
              "or the number becomes a constant of the graph, so every new position compiles a new one. Keep "
              "pos a tensor, and compute the slots from it as tensors too")


def _reads(how: str, attention: bool = False) -> str:
    text = _READS_POS.format(how=how)
    if attention:
        return text.split(". Keep")[0] + (". Build the mask from tensors: compare the slot numbers with "
                                          "the queries' positions, pos kept a tensor")
    return text


def _call(check, what, fn, *args):
    """``fn(*args)`` watched for values read back into Python and for arguments changed in place (the
    caller's ``pos`` too); returns ``(result, reads)``, ``reads`` naming each way a value was read."""
    reads = ValueReads()

    @functools.wraps(fn)
    def watched(*a):
        with reads:
            return fn(*a)
    return call_unmodified(check, what, watched, *args), reads.named()


# ---------------------------------------------------------------------------------------------------
# StaticKVCache


def _found_at(buf, new):
    """Offsets along dim 1 of ``buf [H, S, D]`` where the block ``new [H, T, D]`` sits."""
    T, S = new.shape[1], buf.shape[1]
    return [o for o in range(S - T + 1) if torch.equal(buf[:, o:o + T], new)]


def _bad_rows(o):
    """With row 0's new keys at ``pos``: the other rows whose new keys sit elsewhere, and where."""
    if o.B < 2 or o.pos not in _found_at(o.keys[0], o.new_k[0]):
        return []
    found = [(b, _found_at(o.keys[b], o.new_k[b])) for b in range(1, o.B)]
    return [(b, at) for b, at in found if at and o.pos not in at]


def _pair(got):
    """(keys, values) as a tuple or a list, as the model's cache adapter unpacks either."""
    return isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)


def _unwritten_dirty(o):
    """The slots never written hold something other than zeros (the rest being right)."""
    dirty = (o.keys[:, :, ~o.written] != 0).any() or (o.values[:, :, ~o.written] != 0).any()
    return bool(dirty) and torch.equal(o.keys[:, :, o.written], o.want_k[:, :, o.written])


def _at0(o):
    """Where batch row 0's new keys sit in row 0 of the returned keys."""
    return _found_at(o.keys[0], o.new_k[0])


# (name, mistake present?, message). Checked in order on every update; the first hit fails.
_CACHE_MISTAKES = [
    ("not a pair", lambda o: not _pair(o.got), "update must return (keys, values), a tuple of two tensors"),
    ("sliced", lambda o: o.keys.dim() == 4 and o.keys.shape[2] == o.pos + o.T < o.max_len,
     "update returned positions 0 .. pos+T-1 only, a slice to the current length: its shape then "
     "changes at every step, and a compiled step recompiles for every new shape. Return the WHOLE "
     "buffers [batch, heads, max_len, head_dim]; the attention mask hides the slots not written yet"),
    ("only new", lambda o: o.keys.dim() == 4 and o.keys.shape[2] == o.T < o.max_len,
     "update returned only the T new positions; return the whole buffers "
     "[batch, heads, max_len, head_dim]"),
    ("reads pos", lambda o: bool(o.reads), "update {reads}"),
    ("shape", lambda o: list(o.keys.shape) != o.full or o.values.shape != o.keys.shape,
     "update must return the full buffers, each [batch, heads, max_len, head_dim] = {full}; got "
     "{kshape} and {vshape}"),
    ("dtype", lambda o: o.keys.dtype != o.dtype or o.values.dtype != o.dtype,
     "the cache was made with dtype={dtype} but returned {kdtype}: allocate the buffers with the dtype "
     "argument"),
    ("new tensor", lambda o: o.ptr is not None and o.keys.data_ptr() != o.ptr,
     "update returned a different tensor than at the previous step: allocate each buffer ONCE in "
     "__init__ and write into it in place (a compiled step, and a CUDA graph even more, holds the "
     "buffers it was built with)"),
    ("one buffer", lambda o: torch.equal(o.keys, o.values) and not torch.equal(o.want_k, o.want_v),
     "update returned the same contents for the keys and the values: they share one buffer (or one "
     "is written over the other). Keys and values need a buffer each"),
    ("swapped", lambda o: torch.equal(o.keys, o.want_v) and torch.equal(o.values, o.want_k)
     and not torch.equal(o.keys, o.want_k),
     "update returned the values where the keys belong and the keys where the values belong "
     "(swapped)"),
    ("row 0 everywhere", lambda o: o.B > 1 and not torch.equal(o.want_k[1], o.want_k[0])
     and all(torch.equal(o.keys[b], o.want_k[0]) for b in range(o.B)),
     "every batch row holds row 0's keys: write k as a whole ([batch, heads, T, head_dim]), not k[0]"),
    ("wrong slot per row", lambda o: bool(_bad_rows(o)),
     "batch row 0's new keys are at slot {pos}, but {bad_rows}: with batch > 1 every row writes at "
     "the SAME slots pos .. pos+T-1 (the position is shared by the batch; the batch is dimension 0, "
     "the slots dimension 2)"),
    ("row 0 only", lambda o: o.B > 1 and torch.equal(o.keys[0], o.want_k[0])
     and not any(torch.equal(o.keys[b], o.want_k[b]) for b in range(1, o.B)),
     "only batch row 0 is written correctly; the other rows are not: every batch row writes its "
     "new keys and values at the same slots"),
    ("ignores pos", lambda o: o.rewind and o.pos not in _at0(o),
     "update was called with pos={pos} (a rewind: slots are rewritten, as after a rejected speculative "
     "token) and did not write there: the position is the pos argument; do not keep a counter of "
     "your own"),
    ("wrong slot", lambda o: o.pos not in _at0(o) and bool(_at0(o)),
     "the new keys were written at slot {found}, not at pos={pos}: write slots pos .. pos+T-1"),
    ("not empty", _unwritten_dirty,
     "slots never written hold something other than zeros: a new cache (and one after reset()) must "
     "be empty, all zeros, whatever memory the buffers were allocated from. The mask hides those slots; "
     "exercise 4 asks whether that is enough"),
    ("past changed", lambda o: not torch.equal(o.keys[:, :, o.kept], o.want_k[:, :, o.kept]),
     "the new keys are right but earlier slots changed: something overwrote the past (layers sharing one "
     "buffer, or writing more than T slots)"),
    ("wrong", lambda o: not (torch.equal(o.keys, o.want_k) and torch.equal(o.values, o.want_v)),
     "the returned buffers do not hold what was written (expected every update of this layer at its "
     "slots, zeros elsewhere)"),
]


def _make_cache(StaticKVCache, L, B, H, D, max_len, dtype, device="cpu"):
    try:
        return StaticKVCache(L, B, H, D, max_len, dtype, device)
    except NotImplementedError:                     # a stub not filled in yet: its own message
        raise
    except Exception as e:  # noqa: BLE001
        raise fail(NAME_CACHE, f"StaticKVCache({L}, {B}, {H}, {D}, {max_len}, {dtype}, {device!r}) raised "
                               f"{type(e).__name__}: {e}. The constructor takes (n_layer, batch_size, n_head, "
                               "head_dim, max_len, dtype, device), positionally") from e


def _grade_update(cache, state, layer, k, v, pos, where, rewind=False):
    """One ``update`` against the bookkeeping in ``state`` (the buffers as they should be)."""
    T = k.shape[2]
    got, reads = _call(NAME_CACHE, f"{where}: update(layer, k, v, pos)", cache.update, layer, k.clone(),
                       v.clone(), torch.tensor(pos))
    state.want_k[layer][:, :, pos:pos + T] = k
    state.want_v[layer][:, :, pos:pos + T] = v
    state.written[layer][pos:pos + T] = True
    keys, values = got if _pair(got) else (torch.zeros(0), torch.zeros(0))
    kept = state.written[layer].clone()
    kept[pos:pos + T] = False
    last = state.last[layer]
    o = SimpleNamespace(got=got, keys=keys, values=values, reads=reads, pos=pos, T=T, B=k.shape[0],
                        max_len=state.max_len, full=[k.shape[0], k.shape[1], state.max_len, k.shape[3]],
                        dtype=k.dtype, ptr=None if last is None else last.data_ptr(),
                        want_k=state.want_k[layer], want_v=state.want_v[layer], new_k=k,
                        written=state.written[layer], kept=kept, rewind=rewind)
    for _name, present, message in _CACHE_MISTAKES:
        if present(o):
            same = keys.dim() == 4 and keys.shape[1] == k.shape[1] and keys.shape[3] == k.shape[3]
            found = (_found_at(keys[0], k[0]) or ["?"])[0] if same else "?"
            bad = ", ".join(f"row {b}'s are at slot {at[0]}" for b, at in _bad_rows(o)) if same else ""
            raise fail(NAME_CACHE, f"{where}: " + message.format(
                full=o.full, kshape=list(keys.shape), vshape=list(values.shape), dtype=o.dtype,
                kdtype=keys.dtype, pos=pos, found=found, bad_rows=bad, reads=_reads(reads)))
    # Keep the returned tensor itself, not only its address: a copy freed here could be handed the
    # same memory at the next step, and an address compare would then miss it.
    state.last[layer] = keys


def _run_passes(cache, state, passes, gen, what):
    L, B, H, D = state.dims
    for step, (pos, T, rewind) in enumerate(passes):
        for layer in range(L):
            k = torch.randn(B, H, T, D, dtype=torch.float64, generator=gen)
            v = torch.randn(B, H, T, D, dtype=torch.float64, generator=gen)
            where = f"{what}, pass {step + 1}: {T} token(s) at pos={pos}, layer {layer}"
            _grade_update(cache, state, layer, k, v, pos, where, rewind)


def _fresh_state(L, B, H, D, max_len):
    shape = (B, H, max_len, D)
    return SimpleNamespace(dims=(L, B, H, D), max_len=max_len, last=[None] * L,
                           want_k=[torch.zeros(shape, dtype=torch.float64) for _ in range(L)],
                           want_v=[torch.zeros(shape, dtype=torch.float64) for _ in range(L)],
                           written=[torch.zeros(max_len, dtype=torch.bool) for _ in range(L)])


def _check_small_cases(StaticKVCache) -> None:
    """float32 at the last slot; two caches alive at once; a cache made on the meta device."""
    c1 = _make_cache(StaticKVCache, 1, 1, 1, 8, 4, torch.float32)
    one = torch.ones(1, 1, 1, 8)
    keys, _ = _call(NAME_CACHE, "update on a float32 cache", c1.update, 0, one, one.clone(),
                    torch.tensor(3))[0]
    if keys.dtype != torch.float32 or not torch.equal(keys[0, 0, :, 0], torch.tensor([0.0, 0, 0, 1])):
        raise fail(NAME_CACHE, "a float32 cache of max_len=4, one token written at pos=3: expected a float32 "
                               f"buffer [0, 0, 0, 1] along the slots, got {keys.dtype} {keys[0, 0, :, 0].tolist()}")
    c2 = _make_cache(StaticKVCache, 1, 1, 1, 8, 4, torch.float32)
    _call(NAME_CACHE, "update on a second cache", c2.update, 0, one * 2, one * 2, torch.tensor(3))
    if not torch.equal(keys[0, 0, :, 0], torch.tensor([0.0, 0, 0, 1])):
        raise fail(NAME_CACHE, "two caches alive at once: writing into the second changed the first one's "
                               "buffers. Every cache needs buffers of its own (made in __init__, kept on "
                               "self; not on the class or in a global)")
    meta = _make_cache(StaticKVCache, 2, 1, 2, 4, 8, torch.float16, "meta")
    bad = misplaced(list(held_tensors(meta)), "meta", torch.float16)
    if bad:
        raise fail(NAME_CACHE, f"a cache made with device='meta', dtype=float16 holds {', '.join(bad[:4])}. "
                               "Allocate the buffers with the device and dtype given")
    k = torch.empty(1, 2, 3, 4, dtype=torch.float16, device="meta")
    try:
        got = meta.update(0, k, k.clone(), torch.tensor(2, device="meta"))
    except Exception as e:  # noqa: BLE001 - the learner's error, named
        raise fail(NAME_CACHE, f"update on a cache made with device='meta' (shapes only) raised "
                               f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. On a GPU "
                               "the same happens: create every tensor on the cache's device, not on the "
                               "default one") from e
    bad = misplaced(list(held_tensors(meta)) + [("the returned keys", got[0])], "meta", torch.float16)
    if bad:
        raise fail(NAME_CACHE, f"a cache made with device='meta', dtype=float16: {', '.join(bad[:4])}. "
                               "Allocate the buffers with the device and dtype given")


def check_static_cache(StaticKVCache) -> None:
    """Grade ``StaticKVCache(n_layer, batch_size, n_head, head_dim, max_len, dtype, device)`` with
    ``update(layer, k, v, pos) -> (keys, values)`` (the full buffers) and ``reset()``."""
    gen = torch.Generator().manual_seed(8008)
    L, B, H, D, max_len = 3, 3, 2, 4, 12
    # (pos, T, rewind): a prefill, decode steps, a chunk, then a rewind over written slots.
    passes = [(0, 4, False), (4, 1, False), (5, 1, False), (6, 3, False), (3, 2, True), (5, 1, True)]
    cache = _make_cache(StaticKVCache, L, B, H, D, max_len, torch.float64)
    bad = misplaced(list(held_tensors(cache)), "cpu", torch.float64)
    if bad:      # before any update: a float32 buffer would make torch's own copy fail, unexplained
        raise fail(NAME_CACHE, f"StaticKVCache({L}, {B}, {H}, {D}, {max_len}, torch.float64, 'cpu') holds "
                               f"{', '.join(bad[:4])}: the buffers were not made with the dtype (and device) "
                               "the constructor is given, so the model's keys (in that dtype) cannot be "
                               "written into them. Pass both to every tensor you allocate")
    state = _fresh_state(L, B, H, D, max_len)
    _run_passes(cache, state, passes, gen, "a new cache")
    last = list(state.last)
    held = dict(held_tensors(cache))                 # the tensors, kept alive: their memory stays theirs
    _call(NAME_CACHE, "reset()", cache.reset)
    state = _fresh_state(L, B, H, D, max_len)
    state.last = last                                # reset() must keep the very same buffers
    try:
        _run_passes(cache, state, [(0, 2, False), (2, 1, False)], gen, "after reset()")
    except AssertionError as e:
        if "zeros" in str(e) or "earlier slots" in str(e) or "do not hold" in str(e):
            raise fail(NAME_CACHE, "after reset(), the buffers still hold the previous prompt's keys and "
                                   "values in the slots the new prompt has not written yet: a cache after "
                                   "reset() must be as empty as a new one (all zeros), in the same tensors. "
                                   "The mask hides those slots; exercise 4 asks whether that is enough") from e
        if "different tensor" in str(e):
            moved = [n for n, t in held_tensors(cache) if n in held and held[n].data_ptr() != t.data_ptr()]
            why = (f"reset() allocated new buffers ({', '.join(moved[:3])} moved)" if moved else
                   "after reset(), update returns a new tensor, not the buffers it returned before "
                   "(a copy?)")
            raise fail(NAME_CACHE, f"{why}: a compiled decode step (and a CUDA graph) keeps using the "
                                   "tensors it was built with. Keep the very same buffers and empty them in "
                                   "place") from e
        raise
    _check_small_cases(StaticKVCache)
    passed(NAME_CACHE, f"batch {B}, {L} layers: fixed-shape buffers written in place at a tensor position "
                       "(rewinds included), never read back into Python, pos left unchanged; reset() empties "
                       "them in place; two caches apart; fp16 on device='meta' stays there")


# ---------------------------------------------------------------------------------------------------
# static_attention


_ATTENTION_MISTAKES = [
    (dict(mask="none"), "there is no mask: all max_len slots are attended, including the ones not written yet "
                        "(zeros, or an earlier prompt's stale keys). Hide every slot j > pos + i for query i"),
    (dict(mask="chunk_only"), "the slots after the new tokens (j >= pos + T: not written yet, zeros or stale "
                              "keys) are attended: the mask must hide EVERY slot j > pos + i, written or not"),
    (dict(mask="written"), "the mask hides the unwritten slots but not the future inside a chunk: with T > 1 new "
                           "tokens, query i (at position pos + i) must not see the later new tokens; hide "
                           "j > pos + i, not just j >= pos + T"),
    (dict(mask="topleft"), "the mask ignores pos: query i sits at position pos + i, so it sees slots 0 .. pos+i, "
                           "not 0 .. i (torch.tril on [T, max_len] or is_causal=True draws the wrong triangle)"),
    (dict(mask="strict"), "the mask hides each query's own slot: slot j is allowed when j <= pos + i (<=, not <)"),
    (dict(scale="D"), "wrong scale: the scores are divided by D; divide by sqrt(D)"),
    (dict(scale="none"), "the scores are not scaled: divide q @ k^T by sqrt(D) before the softmax"),
    (dict(scale="tiny"), "the scale is 1/8 whatever the head size: kvlab-tiny's 1/sqrt(64) is written in; "
                         "D is the last dimension of q"),
    (dict(mask="none", scale="D"), "no mask AND the scores divided by D instead of sqrt(D)"),
    (dict(mask="chunk_only", scale="D"), "unwritten slots attended AND the scores divided by D, not sqrt(D)"),
]

# (B, H, T, pos, max_len, D, what the slots after pos + T - 1 hold)
_ATTENTION_CASES = [   # the chunk first: it tells the mask mistakes apart
    (3, 2, 3, 4, 10, 16, "stale"),    # a chunk after a past
    (2, 3, 1, 5, 12, 8, "stale"),     # a decode step; an earlier prompt's keys lie beyond
    (2, 2, 4, 0, 9, 8, "zeros"),      # a prefill into an empty cache
    (1, 4, 1, 0, 6, 4, "stale"),      # the first decode step of a one-token prompt
    (2, 1, 1, 10, 11, 8, "stale"),    # the last slot
    (2, 2, 2, 7, 16, 8, "loud"),      # stale keys that dominate every score if attended
]


def _attention_inputs(B, H, T, pos, S, D, fill, gen):
    q = torch.randn(B, H, T, D, generator=gen) * 1.5
    k = torch.randn(B, H, S, D, generator=gen) * 1.5
    v = torch.randn(B, H, S, D, generator=gen)
    after = slice(pos + T, None)
    if fill == "zeros":
        k[:, :, after], v[:, :, after] = 0, 0
    elif fill == "loud":
        k[:, :, after] = q.mean(2, keepdim=True) * 4          # aligned with the queries: huge scores
        v[:, :, after] = 50.0
    return q, k, v


def _attention_output(static_attention, q, k, v, pos, where):
    """The learner's output for one input, after the checks of its form (no value read back, no
    argument changed, shape, dtype, device)."""
    B, H, T, D = q.shape
    out, reads = _call(NAME_ATTENTION, f"{where}: static_attention", static_attention, q, k, v,
                       torch.tensor(pos))
    if reads:
        raise fail(NAME_ATTENTION, f"{where}: static_attention {_reads(reads, attention=True)}")
    if not isinstance(out, torch.Tensor) or list(out.shape) != [B, H, T, D]:
        shape = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise fail(NAME_ATTENTION, f"{where}: expected an output [B, H, T, D] = {[B, H, T, D]}, got {shape}")
    if out.dtype != q.dtype:
        raise fail(NAME_ATTENTION, f"{where}: output dtype {out.dtype}, expected the inputs' {q.dtype}")
    if torch.isnan(out).any():
        raise fail(NAME_ATTENTION, f"{where}: the output has NaN: a query with every slot hidden? Query i "
                                   "must see slots 0 .. pos + i, its own included")
    return out.double()


def _grade_attention_case(static_attention, case, gen, twice=False):
    """One case (``twice``: then again with other values, so a remembered answer shows). A mistake is
    named only when it explains this input AND a second one of the same case."""
    B, H, T, pos, S, D, fill = case
    where = f"q [{B}, {H}, {T}, {D}], k/v [{B}, {H}, max_len={S}, {D}], pos={pos}"
    q, k, v = _attention_inputs(B, H, T, pos, S, D, fill, gen)
    got = _attention_output(static_attention, q, k, v, pos, where)
    want = float64_attention(q, k, v, pos)
    if (got - want).abs().max().item() <= 1e-5:
        if twice:
            _grade_attention_case(static_attention, case, gen)
        return
    q2, k2, v2 = _attention_inputs(B, H, T, pos, S, D, fill, gen)
    got2 = _attention_output(static_attention, q2, k2, v2, pos, where + ", other values")
    name_the_mistake(NAME_ATTENTION, where, [(got, q, k, v), (got2, q2, k2, v2)], pos, _ATTENTION_MISTAKES,
                     f"your output differs from float64 attention (tolerance 1e-5): {where_wrong(got, want, pos, 'pos')}. "
                     "Expected softmax(q @ k^T / sqrt(D), slots j > pos + i hidden) @ v")


def _attention_on_meta(static_attention) -> None:
    """Inputs on the meta device (shapes only): every tensor the attention makes must follow q's
    device, or the same code fails on a GPU."""
    q = torch.empty(2, 2, 1, 8, device="meta")
    k = torch.empty(2, 2, 6, 8, device="meta")
    where = "q [2, 2, 1, 8], k/v [2, 2, max_len=6, 8] on device='meta' (shapes only), pos=3"
    try:
        out = static_attention(q, k, k.clone(), torch.tensor(3, device="meta"))
    except Exception as e:  # noqa: BLE001 - the learner's error, named
        raise fail(NAME_ATTENTION, f"{where}: your attention raised {type(e).__name__}: "
                                   f"{str(e).splitlines()[0] if str(e) else ''}. On a GPU the same happens: "
                                   "create every tensor on q's device, not on the default one") from e
    if not isinstance(out, torch.Tensor) or out.device.type != "meta" or list(out.shape) != [2, 2, 1, 8]:
        raise fail(NAME_ATTENTION, f"{where}: expected a [2, 2, 1, 8] output on meta, got "
                                   f"{getattr(out, 'shape', type(out).__name__)} on {getattr(out, 'device', '?')}")


def check_static_attention(static_attention) -> None:
    """Grade ``static_attention(q, k, v, pos)`` (``k``/``v`` the full buffers, ``pos`` a 0-d tensor)."""
    gen = torch.Generator().manual_seed(8108)
    for n, case in enumerate(_ATTENTION_CASES):
        _grade_attention_case(static_attention, case, gen, twice=n == 0)
    _attention_on_meta(static_attention)
    passed(NAME_ATTENTION, f"{len(_ATTENTION_CASES)} cases (prefill, decode, chunks, the last slot; stale, zero "
                           "and loud keys beyond the position; the first twice) match float64 attention within "
                           "1e-5, no position read back into Python, inputs unchanged, meta in, meta out")


# ---------------------------------------------------------------------------------------------------
# compiled decode


@contextlib.contextmanager
def _quiet_dynamo():
    """Silence dynamo's own warnings (graph breaks, recompile limit): the grader explains them."""
    log = logging.getLogger("torch._dynamo")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _probe(StaticKVCache, static_attention, model):
    """Eager probes of the pieces, to name why compilation went wrong (a message, or None)."""
    cfg = model.config
    cache = StaticKVCache(cfg.n_layer, 1, cfg.n_head, cfg.head_dim, 16, torch.float32, "cpu")
    k = torch.randn(1, cfg.n_head, 1, cfg.head_dim)
    (keys, _), reads = _call(NAME_COMPILE, "update", cache.update, 0, k, k, torch.tensor(3))
    if keys.shape[2] != 16:
        return ("Your StaticKVCache.update returns a slice to the current length, whose shape changes every "
                "step: return the whole buffers (max_len slots) and let the mask hide the unwritten ones")
    if reads:
        return f"Your StaticKVCache.update {_reads(reads)}"
    _, reads = _call(NAME_COMPILE, "static_attention", static_attention, k, keys, keys, torch.tensor(3))
    if reads:
        return f"Your static_attention {_reads(reads, attention=True)}"
    return None


def _compiled_run(decoder, ids, n):
    from torch._dynamo.utils import counters

    before = dict(counters["graph_break"])
    try:
        out = decoder.generate(ids, n)
    except NotImplementedError:                     # a stub not filled in yet
        raise
    except Exception as e:  # noqa: BLE001
        raise fail(NAME_COMPILE, f"the compiled decode loop with your pieces raised {type(e).__name__}: "
                                 f"{str(e)[:600]}") from e
    breaks = {r: c - before.get(r, 0) for r, c in counters["graph_break"].items() if c > before.get(r, 0)}
    return out, breaks


_NO_REASON = ("Something changes from step to step that torch.compile must specialise on: a shape, or a "
              "Python number (a counter kept in the cache, an int position)")


def _one_graph_or_fail(where, counter, breaks, StaticKVCache, static_attention, model) -> None:
    if counter.frame_count == 1 and not breaks:
        return
    reasons = "; ".join(r.splitlines()[0][:100] for r in breaks)
    problem = (f"{where}: torch compiled {counter.frame_count} graph(s)"
               + (f" and counted graph breaks ({reasons})" if breaks else "")
               + "; one graph for every step was expected.")
    raise fail(NAME_COMPILE, f"{problem} {_probe(StaticKVCache, static_attention, model) or _NO_REASON}")


@functools.lru_cache(maxsize=1)
def _other_model():
    """A random GPT-2 unlike kvlab-tiny: float64, 3 heads of 24 (a hard-coded head size, scale or dtype
    shows), with transformers' model beside the hand-built one."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=120, n_positions=64, n_embd=72, n_layer=2, n_head=3,
                                    bos_token_id=0, eos_token_id=0)).to(torch.float64).eval()
    return hf, GPT2.from_hf(hf)


def _on_other_model(StaticKVCache, static_attention) -> None:
    """Both pieces in the other model, eagerly: a prompt of 5, then one decode step; the logits must
    equal transformers' (float64, to 1e-9): end to end, on what kvlab-tiny has in common with it."""
    hf, model = _other_model()
    ids = torch.tensor([[5, 17, 99, 3, 42], [7, 7, 61, 118, 0]])
    dec = learner_call(NAME_COMPILE, "StaticDecoder with your pieces on a float64 GPT-2 (3 heads of 24)",
                       StaticDecoder, model, batch_size=2, max_len=16, cache_cls=StaticKVCache,
                       attention_fn=static_attention)
    wrong = misplaced(held_tensors(getattr(dec.cache, "inner", dec.cache)), "cpu", torch.float64)
    if wrong:
        raise fail(NAME_COMPILE, f"on a float64 GPT-2 your StaticKVCache holds {', '.join(wrong[:2])}: it was asked "
                                 "for float64 (its dtype argument); build the buffers in the dtype it is given")
    with torch.no_grad():
        learner_call(NAME_COMPILE, "reset()", dec.cache.reset)
        got = learner_call(NAME_COMPILE, "the prefill", dec.model, ids, dec.cache)
        nxt = got[:, -1].argmax(-1, keepdim=True)
        step = learner_call(NAME_COMPILE, "a decode step", dec.model, nxt, dec.cache)
        want = hf(torch.cat([ids, nxt], 1)).logits
    for what, g, w in (("the prompt's logits", got, want[:, :5]), ("a decode step's logits", step[:, -1], want[:, -1])):
        if g.dtype != torch.float64 or not torch.allclose(g, w, rtol=0, atol=1e-9):
            _scale_fixed_to_tiny(static_attention)
            err = (g.double() - w).abs().max().item()
            raise fail(NAME_COMPILE, f"on a float64 GPT-2 with 3 heads of 24 (kvlab-tiny has another head size), "
                                     f"{what} with your pieces are {g.dtype}, off transformers' by up to {err:.2g}: "
                                     "something in your cache or attention is fixed to kvlab-tiny (a head size, a "
                                     "scale, a dtype) instead of read from the tensors")


def _scale_fixed_to_tiny(static_attention) -> None:
    """After a wrong end-to-end result on heads of 24: the learner's attention alone at D = 24, on
    two inputs (:func:`confirmed`); if both match a scale of 1/8 (kvlab-tiny's head size written in),
    say so."""
    gen, probes = torch.Generator().manual_seed(24), []
    for _ in range(2):
        q, k, v = _attention_inputs(2, 3, 1, 4, 16, 24, "zeros", gen)
        try:
            probes.append((q, k, v, static_attention(q.double(), k.double(), v.double(), torch.tensor(4))))
        except Exception:  # noqa: BLE001 - a diagnosis only: the generic message follows
            return

    def tiny_scale(probe):
        q, k, v, out = probe
        return isinstance(out, torch.Tensor) and out.shape == q.shape and torch.allclose(
            out.double(), float64_attention(q, k, v, 4, scale="tiny"), atol=1e-6)
    message = confirmed([(tiny_scale, "on a float64 GPT-2 with 3 heads of 24, your attention alone scales the "
                                      "scores by 1/8 = 1/sqrt(64), kvlab-tiny's head size, on two inputs: the scale "
                                      "must come from the head size of q (its last dimension), not be written in")],
                        probes)
    if message:
        raise fail(NAME_COMPILE, message)


def check_no_recompile(StaticKVCache, static_attention, steps: int = 50) -> None:
    """Your pieces in :class:`kvlab.static.StaticDecoder` (the hand-built GPT-2, batch 2), the decode
    step compiled with ``torch.compile(backend="aot_eager", dynamic=False)``: ``steps`` decode steps,
    then a second prompt of another length through the same decoder. The tokens must equal
    transformers' greedy tokens; torch's counters must show ONE compiled graph and no graph break.

    Calls ``torch._dynamo.reset()`` first (so earlier compilations in this process do not count)."""
    from torch._dynamo.testing import CompileCounterWithBackend


    hf, tok = grading_model()
    model = GPT2.from_hf(hf)
    texts = fresh_prompts(tok)
    prompts = [torch.stack([texts[i][0, :T] for i in rows]) for rows, T in (((0, 2), 7), ((4, 5), 4))]
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    try:
        dec = StaticDecoder(model, batch_size=2, max_len=8 + steps, cache_cls=StaticKVCache,
                            attention_fn=static_attention).compile(backend=counter, fullgraph=False)
    except NotImplementedError:                     # a stub not filled in yet
        raise
    except Exception as e:  # noqa: BLE001
        raise fail(NAME_COMPILE, f"building the decoder with your StaticKVCache raised "
                                 f"{type(e).__name__}: {e}") from e
    for ids, n in ((prompts[0], steps + 1), (prompts[1], steps // 5)):
        want = torch.cat([hf_greedy(hf, row[None], n) for row in ids])
        # A step that recompiles does so every time: after 3 graphs, enough to tell, run it eagerly.
        with torch._dynamo.config.patch(recompile_limit=3), _quiet_dynamo():
            out, breaks = _compiled_run(dec, ids, n)
        where = f"{ids.shape[0]} prompts of {ids.shape[1]} tokens, {n - 1} compiled decode steps"
        _one_graph_or_fail(where, counter, breaks, StaticKVCache, static_attention, model)
        if not torch.equal(out, want):
            row = int((out != want).any(1).nonzero()[0])
            raise fail(NAME_COMPILE, f"{where}: row {row} differs from transformers' greedy tokens. "
                                     "Run check_static_cache and check_static_attention first")
    _on_other_model(StaticKVCache, static_attention)
    passed(NAME_COMPILE, f"GPT2 with your pieces, compiled: {steps} decode steps then a second prompt, "
                         "transformers' greedy tokens, 1 graph compiled, 0 graph breaks (torch's counters); "
                         "eagerly on a float64 GPT-2 with another head size, transformers' logits")


# ---------------------------------------------------------------------------------------------------
# the static decode loop


class _Step:
    """The compiled decode step handed to the learner, ``step(ids [B, 1], pos) -> next ids [B]``, with
    a look at every call before it runs (so a wrong loop is named before it costs a compilation)."""

    def __init__(self, model, cache, counter):
        def decode_step(ids, pos):
            positions = pos + torch.zeros_like(ids)                # [B, 1]: every row at pos
            return model(ids, cache, positions=positions, last_only=True)[:, -1].argmax(dim=-1)

        self.compiled = torch.compile(decode_step, backend=counter, dynamic=False)
        self.cache, self.calls, self.case, self.layout = cache, 0, None, None

    def __call__(self, ids, pos):
        self.calls += 1
        k, (where, B, T, n) = self.calls, self.case
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != B or ids.shape[1] != 1:
            got = list(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] == T and k == 1:
                raise fail(NAME_LOOP, f"{where}: you ran the prompt through the compiled step. Its length "
                                      "changes from prompt to prompt, and every new length is a new graph: "
                                      "prefill eagerly, model(input_ids, cache, last_only=True), and hand "
                                      "the step one token per row")
            raise fail(NAME_LOOP, f"{where}: step call #{k} got ids {got}; it takes the newest token of "
                                  f"every row, a LongTensor [{B}, 1]")
        if not isinstance(pos, torch.Tensor):
            raise fail(NAME_LOOP, f"{where}: step call #{k} got pos={pos!r}, a Python {type(pos).__name__}. "
                                  "torch.compile makes a Python number a constant of the graph, so every "
                                  "new position would compile a new one: keep pos a 0-d torch.long tensor, "
                                  "and advance it as a tensor")
        if self.layout is not None and ids.stride() != self.layout:
            raise fail(NAME_LOOP, f"{where}: step call #{k} got ids with strides {ids.stride()}, an earlier "
                                  f"call {self.layout} (a view into your output tensor, whose width changes "
                                  "with the prompt?). torch.compile specialises on strides as on shapes, so a "
                                  "new layout is a new graph: hand the step ids of the same layout every time")
        self.layout = ids.stride()
        if pos.dim() != 0 or pos.dtype != torch.long:
            raise fail(NAME_LOOP, f"{where}: step call #{k} got pos of shape {list(pos.shape)} and dtype "
                                  f"{pos.dtype}; the contract is a 0-d torch.long tensor")
        held = self.cache.seq_len
        if int(pos) != held:          # the grader reads it, outside the compiled step
            raise fail(NAME_LOOP, f"{where}: step call #{k} got pos={int(pos)}, but the cache holds {held} "
                                  f"tokens, so the new token sits at position {held}: the prompt fills "
                                  f"0 .. {T - 1}, the first step is at {T}, then one more per step")
        if k >= n:
            raise fail(NAME_LOOP, f"{where}: step called {k} times for max_new_tokens={n}: the prefill's "
                                  "logits give the first new token and each step one more, so n - 1 steps; "
                                  "the last token needs no step (what it would predict is never used)")
        return self.compiled(ids, pos)


def _watch_prefill(model, cache, step):
    """The learner's model: the same modules, its calls (eager: the prefill) looked at first."""
    mine, calls = copy.copy(model), []

    def forward(input_ids, cache_arg=None, *args, **kwargs):
        calls.append(1)
        where, B, T, n = step.case
        if len(calls) > 1:
            raise fail(NAME_LOOP, f"{where}: model(...) called a second time for this prompt: after the "
                                  "prefill every token goes through step(ids, pos), the compiled decode step "
                                  "(an eager forward per token is what the compiled step replaces)")
        if cache.seq_len:
            raise fail(NAME_LOOP, f"{where}: the prefill found the cache holding {cache.seq_len} tokens of "
                                  "the previous prompt: call cache.reset() first (it keeps the buffers the "
                                  "compiled step was built with)")
        if cache_arg is not cache and kwargs.get("cache") is not cache:
            raise fail(NAME_LOOP, f"{where}: run the prefill with the cache you were given, model(input_ids, "
                                  "cache, last_only=True): the compiled step reads the same cache")
        shape = getattr(input_ids, "shape", None)
        if shape is None or tuple(shape) != (B, T):
            raise fail(NAME_LOOP, f"{where}: the prefill fed {list(shape) if shape else input_ids!r}; it runs "
                                  f"the whole prompt, [{B}, {T}], in one forward")
        return model(input_ids, cache_arg, *args, **kwargs)

    mine.forward = forward
    return mine, calls


def _loop_cases(tok):
    texts = fresh_prompts(tok)
    batch = lambda rows, T: torch.stack([texts[i][0, :T] for i in rows])   # noqa: E731
    return [("2 prompts of 7 tokens, 9 new", batch((0, 2), 7), 9),
            ("2 other prompts, of 4 tokens, 5 new (the same cache and step)", batch((4, 5), 4), 5),
            ("max_new_tokens=1 (no step needed)", batch((1, 3), 1), 1),
            ("max_new_tokens=0", batch((0, 5), 5), 0)]


def _judge_loop(where, out, want, shape, calls, step, counter, before) -> None:
    """One case of :func:`check_static_generate`: the shape, the prefill, the steps, the graphs, the tokens."""
    from torch._dynamo.utils import counters

    B, T, n = shape
    if not isinstance(out, torch.Tensor) or out.dtype != torch.long or list(out.shape) != [B, T + n]:
        if isinstance(out, torch.Tensor) and out.dtype == torch.long and out.dim() == 2 and out.shape[0] == B:
            extra = out.shape[1] - T
            said = (f"the prompt and {extra} new token(s), for max_new_tokens={n}" if extra >= 0 else
                    f"{out.shape[1]} tokens, fewer than the prompt's {T}")
            raise fail(NAME_LOOP, f"{where}: your tensor holds {said}: the answer is the prompt followed by exactly "
                                  f"max_new_tokens new tokens, shape {[B, T + n]}"
                                  + (" (max_new_tokens=0: the prompt alone, and no step)" if n == 0 else ""))
        got = (f"{out.dtype} {list(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__)
        raise fail(NAME_LOOP, f"{where}: return a LongTensor [B, T + max_new_tokens] = {[B, T + n]} (the "
                              f"prompt, then the new tokens), got {got}")
    if n and not calls:
        raise fail(NAME_LOOP, f"{where}: no prefill: run the prompt once, eagerly, model(input_ids, cache, "
                              "last_only=True); its last logits give the first new token")
    if n >= 2 and step.calls != n - 1:
        raise fail(NAME_LOOP, f"{where}: step called {step.calls} times; max_new_tokens={n} takes {n - 1} "
                              "(the prefill gives the first new token, each step one more)")
    breaks = {r: c for r, c in counters["graph_break"].items() if c > before.get(r, 0)}
    if counter.frame_count > 1 or breaks:
        raise fail(NAME_LOOP, f"{where}: torch compiled {counter.frame_count} graphs"
                              + (f" and counted graph breaks ({'; '.join(breaks)[:200]})" if breaks else "")
                              + ": one graph for every step of every prompt was expected. " + _NO_REASON)
    if not torch.equal(out.cpu(), want):
        row = int((out.cpu() != want).any(1).nonzero()[0])
        i = first_difference(out[row].cpu(), want[row])
        raise fail(NAME_LOOP, f"{where}: row {row}, token {i} (new token #{i - T + 1}) is {int(out[row, i])}, "
                              f"transformers' greedy token is {int(want[row, i])}"
                              + (": the first new token is the argmax of the prefill's last logits"
                                 if i == T else ": the next ids are step's return value, fed back as "
                                 "[B, 1] at the next position"))


def check_static_generate(static_generate) -> None:
    """Grade ``static_generate(model, cache, step, input_ids, max_new_tokens) -> [B, T + n]``: reset
    the cache, the prompt eagerly through ``model(input_ids, cache, last_only=True)``, then every
    further token through ``step(ids [B, 1], pos)``, the compiled decode step, ``pos`` a 0-d tensor.
    Tokens must equal transformers' greedy ones; torch's counters must show one graph for everything
    (two prompts of different lengths), no graph break. Calls ``torch._dynamo.reset()`` first."""
    from torch._dynamo.testing import CompileCounter
    from torch._dynamo.utils import counters

    hf, tok = grading_model()
    model = GPT2.from_hf(hf)
    cfg = model.config
    cache = StaticKVCache(cfg.n_layer, 2, cfg.n_head, cfg.head_dim, 16, torch.float32, "cpu")
    torch._dynamo.reset()
    counter = CompileCounter()
    step = _Step(model, cache, counter)
    mine, calls = _watch_prefill(model, cache, step)
    before = dict(counters["graph_break"])
    for where, ids, n in _loop_cases(tok):
        B, T = ids.shape
        step.calls, step.case = 0, (where, B, T, n)
        calls.clear()
        want = torch.cat([hf_greedy(hf, row[None], n) for row in ids])
        with _quiet_dynamo(), torch._dynamo.config.patch(recompile_limit=3):
            out = learner_call(NAME_LOOP, f"{where}: static_generate(model, cache, step, <[{B}, {T}]>, {n})",
                               static_generate, mine, cache, step, ids.clone(), n)
        _judge_loop(where, out, want, (B, T, n), calls, step, counter, before)
    passed(NAME_LOOP, "two prompts of different lengths (and 1 and 0 new tokens) through your loop: transformers' "
                      f"greedy tokens, {counter.frame_count} graph compiled for every step, 0 graph breaks "
                      "(torch's counters), the prompt eager, the position a tensor")


# ---------------------------------------------------------------------------------------------------
# why reset() zeroes the buffers


_NAN_WHY = {("keys", False): "your attention replaces the hidden slots' scores (masked_fill with -inf or a where): "
                             "the NaN score is gone before the softmax, its weight is exactly 0",
            ("keys", True): "the NaN score survives the mask (an additive mask: NaN + (-inf) is NaN; "
                            "scaled_dot_product_attention adds its mask too), and one NaN score makes the whole "
                            "softmax row NaN",
            ("values", True): "the weight of slot 6 is exactly 0, but weights @ v still multiplies it in: "
                              "0 * NaN = NaN, in every output of that row",
            ("values", False): "your attention never multiplies the hidden slots' values (you zero or drop them)"}


def _nan_truth(static_attention) -> dict:
    """What the learner's attention does with a NaN in hidden slot 6 (pos=3), on two inputs (batch 1
    and batch 2 with 3 heads: one coincidence decides nothing), after it is shown right on clean ones
    (an attention that returns zeros, or anything finite, would make every prediction 'finite')."""
    gen, truth = torch.Generator().manual_seed(8208), {}
    for B, H, D in ((1, 2, 8), (2, 3, 16)):
        q = torch.randn(B, H, 1, D, generator=gen)
        k, v = torch.randn(B, H, 8, D, generator=gen), torch.randn(B, H, 8, D, generator=gen)
        clean = learner_call(NAME_NAN, "static_attention on clean keys and values", static_attention, q, k, v,
                             torch.tensor(3))
        if not torch.allclose(clean.double(), float64_attention(q, k, v, 3), atol=1e-5):
            raise fail(NAME_NAN, "your static_attention is wrong on clean inputs (no NaN anywhere), so what it "
                                 "does with a NaN says nothing: pass check_static_attention first")
        for what in ("keys", "values"):
            kk, vv = k.clone(), v.clone()
            (kk if what == "keys" else vv)[:, :, 6] = float("nan")
            out = learner_call(NAME_NAN, f"static_attention with a NaN in slot 6's {what}", static_attention, q,
                               kk, vv, torch.tensor(3))
            truth.setdefault(what, set()).add(bool(torch.isnan(out).any()))
    return {what: seen.pop() if len(seen) == 1 else None for what, seen in truth.items()}


def _reset_clears(StaticKVCache, static_attention) -> None:
    """A NaN written in the LAST of three layers by an earlier prompt, reset(), 4 new tokens in every
    layer: every layer's output must be finite (a reset that zeroes one layer, or forgets only the
    position, leaves it)."""
    gen, L = torch.Generator().manual_seed(8209), 3
    cache = learner_call(NAME_NAN, "StaticKVCache(3, 1, 2, 8, 8, float32, 'cpu')", StaticKVCache, L, 1, 2, 8, 8,
                         torch.float32, "cpu")
    nan = torch.full((1, 2, 1, 8), float("nan"))
    learner_call(NAME_NAN, "update of a NaN at slot 6 of layer 2", cache.update, L - 1, nan, nan.clone(),
                 torch.tensor(6))
    learner_call(NAME_NAN, "reset()", cache.reset)
    q = torch.randn(1, 2, 1, 8, generator=gen)
    for layer in range(L):
        k, v = torch.randn(1, 2, 4, 8, generator=gen), torch.randn(1, 2, 4, 8, generator=gen)
        keys, values = learner_call(NAME_NAN, f"update of 4 tokens at pos=0, layer {layer}", cache.update, layer,
                                    k, v, torch.tensor(0))
        out = learner_call(NAME_NAN, "static_attention after reset()", static_attention, q, keys, values,
                           torch.tensor(3))
        if torch.isnan(out).any():
            raise fail(NAME_NAN, f"a NaN written at slot 6 of layer {L - 1} by an earlier prompt, then reset(), then 4 "
                                 f"new tokens: your attention's output for layer {layer} is NaN. reset() left the "
                                 "NaN in the buffer, hidden but still multiplied by its weight 0: zero the buffers "
                                 "in reset(), every layer's keys and values, not only the position")


def check_hidden_nan(StaticKVCache, static_attention, nan_in_keys, nan_in_values) -> None:
    """Grade a prediction: a NaN left in a slot the mask hides (slot 6; the new token at pos=3), in the
    keys (``nan_in_keys``) or in the values (``nan_in_values``): is the output NaN? Judged against what
    the learner's own attention does (once it is shown right on clean inputs); then the learner's
    cache, NaN written in its last layer, reset(), refilled, must give a finite output in every layer."""
    for name, value in (("nan_in_keys", nan_in_keys), ("nan_in_values", nan_in_values)):
        if not isinstance(value, bool):
            raise fail(NAME_NAN, f"{name} must be True (the output has NaN) or False, got {value!r}")
    truth = _nan_truth(static_attention)
    for what, said in (("keys", nan_in_keys), ("values", nan_in_values)):
        if truth[what] is None:
            raise fail(NAME_NAN, f"with a NaN in slot 6's {what}, your attention's output is NaN on one input and "
                                 "finite on another: it depends on something besides the mask")
        if said != truth[what]:
            raise fail(NAME_NAN, f"NaN in slot 6's {what}, new token at pos=3 (slot 6 hidden): you predicted "
                                 f"{'NaN' if said else 'a finite output'}, your attention gives "
                                 f"{'NaN' if truth[what] else 'a finite output'}: {_NAN_WHY[what, truth[what]]}")
    _reset_clears(StaticKVCache, static_attention)
    passed(NAME_NAN, f"a NaN in a hidden slot: keys -> {'NaN' if truth['keys'] else 'finite'}, values -> "
                     f"{'NaN' if truth['values'] else 'finite'}, as you predicted; after reset() your cache's zeros "
                     "keep the output finite in every layer")
