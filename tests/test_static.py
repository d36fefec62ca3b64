"""kvlab.static: the static cache, static attention, and the compiled decode step (one graph, same tokens)."""

import pytest
import torch

from kvlab.cache import Cache
from kvlab.gpt2 import GPT2, attention, generate
from kvlab import static
from kvlab.static import StaticCache, StaticDecoder, static_attention, static_attention_explicit


@pytest.fixture(scope="module")
def ours(tiny):
    return GPT2.from_hf(tiny[0])


def test_static_cache_interface():
    c = StaticCache(2, 3, 4, 8, 10, torch.float64)
    assert isinstance(c, Cache) and c.seq_len == 0 and c.nbytes == 2 * 2 * 3 * 4 * 10 * 8 * 8
    k = torch.randn(3, 4, 5, 8, dtype=torch.float64)
    ptr = c.keys[0].data_ptr()
    for layer in range(2):
        keys, values = c.update(layer, k, -k)                 # pos defaults to the cache's own position
        assert keys.shape == (3, 4, 10, 8) and keys.data_ptr() == c.keys[layer].data_ptr()
        assert torch.equal(keys[:, :, :5], k) and torch.equal(values[:, :, :5], -k)
        assert not keys[:, :, 5:].any()
        assert c.seq_len == (5 if layer == 1 else 0)         # advances after the last layer
    one = torch.ones(3, 4, 1, 8, dtype=torch.float64)
    c.update(0, one, one, torch.tensor(2))                   # an explicit position wins (a rewind)
    keys, _ = c.update(1, one, one, torch.tensor(2))
    assert c.seq_len == 3 and torch.equal(keys[:, :, 2:3], one)
    c.reset()
    assert c.seq_len == 0 and c.keys[0].data_ptr() == ptr and not any(t.any() for t in c.keys + c.values)
    assert isinstance(c.position, torch.Tensor) and c.position.dim() == 0 and c.position.dtype == torch.long


@pytest.mark.parametrize("bad", [torch.zeros(2, 4, 1, 8), torch.zeros(3, 4, 1, 4), torch.zeros(3, 4, 11, 8)])
def test_static_cache_refuses_bad_shapes(bad):
    with pytest.raises(ValueError):
        StaticCache(2, 3, 4, 8, 10).update(0, bad, bad)
    with pytest.raises(ValueError):
        StaticCache(0, 3, 4, 8, 10)


@pytest.mark.parametrize("T, pos", [(1, 0), (1, 6), (3, 4), (5, 0)])
def test_static_attention_equals_chapter3_attention(T, pos):
    """Over the full buffer with the mask == chapter 3's attention over the filled part only."""
    g = torch.Generator().manual_seed(T * 10 + pos)
    q = torch.randn(2, 3, T, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, 3, 12, 16, generator=g, dtype=torch.float64) * 3   # slots >= pos+T: stale junk
    v = torch.randn(2, 3, 12, 16, generator=g, dtype=torch.float64)
    want = attention(q, k[:, :, :pos + T], v[:, :, :pos + T], pos)
    for fn in (static_attention, static_attention_explicit):
        assert torch.allclose(fn(q, k, v, torch.tensor(pos)), want, atol=1e-10)


def test_static_cache_through_the_one_forward(ours):
    """The model's own forward on a static cache: the same logits as without a cache, prefill then a chunk."""
    ids = torch.randint(0, ours.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    cache = StaticCache(ours.config.n_layer, 2, ours.config.n_head, ours.config.head_dim, 16)
    with torch.no_grad():
        got = ours(ids[:, :7], cache, last_only=True)[:, -1]
        got2 = ours(ids[:, 7:], cache, last_only=True)[:, -1]
        want = ours(ids)
    assert torch.allclose(got, want[:, 6], atol=1e-4) and torch.allclose(got2, want[:, 8], atol=1e-4)
    assert cache.seq_len == 9 and cache.slot_pos[0, :10].tolist() == list(range(9)) + [-1]


def test_decoder_eager_equals_reference(ours, tiny):
    tok = tiny[1]
    dec = StaticDecoder(ours, batch_size=2, max_len=40)
    for text, n in (("In the beginning God created", 20), ("And", 30)):
        one = tok(text, return_tensors="pt").input_ids
        ids = torch.cat([one, one.flip(1)])                  # two different rows of one length
        assert torch.equal(dec.generate(ids, n), generate(ours, ids, n))


def test_decoder_refuses_bad_input(ours):
    dec = StaticDecoder(ours, batch_size=1, max_len=10)
    with pytest.raises(ValueError, match="max_len"):
        dec.generate(torch.zeros(1, 6, dtype=torch.long), 5)
    with pytest.raises(ValueError, match="batch_size"):
        dec.generate(torch.zeros(2, 3, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="n_positions"):
        StaticDecoder(ours, max_len=ours.config.n_positions + 1)
    assert torch.equal(dec.generate(torch.ones(1, 3, dtype=torch.long), 0), torch.ones(1, 3, dtype=torch.long))


def test_compiled_step_is_one_graph(ours, tiny):
    """aot_eager (no C++ compiler): one graph for every step and every prompt; torch counts it."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    breaks = sum(counters["graph_break"].values())
    dec = StaticDecoder(ours, batch_size=1, max_len=48).compile(backend=counter, fullgraph=True)
    for text, n in (("Thou shalt", 30), ("And the LORD said unto Moses, Go", 12)):
        ids = tiny[1](text, return_tensors="pt").input_ids
        assert torch.equal(dec.generate(ids, n), generate(ours, ids, n))
    assert counter.frame_count == 1 and sum(counters["graph_break"].values()) == breaks


def test_compiled_inductor_same_tokens(ours, tiny):
    """The real thing, once: inductor's C++ backend (needs a C++ compiler), tokens equal to eager."""
    torch._dynamo.reset()
    dec = StaticDecoder(ours, batch_size=1, max_len=32).compile()
    ids = tiny[1]("The LORD is my shepherd", return_tensors="pt").input_ids
    assert torch.equal(dec.generate(ids, 20), generate(ours, ids, 20))


def test_break_even_and_first_call():
    from kvlab.static import break_even_tokens, cpu_compiler, time_first_call

    assert break_even_tokens(10.0, 0.003, 0.001) == pytest.approx(5000)   # 10 s / 2 ms saved per token
    assert break_even_tokens(10.0, 0.001, 0.002) is None                  # slower: never pays off
    assert 0 <= time_first_call(lambda: torch.ones(3).sum(), "cpu") < 5
    assert cpu_compiler()                                                 # the build machine has one


def test_no_compiler_is_a_clear_error(monkeypatch):
    from kvlab.static import cpu_compiler

    monkeypatch.setenv("CXX", "no-such-compiler-kvlab")
    with pytest.raises(RuntimeError, match="needs a C\\+\\+ compiler"):
        cpu_compiler()


def test_hf_compile_config_refuses_a_transformers_that_ignores_the_private_flag(monkeypatch):
    """transformers compiles generate's decode step on a CPU only through CompileConfig's private
    ``_compile_all_devices``; without it the 'compiled' row would run eagerly: refused, by name."""
    import transformers
    from transformers.generation.utils import GenerationMixin

    assert static.honours_compile_all_devices()              # the pinned release reads the flag
    assert static.hf_compile_config("cpu")._compile_all_devices is True
    assert static.hf_compile_config("cuda").mode == "reduce-overhead"   # compiles by itself there
    monkeypatch.delattr(transformers.CompileConfig, "_compile_all_devices")
    with pytest.raises(RuntimeError, match="_compile_all_devices.*would run eagerly"):
        static.hf_compile_config("cpu")
    static.hf_compile_config("cuda")                          # not needed on CUDA: no error
    monkeypatch.undo()
    monkeypatch.setattr(GenerationMixin, "_valid_auto_compile_criteria", lambda self, kw, gc: True)
    assert not static.honours_compile_all_devices()           # the flag exists but is no longer read
    with pytest.raises(RuntimeError, match="transformers .* no longer reads"):
        static.hf_compile_config("cpu")
