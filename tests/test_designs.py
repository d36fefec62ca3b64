"""Chapter 11's arithmetic of the published designs, against chapter 4's formula and the papers."""

import math

import pytest

from kvlab import designs, memory
from kvlab.shrinkbench import headline_checks, published_rows


@pytest.fixture(scope="module")
def table():
    return designs.load_designs()


def test_full_attention_designs_are_chapter_4s_formula(table):
    for name in ("gpt2", "Llama-2-7B", "Llama-3.1-8B", "Falcon-7B", "Qwen2.5-7B", "DeepSeek-LLM-67B"):
        c = table[name]
        assert designs.layer_windows(c) == [None] * len(designs.layer_windows(c)), name
        assert designs.cache_bytes(c, 4096, 3, bits=16) == memory.kv_cache_bytes(c, 4096, 3, "fp16"), name


def test_windows_cap_what_a_layer_holds(table):
    mistral, gemma = table["Mistral-7B-v0.1"], table["Gemma-2-9B"]
    assert designs.layer_windows(mistral) == [4096] * 32
    assert designs.cache_bytes(mistral, 32768) * 8 == designs.cache_bytes({**mistral, "sliding_window": None}, 32768)
    assert designs.cache_bytes(mistral, 4096) == designs.cache_bytes({**mistral, "sliding_window": None}, 4096)
    windows = designs.layer_windows(gemma)
    assert windows[0::2] == [4096] * 21 and windows[1::2] == [None] * 21      # local layers first, alternating
    assert designs.held_tokens(gemma, 8192)[:2] == [4096, 8192]
    explicit = {**gemma, "layer_types": ["full_attention", "sliding_attention"] * 21}
    assert designs.layer_windows(explicit)[:2] == [None, 4096]
    assert designs.layer_windows({**mistral, "use_sliding_window": False}) == [None] * 32


def test_mla_caches_a_latent_and_a_rotary_key(table):
    v2 = table["DeepSeek-V2"]
    assert designs.is_latent(v2) and designs.numbers_per_token(v2) == 512 + 64
    assert designs.mha_numbers_per_token(v2) == 128 * (128 + 64 + 128)
    assert designs.cache_bytes(v2, 1000, 2, bits=6) == 60 * 576 * 1000 * 2 * 6 / 8


def test_headlines_recomputed():
    rows = {r["claim"]: r for r in headline_checks()}
    for claim, r in rows.items():
        if not math.isnan(r["paper"]):
            assert r["ours"] == pytest.approx(r["paper"], abs=5e-4 if r["paper"] < 1 else 1e-9), claim


def test_published_rows_and_bad_input(table):
    rows = published_rows(["Llama-2-7B", "Llama-3.1-8B"], seq_len=1024)
    assert rows[0]["of MHA"] == 1 and rows[1]["of MHA"] == 0.25 and rows[1]["step of MHA"] < 1
    # every row states a context: Falcon-7B's Hub config has none, the catalogue its model card's 2,048
    contexts = {r["model"]: r["context"] for r in published_rows(["gpt2", "Falcon-7B", "Llama-3.1-8B"])}
    assert contexts == {"gpt2": 1024, "Falcon-7B": 2048, "Llama-3.1-8B": 131072}
    with pytest.raises(ValueError, match="bits"):
        designs.cache_bytes(table["gpt2"], 10, 1, bits=0)
    with pytest.raises(ValueError, match="seq_len"):
        designs.cache_bytes(table["gpt2"], -1)
