"""Lab 11 graders: a sink + window cache, the GQA head conversion, a window predicted from attention.

* ``check_sink_window_cache(WindowCache)``: the learner's cache class (``WindowCache(n_layer, window,
  sinks)``, a :class:`kvlab.cache.Cache`) is fed keys and values that carry their token's position in
  their first channel, in decode steps and in chunks of several tokens, for windows and sink counts
  the lab never shows. After every update the grader reads back, per query, which tokens it may see
  (through the library's one rule, :func:`kvlab.cache.visible`, applied to the ``key_pos`` returned)
  and compares that set with the rule "the sinks, and the ``window`` positions ending at the query's
  own", and each visible key's reported position with its true one. Any order of the keys, any extra
  hidden slots, keeping ``window`` instead of ``window - 1`` tokens: all correct. Then the cache runs
  inside GPT-2 (chunked prefill, decode) against the same model with a banded mask and no cache.
* ``check_gqa_conversion(pool_kv_heads, repeat_kv)``: mean-pooling of GPT-2's key and value heads
  against float64 arithmetic, for head and group counts of a 12-head layer, and ``repeat_kv``'s head
  order; then both inside a converted GPT-2, token for token.
* ``check_window_prediction(prediction, rows)``: the smallest window within 1% of full attention, per
  sink count, predicted before the run, against the learner's own run (one grid step of slack).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvlab.cache import visible
from kvlab.course.checks._common import fail, fresh_prompts, grading_model, learner_call, passed

NAME_WINDOW, NAME_GQA, NAME_PREDICT = "check_sink_window_cache", "check_gqa_conversion", "check_window_prediction"

# (window, sinks, chunk sizes fed one after the other): decode steps, prefills longer than the window,
# chunks of several tokens after eviction, a window of 1, no sinks, sinks longer than the first chunk.
_SCENARIOS = [
    (3, 2, [1] * 12),
    (4, 1, [9, 1, 1, 5, 1, 3]),
    (5, 0, [2, 7, 1, 6, 1]),
    (1, 3, [2, 2, 4, 1]),
    (6, 2, [14, 4, 1, 1, 6]),
    (7, 4, [3, 1, 9, 2]),
]


def _tagged(layer: int, positions: torch.Tensor, heads: int = 2, dim: int = 5):
    """Keys and values ``[B, H, T, D]`` whose channel 0 holds the token's position (values: + 0.5) and
    channel 1 the layer: the grader recognises every key it gets back."""
    B, T = positions.shape
    k = torch.randn(B, heads, T, dim, generator=torch.Generator().manual_seed(int(positions.sum()) + 7 * layer))
    k[..., 0] = positions[:, None, :].float()
    k[..., 1] = float(layer)
    v = k.clone()
    v[..., 0] += 0.5
    return k, v


def _visible_sets(keys, values, key_pos, positions, layer):
    """Per query (row 0): {true position: reported position} of the keys it may see; raises on a key
    that is not one the grader wrote, or whose value does not belong to it."""
    B, T = positions.shape
    S = keys.shape[2]
    key_pos = key_pos[:, None] if key_pos.dim() == 2 else key_pos
    seen = visible(positions, key_pos.expand(B, T, S))
    out = []
    for t in range(T):
        got = {}
        for s in seen[0, t].nonzero().flatten().tolist():
            true = int(keys[0, 0, s, 0])
            if int(keys[0, 0, s, 1]) != layer or float(values[0, 0, s, 0]) != true + 0.5:
                raise fail(NAME_WINDOW, f"layer {layer}: slot {s} holds a key or value that is not the one "
                                        f"stored for that token in this layer (keys and values must stay paired, "
                                        "per layer)")
            got[true] = int(key_pos.expand(B, T, S)[0, t, s])
        out.append(got)
    return out


def _expect(p: int, window: int, sinks: int) -> set:
    return {q for q in range(p + 1) if q < sinks or q > p - window}


def _diagnose(wrong: list, window, sinks, chunk) -> str:
    """Name the mistake from every query of one update that saw the wrong keys: ``(p, got, want)``.
    A pattern is named only when every wrong query of the update shows it."""
    p, got, want = wrong[0]
    diffs = [(q, sorted(w - g), sorted(g - w)) for q, g, w in wrong]
    where = f"the query at position {p} (window={window}, sinks={sinks}, a chunk of {chunk})"
    if all(m and all(x < sinks for x in m) and not e for _, m, e in diffs):
        return (f"{where} cannot see {diffs[0][1]}: the sinks were evicted. The first `sinks` tokens stay "
                "in the cache for good, beside the window")
    if all(m == [q - window + 1] and not e for q, m, e in diffs):
        return (f"{where} sees only positions {sorted(got - set(range(sinks)))}: {window - 1} of its window. "
                f"The window is {window} positions ending at the query's own (p - window + 1 .. p): an off-by-one")
    if all(e == [q - window] and not m for q, m, e in diffs):
        return (f"{where} also sees position {p - window}: {window + 1} positions. The window is {window} "
                "positions, the query's own included: an off-by-one")
    if chunk > 1 and any(m for _, m, _ in diffs):
        q, m, _ = next(d for d in diffs if d[1])
        return (f"the query at position {q} (window={window}, sinks={sinks}, a chunk of {chunk}) cannot see {m}, which "
                "its window needs: a chunk of k tokens needs the window - 1 tokens before it plus its own k. Attend "
                "over held + new keys first, evict after")
    if chunk > 1:
        q, _, e = diffs[0]
        return (f"the query at position {q} (window={window}, sinks={sinks}, a chunk of {chunk}) sees {e}, outside its "
                "window: within a chunk each query has its own window. Mark the keys outside a query's window with "
                "EMPTY in key_pos, per query ([B, T, S])")
    return f"{where} sees {sorted(got)}, but must see exactly {sorted(want)}"


def _run_scenario(WindowCache, window, sinks, chunks, n_layer=2):
    cache = learner_call(NAME_WINDOW, f"WindowCache({n_layer}, window={window}, sinks={sinks})",
                         WindowCache, n_layer, window, sinks)
    start = 0
    for chunk in chunks:
        positions = torch.arange(start, start + chunk)[None].expand(2, chunk)     # batch 2, same positions
        for layer in range(n_layer):
            k, v = _tagged(layer, positions)
            keys, values, key_pos = learner_call(NAME_WINDOW, f"update({layer}, k, v, positions {start}..{start + chunk - 1})",
                                                 cache.update, layer, k, v, positions)
            sets = _visible_sets(keys, values, key_pos, positions, layer)
            wrong = [(start + t, set(got), _expect(start + t, window, sinks)) for t, got in enumerate(sets)]
            wrong = [w for w in wrong if w[1] != w[2]]
            if wrong:
                raise fail(NAME_WINDOW, _diagnose(wrong, window, sinks, chunk))
            for got in sets:
                wrong = {q: r for q, r in got.items() if q != r}
                if wrong:
                    q, r = next(iter(wrong.items()))
                    raise fail(NAME_WINDOW, f"the key of the token at position {q} came back with position {r} in "
                                            f"key_pos (window={window}, sinks={sinks}): that is its slot in your cache, "
                                            "not its position. Keep each token's position beside its key")
        start += chunk
        _check_held(cache, window, sinks, start)
    return cache


def _check_held(cache, window, sinks, seen):
    """The memory bound: no tensor the cache holds keeps more than sinks + window tokens."""
    from kvlab.course.checks._common import held_tensors

    bound = min(seen, sinks + window)
    for name, t in held_tensors(cache):
        if t.dim() == 4 and t.shape[2] > bound:
            raise fail(NAME_WINDOW, f"after {seen} tokens your cache holds {name}, a tensor of {t.shape[2]} tokens "
                                    f"(shape {list(t.shape)}), more than sinks + window = {sinks + window}: it must "
                                    "drop every token no later query can see")


def _band_attention(window, sinks):
    def fn(q, k, v, mask):
        i, j = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask & ((j > i - window) | (j < sinks)))
    fn.takes_mask = True
    return fn


def check_sink_window_cache(WindowCache) -> None:
    """``WindowCache(n_layer, window, sinks)``: see the module docstring."""
    for window, sinks, chunks in _SCENARIOS:
        _run_scenario(WindowCache, window, sinks, chunks)
    from kvlab.gpt2 import GPT2

    hf, tok = grading_model()
    ours = GPT2.from_hf(hf)
    for (window, sinks), prompt in zip([(9, 3), (14, 0), (6, 5)], fresh_prompts(tok)[:3]):
        banded = GPT2.from_hf(hf, attention_fn=_band_attention(window, sinks))
        ids = prompt.repeat(1, 40 // prompt.shape[1] + 1)[:, :40]
        want = banded(ids)
        cache = learner_call(NAME_WINDOW, f"WindowCache({hf.config.n_layer}, {window}, {sinks})", WindowCache,
                             hf.config.n_layer, window, sinks)
        got = torch.cat([learner_call(NAME_WINDOW, "the model's forward through your cache", ours, ids[:, a:b], cache)
                         for a, b in ((0, 11), (11, 12), (12, 17), (17, 40))], dim=1)
        if not torch.allclose(got, want, atol=1e-4, rtol=1e-4):
            raise fail(NAME_WINDOW, f"inside GPT-2 (window={window}, sinks={sinks}, chunks of 11, 1, 5, 23 tokens) "
                                    "the logits differ from the same model with a banded mask and no cache")
    passed(NAME_WINDOW, f"{len(_SCENARIOS)} scenarios (decode steps and chunks, windows 1-7, 0-4 sinks, batch 2), "
                        "then GPT-2 with chunked prefill equal to a banded mask")


# ---------------------------------------------------------------------------------------------------
# GQA conversion

def _reference_pool(weight, bias, n_head, n_kv):
    """float64 mean of each group's key and value heads (rows k then v of the fused projection)."""
    C = weight.shape[1]
    D, G = C // n_head, n_head // n_kv
    out = []
    for part in (1, 2):                                            # 0 = queries, 1 = keys, 2 = values
        w = weight[part * C:(part + 1) * C].double().view(n_kv, G, D, C).mean(1).reshape(n_kv * D, C)
        b = bias[part * C:(part + 1) * C].double().view(n_kv, G, D).mean(1).reshape(n_kv * D)
        out += [w, b]
    return out


def _pool_mistake(got, weight, bias, n_head, n_kv):
    """Name what the learner's pooled key weight is, if it is a known wrong one."""
    C = weight.shape[1]
    D, G = C // n_head, n_head // n_kv
    q = weight[:C].double().view(n_kv, G, D, C).mean(1).reshape(n_kv * D, C)
    first = weight[C:2 * C].double().view(n_kv, G, D, C)[:, 0].reshape(n_kv * D, C)
    strided = weight[C:2 * C].double().view(G, n_kv, D, C).mean(0).reshape(n_kv * D, C)
    if torch.allclose(got, q, atol=1e-5):
        return "you pooled the query rows: GQA shares keys and values; the queries keep one head each"
    if torch.allclose(got, first, atol=1e-5):
        return "you kept each group's first head; the GQA paper's conversion averages the group's heads (mean pooling)"
    if G > 1 and n_kv > 1 and torch.allclose(got, strided, atol=1e-5):
        return ("you grouped every n_kv-th head together: a group is consecutive heads, "
                "the layout repeat_kv assumes")
    return None


def _check_pool(pool_kv_heads, n_head, n_kv, C):
    g = torch.Generator().manual_seed(100 * n_head + n_kv)
    weight, bias = torch.randn(3 * C, C, generator=g), torch.randn(3 * C, generator=g)
    before = weight.clone(), bias.clone()
    got = learner_call(NAME_GQA, f"pool_kv_heads(weight [{3 * C}, {C}], bias, n_head={n_head}, n_kv_head={n_kv})",
                       pool_kv_heads, weight, bias, n_head, n_kv)
    if not torch.equal(weight, before[0]) or not torch.equal(bias, before[1]):
        raise fail(NAME_GQA, "pool_kv_heads changed the weight or bias it was given, in place: build new tensors")
    if not isinstance(got, (tuple, list)) or len(got) != 4:
        raise fail(NAME_GQA, "return (k_weight, k_bias, v_weight, v_bias)")
    want = _reference_pool(weight, bias, n_head, n_kv)
    for name, a, b in zip(("k_weight", "k_bias", "v_weight", "v_bias"), got, want):
        if not isinstance(a, torch.Tensor) or a.shape != b.shape:
            shape = list(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__
            raise fail(NAME_GQA, f"{name} for n_head={n_head}, n_kv_head={n_kv}: expected shape {list(b.shape)}, got {shape}")
        if not torch.allclose(a.double(), b, atol=1e-5):
            why = _pool_mistake(got[0].double(), weight, bias, n_head, n_kv) if name == "k_weight" else None
            raise fail(NAME_GQA, f"{name} for n_head={n_head}, n_kv_head={n_kv}: " + (why or "not the mean of each "
                       "group's heads (a group: consecutive heads; keys are rows C..2C of the fused projection, values 2C..3C)"))


def _check_repeat(repeat_kv):
    for n_kv, group in ((2, 3), (3, 2), (1, 4), (4, 1)):
        x = torch.arange(2 * n_kv, dtype=torch.float32).view(2, n_kv, 1, 1).expand(2, n_kv, 3, 2).contiguous()
        got = learner_call(NAME_GQA, f"repeat_kv(x [2, {n_kv}, 3, 2], {group})", repeat_kv, x, group)
        want = torch.arange(n_kv).repeat_interleave(group)
        if not isinstance(got, torch.Tensor) or got.shape != (2, n_kv * group, 3, 2):
            raise fail(NAME_GQA, f"repeat_kv(x [2, {n_kv}, 3, 2], {group}) must return [2, {n_kv * group}, 3, 2]")
        heads = got[0, :, 0, 0].long().tolist()
        if heads != want.tolist():
            tiled = torch.arange(n_kv).repeat(group).tolist()
            hint = (" (the heads tiled: the query heads cycle through the kv heads). A group is consecutive query "
                    "heads, so each kv head serves `group` query heads in a row"
                    if heads == tiled else "")
            raise fail(NAME_GQA, f"repeat_kv with {n_kv} kv heads, groups of {group}: query heads read kv heads "
                                 f"{heads}, expected {want.tolist()}{hint}")
        if not torch.equal(got[1, :, 0, 0].long(), want + n_kv):
            raise fail(NAME_GQA, "repeat_kv mixed rows of the batch: keep the batch dimension as it is")


def check_gqa_conversion(pool_kv_heads, repeat_kv) -> None:
    """``pool_kv_heads(weight, bias, n_head, n_kv_head) -> (k_w, k_b, v_w, v_b)`` and ``repeat_kv(x, group)``."""
    for n_kv in (1, 2, 3, 4, 6, 12):
        _check_pool(pool_kv_heads, 12, n_kv, 36)
    try:
        pool_kv_heads(torch.zeros(3 * 36, 36), torch.zeros(3 * 36), 12, 5)
    except ValueError:
        pass
    except Exception as e:  # noqa: BLE001
        raise fail(NAME_GQA, f"n_kv_head=5 for 12 heads: raise ValueError naming the problem, not {type(e).__name__}") from None
    else:
        raise fail(NAME_GQA, "n_kv_head=5 does not divide 12 heads: pool_kv_heads must raise ValueError")
    _check_repeat(repeat_kv)
    _check_in_model(pool_kv_heads, repeat_kv)
    passed(NAME_GQA, "mean pooling for 1-12 kv heads of a 12-head layer (float64), repeat_kv's order, and a "
                     "converted GPT-2 token for token")


def _check_in_model(pool_kv_heads, repeat_kv):
    from kvlab import gqa
    from kvlab.gpt2 import GPT2, generate

    hf, tok = grading_model()
    ours = GPT2.from_hf(hf)
    H = ours.config.n_head
    for n_kv in [g for g in gqa.group_counts(H) if g < H]:
        want_model = gqa.convert(ours, n_kv, "mean")
        mine = gqa.convert(ours, n_kv, "mean")
        with torch.no_grad():
            for blk, orig in zip(mine.h, ours.h):
                kw, kb, vw, vb = pool_kv_heads(orig.attn.c_attn.weight, orig.attn.c_attn.bias, H, n_kv)
                blk.attn.kv_proj.weight.copy_(torch.cat([kw, vw])), blk.attn.kv_proj.bias.copy_(torch.cat([kb, vb]))
        for blk in mine.h:
            blk.attn.repeat = repeat_kv
        for prompt in fresh_prompts(tok)[3:5]:
            if not torch.equal(generate(mine, prompt, 12), generate(want_model, prompt, 12)):
                raise fail(NAME_GQA, f"a GPT-2 converted to {n_kv} kv heads with your functions generates other tokens "
                                     "than the mean-pooled conversion")


# ---------------------------------------------------------------------------------------------------
# The prediction

def check_window_prediction(prediction, rows, tolerance: float = 0.01) -> None:
    """``prediction``: ``{sinks: the smallest window whose perplexity stays within 1% of full attention}``,
    written before the run; ``rows``: the run (``kvlab.shrinkbench.window_rows``)."""
    if not isinstance(prediction, dict) or not prediction:
        raise fail(NAME_PREDICT, "prediction must be a dict {sinks: window}, e.g. {0: 64, 4: 32}")
    for sinks, window in prediction.items():
        grid = sorted(r["window"] for r in rows if r["sinks"] == sinks)
        if not grid:
            raise fail(NAME_PREDICT, f"your run has no row with sinks={sinks}: run the windows with those sinks")
        ok = [r["window"] for r in rows if r["sinks"] == sinks and r["ppl change"] <= tolerance]
        measured = min(ok) if ok else None
        if window not in grid and window is not None:
            raise fail(NAME_PREDICT, f"predict one of the windows you ran ({grid}), got {window!r}")
        if measured is None and window is None:
            continue
        if measured is None or window is None or abs(grid.index(window) - grid.index(measured)) > 1:
            raise fail(NAME_PREDICT, f"with {sinks} sinks you predicted {window}, your run says {measured} "
                                     f"(perplexity changes: {[round(r['ppl change'], 4) for r in rows if r['sinks'] == sinks]}"
                                     " over windows " + f"{grid}). Compare the attention a window drops with what it costs, "
                                     "and say in the cell below why the prediction was off")
    passed(NAME_PREDICT, f"predicted {prediction}, within one grid step of your run")
