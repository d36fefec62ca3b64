"""kvlab.quant: quantization, packing, the quantized cache's bytes and exactness, and generation with it."""

import pytest
import torch

from kvlab import footprint, memory, quant, quant_cache

CFG = dict(n_layer=3, n_head=2, n_embd=64, n_positions=256)   # head_dim 32


def fill(cache, lengths, seed=0):
    """Feed random keys/values in chunks of ``lengths`` tokens; return every layer's inputs, concatenated."""
    g = torch.Generator().manual_seed(seed)
    ks, vs = [[] for _ in range(cache.n_layer)], [[] for _ in range(cache.n_layer)]
    out = None
    for T in lengths:
        for layer in range(cache.n_layer):
            k = torch.randn(cache.batch_size, cache.n_head, T, cache.head_dim, generator=g)
            v = torch.randn(cache.batch_size, cache.n_head, T, cache.head_dim, generator=g)
            k[..., 3] = k[..., 3] * 10 + 5        # an outlier channel
            ks[layer].append(k)
            vs[layer].append(v)
            out = cache.update(layer, k, v)
    return [torch.cat(x, 2) for x in ks], [torch.cat(x, 2) for x in vs], out


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_round_trip(bits):
    q = torch.randint(0, 2 ** bits, (2, 3, 5, 32), dtype=torch.uint8)
    p = quant.pack(q, bits)
    assert p.dtype == torch.uint8 and p.shape[-1] == 32 * bits // 8
    assert torch.equal(quant.unpack(p, bits), q)
    if bits == 4:
        assert torch.equal(p[..., 0], q[..., 0] | (q[..., 1] << 4))      # low nibble first
    if bits == 2:
        assert torch.equal(p[..., 0], q[..., 0] | (q[..., 1] << 2) | (q[..., 2] << 4) | (q[..., 3] << 6))


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 2"):
        quant.pack(torch.zeros(3, 5, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="uint8"):
        quant.pack(torch.zeros(3, 4), 4)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dim", [-1, -2, 0, (1, 2, 3)])
def test_quantize_within_half_step(bits, dim):
    x = torch.randn(2, 3, 20, 8)
    x[..., 2] *= 20
    q, s, z = quant.quantize(x, bits, dim)
    assert q.dtype == torch.uint8 and int(q.max()) <= 2 ** bits - 1
    assert ((quant.dequantize(q, s, z) - x).abs() <= s / 2 * (1 + 1e-5) + 1e-6).all()


def test_quantize_constant_and_bad_bits():
    x = torch.full((4, 6), -2.5)
    q, s, z = quant.quantize(x, 4, -1)
    assert torch.isfinite(s).all() and torch.equal(quant.dequantize(q, s, z), x)
    for bad in (1, 3, 16, 4.0, True):
        with pytest.raises(ValueError, match=r"\(2, 4, 8\)"):
            quant.quantize(x, bad, -1)


def test_groups_are_finer_than_whole_token():
    x = torch.randn(2, 5, 64)
    x[..., 7] *= 30
    e_token = (quant.fake_quantize(x, 4, -1) - x).norm()
    e_group = (quant.dequantize_groups(*quant.quantize_groups(x, 4, 16)) - x).norm()
    assert e_group < e_token


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_nbytes_against_formula(bits):
    B, T, block = 2, 96, 32
    c = quant_cache.QuantizedKVCache.for_model(type("C", (), CFG)(), B, 128, bits=bits, block=block)
    fill(c, [T])
    L, H, D = CFG["n_layer"], CFG["n_head"], CFG["n_embd"] // CFG["n_head"]
    fp32 = memory.kv_cache_bytes(CFG, T, B, torch.float32)
    codes = fp32 * bits // 32                                   # the formula, at `bits` per number
    key_meta = 2 * L * B * H * (T // block) * D * 4             # scale + zero point per channel per block
    value_meta = 2 * L * B * H * T * 4                          # scale + zero point per token
    assert c.nbytes_breakdown() == {"codes": codes, "scales+zero points": key_meta + value_meta,
                                    "full-precision window": 0}
    assert c.nbytes == codes + key_meta + value_meta == footprint.measured_cache_bytes(c)
    assert c.nbytes < fp32 * (bits / 32 + 0.2)


def test_article_a_cache_saves_nothing():
    c = quant_cache.AbsmaxFakeInt8Cache.for_model(type("C", (), CFG)(), 2, 128)
    fill(c, [40, 1, 1])
    fp32 = memory.kv_cache_bytes(CFG, 42, 2, torch.float32)
    assert c.nbytes == footprint.measured_cache_bytes(c) == fp32 + 3 * 2 * CFG["n_layer"] * 4   # + one scale each


@pytest.mark.parametrize("residual", [0, 8, 40])
def test_residual_window_exact_and_blocks_within_half_step(residual):
    block, bits = 16, 2
    c = quant_cache.QuantizedKVCache(3, 2, 2, 32, 256, bits=bits, residual=residual, block=block)
    ks, vs, _ = fill(c, [37, 1, 1, 1, 25, 1])
    assert c.seq_len == 66
    nq = c.quantized_len
    assert nq % block == 0 and residual <= 66 - nq < residual + block
    for layer in range(3):
        keys, values = c.update(layer, ks[layer][..., :0, :], vs[layer][..., :0, :])   # read back, add nothing
        assert keys.shape == ks[layer].shape
        # the residual window (and the not-yet-full block) is returned exactly
        assert torch.equal(keys[..., nq:, :], ks[layer][..., nq:, :])
        assert torch.equal(values[..., nq:, :], vs[layer][..., nq:, :])
        # quantized blocks: keys per channel, values per token, each within half a step
        for s in range(0, nq, block):
            kb, vb = ks[layer][..., s:s + block, :], vs[layer][..., s:s + block, :]
            assert torch.allclose(keys[..., s:s + block, :], quant.fake_quantize(kb, bits, -2), atol=1e-5)
            assert torch.allclose(values[..., s:s + block, :], quant.fake_quantize(vb, bits, -1), atol=1e-5)
    assert c.nbytes == footprint.measured_cache_bytes(c)


def test_cache_contract():
    c = quant_cache.QuantizedKVCache(2, 1, 2, 32, 40, bits=4, block=8)
    k = torch.randn(1, 2, 30, 32)
    c.update(0, k, k)
    assert c.seq_len == 0                     # advances once the last layer has its tokens
    c.update(1, k, k)
    assert c.seq_len == 30
    with pytest.raises(ValueError, match="max_len"):
        c.update(0, k, k)
    with pytest.raises(ValueError, match="head_dim"):
        c.update(0, torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16))
    c.reset()
    assert c.seq_len == 0 and c.nbytes == 0
    with pytest.raises(ValueError, match="multiple of 4"):
        quant_cache.QuantizedKVCache(2, 1, 2, 30, 40, bits=2)


def test_quantized_cache_generation_matches_full_precision(tiny, ours):
    """8-bit KIVI cache on kvlab-tiny: greedy tokens mostly equal to the fp32 cache's; 2 bits still runs."""
    from kvlab.gpt2 import generate
    from kvlab.paths import TINY_DIR

    (model, tok), gpt = tiny, ours
    text = (TINY_DIR / "heldout.txt").read_text()[:20_000]
    ids = tok(text, return_tensors="pt", verbose=False).input_ids[0]
    prompts = torch.stack([ids[s:s + 80] for s in (0, 1000, 3000)])     # batch of 3 held-out prompts
    N = 24
    full = generate(gpt, prompts, N)
    cache = quant_cache.QuantizedKVCache.for_model(gpt.config, 3, 80 + N, bits=8, block=32)
    q8 = generate(gpt, prompts, N, cache=cache)
    assert torch.equal(q8[:, :80], prompts)
    agree = (q8[:, 80:] == full[:, 80:]).float().mean().item()
    assert agree >= 0.9, f"8-bit cache agrees on only {agree:.0%} of greedy tokens"
    assert cache.nbytes < 0.5 * memory.kv_cache_bytes(model.config, 80 + N - 1, 3, torch.float32)
    again = generate(gpt, prompts, N, cache=cache)                       # generate resets the cache
    assert torch.equal(again, q8)
    q2 = generate(gpt, prompts, N, cache=quant_cache.QuantizedKVCache.for_model(gpt.config, 3, 80 + N, bits=2))
    assert q2.shape == full.shape


@pytest.mark.parametrize("bits", [2, 8])
def test_prefill_attends_to_exact_prompt_then_reads_the_stored_past(tiny, ours, bits):
    """Only what is stored is quantized: the prefill's logits equal the full-precision cache's exactly
    (as in KIVI and transformers' QuantizedKVCache); the next step reads the quantized past."""
    (model, _), gpt = tiny, ours
    ids = torch.randint(1, model.config.vocab_size, (2, 70), generator=torch.Generator().manual_seed(5))
    full = gpt.new_cache(2, 71)
    caches = [quant_cache.QuantizedKVCache.for_model(gpt.config, 2, 71, bits=bits, block=32),
              quant_cache.AbsmaxFakeInt8Cache.for_model(gpt.config, 2, 71)]
    with torch.no_grad():
        ref_prefill = gpt(ids[:, :64], full)
        ref_next = gpt(ids[:, 64:65], full)
        for c in caches:
            assert torch.equal(gpt(ids[:, :64], c), ref_prefill), type(c).__name__
            assert not torch.equal(gpt(ids[:, 64:65], c), ref_next), type(c).__name__
    assert caches[0].quantized_len == 64
