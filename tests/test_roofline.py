"""kvlab.roofline: exact byte and FLOP counts worked out by hand, on real, hand-built and meta models."""

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from kvlab import probes, roofline
from kvlab.memory import kv_cache_bytes


def tiny_gpt2(dtype=torch.float32):
    # V=64, positions 16, width 8, 2 layers, 2 heads (head_dim 4)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=8, n_layer=2, n_head=2)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).to(dtype).eval()


def tiny_llama(tied=False, dtype=torch.float16):
    # width 16, 2 layers, 4 query heads / 2 key-value heads of 4, MLP 24, vocab 32
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=24, tie_word_embeddings=tied)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype).eval()


# GPT-2 by hand: wte 64x8=512, wpe 16x8=128; per layer ln_1 16, c_attn 8x24+24=216, c_proj 8x8+8=72,
# ln_2 16, c_fc 8x32+32=288, mlp c_proj 32x8+8=264 -> 872; two layers 1744; ln_f 16. LM head tied.
GPT2_PARAMS = 512 + 128 + 2 * 872 + 16                  # 2400
GPT2_MATMUL = 2 * (192 + 64 + 256 + 256) + 512           # 2048: the layers' Linear weights + LM head
# Llama by hand: embed 32x16=512; per layer q 256, k 128, v 128, o 256, gate/up/down 3x384, two norms 32
# -> 1952; two layers 3904; final norm 16; untied lm_head 512.
LLAMA_PARAMS = 512 + 2 * 1952 + 16 + 512                # 4944
LLAMA_MATMUL = 2 * (256 + 128 + 128 + 256 + 3 * 384) + 512   # 4352


# The convention: the tied wte is the LM head, read whole; of the position table (16 x 8) a step
# of B rows reads B rows of 8.
def read(B):
    return GPT2_PARAMS - 128 + 8 * B


def test_gpt2_bytes_by_hand_fp32_and_fp16():
    m = tiny_gpt2()
    # cache: 2 (K,V) x 2 layers x 2 heads x 4 x 5 positions x 3 rows x 4 bytes = 1920
    assert roofline.decode_step_bytes(m, 3, 5) == read(3) * 4 + 1920
    assert roofline.decode_step_bytes(m, 7, 0) == read(7) * 4          # no cache yet: weights only
    assert roofline.decode_step_bytes(tiny_gpt2(torch.float16), 3, 5) == read(3) * 2 + 960
    assert roofline.lookup_share(m) == pytest.approx(128 / GPT2_PARAMS)


def test_tied_head_counted_once_and_flops_by_hand():
    m = tiny_gpt2()
    assert m.lm_head.weight is m.transformer.wte.weight
    assert roofline.weight_bytes(m) == GPT2_PARAMS * 4
    assert roofline.matmul_weights(m) == GPT2_MATMUL
    # 2 x 3 rows x 2048 + 4 x 3 rows x 2 layers x 2 heads x 4 x 5 positions
    assert roofline.decode_step_flops(m, 3, 5) == 2 * 3 * GPT2_MATMUL + 960


def test_gqa_bytes_and_flops_by_hand():
    m = tiny_llama()
    # cache: 2 (K,V) x 2 layers x 2 KEY/VALUE heads x 4 x 7 positions x 2 rows x 2 bytes = 896
    # the untied input embedding (32 x 16): two rows of 16 read, not the table; lm_head read whole
    assert roofline.decode_step_bytes(m, 2, 7) == (LLAMA_PARAMS - 512 + 32) * 2 + 2 * 2 * 2 * 4 * 7 * 2 * 2
    # attention FLOPs use the 4 QUERY heads: 4 x 2 rows x 2 layers x 4 heads x 4 x 7
    assert roofline.decode_step_flops(m, 2, 7) == 2 * 2 * LLAMA_MATMUL + 4 * 2 * 2 * 4 * 4 * 7
    tied = tiny_llama(tied=True)
    assert roofline.weight_bytes(tied) == (LLAMA_PARAMS - 512) * 2
    assert roofline.matmul_weights(tied) == LLAMA_MATMUL
    assert roofline.decode_step_bytes(tied, 2, 0) == (LLAMA_PARAMS - 512) * 2    # tied: the head, whole
    assert roofline.lookup_share(tied) == 0


def test_hand_built_gpt2_and_meta_model_agree_with_transformers(tiny, ours):
    hf, _ = tiny
    meta = roofline.meta_model(hf.config)
    assert next(meta.parameters()).device.type == "meta"
    for fn in (roofline.decode_step_bytes, roofline.decode_step_flops):
        want = fn(hf, 3, 17)
        assert fn(ours, 3, 17) == want and fn(meta, 3, 17) == want


def test_meta_gpt2_sizes_and_open_models():
    m = roofline.meta_model("shape:gpt2-medium")
    assert roofline.weight_bytes(m) == 354_823_168 * 4
    # article A's floor: 1.42 GB of fp32 weights at an RTX 3090's 936 GB/s, about 1.5 ms a token
    assert roofline.step_time_floor(m, 1, 0, 936e9, 35.6e12) == pytest.approx(1.512e-3, rel=1e-3)
    llama = roofline.meta_model("Llama-3.1-8B", torch.bfloat16)
    assert roofline.weight_bytes(llama) == 8_030_261_248 * 2
    assert roofline.cache_read_bytes(llama, 4, 8192) == kv_cache_bytes(llama.config, 8192, 4, torch.bfloat16)
    with pytest.raises(ValueError, match="unknown model"):
        roofline.meta_model("gpt5")


def test_floor_is_the_larger_term_and_helpers():
    m = tiny_gpt2()
    b, f = roofline.decode_step_bytes(m, 3, 5), roofline.decode_step_flops(m, 3, 5)
    assert roofline.step_time_floor(m, 3, 5, 1e9, 1e12) == pytest.approx(b / 1e9)     # memory-bound
    assert roofline.step_time_floor(m, 3, 5, 1e12, 1e9) == pytest.approx(f / 1e9)     # compute-bound
    assert roofline.step_time_floor(m, np.int64(3), np.int32(5), np.float64(1e9), 1e12) == pytest.approx(b / 1e9)
    t = roofline.step_terms(m, 3, 5, 1e9, 1e12)
    assert t["floor"] == pytest.approx(b / 1e9) and t["bound"] == "weights"
    assert roofline.step_terms(m, 3, 5, 1e9, 1e12, cache_dtype=torch.int8)["cache_bytes"] == 1920 // 4
    # the crossover: the cache of one row outweighs the weights (9120 bytes / 128 bytes per token)
    assert roofline.crossover_length(m) == 72
    crit = roofline.critical_batch(m, 0, 1e9, 1e9)
    assert roofline.step_terms(m, crit, 0, 1e9, 1e9)["bound"] == "compute"
    assert roofline.step_terms(m, crit - 1, 0, 1e9, 1e9)["bound"] != "compute"
    assert roofline.generation_floor(m, 1, 4, 3, 1e9, 1e12) == pytest.approx(
        sum(roofline.step_time_floor(m, 1, s, 1e9, 1e12) for s in (4, 5, 6)))


@pytest.mark.parametrize("args, match", [((2.5, 5), "batch_size"), ((1, -1), "seq_len"), ((1, "5"), "seq_len")])
def test_bad_counts_are_value_errors(args, match):
    with pytest.raises(ValueError, match=match):
        roofline.decode_step_bytes(tiny_gpt2(), *args)


def test_bad_rates_are_value_errors():
    with pytest.raises(ValueError, match="bandwidth"):
        roofline.step_time_floor(tiny_gpt2(), 1, 1, 0, 1e9)
    with pytest.raises(ValueError, match="flops"):
        roofline.step_time_floor(tiny_gpt2(), 1, 1, 1e9, "fast")


def test_measurements_run_and_fix_threads(capsys):
    before = torch.get_num_threads()
    try:
        bw = probes.measure_bandwidth("cpu", size_mib=4, threads=1, repeats=3)
        fl = probes.measure_matmul_flops("cpu", torch.float32, n=128, threads=1, repeats=3)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    out = capsys.readouterr().out
    assert "1 thread)" in out and "1 threads" not in out and "GB/s" in out and "GFLOP/s" in out
    assert bw > 0 and fl > 0            # a measurement, never asserted beyond being one


def test_llama_8b_input_embedding_is_six_and_a_half_percent():
    llama = roofline.meta_model("Llama-3.1-8B", torch.bfloat16)
    assert roofline.lookup_share(llama) == pytest.approx(0.0654, abs=5e-4)
    embed = 128_256 * 4096 * 2
    assert roofline.weight_read_bytes(llama, 4) == roofline.weight_bytes(llama) - embed + 4 * 4096 * 2


def test_prefill_prices_the_lm_head_once_per_row():
    m = tiny_gpt2()
    # 6 prompt tokens of one row: 6 tokens through the layers, ONE row through the LM head (512)
    layers = GPT2_MATMUL - 512
    assert roofline.step_flops(m, 6, 1, 15) == 2 * 6 * layers + 2 * 512 + 4 * 2 * 2 * 4 * 15
    assert roofline.step_flops(m, 6, 6, 0) == 2 * 6 * GPT2_MATMUL             # every token's logits
    assert roofline.step_bytes(m, 6, 1, 0) == read(6) * 4
    assert roofline.step_bytes(m, 6, 0, 0) == (read(6) - 512) * 4             # no logits: no head read
    assert roofline.decode_step_flops(m, 3, 5) == roofline.step_flops(m, 3, 3, 15)
    assert roofline.forward_floor(m, 6, 1, 0, 15, 1e12, 1e6) == pytest.approx(
        roofline.step_flops(m, 6, 1, 15) / 1e6)
    with pytest.raises(ValueError, match="logit_rows"):
        roofline.step_bytes(m, 2, 3, 0)


@pytest.mark.parametrize("seq", [0, 5, 40, 200])
@pytest.mark.parametrize("bw, fl", [(1e9, 1e9), (1e9, 4e9), (20e9, 200e9), (1e9, 1e12)])
def test_critical_batch_is_the_first_compute_bound_batch(seq, bw, fl):
    m = tiny_gpt2()
    crit = roofline.critical_batch(m, seq, bw, fl)
    bound = lambda b: roofline.step_terms(m, b, seq, bw, fl)["bound"] == "compute"
    if crit is None:        # then each row's own bytes outlast its FLOPs: no batch ever gets there
        assert not any(bound(b) for b in (1, 10, 1000, 10**6))
    else:
        assert bound(crit) and (crit == 1 or not bound(crit - 1))


def test_attention_intensity_is_constant_and_gqa_raises_it():
    # 2 x query heads / (key-value heads x bytes): GPT-2 fp32 0.5, the tiny Llama fp16 2 x 4 / (2 x 2) = 2
    assert roofline.attention_intensity(tiny_gpt2()) == 0.5
    assert roofline.attention_intensity(tiny_llama()) == 2.0
    m = tiny_gpt2()
    for B, S in ((1, 100), (8, 1000)):
        extra = roofline.decode_step_flops(m, B, S + 1) - roofline.decode_step_flops(m, B, S)
        assert extra / (roofline.decode_step_bytes(m, B, S + 1) - roofline.decode_step_bytes(m, B, S)) == 0.5
    assert roofline.critical_batch_curve(m, [0, 10**6], 1e9, 4e9)[1] is None


def test_achieved_bandwidth_is_bytes_over_seconds():
    m = tiny_gpt2()
    want = sum(roofline.decode_step_bytes(m, 1, s) for s in (4, 5, 6))
    assert roofline.generation_bytes(m, 1, 4, 3) == want
    assert roofline.achieved_bandwidth(m, 1, 4, 3, 2.0) == want / 2


def test_probe_kinds(capsys):
    before = torch.get_num_threads()
    try:
        for kind in ("read", "copy", "gemv"):
            assert probes.measure_bandwidth("cpu", size_mib=4, threads=1, repeats=2, kind=kind) > 0
    finally:
        torch.set_num_threads(before)
    out = capsys.readouterr().out
    assert "sum of 4 MiB" in out and "copy of 4 MiB" in out and "matrix-vector" in out
    if (probes.cpu_cache_bytes() or 0) >= 4 * 2**20:
        assert "fits in the last-level cache" in out      # a probe that small measures the cache
    with pytest.raises(ValueError, match="kind"):
        probes.measure_bandwidth("cpu", size_mib=4, kind="write")
    assert probes._default_probe_mib("cpu") * 2**20 >= 4 * (probes.cpu_cache_bytes() or 0)


def test_arithmetic_rate_names_the_dtype(capsys):
    rate, used = probes.arithmetic_rate("cpu", torch.float32, threads=1, verbose=False)
    assert rate > 0 and used == torch.float32
    rate, used = probes.arithmetic_rate("cpu", torch.float16, threads=1)
    assert used in (torch.float16, torch.bfloat16, torch.float32)
    assert "priced at the" in capsys.readouterr().out


def test_one_matmul_rate_per_dtype_in_a_process(monkeypatch, capsys):
    """Chapter 7 printed bf16 at 355.9 GFLOP/s in one section and 408.6 in the next: a rate picked by
    time is measured once per device, dtype and threads, and a later call says it reuses it."""
    monkeypatch.setattr(probes, "_RATES", {})
    calls = []
    monkeypatch.setattr(probes, "median_seconds", lambda *a, **k: calls.append(1) or 1e-3 * len(calls))
    monkeypatch.setattr(probes, "_matmul_size", lambda *a: 256)
    first = probes.measure_matmul_flops("cpu", torch.bfloat16, threads=1)
    again = probes.measure_matmul_flops("cpu", torch.bfloat16, threads=1)
    assert again == first and len(calls) == 1
    assert "measured earlier in this process" in capsys.readouterr().out
    assert probes.measure_matmul_flops("cpu", torch.bfloat16, threads=1, fresh=True) != first   # measured again
    assert probes.measure_matmul_flops("cpu", torch.bfloat16, n=256, threads=1) != first        # an explicit size: always measured
    assert probes.measure_matmul_flops("cpu", torch.float32, threads=1) and len(calls) == 4     # another dtype: its own


def test_the_matmul_probe_is_sized_by_time_so_an_emulated_dtype_stays_cheap(monkeypatch):
    """A CPU without native fp16 takes seconds per 1024 x 1024 fp16 product: the probe's size is
    picked by timing one product (at least MATMUL_PROBE_S), so a slow dtype gets a small matrix."""
    monkeypatch.setattr(probes, "MATMUL_PROBE_S", 0.0)          # every size is "slow enough": the smallest
    assert probes._matmul_size(torch.device("cpu"), torch.float32, 1) == 256
    monkeypatch.setattr(probes, "MATMUL_PROBE_S", 1e9)          # none is: the cap
    assert probes._matmul_size(torch.device("cpu"), torch.float32, 1) == (512 if probes.QUICK else 1024)


def test_generation_bytes_is_the_floors_memory_term():
    from kvlab.course.checks._common import grading_model
    m = grading_model()[0]
    b = roofline.generation_bytes(m, 2, 7, 5)
    assert b == sum(roofline.decode_step_bytes(m, 2, s) for s in range(7, 12))
    assert abs(b / 1e9 - roofline.generation_floor(m, 2, 7, 5, 1e9, 1e30)) < 1e-12


def test_the_machine_is_measured_once_per_build_and_shared(monkeypatch, tmp_path, capsys):
    """probes.machine: one measurement per (device, dtype, threads) in a process, and through
    KVLAB_PROBE_FILE one per build; another thread count, a stale entry or fresh=True measure again;
    a half-written file is measured over, never read."""
    calls = []

    def best(device, verbose=True):
        calls.append("best")
        return 30e9 + len(calls), "read, 128 MiB"
    monkeypatch.setattr(probes, "best_bandwidth", best)
    monkeypatch.setattr(probes, "measure_bandwidth", lambda *a, **k: 15e9)
    monkeypatch.setattr(probes, "arithmetic_rate", lambda *a, **k: (50e9, torch.float32))
    monkeypatch.setattr(probes, "_MEASURED", {})
    shared = tmp_path / "probes.json"
    monkeypatch.setenv("KVLAB_PROBE_FILE", str(shared))
    threads = torch.get_num_threads()
    try:
        first = probes.machine("cpu", threads=threads, verbose=False)
        assert not first["shared"] and probes.measured_when(first).endswith("by this page")
        assert probes.machine("cpu", threads=threads, verbose=False)["bandwidth"] == first["bandwidth"]
        monkeypatch.setattr(probes, "_MEASURED", {})            # another page of the build: a new process
        other = probes.machine("cpu", threads=threads)
        assert other["bandwidth"] == first["bandwidth"] and other["shared"] and other["flops_dtype"] is torch.float32
        assert "by an earlier page of this build" in capsys.readouterr().out
        assert len(calls) == 1
        probes.machine("cpu", threads=2 if threads == 1 else 1, verbose=False)   # another thread count: another machine
        assert len(calls) == 2
        again = probes.machine("cpu", threads=threads, verbose=False, fresh=True)
        assert len(calls) == 3 and again["bandwidth"] != first["bandwidth"]
        monkeypatch.setattr(probes, "_MEASURED", {})
        monkeypatch.setattr(probes, "SHARED_MAX_AGE_S", -1)      # every entry stale: measured again
        probes.machine("cpu", threads=threads, verbose=False)
        assert len(calls) == 4
        monkeypatch.setattr(probes, "SHARED_MAX_AGE_S", 3600)
        monkeypatch.setattr(probes, "_MEASURED", {})
        shared.write_text('{"half a')                               # a torn file: measured, then rewritten
        probes.machine("cpu", threads=threads, verbose=False)
        assert len(calls) == 5 and '"bandwidth"' in shared.read_text()
    finally:
        torch.set_num_threads(threads)


def test_without_a_probe_file_the_machine_is_measured_in_the_process(monkeypatch):
    monkeypatch.delenv("KVLAB_PROBE_FILE", raising=False)
    monkeypatch.setattr(probes, "_MEASURED", {})
    monkeypatch.setattr(probes, "best_bandwidth", lambda device, verbose=True: (30e9, "read, 128 MiB"))
    monkeypatch.setattr(probes, "measure_bandwidth", lambda *a, **k: 15e9)
    monkeypatch.setattr(probes, "arithmetic_rate", lambda *a, **k: (50e9, torch.float32))
    m = probes.machine("cpu", verbose=False)
    assert m["bandwidth"] == 30e9 and not m["shared"]
