"""The lab-3 graders accept the reference pieces and reject each known mistake with a pointed message."""

import math

import pytest
import torch
import torch.nn.functional as F

from kvlab.cache import ConcatCache, PreallocatedCache
from kvlab.course.checks import check_attention, check_generate_with_cache, check_kv_cache
from kvlab.gpt2 import attention as reference_attention

from utils import attention_without_mask as attention_no_mask, expect_rejected, one_step_removed, own_copy

# the graders refuse the library's own code: the tests hand in copies, as a learner's would be
PreallocatedCache, ConcatCache = own_copy(PreallocatedCache), own_copy(ConcatCache)
reference_attention = own_copy(reference_attention)



# --- attention: the right one and the wrong ones ------------------------------------------------------

def _masked(q, k, v, allowed, scale):
    scores = (q @ k.transpose(-2, -1)) * scale
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v


def attention_mask_ignores_past(q, k, v, past_len):             # tril on [T, S]: top-left corner
    T, S = q.shape[-2], k.shape[-2]
    return _masked(q, k, v, torch.ones(T, S, dtype=torch.bool).tril(), 1 / math.sqrt(q.shape[-1]))


def attention_is_causal_flag(q, k, v, past_len):                # sdpa's is_causal, used with a past
    return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[-2] > 1)


def attention_scale_1_over_d(q, k, v, past_len):
    T, S = q.shape[-2], k.shape[-2]
    allowed = torch.arange(S)[None] <= torch.arange(past_len, past_len + T)[:, None]
    return _masked(q, k, v, allowed, 1 / q.shape[-1])


def attention_no_scale(q, k, v, past_len):
    T, S = q.shape[-2], k.shape[-2]
    allowed = torch.arange(S)[None] <= torch.arange(past_len, past_len + T)[:, None]
    return _masked(q, k, v, allowed, 1.0)


def attention_batch_one(q, k, v, past_len):                      # squeezes the batch away
    return reference_attention(q[0], k[0], v[0], past_len) if q.dim() == 4 else None


def attention_row_zero_only(q, k, v, past_len):                  # runs row 0 and broadcasts it
    out = reference_attention(q[:1], k[:1], v[:1], past_len)
    return out.expand(q.shape[0], -1, -1, -1).contiguous()


# --- caches: the wrong ones ---------------------------------------------------------------------------

class CacheNoReset(PreallocatedCache):
    def reset(self):
        pass                                                     # article C: never reset between prompts


class CacheSeqLenStuck(PreallocatedCache):
    @property
    def seq_len(self):
        return 0                                                 # positions restart at 0 every step


class CacheWrongOffset(PreallocatedCache):
    def update(self, layer, k, v):                               # writes one slot too far
        T, start = k.shape[2], self._len
        self.keys[layer, :, :, start + 1:start + 1 + T] = k
        self.values[layer, :, :, start + 1:start + 1 + T] = v
        if layer == self.n_layer - 1:
            self._len += T
        return self.keys[layer, :, :, :start + T], self.values[layer, :, :, :start + T]


class CacheWritesAtZero(PreallocatedCache):
    def update(self, layer, k, v):                               # always overwrites position 0..
        T, start = k.shape[2], self._len
        self.keys[layer, :, :, :T] = k
        self.values[layer, :, :, :T] = v
        if layer == self.n_layer - 1:
            self._len += T
        return self.keys[layer, :, :, :start + T], self.values[layer, :, :, :start + T]


class CacheNoBatch:
    """Article C: buffers without a batch dimension (row 0 kept, then broadcast)."""

    def __init__(self, n_layer, batch_size, n_head, head_dim, max_len, dtype, device):
        self.n_layer, self.batch = n_layer, batch_size
        self.k = torch.zeros(n_layer, n_head, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.pos = 0

    def update(self, layer, k, v):
        T = k.shape[2]
        self.k[layer, :, self.pos:self.pos + T] = k[0]
        self.v[layer, :, self.pos:self.pos + T] = v[0]
        end = self.pos + T
        if layer == self.n_layer - 1:
            self.pos = end
        B = k.shape[0]
        return self.k[layer, :, :end][None].expand(B, -1, -1, -1), self.v[layer, :, :end][None].expand(B, -1, -1, -1)

    def reset(self):
        self.pos = 0

    @property
    def seq_len(self):
        return self.pos


class CacheSqueeze(CacheNoBatch):
    def update(self, layer, k, v):                               # k.squeeze(0): fails for batch > 1
        T = k.shape[2]
        self.k[layer, :, self.pos:self.pos + T] = k.squeeze(0)
        self.v[layer, :, self.pos:self.pos + T] = v.squeeze(0)
        end = self.pos + T
        if layer == self.n_layer - 1:
            self.pos = end
        return self.k[layer, :, :end][None], self.v[layer, :, :end][None]


class CacheConcat(ConcatCache):
    def __init__(self, n_layer, batch_size, n_head, head_dim, max_len, dtype, device):
        super().__init__(n_layer)


class CacheNoOverflowCheck(PreallocatedCache):
    def update(self, layer, k, v):                               # silently truncates a write past max_len
        room = self.max_len - self._len
        return super().update(layer, k[:, :, :room], v[:, :, :room])


# --- the tests ----------------------------------------------------------------------------------------

def test_accepts_reference(capsys):
    check_kv_cache(PreallocatedCache)
    check_attention(reference_attention)
    check_generate_with_cache(PreallocatedCache, reference_attention)
    out = capsys.readouterr().out
    for name in ("check_kv_cache", "check_attention", "check_generate_with_cache"):
        assert f"PASSED {name}" in out


@pytest.mark.parametrize("impl, needles", [
    (attention_no_mask, ["no causal mask"]),
    (attention_mask_ignores_past, ["ignores past_len"]),
    (attention_is_causal_flag, ["do not call scaled_dot_product_attention"]),
    (attention_scale_1_over_d, ["scale", "sqrt(D)"]),
    (attention_no_scale, ["not scaled"]),
    (attention_batch_one, ["batch"]),
    (attention_row_zero_only, ["batch size 1"]),
])
def test_attention_rejects(impl, needles):
    expect_rejected(check_attention, impl, *needles)


@pytest.mark.parametrize("impl, needles", [
    (CacheNoReset, ["reset()"]),
    (CacheSeqLenStuck, ["never advances", "restarting at 0"]),
    (CacheWrongOffset, ["position 1", "offset"]),
    (CacheWritesAtZero, ["offset"]),
    (CacheNoBatch, ["batch"]),
    (CacheSqueeze, ["batch"]),
    (CacheConcat, ["preallocate"]),
    (CacheNoOverflowCheck, ["max_len"]),
])
def test_kv_cache_rejects(impl, needles):
    expect_rejected(check_kv_cache, impl, *needles)


@pytest.mark.parametrize("cache, attn, needles", [
    (PreallocatedCache, attention_no_mask, ["your attention"]),
    (PreallocatedCache, attention_mask_ignores_past, ["your attention"]),
    (CacheNoReset, reference_attention, ["reset()", "second"]),
    (CacheSeqLenStuck, reference_attention, ["your kvcache", "seq_len"]),
    (CacheNoBatch, reference_attention, ["your kvcache"]),
])
def test_generate_rejects(cache, attn, needles):
    expect_rejected(lambda pair: check_generate_with_cache(*pair), (cache, attn), *needles)


# ------------------------------------------------ issue 18: contract edges, dtypes, devices

from kvlab.course.checks import check_cache_bytes_prediction  # noqa: E402


class CacheOverflowIndexError(PreallocatedCache):
    def update(self, layer, k, v):                               # a raw error instead of ValueError
        if self._len + k.shape[2] > self.max_len:
            raise IndexError("out of range")
        return super().update(layer, k, v)


class CacheAlwaysCPU(PreallocatedCache):
    def __init__(self, n_layer, batch_size, n_head, head_dim, max_len, dtype=torch.float32, device="cpu"):
        super().__init__(n_layer, batch_size, n_head, head_dim, max_len, dtype, "cpu")

    def update(self, layer, k, v):
        keys, values = super().update(layer, k.to("cpu") if k.device.type != "meta" else
                                      torch.zeros(k.shape, dtype=k.dtype), v.to("cpu") if
                                      v.device.type != "meta" else torch.zeros(v.shape, dtype=v.dtype))
        return keys, values


class CacheFullIsOverflow(PreallocatedCache):
    def update(self, layer, k, v):                               # off by one: refuses to fill max_len
        if self._len + k.shape[2] >= self.max_len:
            raise ValueError("full")
        return super().update(layer, k, v)


class CacheIgnoresDtype(PreallocatedCache):
    def __init__(self, n_layer, batch_size, n_head, head_dim, max_len, dtype=torch.float32, device="cpu"):
        super().__init__(n_layer, batch_size, n_head, head_dim, max_len, torch.float64, device)


def attention_upcasts(q, k, v, past_len):                          # returns float32 for bf16 inputs
    return reference_attention(q.float(), k.float(), v.float(), past_len)


@pytest.mark.parametrize("impl, needles", [
    (CacheOverflowIndexError, ["ValueError", "IndexError"]),
    (CacheAlwaysCPU, ["meta"]),
    (CacheFullIsOverflow, ["EXACTLY"]),
    (CacheIgnoresDtype, ["dtype"]),
])
def test_kv_cache_rejects_hardened(impl, needles):
    expect_rejected(check_kv_cache, impl, *needles)


def test_attention_rejects_upcast():
    expect_rejected(check_attention, attention_upcasts, "bfloat16")


def test_cache_bytes_prediction():
    # the library's cache also keeps each slot's position (int64, [batch, max_len]): the one mask rule's data
    check_cache_bytes_prediction(PreallocatedCache, 2 * 12 * 12 * 1024 * 64 * 4 + 1024 * 8)
    expect_rejected(lambda c: check_cache_bytes_prediction(c, 12 * 12 * 1024 * 64 * 4),
                    PreallocatedCache, "you predicted", "0.5 times")
    expect_rejected(lambda c: check_cache_bytes_prediction(c, 1.2e8), PreallocatedCache, "int")


def test_chapter_3_sdpa_attention_does_not_pass():
    """Chapter 3 shows sdpa_attention (correct, fused): pasting it must not pass the exercise."""
    from kvlab.gpt2 import sdpa_attention

    expect_rejected(check_attention, own_copy(sdpa_attention), "scaled_dot_product_attention")
    expect_rejected(check_attention, sdpa_attention, "kvlab.gpt2.sdpa_attention", "yourself")


# ------------------------------------------------ issue 24: what still got through, and the unusual

class CacheSeqLenMethod(PreallocatedCache):
    def seq_len(self):                                           # a plain method, not a property
        return self._len


class CacheLosesDtypeOnReset(PreallocatedCache):
    def __init__(self, n_layer, batch_size, n_head, head_dim, max_len, dtype=torch.float32, device="cpu"):
        super().__init__(n_layer, batch_size, n_head, head_dim, max_len, dtype, device)
        self.sizes = (n_layer, batch_size, n_head, head_dim, max_len)

    def reset(self):                                             # reallocates with the defaults
        PreallocatedCache.__init__(self, *self.sizes)


class CacheOneBuffer(PreallocatedCache):
    def update(self, layer, k, v):                               # values written over the keys
        keys, _ = super().update(layer, k, v)
        T, start = k.shape[2], self._len - (k.shape[2] if layer == self.n_layer - 1 else 0)
        self.keys[layer, :, :, start:start + T] = v
        return keys, keys


class CacheClassBuffers:
    """Keeps its buffers on the class: every cache made shares them."""
    store = {}

    def __init__(self, n_layer, batch_size, n_head, head_dim, max_len, dtype=torch.float32, device="cpu"):
        shape = (n_layer, batch_size, n_head, max_len, head_dim)
        key = (shape, dtype, str(device))
        if key not in CacheClassBuffers.store:
            CacheClassBuffers.store[key] = (torch.zeros(shape, dtype=dtype, device=device),
                                            torch.zeros(shape, dtype=dtype, device=device))
        self.k, self.v = CacheClassBuffers.store[key]
        self.n_layer, self.max_len, self.pos = n_layer, max_len, 0

    def update(self, layer, k, v):
        T = k.shape[2]
        if self.pos + T > self.max_len:
            raise ValueError("full")
        self.k[layer, :, :, self.pos:self.pos + T] = k
        self.v[layer, :, :, self.pos:self.pos + T] = v
        end = self.pos + T
        if layer == self.n_layer - 1:
            self.pos = end
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def reset(self):
        self.pos = 0

    @property
    def seq_len(self):
        return self.pos


@pytest.mark.parametrize("impl, needles", [
    (CacheSeqLenMethod, ["@property"]),
    (CacheLosesDtypeOnReset, ["reset()", "float64", "float32"]),
    (CacheOneBuffer, ["share one buffer"]),
    (CacheClassBuffers, ["two caches alive at once"]),
])
def test_kv_cache_rejects_issue_24(impl, needles):
    CacheClassBuffers.store.clear()
    expect_rejected(check_kv_cache, impl, *needles)


def test_generate_rejects_refusing_an_exact_fill():
    # the unit grader says it too; end to end the message names the exact fill
    expect_rejected(lambda pair: check_generate_with_cache(*pair), (CacheFullIsOverflow, reference_attention),
                    "fills the cache exactly", "<=")


_LAST: dict = {}


def attention_remembers_by_shape(q, k, v, past_len):
    key = (tuple(q.shape), tuple(k.shape), past_len, q.dtype, q.device)
    if key not in _LAST:
        _LAST[key] = reference_attention(q, k, v, past_len)
    return _LAST[key].clone()


def attention_mask_on_cpu(q, k, v, past_len):                      # torch.arange without device=
    T, S = q.shape[-2], k.shape[-2]
    hidden = torch.arange(S)[None] > torch.arange(past_len, past_len + T)[:, None]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return torch.softmax(scores.masked_fill(hidden.to(q.device) if q.device.type != "meta" else hidden, float("-inf")), -1) @ v


def attention_scales_q_in_place(q, k, v, past_len):
    q.mul_(q.shape[-1] ** -0.5)                                    # scales the caller's q
    return reference_attention(q * q.shape[-1] ** 0.5, k, v, past_len)


def attention_off_on_last_query(q, k, v, past_len):               # a mistake with no name
    out = reference_attention(q, k, v, past_len).clone()
    out[:, :, -1] += 0.01
    return out


@pytest.mark.parametrize("impl, needles", [
    (attention_remembers_by_shape, ["remembered result"]),
    (attention_mask_on_cpu, ["meta", "created on q's device"]),
    (attention_scales_q_in_place, ["modified its argument q"]),
    (attention_off_on_last_query, ["largest error", "wrong queries: [5]"]),
])
def test_attention_rejects_issue_24(impl, needles):
    _LAST.clear()
    expect_rejected(check_attention, impl, *needles)


def attention_einsum_where(q, k, v, past_len):
    """Correct, written with einsum and torch.where; in bf16 it rounds more than the fp32 path."""
    T, S, D = q.shape[-2], k.shape[-2], q.shape[-1]
    scores = torch.einsum("bhtd,bhsd->bhts", q, k) / math.sqrt(D)
    allowed = torch.arange(S, device=q.device)[None] <= torch.arange(past_len, past_len + T, device=q.device)[:, None]
    scores = torch.where(allowed, scores, torch.finfo(q.dtype).min)
    return torch.einsum("bhts,bhsd->bhtd", scores.softmax(-1), v)


def attention_products_summed(q, k, v, past_len):
    """Correct: scores as elementwise products summed (more rounding in low precision)."""
    T, S, D = q.shape[-2], k.shape[-2], q.shape[-1]
    scores = (q.unsqueeze(3) * k.unsqueeze(2) * D ** -0.5).sum(-1)
    hidden = torch.arange(S, device=q.device)[None] > torch.arange(past_len, past_len + T, device=q.device)[:, None]
    weights = torch.softmax(scores.float().masked_fill(hidden, float("-inf")), -1).to(q.dtype)
    return (weights.unsqueeze(-1) * v.unsqueeze(2)).sum(3)


@pytest.mark.parametrize("impl", [attention_einsum_where, attention_products_summed])
def test_attention_accepts_unusual_correct(impl, capsys):
    check_attention(impl)
    assert "PASSED check_attention" in capsys.readouterr().out


def test_library_refused():
    from kvlab import cache, gpt2

    class Inherits(cache.PreallocatedCache):                        # adds nothing of its own
        pass

    expect_rejected(check_kv_cache, cache.PreallocatedCache, "kvlab.cache.PreallocatedCache")
    expect_rejected(check_kv_cache, Inherits, "library's own")
    expect_rejected(check_attention, gpt2.attention, "kvlab.gpt2.attention", "yourself")


def test_cache_bytes_prediction_names_what_is_left_out():
    # the library's cache also keeps slot_pos: a prediction of the K/V alone is 8,192 bytes short
    expect_rejected(lambda c: check_cache_bytes_prediction(c, 2 * 12 * 12 * 1024 * 64 * 4), PreallocatedCache,
                    "8,192 bytes short", "slot_pos [1, 1024] int64")


def attention_past_from_shapes(q, k, v, past_len):
    """Correct: reads past_len from the shapes (S - T), as the contract allows (issue 34, kind 8)."""
    import math as _m
    T, S = q.shape[-2], k.shape[-2]
    past = S - T
    hidden = torch.arange(S, device=q.device)[None] > past + torch.arange(T, device=q.device)[:, None]
    scores = (q.float() @ k.float().transpose(-2, -1) / _m.sqrt(q.shape[-1])).masked_fill(hidden, float("-inf"))
    return (torch.softmax(scores, -1) @ v.float()).to(q.dtype)


def test_attention_taking_past_len_from_the_shapes_passes(capsys):
    from kvlab.course.checks import check_attention
    check_attention(attention_past_from_shapes)
    assert "PASSED check_attention" in capsys.readouterr().out


class ForwardsToTheLibrary:
    """Composition: a cache of the learner's whose every method hands on to the library's."""

    def __init__(self, *args, **kwargs):
        from kvlab import cache
        self.inner = cache.PreallocatedCache(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_the_library_one_step_removed_is_refused_by_what_runs(capsys):
    """Issue 34, kind 1, in lab 3: the library's attention without its name, and a cache that forwards
    to the library's, are refused by what ran, in the unit checks and in the end-to-end one (where the
    grader, not the learner, calls them from inside GPT-2); the learner's own copies pass both."""
    from kvlab import gpt2

    for how, impl in one_step_removed(gpt2.attention).items():
        expect_rejected(check_attention, impl, "ran kvlab.gpt2.attention", "write it yourself")
        expect_rejected(lambda a: check_generate_with_cache(PreallocatedCache, a), impl, "ran kvlab.gpt2.attention")
    expect_rejected(check_kv_cache, ForwardsToTheLibrary, "ran kvlab.cache.PreallocatedCache")
    expect_rejected(lambda c: check_generate_with_cache(c, reference_attention), ForwardsToTheLibrary,
                    "ran kvlab.cache.PreallocatedCache", "write it yourself")
    check_generate_with_cache(PreallocatedCache, reference_attention)
    assert "PASSED check_generate_with_cache" in capsys.readouterr().out


def test_a_callable_library_object_is_refused_at_the_door():
    """A kvlab object that calls the library's attention when called (the model's own adapter): the
    grader calls it, not the learner's code, so only the refusal of what is handed in can see it."""
    from kvlab import gpt2

    expect_rejected(check_attention, gpt2.PastLenAttention(gpt2.attention), "handed in kvlab.gpt2.PastLenAttention",
                    "write it yourself")
