"""kvlab.static: the static cache, static attention, and the compiled decode step (one graph, same tokens)."""

import pytest
import torch

from kvlab.cache import Cache
from kvlab.gpt2 import attention, generate
from kvlab import reference
from kvlab.static import StaticKVCache, StaticDecoder, static_attention, static_attention_explicit


def test_static_cache_interface():
    c = StaticKVCache(2, 3, 4, 8, 10, torch.float64)
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
        StaticKVCache(2, 3, 4, 8, 10).update(0, bad, bad)
    with pytest.raises(ValueError):
        StaticKVCache(0, 3, 4, 8, 10)


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
    cache = StaticKVCache(ours.config.n_layer, 2, ours.config.n_head, ours.config.head_dim, 16)
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


@pytest.fixture(scope="module")
def inductor_dec(ours):
    """One inductor compilation for the module's tests (compiling takes seconds)."""
    torch._dynamo.reset()
    return StaticDecoder(ours, batch_size=1, max_len=32).compile(matvec="blas")   # products the profiler can name


def test_reduction_products_same_tokens_same_weights(ours, tiny):
    """matvec="auto" on a CPU at batch 1 compiles the products as reductions (kvlab.matvec): the same
    tokens as eager, on the very same Parameters (nothing copied); refused where it would be wrong."""
    from kvlab import matvec

    ids = tiny[1]("The LORD is my shepherd", return_tensors="pt").input_ids
    dec = StaticDecoder(ours, max_len=40).compile()
    assert dec.matvec == "reduction"
    assert torch.equal(dec.generate(ids, 24), generate(ours, ids, 24))
    assert all(a is b for a, b in zip(dec.step_model.parameters(), ours.parameters()))
    assert isinstance(dec.step_model.h[0].mlp.c_fc, matvec.ReductionLinear)
    assert isinstance(ours.h[0].mlp.c_fc, torch.nn.Linear)                    # the model itself unchanged
    x = torch.randn(1, 1, ours.config.n_embd)
    lin = ours.h[0].attn.c_attn
    assert torch.allclose(matvec.ReductionLinear(lin)(x), lin(x), atol=1e-5)
    assert StaticDecoder(ours, batch_size=2, max_len=8).compile(backend="eager").matvec == "blas"
    with pytest.raises(ValueError, match="batch 1"):
        StaticDecoder(ours, batch_size=2, max_len=8).compile(matvec="reduction")
    with pytest.raises(ValueError, match="'auto', 'blas' or 'reduction'"):
        StaticDecoder(ours, max_len=8).compile(matvec="fast")


def test_compiled_inductor_same_tokens(ours, tiny, inductor_dec):
    """The real thing, once: inductor's C++ backend (needs a C++ compiler), tokens equal to eager."""
    ids = tiny[1]("The LORD is my shepherd", return_tensors="pt").input_ids
    assert torch.equal(inductor_dec.generate(ids, 20), generate(ours, ids, 20))


def _step_at_max_len_refused(dec, ids):
    """A full cache: the compiled step asked to write at position == max_len raises a ValueError that
    names the fix, writes nothing, and the decoder still generates correctly afterwards."""
    dec.generate(ids, dec.max_len - ids.shape[1])
    dec.cache.position.fill_(dec.max_len)
    keys = [k.clone() for k in dec.cache.keys]
    with torch.no_grad(), pytest.raises(ValueError, match=r"position 32.*max_len=32.*larger max_len.*reset\(\)"):
        dec.step(dec.ids)
    assert int(dec.cache.position) == dec.max_len
    assert all(torch.equal(a, b) for a, b in zip(keys, dec.cache.keys))


def test_compiled_step_at_max_len_is_a_clear_error_eager_backend(ours, tiny):
    ids = tiny[1]("The LORD is my shepherd", return_tensors="pt").input_ids
    torch._dynamo.reset()
    dec = StaticDecoder(ours, batch_size=1, max_len=32).compile(backend="aot_eager")
    _step_at_max_len_refused(dec, ids)
    assert torch.equal(dec.generate(ids, 20), generate(ours, ids, 20))


def test_compiled_step_at_max_len_is_a_clear_error_inductor(ours, tiny, inductor_dec):
    """inductor's generated C++ checks its index and raises a RuntimeError; the decoder names the fix."""
    ids = tiny[1]("The LORD is my shepherd", return_tensors="pt").input_ids
    _step_at_max_len_refused(inductor_dec, ids)
    assert torch.equal(inductor_dec.generate(ids, 20), generate(ours, ids, 20))


def test_compiled_step_profile_attributes_the_parts(ours, tiny, inductor_dec):
    """Chapter 8's profile of a compiled step: the library's matmuls and attention are found by name
    in inductor's step, the parts add up to the profiled wall time, and the step still runs after."""
    from kvlab import staticbench as sb, staticview as sv

    ids = tiny[1]("The LORD is my shepherd", return_tensors="pt").input_ids
    inductor_dec.generate(ids, 4)
    prof = sb.profile_compiled_step(inductor_dec, steps=3, rounds=2)
    for i in range(2):
        parts = {p: prof[p].samples[i] for p in sb.PARTS}
        assert parts["matrix products"] > 0 and parts["attention"] > 0 and parts["everything else"] >= 0
        assert sum(parts.values()) == pytest.approx(prof["wall"].samples[i], rel=1e-6)
        assert 0 <= prof["fused"].samples[i] <= prof["wall"].samples[i]
    # the profiler slows a step, but a profile 10x off the unprofiled step attributes something else
    assert 0.1 < prof["wall"].median / prof["unprofiled"].median < 10
    assert torch.equal(inductor_dec.generate(ids, 20), generate(ours, ids, 20))   # its state left sound
    with pytest.raises(ValueError, match="compile"):
        sb.profile_compiled_step(StaticDecoder(ours, max_len=16))


def test_step_parts_by_name_and_device_time():
    """Operator names (CPU) and GPU kernel names go to the right part; on a GPU the device time counts."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from kvlab import staticbench as sb, staticview as sv

    ops = {"aten::addmm": "matrix products", "aten::mm": "matrix products", "aten::bmm": "attention",
           "aten::_scaled_dot_product_flash_attention_for_cpu": "attention", "aten::add": "everything else",
           "## Call CompiledFxGraph abc": "everything else"}
    kernels = {"ampere_sgemm_32x128_tn": "matrix products", "gemv2T_kernel_val<int, float>": "matrix products",
               "fmha_cutlassF_f32_aligned_64x64_rf_sm80": "attention",
               "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>": "attention",
               "triton_red_fused__softmax_0": "attention",
               "triton_poi_fused_add_native_layer_norm_1": "everything else"}
    assert {k: sb.part_of(k) for k in ops} == ops
    assert {k: sb.part_of(k, kernel=True) for k in kernels} == kernels
    ev = lambda key, dev, self_us=0.0, total_us=0.0, note=False: SimpleNamespace(    # noqa: E731
        key=key, device_type=dev, self_device_time_total=self_us, self_cpu_time_total=self_us,
        cpu_time_total=total_us, is_user_annotation=note)
    events = [ev(sb._STEP, DeviceType.CPU, 100.0, 1000.0), ev("aten::addmm", DeviceType.CPU, 300.0),
              ev(sb._STEP, DeviceType.CUDA, 900.0, 0.0),     # the range's device-side annotation
              ev("attention block", DeviceType.CUDA, 700.0, 0.0, True),   # a user's range, not a kernel
              ev("ampere_sgemm_32x128_tn", DeviceType.CUDA, 400.0), ev("flash_fwd_kernel", DeviceType.CUDA, 200.0),
              ev("triton_poi_fused_add_0", DeviceType.CUDA, 100.0)]
    gpu = sb._attribute(events, steps=2, cuda=True)     # device time of the kernels, not the CPU's addmm
    assert gpu == pytest.approx({"matrix products": 200e-6, "attention": 100e-6, "everything else": 200e-6,
                                 "wall": 500e-6, "fused": 50e-6})
    cpu = sb._attribute(events, steps=2, cuda=False)
    assert cpu["matrix products"] == pytest.approx(150e-6) and cpu["attention"] == 0


def test_part_floors_are_the_step_bytes(tiny):
    """The three parts' floors split the static step's bytes: matmul weights (LM head once), the full
    max_len buffers, and the rest; the FLOP term takes over when the rate is low."""
    from kvlab import roofline
    from kvlab import staticbench as sb, staticview as sv

    hf, C = tiny[0], tiny[0].config.n_embd
    L, V, S = hf.config.n_layer, hf.config.vocab_size, 40
    f = sb.part_floors(hf, 1, S, bandwidth=1.0, flops=1e30)
    assert f["matrix products"] == (L * 12 * C * C + V * C) * 4
    assert f["attention"] == 2 * L * S * C * 4
    assert sum(f.values()) == roofline.decode_step_bytes(hf, 1, S)
    slow = sb.part_floors(hf, 1, S, bandwidth=1e30, flops=1.0)
    assert slow["matrix products"] == 2 * (L * 12 * C * C + V * C) and slow["attention"] == 4 * L * C * S


def test_break_even_and_first_call():
    from kvlab.staticbench import break_even_tokens, cpu_compiler, time_first_call

    assert break_even_tokens(10.0, 0.003, 0.001) == pytest.approx(5000)   # 10 s / 2 ms saved per token
    assert break_even_tokens(10.0, 0.001, 0.002) is None                  # slower: never pays off
    assert 0 <= time_first_call(lambda: torch.ones(3).sum(), "cpu") < 5
    assert cpu_compiler()                                                 # the build machine has one


def test_no_compiler_is_a_clear_error(monkeypatch):
    from kvlab.staticbench import cpu_compiler

    monkeypatch.setenv("CXX", "no-such-compiler-kvlab")
    with pytest.raises(RuntimeError, match="needs a C\\+\\+ compiler"):
        cpu_compiler()


def test_hf_compile_config_refuses_a_transformers_that_ignores_the_private_flag(monkeypatch):
    """transformers compiles generate's decode step on a CPU only through CompileConfig's private
    ``_compile_all_devices``; without it the 'compiled' row would run eagerly: refused, by name."""
    import transformers
    from transformers.generation.utils import GenerationMixin

    assert reference.honours_compile_all_devices()              # the pinned release reads the flag
    assert reference.hf_compile_config("cpu")._compile_all_devices is True
    assert reference.hf_compile_config("cuda").mode == "reduce-overhead"   # compiles by itself there
    monkeypatch.delattr(transformers.CompileConfig, "_compile_all_devices")
    with pytest.raises(RuntimeError, match="_compile_all_devices.*would run eagerly"):
        reference.hf_compile_config("cpu")
    reference.hf_compile_config("cuda")                          # not needed on CUDA: no error
    monkeypatch.undo()
    monkeypatch.setattr(GenerationMixin, "_valid_auto_compile_criteria", lambda self, kw, gc: True)
    assert not reference.honours_compile_all_devices()           # the flag exists but is no longer read
    with pytest.raises(RuntimeError, match="transformers .* no longer reads"):
        reference.hf_compile_config("cpu")


def test_breakdown_sentence_is_computed_from_the_parts(capsys):
    """The sentence names the part farthest above its floor, says when the noise test cannot tell it
    from the next, and says so when the profiler named nothing (no split is invented)."""
    from kvlab import staticbench as sb, staticview as sv
    from kvlab.timing import Timing

    def parts(secs, spread=0.0):
        out = []
        for p, (t, floor) in zip(sb.PARTS, secs):
            samples = [t * (1 - spread), t, t * (1 + spread)]
            out.append(dict(model="m", threads=1, device="cpu", part=p, seconds=t, floor=floor, wall=3e-3,
                            where="CPU x", profiled="3 x 5 steps", max_len=24,
                            excess=Timing(p, [s - floor for s in samples])))
        return out

    attention_worst = parts([(1.0e-3, 0.9e-3), (1.5e-3, 0.1e-3), (0.5e-3, 0.0)])
    s = sv.breakdown_sentence(attention_worst)
    assert "farthest above its floor is attention" in s and "the next, everything else" in s
    noisy = parts([(1.0e-3, 0.9e-3), (1.5e-3, 0.1e-3), (1.3e-3, 0.0)], spread=0.5)
    assert "is as far: no difference measured" in sv.breakdown_sentence(noisy)
    under = parts([(4.0e-3, 0.045e-3), (0.06e-3, 4.0e-3), (0.8e-3, 0.0)])   # attention under its floor
    s = sv.breakdown_sentence(under)
    assert "3.955 ms above it, 83% of the 4.755 ms the parts spend above their floors (1 part ran 3.940 ms under its floor)" in s
    blind = parts([(0.0, 0.9e-3), (0.0, 0.1e-3), (3e-3, 0.0)])
    assert "named no matrix product" in sv.breakdown_sentence(blind)
    sv.print_breakdown(attention_worst)
    assert "above floor ms" in capsys.readouterr().out
