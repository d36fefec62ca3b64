"""The from-scratch GPT-2 (kvlab.gpt2) and its caches (kvlab.cache) against transformers."""

import pytest
import torch
from transformers import DynamicCache, GPT2Config as HFConfig, GPT2LMHeadModel

from kvlab.cache import ConcatCache, PreallocatedCache, SlidingWindowKVCache
from kvlab.reference import hf_greedy
from kvlab.gpt2 import GPT2, attention, generate, generate_uncached, sdpa_attention

TOL = 1e-4   # fp32 logits, ours vs transformers (measured: ~1e-5 on kvlab-tiny)


@pytest.fixture(scope="module")
def small():
    """A small random GPT-2 (2 layers, width 48): other shapes than kvlab-tiny."""
    torch.manual_seed(1)
    cfg = HFConfig(n_layer=2, n_head=3, n_embd=48, n_positions=40, vocab_size=97)
    return GPT2LMHeadModel(cfg).eval()


@pytest.fixture(scope="module")
def hf_models(tiny, small):
    return {"kvlab-tiny": tiny[0], "small": small}


@pytest.mark.parametrize("name", ["kvlab-tiny", "small"])
@torch.no_grad()
def test_logits_match_transformers_prefill_and_decode(hf_models, name):
    hf = hf_models[name]
    ours = GPT2.from_hf(hf)
    V = hf.config.vocab_size
    ids = torch.randint(0, V, (3, 14), generator=torch.Generator().manual_seed(0))
    assert (ours(ids) - hf(ids).logits).abs().max() < TOL                 # no cache at all
    cache, dc = ours.new_cache(3), DynamicCache(config=hf.config)
    a, b = ours(ids[:, :9], cache), hf(ids[:, :9], cache=dc, use_cache=True).logits
    assert (a - b).abs().max() < TOL and cache.seq_len == 9
    for t in range(9, 14):                                                  # every decode step
        a, b = ours(ids[:, t:t + 1], cache), hf(ids[:, t:t + 1], cache=dc, use_cache=True).logits
        assert (a - b).abs().max() < TOL
    assert cache.seq_len == 14


@torch.no_grad()
def test_chunk_after_a_past_uses_the_right_mask(small):
    """T > 1 new tokens after a past: the case where sdpa's is_causal=True would be wrong."""
    ours = GPT2.from_hf(small)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(2))
    full = ours(ids)
    for fn in (attention, sdpa_attention):
        ours.attention_fn = fn
        cache = ours.new_cache(2)
        ours(ids[:, :5], cache)
        assert (ours(ids[:, 5:], cache) - full[:, 5:]).abs().max() < TOL


def test_generation_equals_transformers(tiny, small):
    hf, tok = tiny
    ours = GPT2.from_hf(hf)
    ids = tok("And the LORD said unto", return_tensors="pt").input_ids
    want = hf_greedy(hf, ids, 25)
    assert torch.equal(generate(ours, ids, 25), want)
    assert torch.equal(generate_uncached(ours, ids, 25), want)
    assert torch.equal(generate(ours, ids, 25, cache=ConcatCache(hf.config.n_layer)), want)
    ids = torch.randint(0, 97, (2, 4), generator=torch.Generator().manual_seed(3))   # batch 2
    s = GPT2.from_hf(small)
    assert torch.equal(generate(s, ids, 20), torch.cat([hf_greedy(small, r[None], 20) for r in ids]))


def test_reusing_a_cache_resets_it(small):
    ours = GPT2.from_hf(small)
    cache = ours.new_cache(1)
    a = torch.tensor([[5, 6, 7]])
    b = torch.tensor([[9, 1]])
    generate(ours, a, 6, cache=cache)
    assert cache.seq_len == 8                       # prompt + all but the last new token were fed
    assert torch.equal(generate(ours, b, 6, cache=cache), generate(ours, b, 6))
    cache.reset()
    assert cache.seq_len == 0


def test_errors_are_clear(small):
    ours = GPT2.from_hf(small)
    with pytest.raises(ValueError, match="exceeds the model's context of 40"):
        generate(ours, torch.tensor([[1, 2, 3]]), 38)
    with pytest.raises(ValueError, match="empty"):
        generate(ours, torch.zeros(1, 0, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="LongTensor"):
        generate(ours, torch.tensor([[1.0, 2.0]]), 3)
    cache = PreallocatedCache(1, 1, 2, 4, max_len=5)
    cache.update(0, torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4, 4))
    with pytest.raises(ValueError, match=r"(?s)2 more token.*max_len of 5.*GPT-2's context"):
        cache.update(0, torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4))
    with pytest.raises(ValueError, match="batch=1"):
        cache.update(0, torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4))


def test_preallocated_cache_bookkeeping():
    c = PreallocatedCache(n_layer=2, batch_size=2, n_head=3, head_dim=4, max_len=10)
    assert c.nbytes == 2 * 2 * 2 * 3 * 10 * 4 * 4          # K and V, layers, batch, heads, len, dim, fp32
    k = torch.randn(2, 3, 6, 4)
    keys, values = c.update(0, k, -k)
    assert c.seq_len == 0                                   # advances after the last layer only
    keys, values = c.update(1, k, -k)
    assert c.seq_len == 6 and torch.equal(keys, k) and torch.equal(values, -k)
    keys2, _ = c.update(0, k[:, :, :1], k[:, :, :1])
    assert keys2.shape[2] == 7 and keys2.data_ptr() == c.keys[0].data_ptr()   # a view of the buffer


def test_sliding_window(small):
    ours = GPT2.from_hf(small)
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(4))
    wide = SlidingWindowKVCache(small.config.n_layer, window=64)      # never drops anything: exact
    assert torch.equal(generate(ours, ids, 20, cache=wide), generate(ours, ids, 20))
    narrow = SlidingWindowKVCache(small.config.n_layer, window=4)
    generate(ours, ids, 20, cache=narrow)
    assert narrow.seq_len == 25 and narrow.keys[0].shape[2] == 4   # positions count on; 4 tokens held


def test_from_hf_names_a_shape_mismatch(small):
    """nanoGPT's habit: every copied weight's shape is checked, and a mismatch names the weight."""
    cfg = HFConfig(n_layer=1, n_head=3, n_embd=48, n_positions=40, vocab_size=97, n_inner=100)
    odd = GPT2LMHeadModel(cfg).eval()        # an MLP of width 100, where GPT-2 has 4 * n_embd
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.mlp\.c_fc\.weight.*\[48, 100\].*\[192, 48\]"):
        GPT2.from_hf(odd)


@torch.no_grad()
def test_bad_input_is_refused_before_any_work(small):
    ours = GPT2.from_hf(small)
    cache = ours.new_cache(2, max_len=20)
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(5))
    ours(ids, cache)
    cases = [
        (dict(input_ids=ids[:, :2], positions=torch.tensor([[6, 5], [5, 6]])), "run backwards"),
        (dict(input_ids=ids[:, :3], positions=torch.tensor([[5, -1, 6], [5, 6, 7]])), "pad on the left"),
        (dict(input_ids=ids[:, :1], positions=torch.tensor([[2], [5]])), "not after position 4"),
        (dict(input_ids=ids[:1, :1]), "holds 2 row"),
        (dict(input_ids=ids[:, :1], positions=torch.tensor([[40], [40]])), "exceeds the model's context"),
        (dict(input_ids=ids[:, :1], positions=torch.tensor([5, 5])), "LongTensor"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            ours(cache=cache, **kwargs)
        assert cache.seq_len == 5                 # a refused call leaves nothing behind
    with pytest.raises(ValueError, match="n_head=2 but the model has n_head=3"):
        ours(ids, PreallocatedCache(2, 2, 2, 24, 20))
    with pytest.raises(ValueError, match="n_positions=40"):
        ours(torch.zeros(1, 41, dtype=torch.long))
    given = ours(ids[:, :1], cache, positions=torch.tensor([[5], [5]]))
    cache.rewind(5)
    assert torch.equal(given, ours(ids[:, :1], cache))   # positions given, or asked of the cache: the same


def test_padded_positions_are_hidden(small):
    """A left-padded row (pads at position EMPTY) gives the logits of the same row unpadded."""
    from kvlab.cache import EMPTY

    ours = GPT2.from_hf(small)
    ids = torch.randint(1, 97, (1, 6), generator=torch.Generator().manual_seed(6))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    pos = torch.tensor([[EMPTY] * 3 + list(range(6))])
    with torch.no_grad():
        got = ours(padded, ours.new_cache(1), positions=pos)[:, 3:]
        assert (got - ours(ids)).abs().max() < TOL
