"""The lab-8 graders accept correct static caches and attentions (usual and unusual ones) and reject
each known mistake with a message that names it."""

import math

import pytest
import torch
import torch.nn.functional as F

from kvlab.course.checks import check_no_recompile, check_static_attention, check_static_cache
from kvlab.static import StaticKVCache, static_attention, static_attention_explicit

from utils import expect_rejected, own_copy

# the graders refuse the library's own code: the tests hand in copies, as a learner's would be
StaticKVCache = own_copy(StaticKVCache)
static_attention, static_attention_explicit = own_copy(static_attention), own_copy(static_attention_explicit)


# --- caches: correct ones ------------------------------------------------------------------------------

class CacheAdvancedIndex:
    """Correct, unusual: one tensor per layer and kind in a dict, written by advanced indexing."""

    def __init__(self, n_layer, batch_size, n_head, head_dim, max_len, dtype, device):
        shape = (batch_size, n_head, max_len, head_dim)
        self.buf = {(i, kind): torch.zeros(shape, dtype=dtype, device=device)
                    for i in range(n_layer) for kind in "kv"}

    def update(self, layer, k, v, pos):
        slots = pos + torch.arange(k.shape[2], device=k.device)
        self.buf[layer, "k"][:, :, slots] = k
        self.buf[layer, "v"][:, :, slots] = v
        return self.buf[layer, "k"], self.buf[layer, "v"]

    def reset(self):
        for t in self.buf.values():
            t.fill_(0)


class CacheWhere:
    """Correct, unusual: one [layers, 2, B, H, S, D] tensor, written with a mask and torch.where."""

    def __init__(self, n_layer, batch_size, n_head, head_dim, max_len, dtype, device):
        self.kv = torch.zeros(n_layer, 2, batch_size, n_head, max_len, head_dim, dtype=dtype, device=device)

    def update(self, layer, k, v, pos):
        S, T = self.kv.shape[4], k.shape[2]
        rel = torch.arange(S, device=k.device) - pos             # slot j holds new token j - pos
        hit = ((rel >= 0) & (rel < T))[:, None]
        for i, new in enumerate((k, v)):
            spread = new[:, :, rel.clamp(0, T - 1)]              # [B, H, S, D]
            self.kv[layer, i].copy_(torch.where(hit, spread, self.kv[layer, i]))
        return self.kv[layer, 0], self.kv[layer, 1]

    def reset(self):
        self.kv.zero_()


# --- caches: wrong ones --------------------------------------------------------------------------------

class CacheSliced(StaticKVCache):                     # returns only the filled part: shape grows every step
    def update(self, layer, k, v, pos=None):
        keys, values = super().update(layer, k, v, pos)
        end = int(pos) + k.shape[2]
        return keys[:, :, :end], values[:, :, :end]


class CacheIntPos(StaticKVCache):                     # the position read back as a Python int
    def update(self, layer, k, v, pos=None):
        p, T = int(pos), k.shape[2]
        self.keys[layer][:, :, p:p + T] = k
        self.values[layer][:, :, p:p + T] = v
        return self.keys[layer], self.values[layer]


class CacheResetKeepsKeys(StaticKVCache):             # reset() forgets the position only
    def reset(self):
        self.position.zero_()


class CacheResetReallocates(StaticKVCache):           # reset() makes new buffers
    def reset(self):
        self.keys = [torch.zeros_like(t) for t in self.keys]
        self.values = [torch.zeros_like(t) for t in self.values]


class CacheRowZeroEverywhere(StaticKVCache):          # k[0] broadcast over the batch
    def update(self, layer, k, v, pos=None):
        return super().update(layer, k[:1].expand_as(k), v[:1].expand_as(v), pos)


class CacheRowShift(StaticKVCache):                   # row b written b slots late
    def update(self, layer, k, v, pos=None):
        T = k.shape[2]
        for b in range(k.shape[0]):
            slots = pos + b + torch.arange(T)
            self.keys[layer][b].index_copy_(1, slots % self.max_len, k[b])
            self.values[layer][b].index_copy_(1, slots % self.max_len, v[b])
        return self.keys[layer], self.values[layer]


class CacheRowZeroOnly(StaticKVCache):                # only row 0 is written
    def update(self, layer, k, v, pos=None):
        slots = pos + torch.arange(k.shape[2])
        self.keys[layer][0].index_copy_(1, slots, k[0])
        self.values[layer][0].index_copy_(1, slots, v[0])
        return self.keys[layer], self.values[layer]


class CacheOwnCounter(StaticKVCache):                 # ignores pos, keeps a Python counter (lab 3 style)
    def __init__(self, *args):
        super().__init__(*args)
        self.n = 0

    def update(self, layer, k, v, pos=None):
        keys, values = super().update(layer, k, v, torch.tensor(self.n))
        if layer == self.n_layer - 1:
            self.n += k.shape[2]
        return keys, values

    def reset(self):
        super().reset()
        self.n = 0


class CacheGarbage(StaticKVCache):                    # torch.empty-like: unwritten slots are not zeros
    def __init__(self, *args):
        super().__init__(*args)
        for t in self.keys + self.values:
            t.fill_(7.0)


class CacheNewTensor(StaticKVCache):                  # returns a copy: a new tensor every step
    def update(self, layer, k, v, pos=None):
        keys, values = super().update(layer, k, v, pos)
        return keys.clone(), values.clone()


class CacheSwapped(StaticKVCache):
    def update(self, layer, k, v, pos=None):
        keys, values = super().update(layer, k, v, pos)
        return values, keys


class CacheSharedLayers(StaticKVCache):               # every layer writes the same buffer
    def __init__(self, *args):
        super().__init__(*args)
        self.keys = [self.keys[0]] * self.n_layer
        self.values = [self.values[0]] * self.n_layer


class CacheOffByOne(StaticKVCache):
    def update(self, layer, k, v, pos=None):
        return super().update(layer, k, v, pos + 1)


class CacheWrongSignature:
    def __init__(self, n_layer, max_len):
        pass


# --- attentions: correct and wrong ---------------------------------------------------------------------

def attention_additive_mask(q, k, v, pos):          # correct, unusual: float mask of -1e9, float64 inside
    T, S = q.shape[-2], k.shape[-2]
    hidden = torch.arange(S, device=q.device)[None] > pos + torch.arange(T, device=q.device)[:, None]
    scores = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(q.shape[-1]) - 1e9 * hidden
    return (torch.softmax(scores, -1) @ v.double()).to(q.dtype)


def _masked(q, k, v, allowed, scale=None):
    scale = scale or 1 / math.sqrt(q.shape[-1])
    return torch.softmax((q @ k.transpose(-2, -1) * scale).masked_fill(~allowed, float("-inf")), -1) @ v


def _qk_pos(q, k, pos):
    return torch.arange(k.shape[-2])[None], pos + torch.arange(q.shape[-2])[:, None]


def attention_no_mask(q, k, v, pos):
    return F.scaled_dot_product_attention(q, k, v)


def attention_chunk_causal_only(q, k, v, pos):      # causal among the new tokens, unwritten slots let through
    kp, qp = _qk_pos(q, k, pos)
    return _masked(q, k, v, (kp <= qp) | (kp >= pos + q.shape[-2]))


def attention_hides_unwritten_only(q, k, v, pos):   # the future inside a chunk is visible
    kp, _ = _qk_pos(q, k, pos)
    return _masked(q, k, v, (kp < pos + q.shape[-2]).expand(q.shape[-2], -1))


def attention_ignores_pos(q, k, v, pos):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def attention_strict(q, k, v, pos):
    kp, qp = _qk_pos(q, k, pos)
    return _masked(q, k, v, kp < qp)


def attention_scale_d(q, k, v, pos):
    kp, qp = _qk_pos(q, k, pos)
    return _masked(q, k, v, kp <= qp, scale=1 / q.shape[-1])


def attention_int_pos(q, k, v, pos):                # right numbers, but the position read back as an int
    return static_attention(q, k, v, int(pos))


def attention_sliced(q, k, v, pos):                 # slices the keys to the current length
    end = int(pos) + q.shape[-2]
    return static_attention(q, k[:, :, :end], v[:, :, :end], pos)


def attention_row_zero(q, k, v, pos):
    return static_attention(q[:1], k[:1], v[:1], pos).expand_as(q).contiguous()


def attention_crashes(q, k, v, pos):
    raise RuntimeError("shapes do not match")


# --- the tests -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", [StaticKVCache, CacheAdvancedIndex, CacheWhere])
def test_cache_accepts_correct(impl, capsys):
    check_static_cache(impl)
    assert "PASSED check_static_cache" in capsys.readouterr().out


@pytest.mark.parametrize("impl, needles", [
    (CacheSliced, ["slice to the current length", "recompiles"]),
    (CacheIntPos, ["int(pos)", "graph break"]),
    (CacheResetKeepsKeys, ["after reset()", "previous prompt", "as empty as a new one", "exercise 4 asks"]),
    (CacheResetReallocates, ["reset() allocated new buffers"]),
    (CacheRowZeroEverywhere, ["row 0's keys"]),
    (CacheRowShift, ["row 1's are at slot", "same"]),
    (CacheRowZeroOnly, ["only batch row 0"]),
    (CacheOwnCounter, ["rewind", "counter of your own"]),
    (CacheGarbage, ["never written", "zeros"]),
    (CacheNewTensor, ["different tensor", "once"]),
    (CacheSwapped, ["swapped"]),
    (CacheSharedLayers, ["overwrote the past"]),
    (CacheOffByOne, ["slot 1, not at pos=0"]),
    (CacheWrongSignature, ["constructor takes"]),
])
def test_cache_rejects(impl, needles):
    expect_rejected(check_static_cache, impl, *needles)


@pytest.mark.parametrize("impl", [static_attention, static_attention_explicit, attention_additive_mask])
def test_attention_accepts_correct(impl, capsys):
    check_static_attention(impl)
    assert "PASSED check_static_attention" in capsys.readouterr().out


@pytest.mark.parametrize("impl, needles", [
    (attention_no_mask, ["no mask", "not written"]),
    (attention_chunk_causal_only, ["j >= pos + T", "written or not"]),
    (attention_hides_unwritten_only, ["future inside a chunk"]),
    (attention_ignores_pos, ["ignores pos"]),
    (attention_strict, ["own slot"]),
    (attention_scale_d, ["divided by D"]),
    (attention_int_pos, ["int(pos)", "graph break"]),
    (attention_sliced, ["slicing", "graph break"]),
    (attention_row_zero, ["batch row 0"]),
    (attention_crashes, ["raised RuntimeError", "shapes do not match"]),
])
def test_attention_rejects(impl, needles):
    expect_rejected(check_static_attention, impl, *needles)


# check_no_recompile compiles (aot_eager backend, a few seconds each): the main cases only.

def test_no_recompile_accepts_correct(capsys):
    check_no_recompile(StaticKVCache, static_attention)
    check_no_recompile(CacheAdvancedIndex, static_attention_explicit, steps=10)
    out = capsys.readouterr().out
    assert out.count("PASSED check_no_recompile") == 2 and "1 graph compiled" in out


def attention_scale_of_tiny(q, k, v, pos):        # kvlab-tiny's head size written in: 1 / sqrt(64)
    T, S = q.shape[-2], k.shape[-2]
    hidden = torch.arange(S)[None] > pos + torch.arange(T)[:, None]
    return torch.softmax((q @ k.transpose(-2, -1) / 8.0).masked_fill(hidden, float("-inf")), -1) @ v


class CacheFloat32Always(StaticKVCache):             # ignores its dtype argument
    def __init__(self, n_layer, batch_size, n_head, head_dim, max_len, dtype, device):
        super().__init__(n_layer, batch_size, n_head, head_dim, max_len, torch.float32, device)


class _LayerLists:
    """``update`` and ``reset`` over per-layer lists ``self.k`` / ``self.v``: the test caches below differ
    only in how they make those buffers. ``index_copy_`` refuses keys of another dtype (torch's own error)."""

    def update(self, layer, k, v, pos):
        slots = pos + torch.arange(k.shape[2], device=k.device)
        self.k[layer].index_copy_(2, slots, k)
        self.v[layer].index_copy_(2, slots, v)
        return self.k[layer], self.v[layer]

    def reset(self):
        for t in self.k + self.v:
            t.zero_()


class CacheNoDtype(_LayerLists):                     # torch.zeros without the dtype: float32 whatever it is given
    def __init__(self, n_layer, batch_size, n_head, head_dim, max_len, dtype, device):
        shape = (batch_size, n_head, max_len, head_dim)
        self.k = [torch.zeros(shape, device=device) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, device=device) for _ in range(n_layer)]


def test_a_cache_without_its_dtype_is_named_before_torch_fails():
    """Issue 34 (lab 8): a missing dtype used to surface as torch's raw index_copy_ error; the grader
    now names it before the first update, for a buffer made without the dtype and one fixed to float32."""
    for wrong in (CacheNoDtype, CacheFloat32Always):
        msg = expect_rejected(check_static_cache, wrong, "torch.float64", "not made with the dtype")
        assert "index_copy_" not in msg


def test_no_recompile_checks_another_model():
    """Issue 34, kind 6: a hard-coded attention scale and a cache fixed to float32 pass every step on
    kvlab-tiny; a float64 GPT-2 with heads of 24 shows both. A correct pair passes there too."""
    from kvlab.course.checks import lab08
    expect_rejected(lambda a: check_no_recompile(StaticKVCache, a, steps=4), attention_scale_of_tiny,
                    "3 heads of 24", "1/sqrt(64)", "on two inputs")
    expect_rejected(check_static_attention, attention_scale_of_tiny, "1/8 whatever the head size")
    expect_rejected(lambda c: check_no_recompile(c, static_attention_explicit, steps=4), CacheFloat32Always,
                    "float64", "dtype it is given")
    lab08._on_other_model(CacheAdvancedIndex, static_attention_explicit)      # unusual, correct


def attention_for_sliced(q, k, v, pos):            # works with a sliced cache (keys 0 .. pos+T-1)
    return static_attention(q, k, v, pos)


@pytest.mark.parametrize("cache, attention, needles", [
    (CacheSliced, attention_for_sliced, ["graph", "slice to the current length"]),
    (CacheIntPos, static_attention, ["graph", "update reads the position"]),
    (CacheOwnCounter, static_attention, ["graph", "counter kept in the cache"]),
    (StaticKVCache, attention_int_pos, ["graph", "static_attention reads the position"]),
])
def test_no_recompile_rejects(cache, attention, needles):
    expect_rejected(lambda c: check_no_recompile(c, attention, steps=12), cache, *needles)


# ------------------------------------------------ issue 24: the decode loop, a NaN in a hidden slot

from kvlab.course.checks import check_hidden_nan, check_static_generate  # noqa: E402


@torch.no_grad()
def static_generate(model, cache, step, input_ids, max_new_tokens, pos_as=torch.tensor, reset=True,
                    prefill_in_step=False, steps_extra=0, eager_decode=False, start=0):
    """The loop, right by default; each keyword makes one mistake."""
    B, T = input_ids.shape
    if max_new_tokens == 0:
        return input_ids.clone()
    if reset:
        cache.reset()
    if prefill_in_step:
        nxt = step(input_ids, pos_as(0))
    else:
        nxt = model(input_ids, cache, last_only=True)[:, -1].argmax(-1)
    out, pos = [input_ids, nxt[:, None]], pos_as(T + start)
    for _ in range(max_new_tokens - 1 + steps_extra):
        nxt = (model(nxt[:, None], cache, last_only=True)[:, -1].argmax(-1) if eager_decode
               else step(nxt[:, None], pos))
        pos = pos + 1
        out.append(nxt[:, None])
    return torch.cat(out, 1)[:, :T + max_new_tokens]


def static_generate_tensor_in_place(model, cache, step, input_ids, max_new_tokens):
    """Correct, unusual: one position tensor advanced in place, the step's input in a fixed buffer."""
    B, T = input_ids.shape
    out = torch.empty(B, T + max_new_tokens, dtype=torch.long)
    out[:, :T] = input_ids
    if max_new_tokens:
        cache.reset()
        with torch.no_grad():
            out[:, T] = model(input_ids, cache, last_only=True)[:, -1].argmax(-1)
        pos, ids = torch.tensor(T), torch.empty(B, 1, dtype=torch.long)
        for t in range(T + 1, T + max_new_tokens):
            ids.copy_(out[:, t - 1:t])
            with torch.no_grad():
                out[:, t] = step(ids, pos)
            pos += 1
    return out


def test_static_generate_accepts_correct(capsys):
    check_static_generate(static_generate)
    check_static_generate(static_generate_tensor_in_place)
    assert capsys.readouterr().out.count("PASSED check_static_generate") == 2


@pytest.mark.parametrize("kwargs, needles", [
    (dict(pos_as=int), ["python int", "0-d torch.long tensor"]),
    (dict(reset=False), ["cache.reset()", "previous prompt"]),
    (dict(prefill_in_step=True), ["prompt through the compiled step", "prefill eagerly"]),
    (dict(steps_extra=1), ["the last token needs no step"]),
    (dict(eager_decode=True), ["model(...) called a second time"]),
    (dict(start=-1), ["the first step is at"]),
])
def test_static_generate_rejects(kwargs, needles):
    import functools

    expect_rejected(check_static_generate, functools.partial(static_generate, **kwargs), *needles)


def test_static_generate_zero_new_tokens_is_named_as_a_count():
    """max_new_tokens=0 answered with one token too many is told as a count of tokens, not as a dtype
    (the walkthrough of issue 34: "LongTensor ... got torch.int64" read like a dtype complaint)."""
    def one_too_many_at_zero(model, cache, step, input_ids, max_new_tokens):
        return static_generate(model, cache, step, input_ids, max(max_new_tokens, 1))
    msg = expect_rejected(check_static_generate, one_too_many_at_zero, "1 new token(s), for max_new_tokens=0",
                          "the prompt alone")
    assert "torch.int64" not in msg


def attention_zeroes_hidden_values(q, k, v, pos):                 # correct, and immune to NaN values
    T, S = q.shape[-2], k.shape[-2]
    hidden = torch.arange(S, device=q.device)[None] > pos + torch.arange(T, device=q.device)[:, None]
    scores = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(hidden, float("-inf"))
    keep = (torch.arange(S, device=q.device) <= pos + T - 1)[:, None]
    return torch.softmax(scores, -1) @ torch.where(keep, v, torch.zeros_like(v))


@pytest.mark.parametrize("attention, keys, values", [
    (static_attention_explicit, False, True),       # masked_fill: the NaN score is replaced
    (static_attention, True, True),                 # sdpa adds its mask: NaN + -inf = NaN
    (attention_zeroes_hidden_values, False, False),
])
def test_hidden_nan_accepts_the_truth(attention, keys, values, capsys):
    check_hidden_nan(StaticKVCache, attention, keys, values)
    assert "PASSED check_hidden_nan" in capsys.readouterr().out


def test_hidden_nan_rejects():
    expect_rejected(lambda a: check_hidden_nan(StaticKVCache, a, False, False), static_attention_explicit,
                    "you predicted a finite output", "0 * NaN = NaN")
    expect_rejected(lambda a: check_hidden_nan(StaticKVCache, a, True, True), static_attention_explicit,
                    "masked_fill")
    expect_rejected(lambda c: check_hidden_nan(c, static_attention_explicit, False, True), CacheResetKeepsKeys,
                    "zero the buffers in reset()")
    expect_rejected(lambda a: check_hidden_nan(StaticKVCache, a, "NaN", True), static_attention_explicit,
                    "True")


class CacheResetsLayerZeroOnly(StaticKVCache):        # reset() clears the first layer and the position
    def reset(self):
        self.keys[0].zero_()
        self.values[0].zero_()
        self.slot_pos.fill_(-1)
        self.position.zero_()


def attention_of_zeros(q, k, v, pos):
    return torch.zeros_like(q)


def attention_mean_of_values(q, k, v, pos):                     # finite, and wrong
    return v.nan_to_num().mean(-2, keepdim=True).expand_as(q)


def test_hidden_nan_can_fail():
    """Issue 34, kind 5: the prediction was judged against the learner's own attention, so one that
    returns zeros passed with any (False, False); the reset part used a one-layer cache."""
    for wrong in (attention_of_zeros, attention_mean_of_values):       # two wrong attentions, one message
        expect_rejected(lambda a: check_hidden_nan(StaticKVCache, a, False, False), wrong,
                        "wrong on clean inputs", "check_static_attention first")
    expect_rejected(lambda c: check_hidden_nan(c, static_attention_explicit, False, True), CacheResetsLayerZeroOnly,
                    "layer 2", "zero the buffers in reset()")
    check_hidden_nan(CacheResetReallocates, static_attention_explicit, False, True)    # unusual, correct here


def static_generate_feeds_views(model, cache, step, input_ids, max_new_tokens):
    """Right tokens, but feeds the step views into its output tensor, whose width (so the views'
    strides) changes with the prompt: a second graph for the second prompt."""
    B, T = input_ids.shape
    out = torch.empty(B, T + max_new_tokens, dtype=torch.long)
    out[:, :T] = input_ids
    if max_new_tokens:
        cache.reset()
        with torch.no_grad():
            out[:, T] = model(input_ids, cache, last_only=True)[:, -1].argmax(-1)
            pos = torch.tensor(T)
            for t in range(T + 1, T + max_new_tokens):
                out[:, t] = step(out[:, t - 1:t], pos)
                pos = pos + 1
    return out


def test_static_generate_rejects_a_changing_layout():
    expect_rejected(check_static_generate, static_generate_feeds_views, "strides", "same layout")


# ------------------------------------------------ issue 24: the unit graders against the kinds

class CacheReturnsList(StaticKVCache):                # correct: a list [keys, values], as the model accepts
    def update(self, layer, k, v, pos=None):
        return list(super().update(layer, k, v, pos))


class CacheOneBuffer(StaticKVCache):                  # keys and values in one buffer: values over keys
    def __init__(self, *args):
        super().__init__(*args)
        self.values = self.keys


class CacheToListSlots(StaticKVCache):                # the slots read back with .tolist()
    def update(self, layer, k, v, pos=None):
        for j, s in enumerate((pos + torch.arange(k.shape[2])).tolist()):
            self.keys[layer][:, :, s] = k[:, :, j]
            self.values[layer][:, :, s] = v[:, :, j]
        return self.keys[layer], self.values[layer]


class CacheIteratesSlots(StaticKVCache):              # iterates over a tensor of slots
    def update(self, layer, k, v, pos=None):
        for j, s in enumerate(pos + torch.arange(k.shape[2])):
            self.keys[layer][:, :, s] = k[:, :, j]
            self.values[layer][:, :, s] = v[:, :, j]
        return self.keys[layer], self.values[layer]


class CacheAdvancesPos(StaticKVCache):                # moves the caller's position on, in place
    def update(self, layer, k, v, pos=None):
        out = super().update(layer, k, v, pos)
        if layer == len(self.keys) - 1:
            pos += k.shape[2]
        return out


class CacheOnCpuAlways(StaticKVCache):                # ignores device=
    def __init__(self, n_layer, batch_size, n_head, head_dim, max_len, dtype=torch.float32, device="cpu"):
        super().__init__(n_layer, batch_size, n_head, head_dim, max_len, dtype, "cpu")


class CacheClassBuffers(_LayerLists):               # buffers on the class: every cache shares them
    store = {}

    def __init__(self, n_layer, batch_size, n_head, head_dim, max_len, dtype=torch.float32, device="cpu"):
        key = (n_layer, batch_size, n_head, head_dim, max_len, dtype, str(device))
        shape = (batch_size, n_head, max_len, head_dim)
        if key not in CacheClassBuffers.store:
            CacheClassBuffers.store[key] = [[torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
                                            for _ in range(2)]
        self.k, self.v = CacheClassBuffers.store[key]


def test_cache_accepts_a_list(capsys):
    check_static_cache(CacheReturnsList)
    assert "PASSED" in capsys.readouterr().out


@pytest.mark.parametrize("impl, needles", [
    (CacheOneBuffer, ["share one buffer"]),
    (CacheToListSlots, [".tolist()", "graph break"]),
    (CacheIteratesSlots, ["iterating over a tensor"]),
    (CacheAdvancesPos, ["modified its argument pos"]),
    (CacheOnCpuAlways, ["device='meta'", "on cpu"]),
    (CacheClassBuffers, ["two caches alive at once"]),
])
def test_cache_rejects_issue_24(impl, needles):
    CacheClassBuffers.store.clear()
    expect_rejected(check_static_cache, impl, *needles)


_SEEN: dict = {}


def attention_remembers(q, k, v, pos):
    key = (tuple(q.shape), tuple(k.shape), q.device)
    if key not in _SEEN:
        _SEEN[key] = static_attention_explicit(q, k, v, pos)
    return _SEEN[key].clone()


def attention_mask_on_cpu(q, k, v, pos):            # torch.arange without device=
    T, S = q.shape[-2], k.shape[-2]
    hidden = torch.arange(S)[None] > pos.cpu() + torch.arange(T)[:, None]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return torch.softmax(scores.masked_fill(hidden, float("-inf")), -1) @ v


def attention_tolist(q, k, v, pos):
    return static_attention_explicit(q, k, v, torch.tensor(pos.tolist()))


def attention_off_on_last_query(q, k, v, pos):      # a mistake with no name
    out = static_attention_explicit(q, k, v, pos).clone()
    out[:, :, -1] += 0.01
    return out


@pytest.mark.parametrize("impl, needles", [
    (attention_remembers, ["remembered result"]),
    (attention_mask_on_cpu, ["meta", "on q's device"]),
    (attention_tolist, [".tolist()"]),
    (attention_off_on_last_query, ["largest error", "wrong queries"]),
])
def test_attention_rejects_issue_24(impl, needles):
    _SEEN.clear()
    expect_rejected(check_static_attention, impl, *needles)


def test_library_refused():
    from kvlab import static

    expect_rejected(check_static_cache, static.StaticKVCache, "kvlab.static.StaticKVCache", "yourself")
    expect_rejected(check_static_attention, static.static_attention, "kvlab.static.static_attention")
    expect_rejected(lambda c: check_no_recompile(c, static_attention), static.StaticKVCache, "library's own")
