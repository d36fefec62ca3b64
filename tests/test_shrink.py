"""Chapter 11's designs that shrink the cache: GQA/MQA conversion, the sink + window cache, the latent.

What each must get right beyond cached == uncached (tests/test_equivalence.py): the lossless latent
and why it exists, the bytes each cache holds, the keys a chunk needs, and bad input refused before
any work, with the cache's state unchanged after the refusal."""

import pytest
import torch

from kvlab import gqa, latent
from kvlab.cache import visible
from kvlab.gpt2 import generate
from kvlab.window import SinkWindowKVCache


@pytest.fixture(scope="module")
def text(tiny):
    _, tok = tiny
    return tok("And God said, Let there be light: and there was light. And God saw the light, that it "
               "was good: and God divided the light from the darkness.", return_tensors="pt").input_ids


def test_latent_of_n_embd_is_lossless_and_why(ours, text):
    """K and V of a layer are W_kv x + b with W_kv [2C, C]: rank <= C, so a C-number latent is exact
    (half the cache); one number fewer is not, for this checkpoint (W_kv has full rank C)."""
    C = ours.config.n_embd
    for blk in ours.h:
        w_kv = blk.attn.c_attn.weight[C:]
        assert w_kv.shape == (2 * C, C) and torch.linalg.matrix_rank(w_kv.double()) == C
    exact = latent.convert(ours, latent.lossless_rank(ours.config))
    torch.testing.assert_close(exact(text), ours(text), atol=1e-4, rtol=1e-4)
    assert torch.equal(generate(exact, text, 20), generate(ours, text, 20))
    full, half = ours.new_cache(1, 64).nbytes, exact.new_cache(1, 64).nbytes
    assert half * 2 == full
    short = latent.convert(ours, C - 1)
    assert (short(text) - ours(text)).abs().max() > 1e-4     # the lossless rank is the least one here


def test_gqa_caches_store_only_the_kv_heads(ours, text):
    H = ours.config.n_head
    full = ours.new_cache(1, 64)
    for n_kv in gqa.group_counts(H):
        model = gqa.convert(ours, n_kv, "mean")
        cache = model.new_cache(1, 64)
        assert cache.keys.shape[2] == n_kv and cache.nbytes * H == full.nbytes * n_kv
        generate(model, text, 4, cache=cache)
    same = gqa.convert(ours, H, "mean")          # one head per group: the model itself
    assert torch.equal(generate(same, text, 12), generate(ours, text, 12))


def test_gqa_pca_beats_mean_on_calibration_outputs(ours, tiny):
    """The pca conversion reproduces the original's logits better than mean pooling (the maps it folds
    into the query and output projections make mean pooling a special case)."""
    _, tok = tiny
    calib = tok(open("models/kvlab-tiny/heldout.txt").read()[:20000], return_tensors="pt").input_ids[:, :2048]
    x = calib.view(4, 512)
    ref = ours(x)
    err = {m: (gqa.convert(ours, 1, m, x)(x) - ref).pow(2).mean() for m in gqa.METHODS}
    assert err["pca"] < err["mean"] and err["pca"] < err["first"], err


def test_repeat_kv_order():
    kv = torch.arange(2 * 3).float().view(1, 2, 3, 1)        # 2 kv heads
    out = gqa.repeat_kv(kv, 3)
    assert out[0, :, 0, 0].tolist() == [0, 0, 0, 3, 3, 3]    # query head h reads kv head h // 3


def test_a_chunk_attends_over_window_minus_one_plus_k_keys(ours, text):
    seen = []

    class Counting(SinkWindowKVCache):
        def store(self, layer, k, v, positions):
            out = super().store(layer, k, v, positions)
            if layer == 0:
                seen.append((k.shape[2], out[0].shape[2], int(visible(positions, out[2]).sum(-1).max())))
            return out

    cache = Counting(ours.config.n_layer, window=6, sinks=2)
    ours(text[:, :20], cache)                   # prefill: every query sees at most sinks + window keys
    ours(text[:, 20:25], cache)                 # a chunk of 5 after 20 held: 2 sinks + 5 of window + 5 new
    assert seen == [(20, 20, 8), (5, 2 + 5 + 5, 8)]
    assert cache.held == 2 + 5 and cache._key_pos[0].tolist() == [0, 1, 20, 21, 22, 23, 24]


def test_window_rewind_within_and_into_evicted(ours, text):
    cache = SinkWindowKVCache(ours.config.n_layer, window=8, sinks=2)
    out = generate(ours, text[:, :5], 3, cache=cache)     # 7 tokens seen, nothing evicted yet
    cache.rewind(5)
    assert torch.equal(generate(ours, text[:, :5], 3, cache=SinkWindowKVCache(ours.config.n_layer, 8, 2)), out)
    cache = SinkWindowKVCache(ours.config.n_layer, window=4, sinks=1)
    ours(text[:, :20], cache)
    before = (cache.seq_len, cache._key_pos.clone(), [k.clone() for k in cache.keys])
    with pytest.raises(ValueError, match="evicted"):
        cache.rewind(18)
    assert cache.seq_len == before[0] and torch.equal(cache._key_pos, before[1])
    assert all(torch.equal(a, b) for a, b in zip(cache.keys, before[2]))


def test_bad_inputs_named_and_nothing_changed(ours, text):
    H, C, ctx = ours.config.n_head, ours.config.n_embd, ours.config.n_positions
    with pytest.raises(ValueError, match=r"cannot be shared evenly.*\[1, 2, 4\]"):
        gqa.convert(ours, 3)
    for bad in (0, H + 1, 2.0, True):
        with pytest.raises(ValueError, match="shared evenly"):
            gqa.convert(ours, bad)
    with pytest.raises(ValueError, match="method"):
        gqa.convert(ours, 2, "median")
    with pytest.raises(ValueError, match="calibration"):
        gqa.convert(ours, 2, "pca")
    with pytest.raises(ValueError, match="unconverted"):
        gqa.convert(gqa.convert(ours, 2), 1)
    for bad in (0, C + 1, 1.5):
        with pytest.raises(ValueError, match="n_embd"):
            latent.convert(ours, bad)
    with pytest.raises(ValueError, match="larger than the model's context"):
        SinkWindowKVCache(ours.config.n_layer, window=ctx - 3, sinks=4, context=ctx)
    late = SinkWindowKVCache(ours.config.n_layer, window=ctx, sinks=1)   # no context given: refused on first use
    with pytest.raises(ValueError, match="larger than the model's context"):
        ours(text, late)
    assert late.seq_len == 0 and late.held == 0
    with pytest.raises(ValueError, match="window must be"):
        SinkWindowKVCache(ours.config.n_layer, window=0)
    cache = SinkWindowKVCache(ours.config.n_layer, window=4, sinks=1)
    ours(text[:, :6], cache)
    state = (cache.seq_len, cache.held, cache._key_pos.clone())
    with pytest.raises(ValueError, match="row"):                        # another batch size
        ours(text[:, :2].repeat(2, 1), cache)
    with pytest.raises(ValueError, match="evicted"):
        cache.rewind(3)                                                  # needs 1 and 2, gone
    assert (cache.seq_len, cache.held) == state[:2] and torch.equal(cache._key_pos, state[2])
    two = SinkWindowKVCache(ours.config.n_layer, window=4)
    with pytest.raises(ValueError, match="same positions"):
        ours(text[:, :2].repeat(2, 1), two, positions=torch.tensor([[0, 1], [1, 2]]))
    assert two.seq_len == 0 and two.held == 0 and all(k is None for k in two.keys)
    with pytest.raises(ValueError, match="LatentKVCache stores one latent"):
        latent.LatentKVCache(1, 1, 1, 4, 8).update(0, torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4),
                                                 torch.zeros(1, 1, dtype=torch.long))
    assert ours.config.cache_dims() == (H, C // H)        # the original is never changed by a conversion


def test_measurements_follow_the_books_protocol(ours, tiny):
    """shrinkbench.quality is models' window_loss through the hand-built model: the same perplexity as
    transformers' model on the same windows; the original agrees with itself everywhere; a window as
    long as the context changes nothing; attention a window drops is 0 beyond the context."""
    import math

    from kvlab import shrinkbench as sb
    from kvlab.quality import window_loss

    hf, tok = tiny
    calib, train, ev = sb.split_text(tok)
    assert calib.shape == (8, 512) and train.numel() + ev.numel() > 50_000 and not set(calib[0].tolist()) - set(train.tolist())
    ref = sb.quality(ours, ev, max_windows=2)
    loss, n = window_loss(hf, ev, window=512, max_windows=2)
    assert n == 2 and ref["ppl"] == pytest.approx(math.exp(loss), rel=1e-4)
    again = sb.quality(ours, ev, ref["top1"], max_windows=2)
    assert again["agree"] == 1.0
    whole = sb.quality(ours, ev, ref["top1"], lambda B: SinkWindowKVCache(ours.config.n_layer, 512), max_windows=2)
    assert whole["ppl"] == pytest.approx(ref["ppl"], rel=1e-5)
    beyond = sb.attention_beyond(ours, calib[:1], [1, 512], first=0)
    assert beyond.shape == (ours.config.n_layer, 2) and bool((beyond[:, 1] == 0).all()) and bool((beyond[:, 0] > 0).all())
    mass = sb.attention_mass(ours, calib[:1])
    assert mass.shape == (ours.config.n_layer, ours.config.n_head) and bool(((mass >= 0) & (mass <= 1)).all())


def test_every_page_quotes_one_perplexity(ours, tiny):
    """The book's perplexity (kvlab.quality.perplexity) is ONE measurement: chapter 11's reference
    (shrinkbench.quality on the evaluation split, the book's windows), chapter 8's fp32 row
    (weightbench.quality) and transformers' model on the same windows all give the same number."""
    from kvlab import quality, shrinkbench as sb, weightbench

    hf, tok = tiny
    book = quality.perplexity(ours, tok, quick=True)
    _, _, ev = sb.split_text(tok)
    assert book["windows"] == quality.perplexity_windows(ours, True) == 4 and book["window"] == 512
    assert book["tokens"] == ev.numel()
    assert sb.quality(ours, ev, max_windows=book["windows"])["ppl"] == pytest.approx(book["ppl"], rel=1e-5)
    assert quality.perplexity(hf, tok, quick=True)["ppl"] == pytest.approx(book["ppl"], rel=1e-4)
    fp32 = weightbench.quality(ours, tok, formats=("fp32",), quick=True, prompts=1, new_tokens=2)[0]
    assert fp32["perplexity"] == pytest.approx(book["ppl"], rel=1e-5) and fp32["ppl_text"] == quality.describe(book)
    assert "4 windows of 512 tokens" in quality.describe(book)
