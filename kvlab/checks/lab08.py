"""Graders for lab 8: a static KV cache, attention over it, and a decode step compiled once.

* ``check_static_cache(StaticKVCache)``: fixed-shape buffers written in place at a position held
  in a tensor, against plain slicing bookkeeping done here (float64, batch 3, a rewind included);
* ``check_static_attention(static_attention)``: attention over all ``max_len`` slots, the slots
  after each query's position hidden, against float64 arithmetic with stale keys in those slots;
* ``check_no_recompile(StaticKVCache, static_attention)``: both pieces in the hand-built GPT-2's
  decode step (:class:`kvlab.static.StaticDecoder`), compiled; 50 decode steps must give
  transformers' greedy tokens, and torch's own counters must show one graph, no graph break.

Each check also watches for reads of a tensor's value back into Python (``int(pos)``,
``pos.item()``, slicing with ``pos``): eager code does not mind, ``torch.compile`` does (a graph
break, then a new graph or guard for every new value). A dispatch mode sees them as the aten op
``_local_scalar_dense``.
"""

from __future__ import annotations

import contextlib
import logging
import math
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..generate import hf_greedy
from ._common import fail, fresh_prompts, grading_model, passed

NAME_CACHE = "check_static_cache"
NAME_ATTENTION = "check_static_attention"
NAME_COMPILE = "check_no_recompile"

_READS_POS = ("reads the position back into Python (int(pos), pos.item(), float(pos) or slicing with it, "
              "buffer[..., pos:pos + T]). Eagerly that works; under torch.compile it is a graph break, and "
              "the number becomes a constant of the next graph, so every step compiles a new one. Keep "
              "pos a tensor: slots = pos + torch.arange(T), then index_copy_(2, slots, k) or "
              "buffer[:, :, slots] = k")


class ScalarReads(TorchDispatchMode):
    """Counts the reads of a tensor's value into a Python number (aten ``_local_scalar_dense``)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _call(check, what, fn, *args):
    """``fn(*args)`` under :class:`ScalarReads`; the learner's exception becomes a pointed failure."""
    reads = ScalarReads()
    try:
        with reads:
            return fn(*args), reads.count
    except Exception as e:  # noqa: BLE001 - the learner's error, named
        raise fail(check, f"{what} raised {type(e).__name__}: {e}") from e


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
    return isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)


def _unwritten_dirty(o):
    """The slots never written hold something other than zeros (the rest being right)."""
    dirty = (o.keys[:, :, ~o.written] != 0).any() or (o.values[:, :, ~o.written] != 0).any()
    return bool(dirty) and torch.equal(o.keys[:, :, o.written], o.want_k[:, :, o.written])


def _at0(o):
    """Where batch row 0's new keys sit in row 0 of the returned keys."""
    return _found_at(o.keys[0], o.new_k[0])


# (name, mistake present?, message). Checked in order on every update; the first hit fails.
_CACHE_MISTAKES = [
    ("not a pair", lambda o: not _pair(o.got), "update must return a tuple (keys, values) of tensors"),
    ("sliced", lambda o: o.keys.dim() == 4 and o.keys.shape[2] == o.pos + o.T < o.max_len,
     "update returned positions 0 .. pos+T-1 only, a slice to the current length: its shape then "
     "changes at every step, and a compiled step recompiles for every new shape. Return the WHOLE "
     "buffers [batch, heads, max_len, head_dim]; the attention mask hides the slots not written yet"),
    ("only new", lambda o: o.keys.dim() == 4 and o.keys.shape[2] == o.T < o.max_len,
     "update returned only the T new positions; return the whole buffers "
     "[batch, heads, max_len, head_dim]"),
    ("reads pos", lambda o: o.reads > 0, f"update {_READS_POS}"),
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
    ("swapped", lambda o: torch.equal(o.keys, o.want_v) and not torch.equal(o.keys, o.want_k),
     "update returned the values where the keys belong (keys and values swapped)"),
    ("row 0 everywhere", lambda o: o.B > 1 and not torch.equal(o.want_k[1], o.want_k[0])
     and all(torch.equal(o.keys[b], o.want_k[0]) for b in range(o.B)),
     "every batch row holds row 0's keys: write k as a whole ([batch, heads, T, head_dim]), not k[0]"),
    ("wrong slot per row", lambda o: bool(_bad_rows(o)),
     "batch row 0's new keys are at slot {pos}, but {bad_rows}: with batch > 1 every row writes at "
     "the SAME slots pos .. pos+T-1 (the position is shared by the batch; the batch is dimension 0, "
     "the slots dimension 2)"),
    ("row 0 only", lambda o: o.B > 1 and torch.equal(o.keys[0], o.want_k[0])
     and not any(torch.equal(o.keys[b], o.want_k[b]) for b in range(1, o.B)),
     "only batch row 0 is written correctly; the other rows are not: index every row "
     "(buffer[:, :, slots])"),
    ("ignores pos", lambda o: o.rewind and o.pos not in _at0(o),
     "update was called with pos={pos} (a rewind: slots are rewritten, as after a rejected speculative "
     "token) and did not write there: the position is the pos argument; do not keep a counter of "
     "your own"),
    ("wrong slot", lambda o: o.pos not in _at0(o) and bool(_at0(o)),
     "the new keys were written at slot {found}, not at pos={pos}: write slots pos .. pos+T-1"),
    ("not empty", _unwritten_dirty,
     "slots never written hold something other than zeros: a new cache (and one after reset()) must "
     "be empty, all zeros (torch.zeros, not torch.empty; and .zero_() in reset). Masked slots get "
     "weight 0, but 0 * NaN is NaN, so garbage there can still poison the output"),
    ("past changed", lambda o: not torch.equal(o.keys[:, :, o.kept], o.want_k[:, :, o.kept]),
     "the new keys are right but earlier slots changed: something overwrote the past (layers sharing one "
     "buffer, or writing more than T slots)"),
    ("wrong", lambda o: not (torch.equal(o.keys, o.want_k) and torch.equal(o.values, o.want_v)),
     "the returned buffers do not hold what was written (expected every update of this layer at its "
     "slots, zeros elsewhere)"),
]


def _make_cache(StaticKVCache, L, B, H, D, max_len, dtype):
    try:
        return StaticKVCache(L, B, H, D, max_len, dtype, "cpu")
    except Exception as e:  # noqa: BLE001
        raise fail(NAME_CACHE, f"StaticKVCache({L}, {B}, {H}, {D}, {max_len}, {dtype}, 'cpu') raised "
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
    o = SimpleNamespace(got=got, keys=keys, values=values, reads=reads, pos=pos, T=T, B=k.shape[0],
                        max_len=state.max_len, full=[k.shape[0], k.shape[1], state.max_len, k.shape[3]],
                        dtype=k.dtype, ptr=state.ptr[layer], want_k=state.want_k[layer],
                        want_v=state.want_v[layer], new_k=k, written=state.written[layer], kept=kept,
                        rewind=rewind)
    for _name, present, message in _CACHE_MISTAKES:
        if present(o):
            same = keys.dim() == 4 and keys.shape[1] == k.shape[1] and keys.shape[3] == k.shape[3]
            found = (_found_at(keys[0], k[0]) or ["?"])[0] if same else "?"
            bad = ", ".join(f"row {b}'s are at slot {at[0]}" for b, at in _bad_rows(o)) if same else ""
            raise fail(NAME_CACHE, f"{where}: " + message.format(
                full=o.full, kshape=list(keys.shape), vshape=list(values.shape), dtype=o.dtype,
                kdtype=keys.dtype, pos=pos, found=found, bad_rows=bad))
    state.ptr[layer] = keys.data_ptr()


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
    return SimpleNamespace(dims=(L, B, H, D), max_len=max_len, ptr=[None] * L,
                           want_k=[torch.zeros(shape, dtype=torch.float64) for _ in range(L)],
                           want_v=[torch.zeros(shape, dtype=torch.float64) for _ in range(L)],
                           written=[torch.zeros(max_len, dtype=torch.bool) for _ in range(L)])


def check_static_cache(StaticKVCache) -> None:
    """Grade ``StaticKVCache(n_layer, batch_size, n_head, head_dim, max_len, dtype, device)`` with
    ``update(layer, k, v, pos) -> (keys, values)`` (the full buffers) and ``reset()``."""
    gen = torch.Generator().manual_seed(8008)
    L, B, H, D, max_len = 3, 3, 2, 4, 12
    # (pos, T, rewind): a prefill, decode steps, a chunk, then a rewind over written slots.
    passes = [(0, 4, False), (4, 1, False), (5, 1, False), (6, 3, False), (3, 2, True), (5, 1, True)]
    cache = _make_cache(StaticKVCache, L, B, H, D, max_len, torch.float64)
    state = _fresh_state(L, B, H, D, max_len)
    _run_passes(cache, state, passes, gen, "a new cache")
    ptrs = list(state.ptr)
    _call(NAME_CACHE, "reset()", cache.reset)
    state = _fresh_state(L, B, H, D, max_len)
    state.ptr = ptrs                                 # reset() must keep the very same buffers
    try:
        _run_passes(cache, state, [(0, 2, False), (2, 1, False)], gen, "after reset()")
    except AssertionError as e:
        if "zeros" in str(e) or "earlier slots" in str(e) or "do not hold" in str(e):
            raise fail(NAME_CACHE, "after reset(), the buffers still hold the previous prompt's keys and "
                                   "values: reset() must empty the cache IN PLACE (buffer.zero_()), so nothing "
                                   "of an old prompt stays visible; not reallocate it") from e
        if "different tensor" in str(e):
            raise fail(NAME_CACHE, "reset() allocated new buffers: a compiled decode step (and a CUDA graph) "
                                   "keeps using the old ones. Empty them in place: buffer.zero_()") from e
        raise
    c1 = _make_cache(StaticKVCache, 1, 1, 1, 8, 4, torch.float32)
    keys, _ = _call(NAME_CACHE, "update on a float32 cache", c1.update, 0, torch.ones(1, 1, 1, 8),
                    torch.ones(1, 1, 1, 8), torch.tensor(3))[0]
    if keys.dtype != torch.float32 or not torch.equal(keys[0, 0, :, 0], torch.tensor([0.0, 0, 0, 1])):
        raise fail(NAME_CACHE, "a float32 cache of max_len=4, one token written at pos=3: expected a float32 "
                               f"buffer [0, 0, 0, 1] along the slots, got {keys.dtype} {keys[0, 0, :, 0].tolist()}")
    passed(NAME_CACHE, f"batch {B}, {L} layers: fixed-shape buffers written in place at a tensor position "
                       "(rewinds included), never read back into Python; reset() empties them in place")


# ---------------------------------------------------------------------------------------------------
# static_attention


def reference_static_attention(q, k, v, pos, mask="causal", scale="sqrt"):
    """float64 attention over every slot, and the usual mistakes (for diagnosis)."""
    q, k, v = q.double(), k.double(), v.double()
    T, S, D = q.shape[2], k.shape[2], q.shape[3]
    qpos = int(pos) + torch.arange(T)[:, None]
    kpos = torch.arange(S)[None, :]
    allowed = {
        "causal": kpos <= qpos,
        "none": torch.ones(T, S, dtype=torch.bool),
        "written": kpos < int(pos) + T,                       # hides unwritten slots, not the chunk's future
        "chunk_only": (kpos <= qpos) | (kpos >= int(pos) + T),  # causal among the new, unwritten let through
        "topleft": kpos <= torch.arange(T)[:, None],          # ignores pos
        "strict": kpos < qpos,
    }[mask]
    s = {"sqrt": 1 / math.sqrt(D), "D": 1 / D, "none": 1.0}[scale]
    scores = torch.einsum("bhtd,bhsd->bhts", q, k) * s
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
    return torch.einsum("bhts,bhsd->bhtd", weights, v)


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


def _grade_attention_case(static_attention, case, gen):
    B, H, T, pos, S, D, fill = case
    q, k, v = _attention_inputs(B, H, T, pos, S, D, fill, gen)
    saved = [t.clone() for t in (q, k, v)]
    where = f"q [{B}, {H}, {T}, {D}], k/v [{B}, {H}, max_len={S}, {D}], pos={pos}"
    out, reads = _call(NAME_ATTENTION, f"{where}: static_attention", static_attention, q, k, v,
                       torch.tensor(pos))
    if reads:
        raise fail(NAME_ATTENTION, f"{where}: static_attention {_READS_POS.split('. Keep')[0]}. Build the mask "
                                   "from tensors: (torch.arange(max_len) > pos + torch.arange(T)[:, None])")
    if not all(torch.equal(a, b) for a, b in zip((q, k, v), saved)):
        raise fail(NAME_ATTENTION, f"{where}: static_attention modified its inputs in place")
    if not isinstance(out, torch.Tensor) or list(out.shape) != [B, H, T, D]:
        shape = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise fail(NAME_ATTENTION, f"{where}: expected an output [B, H, T, D] = {[B, H, T, D]}, got {shape}")
    if out.dtype != q.dtype:
        raise fail(NAME_ATTENTION, f"{where}: output dtype {out.dtype}, expected the inputs' {q.dtype}")
    got = out.double()
    if torch.isnan(got).any():
        raise fail(NAME_ATTENTION, f"{where}: the output has NaN: a query with every slot hidden? Query i "
                                   "must see slots 0 .. pos + i, its own included")
    if (got - reference_static_attention(q, k, v, pos)).abs().max().item() <= 1e-5:
        return
    if B > 1 and torch.allclose(got[0], reference_static_attention(q, k, v, pos)[0], atol=1e-5):
        raise fail(NAME_ATTENTION, f"{where}: batch row 0 is right, the others are not: keep the batch "
                                   "dimension in every operation")
    for kwargs, message in _ATTENTION_MISTAKES:
        if torch.allclose(got, reference_static_attention(q, k, v, pos, **kwargs), atol=1e-5):
            raise fail(NAME_ATTENTION, f"{where}: {message}")
    err = (got - reference_static_attention(q, k, v, pos)).abs().max().item()
    raise fail(NAME_ATTENTION, f"{where}: max abs error {err:.2e} against float64 attention (tolerance 1e-5); "
                               "expected softmax(q @ k^T / sqrt(D), slots j > pos + i hidden) @ v")


def check_static_attention(static_attention) -> None:
    """Grade ``static_attention(q, k, v, pos)`` (``k``/``v`` the full buffers, ``pos`` a 0-d tensor)."""
    gen = torch.Generator().manual_seed(8108)
    for case in _ATTENTION_CASES:
        _grade_attention_case(static_attention, case, gen)
    passed(NAME_ATTENTION, f"{len(_ATTENTION_CASES)} cases (prefill, decode, chunks, the last slot; stale, zero "
                           "and loud keys beyond the position) match float64 attention within 1e-5, no position "
                           "read back into Python")


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
        return f"Your StaticKVCache.update {_READS_POS}"
    _, reads = _call(NAME_COMPILE, "static_attention", static_attention, k, keys, keys, torch.tensor(3))
    if reads:
        return f"Your static_attention {_READS_POS.split('. Keep')[0]}"
    return None


def _compiled_run(decoder, ids, n):
    from torch._dynamo.utils import counters

    before = dict(counters["graph_break"])
    try:
        out = decoder.generate(ids, n)
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


def check_no_recompile(StaticKVCache, static_attention, steps: int = 50) -> None:
    """Your pieces in :class:`kvlab.static.StaticDecoder` (the hand-built GPT-2, batch 2), the decode
    step compiled with ``torch.compile(backend="aot_eager", dynamic=False)``: ``steps`` decode steps,
    then a second prompt of another length through the same decoder. The tokens must equal
    transformers' greedy tokens; torch's counters must show ONE compiled graph and no graph break.

    Calls ``torch._dynamo.reset()`` first (so earlier compilations in this process do not count)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from ..gpt2 import GPT2
    from ..static import StaticDecoder

    hf, tok = grading_model()
    model = GPT2.from_hf(hf)
    texts = fresh_prompts(tok)
    prompts = [torch.stack([texts[i][0, :T] for i in rows]) for rows, T in (((0, 2), 7), ((4, 5), 4))]
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    try:
        dec = StaticDecoder(model, batch_size=2, max_len=8 + steps, cache_cls=StaticKVCache,
                            attention_fn=static_attention).compile(backend=counter, fullgraph=False)
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
    passed(NAME_COMPILE, f"GPT2 with your pieces, compiled: {steps} decode steps then a second prompt, "
                         "transformers' greedy tokens, 1 graph compiled, 0 graph breaks (torch's counters)")
