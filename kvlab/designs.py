"""Cache bytes of the published designs (chapter 11): chapter 4's formula, per layer and per design.

Chapter 4's ``kvlab.memory.kv_cache_bytes`` counts ``2 x kv_heads x head_dim`` numbers per token in
every layer, for every token of the context. Three designs change one factor each:

* grouped-query / multi-query attention: fewer ``kv_heads`` (already in chapter 4's formula);
* a sliding window: a layer holds at most ``window`` tokens (Mistral-7B-v0.1: every layer; Gemma 2:
  every other layer, the rest attend globally);
* a latent (DeepSeek-V2's MLA): a layer holds ``kv_lora_rank + qk_rope_head_dim`` numbers per token,
  whatever the number of heads.

    layer_windows(config)                          # per layer: its window, or None (global)
    numbers_per_token(config)                      # per layer: numbers cached for one token
    cache_bytes(config, seq_len, batch, bits)      # the whole cache, windows applied
    step_bytes(config, seq_len, batch, bits)       # chapter 7's floor: weights read + cache read

Bits rather than a dtype, so that DeepSeek-V2's 6-bit cache can be priced too. Nothing here prints.
"""

from __future__ import annotations

import json

from .configs import config_field, kv_dims
from .memory import parameter_count
from .paths import CONFIG_DIR
from .validate import check_count, check_int

DESIGNS_PATH = CONFIG_DIR / "cache-designs.json"


def load_designs() -> dict[str, dict]:
    """Chapter 4's models (``kvlab.catalogue.all_models``) and ``models/configs/cache-designs.json``."""
    from .catalogue import all_models

    extra = {m["name"]: m for m in json.loads(DESIGNS_PATH.read_text())["models"]}
    return {**all_models(), **extra}


def is_latent(config) -> bool:
    return config_field(config, "kv_lora_rank") is not None


def layer_windows(config) -> list[int | None]:
    """Each layer's sliding window (None: it attends over the whole context). ``layer_types`` when the
    config lists them; Gemma 2 alternates (even layers local, as transformers builds it); otherwise a
    ``sliding_window`` applies to every layer unless ``use_sliding_window`` is false (Qwen2)."""
    n_layer = check_int(config_field(config, "num_hidden_layers", "n_layer"), "the number of layers")
    window = config_field(config, "sliding_window")
    types = config_field(config, "layer_types")
    if types is not None:
        return [window if t == "sliding_attention" else None for t in types]
    if window is None or config_field(config, "use_sliding_window", default=True) is False:
        return [None] * n_layer
    if config_field(config, "model_type") == "gemma2":
        return [window if i % 2 == 0 else None for i in range(n_layer)]
    return [window] * n_layer


def numbers_per_token(config) -> int:
    """Numbers one token adds to one layer's cache: ``2 x kv_heads x head_dim``, or MLA's latent plus
    its shared rotary key."""
    if is_latent(config):
        return int(config_field(config, "kv_lora_rank")) + int(config_field(config, "qk_rope_head_dim", default=0))
    _, n_kv, head_dim = kv_dims(config)
    return 2 * n_kv * head_dim


def mha_numbers_per_token(config) -> int:
    """The same model with a key and a value head per query head (the design's baseline)."""
    n_head = int(config_field(config, "num_attention_heads", "n_head"))
    if is_latent(config):
        k = int(config_field(config, "qk_nope_head_dim")) + int(config_field(config, "qk_rope_head_dim"))
        return n_head * (k + int(config_field(config, "v_head_dim")))
    _, _, head_dim = kv_dims(config)
    return 2 * n_head * head_dim


def held_tokens(config, seq_len: int) -> list[int]:
    """Tokens each layer holds after ``seq_len`` tokens."""
    seq_len = check_count(seq_len, "seq_len")
    return [seq_len if w is None else min(seq_len, w) for w in layer_windows(config)]


def cache_bytes(config, seq_len: int, batch_size: int = 1, bits: float = 16) -> float:
    """Bytes of the whole cache after ``seq_len`` tokens per sequence: windows applied, ``bits`` per number."""
    batch_size = check_count(batch_size, "batch_size")
    if not bits > 0:
        raise ValueError(f"bits must be > 0, got {bits!r}")
    return sum(held_tokens(config, seq_len)) * numbers_per_token(config) * batch_size * bits / 8


def weight_read_bytes(config, bits: float = 16) -> float:
    """Weights a batch-1 decode step reads: every parameter, or the activated ones of a mixture of
    experts (``active_parameters``), at ``bits`` per parameter. Look-up tables are counted whole: an
    upper bound by at most the embedding table."""
    active = config_field(config, "active_parameters")
    return (int(active) if active is not None else parameter_count(config)) * bits / 8


def step_bytes(config, seq_len: int, batch_size: int = 1, bits: float = 16, weight_bits: float = 16) -> float:
    """Chapter 7's floor for one decode step at ``seq_len`` cached tokens, in bytes: weights read once
    plus the cache of every row (divide by a bandwidth for seconds)."""
    return weight_read_bytes(config, weight_bits) + cache_bytes(config, seq_len, batch_size, bits)
