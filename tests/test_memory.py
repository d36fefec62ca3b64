"""kvlab.memory: the KV-cache formula equals the bytes real caches hold; the data and the calculator."""

import json

import pytest
import torch
from transformers import (DynamicCache, FalconConfig, Gemma2Config, GPT2Config, LlamaConfig, StaticCache)

from kvlab import calculator, catalogue, configs, footprint, memory
from kvlab.cache import PreallocatedCache
from kvlab.paths import CONFIG_DIR

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TINY = dict(vocab_size=64, intermediate_size=48)
TINY_CONFIGS = {
    "gpt2": GPT2Config(vocab_size=64, n_embd=48, n_layer=3, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0),
    "llama-gqa": LlamaConfig(hidden_size=48, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, **TINY),
    "llama-mqa": LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, **TINY),
    "llama-head_dim": LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=24, **TINY),
    "falcon-mqa": FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               multi_query=True, new_decoder_architecture=False),
    "gemma2-head_dim": Gemma2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=16, **TINY),
}


# --- reading configs ----------------------------------------------------------------------------------

def test_kv_dims_all_naming_schemes():
    assert configs.kv_dims(GPT2Config()) == (12, 12, 64)
    assert configs.kv_dims(json.loads((CONFIG_DIR / "gpt2-xl.json").read_text())) == (48, 25, 64)
    assert configs.kv_dims({"n_layer": 2, "n_head": 4, "n_embd": 32}) == (2, 4, 8)
    assert configs.kv_dims(TINY_CONFIGS["llama-gqa"]) == (3, 2, 8)
    assert configs.kv_dims(TINY_CONFIGS["llama-mqa"]) == (2, 1, 8)
    assert configs.kv_dims(TINY_CONFIGS["llama-head_dim"]) == (2, 2, 24)    # explicit head_dim wins
    assert configs.kv_dims({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 32,
                           "head_dim": None}) == (2, 4, 8)                  # None means "derive it"
    assert configs.kv_dims(TINY_CONFIGS["falcon-mqa"]) == (2, 1, 8)          # multi_query -> one K/V head


@pytest.mark.parametrize("bad, words", [
    ({"n_head": 4, "n_embd": 32}, "layer count"),
    ({"n_layer": 2, "n_head": 3, "n_embd": 32}, "not divisible"),
    ({"n_layer": 2, "n_head": 4, "num_key_value_heads": 3, "n_embd": 32}, "evenly"),
    ({"n_layer": -1, "n_head": 4, "n_embd": 32}, ">= 1"),
    ("gpt2", "config"),
])
def test_kv_dims_errors(bad, words):
    with pytest.raises(ValueError, match=words):
        configs.kv_dims(bad)


def test_bytes_per_element():
    assert [configs.bytes_per_element(d) for d in DTYPES] == [4, 2, 2]
    assert configs.bytes_per_element(torch.int8) == configs.bytes_per_element(torch.uint8) == 1
    assert configs.bytes_per_element(torch.float8_e4m3fn) == configs.bytes_per_element(torch.float8_e5m2) == 1
    assert configs.bytes_per_element("bf16") == 2 and configs.bytes_per_element("fp32") == 4
    for bad in ("int4", "float17", 2, None, torch.bool, torch.complex64, torch.int4, torch.uint4):
        with pytest.raises(ValueError):
            configs.bytes_per_element(bad)


def test_formula_values_and_errors():
    cfg = GPT2Config()
    assert memory.bytes_per_token(cfg, torch.float32) == 73_728           # 2 x 12 x 12 x 64 x 4
    assert memory.kv_cache_bytes(cfg, 1024, 2, torch.float16) == 73_728 // 2 * 1024 * 2   # fp16: half the bytes, batch 2
    assert memory.kv_cache_bytes(cfg, 0, 4, torch.float16) == 0
    # article B's example is one layer; the 32-layer model holds 32 times as much
    one_layer = {"n_layer": 1, "n_head": 32, "n_embd": 2048}
    assert memory.kv_cache_bytes(one_layer, 2048, 1, torch.float16) == 16 * 2 ** 20
    assert memory.kv_cache_bytes({**one_layer, "n_layer": 32}, 2048, 1, torch.float16) == 512 * 2 ** 20
    for args in [(-1, 1), (1, -2), (1.5, 1), ("8", 1)]:
        with pytest.raises(ValueError):
            memory.kv_cache_bytes(cfg, *args, torch.float16)
    with pytest.raises(ValueError, match="dtype"):
        memory.kv_cache_bytes(cfg, 8, 1, "float17")


def test_max_batch_size_boundaries():
    cfg = TINY_CONFIGS["llama-gqa"]
    per = memory.kv_cache_bytes(cfg, 100, 1, torch.float16)
    assert memory.max_batch_size(cfg, 100, torch.float16, 7 * per) == 7
    assert memory.max_batch_size(cfg, 100, torch.float16, 7 * per - 1) == 6
    assert memory.max_batch_size(cfg, 100, torch.float16, per - 1) == 0
    with pytest.raises(ValueError):
        memory.max_batch_size(cfg, 0, torch.float16, per)
    with pytest.raises(ValueError):
        memory.max_batch_size(cfg, 100, torch.float16, -1)


# --- formula == measurement ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(TINY_CONFIGS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_formula_equals_dynamic_cache(name, dtype):
    cfg = TINY_CONFIGS[name]
    for seq_len, batch in [(1, 1), (6, 3)]:
        assert footprint.measure_config(cfg, seq_len, batch, dtype) == memory.kv_cache_bytes(cfg, seq_len, batch, dtype)


def test_formula_equals_dynamic_cache_on_bundled_model(tiny):
    model, _ = tiny
    cache = footprint.fill_dynamic_cache(model, 40, 2, decode_steps=3)
    assert footprint.measured_cache_bytes(cache) == memory.kv_cache_bytes(model.config, 40, 2, torch.float32)
    # what the layers hold, tensor by tensor, is [batch, heads, seq, head_dim]
    n_layer, n_kv, head_dim = configs.kv_dims(model.config)
    assert len(cache.layers) == n_layer
    assert list(cache.layers[0].keys.shape) == [2, n_kv, 40, head_dim]


def test_static_cache_holds_max_len(tiny):
    model, _ = tiny
    cache = StaticCache(config=model.config, max_cache_len=32)
    with torch.no_grad():
        model(torch.ones(2, 5, dtype=torch.long), cache=cache, use_cache=True)
    # preallocated: the bytes of max_cache_len tokens, however few are written
    assert footprint.measured_cache_bytes(cache) == memory.kv_cache_bytes(model.config, 32, 2, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_formula_equals_preallocated_cache(tiny, dtype):
    from kvlab.gpt2 import GPT2

    hf, _ = tiny
    model = GPT2.from_hf(hf).to(dtype)
    cache = model.new_cache(batch_size=3, max_len=24)
    with torch.no_grad():
        model(torch.ones(3, 10, dtype=torch.long), cache=cache)
        model(torch.ones(3, 1, dtype=torch.long), cache=cache)
    want = memory.kv_cache_bytes(hf.config, 24, 3, dtype)
    assert cache.seq_len == 11
    assert footprint.measured_cache_bytes(cache) == cache.nbytes == want
    # a cache built directly from the formula's factors agrees too
    n_layer, n_kv, head_dim = configs.kv_dims(hf.config)
    direct = PreallocatedCache(n_layer, 2, n_kv, head_dim, 7, dtype=dtype)
    assert footprint.measured_cache_bytes(direct) == memory.kv_cache_bytes(hf.config, 7, 2, dtype)


def test_measured_counts_storage_once():
    t = torch.zeros(4, 8)
    assert footprint.measured_cache_bytes([t, t[:2], t.view(-1)]) == t.nbytes
    with pytest.raises(ValueError):
        footprint.measured_cache_bytes(object())
    empty = DynamicCache(config=TINY_CONFIGS["gpt2"])
    assert footprint.measured_cache_bytes(empty) == 0


# --- weights and the open-models data ----------------------------------------------------------------

def test_weights_bytes(tiny):
    model, _ = tiny
    n = sum(p.numel() for p in model.parameters())
    assert memory.parameter_count(model) == n
    assert memory.parameter_count(model.config) == n        # the same count, built on the meta device
    assert memory.weights_bytes(model, torch.float16) == 2 * n
    assert memory.parameter_count(GPT2Config()) == 124_439_808


def test_open_models_json():
    models = catalogue.load_open_models()
    assert len(models) >= 5
    for name, m in models.items():
        assert "config.json" in m["source"] and m["hf_repo"] in m["source"], name
        n_layer, n_kv, head_dim = configs.kv_dims(m)
        assert m["attention"] == ("MHA" if n_kv == m["num_attention_heads"] else "MQA" if n_kv == 1 else "GQA")
        assert m["parameters"] > 1e9
    assert configs.kv_dims(models["Gemma-2-9B"])[2] == 256 != 3584 // 16
    assert configs.kv_dims(models["Falcon-7B"]) == (32, 1, 64)
    assert configs.kv_dims(models["Llama-3.1-8B"]) == (32, 8, 128)
    gpt2 = catalogue.gpt2_models()
    assert [configs.kv_dims(m) for m in gpt2.values()] == [(12, 12, 64), (24, 16, 64), (36, 20, 64), (48, 25, 64)]
    assert all("config.json" in m["source"] for m in gpt2.values())


def test_open_models_parameter_counts_match_their_configs():
    """The stored parameter counts are what transformers builds from the stored config fields."""
    for name, m in catalogue.load_open_models().items():
        fields = {k: v for k, v in m.items()
                  if k not in ("name", "hf_repo", "parameters", "source", "note", "attention", "context")}
        if m["model_type"] == "falcon":
            fields.pop("num_key_value_heads")   # Falcon-7B's config says multi_query instead
        assert memory.parameter_count(fields) == m["parameters"], name


# --- the calculator -------------------------------------------------------------------------------------

def test_calculator_numbers():
    models = catalogue.all_models()
    r = calculator.calculator(models["Llama-3.1-8B"], 8192, 4, torch.float16)
    assert r["cache_bytes"] == 2 * 32 * 8 * 128 * 8192 * 4 * 2
    assert r["weights_bytes"] == 2 * 8_030_261_248
    assert r["total_bytes"] == r["cache_bytes"] + r["weights_bytes"]
    for gb, g in r["gpus"].items():
        free = gb * memory.GIB - r["weights_bytes"]
        per_seq = memory.kv_cache_bytes(models["Llama-3.1-8B"], 8192, 1, torch.float16)
        assert g["max_batch"] == max(free, 0) // per_seq
        assert g["fits"] == (r["total_bytes"] <= gb * memory.GIB)
    assert not r["beyond_context"]
    assert calculator.calculator(models["gpt2"], 2048, 1, "int8")["beyond_context"]
    big = calculator.calculator(models["Llama-3.1-70B"], 32768, 8, "fp16")
    assert not big["gpus"][24]["fits"] and big["gpus"][24]["max_batch"] == 0   # the weights alone do not fit


def test_calculator_widget_updates():
    import ipywidgets  # noqa: F401  (in requirements.txt: its absence is a failure)
    import matplotlib

    matplotlib.use("Agg")
    models = catalogue.all_models()
    box = calculator.calculator_widget(models, default="gpt2")
    dropdown = box.children[0].children[0]
    assert dropdown.value == "gpt2"
    dropdown.value = "Llama-3.1-8B"          # the observer redraws for the new model
    assert "Llama-3.1-8B" in box.text.value and "KV cache" in box.text.value
    assert box.result == calculator.calculator(models["Llama-3.1-8B"], 8192, 1, "fp16")
    assert box.image.value[:8] == b"\x89PNG\r\n\x1a\n"   # the chart was redrawn
    box.children[1].children[1].value = 3    # batch
    assert box.result["cache_bytes"] == memory.kv_cache_bytes(models["Llama-3.1-8B"], 8192, 3, torch.float16)
    box.children[1].children[1].value = -1   # nonsense input: said so in the widget, no exception, not clamped
    assert "error" in box.text.value and "batch_size must be an int &gt;= 0" in box.text.value


def test_human_bytes():
    assert calculator.human_bytes(16_777_216) == "16.0 MiB"
    assert calculator.human_bytes(16_777_216, binary=False) == "16.8 MB"
    assert calculator.human_bytes(512) == "512 B"
