"""KV-cache memory arithmetic (chapter 4): from a config to bytes, with no tensor allocated.

Every layer caches one key and one value tensor of shape ``[batch, kv_heads, seq_len, head_dim]``,
so a whole cache holds

    2 (K and V) x n_layer x kv_heads x head_dim x seq_len x batch x bytes_per_element

bytes. ``kv_heads`` is the number of *key/value* heads: equal to the query heads in classic
multi-head attention (GPT-2, Llama-2-7B), fewer with grouped-query attention (Llama-3, Mistral),
one with multi-query attention (Falcon-7B). ``head_dim`` is usually ``hidden_size / n_heads``, but
some configs set it explicitly to something else (Gemma-2), and then the explicit value is the one
the model uses.

    kv_cache_bytes(config, seq_len, batch_size, dtype)   # the formula, an exact int
    max_batch_size(config, seq_len, dtype, free_bytes)   # the largest batch whose cache fits
    weights_bytes(config_or_model, dtype)                # what the parameters take

``config`` is a transformers ``PretrainedConfig`` or a plain dict with the same field names (GPT-2's
``n_layer``/``n_head``/``n_embd`` or the Llama-style ``num_hidden_layers``/``num_attention_heads``/
``num_key_value_heads``/``head_dim``/``hidden_size``), e.g. an entry of ``models/configs/open-models.json``.
The bytes real caches hold are measured in ``kvlab.measure``; the chapter's calculator (model table,
text, chart, widget) is ``kvlab.calculator``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping

import torch
from .configs import bytes_per_element, kv_dims, model_from_json
from .validate import check_count

GIB = 2 ** 30

# ---------------------------------------------------------------------------------------------------
# Reading the attention shape out of any config


# ---------------------------------------------------------------------------------------------------
# Bytes per element


# ---------------------------------------------------------------------------------------------------
# The formula


def kv_cache_bytes(config, seq_len: int, batch_size: int, dtype) -> int:
    """Bytes of a full KV cache (chapter 4): ``2 x layers x kv_heads x head_dim x seq_len x batch x bytes``.

    The factor 2 is one tensor for keys and one for values; every layer has its own pair.
    """
    n_layer, n_kv, head_dim = kv_dims(config)
    seq_len = check_count(seq_len, "seq_len")
    batch_size = check_count(batch_size, "batch_size")
    return 2 * n_layer * n_kv * head_dim * seq_len * batch_size * bytes_per_element(dtype)


def bytes_per_token(config, dtype) -> int:
    """Cache bytes one more token of one sequence costs (all layers, keys and values)."""
    return kv_cache_bytes(config, 1, 1, dtype)


def max_batch_size(config, seq_len: int, dtype, free_bytes: int) -> int:
    """The largest batch whose cache of ``seq_len`` tokens per sequence fits in ``free_bytes`` (floor)."""
    per_sequence = kv_cache_bytes(config, seq_len, 1, dtype)
    free_bytes = check_count(free_bytes, "free_bytes")
    if per_sequence == 0:
        raise ValueError("seq_len is 0: an empty cache takes no memory, so every batch size fits")
    return free_bytes // per_sequence   # floor: a partly fitting sequence does not fit


# ---------------------------------------------------------------------------------------------------
# Weights


@functools.lru_cache(maxsize=64)
def _meta_parameter_count(config_json: str, model_type: str) -> int:
    with torch.device("meta"):   # shapes only: no memory, no initialisation cost
        model = model_from_json(config_json, model_type)
    return sum(p.numel() for p in model.parameters())   # tied weights are one Parameter, counted once


def parameter_count(config_or_model) -> int:
    """Number of parameters: counted from a model, from a config (built on the meta device), or a
    dict's ``parameters`` field (the open-models table)."""
    if isinstance(config_or_model, torch.nn.Module):
        return sum(p.numel() for p in config_or_model.parameters())
    if isinstance(config_or_model, Mapping):
        if config_or_model.get("parameters") is not None:
            return int(config_or_model["parameters"])
        fields = {k: v for k, v in config_or_model.items() if not k.startswith("_")}
    elif hasattr(config_or_model, "to_dict"):
        fields = config_or_model.to_diff_dict()
        fields["model_type"] = config_or_model.model_type
    else:
        raise ValueError(f"expected a model, a config or a dict, got {type(config_or_model).__name__}")
    if not fields.get("model_type"):
        raise ValueError("cannot count parameters: the config has no model_type and no 'parameters' field")
    keep = {k: v for k, v in fields.items() if isinstance(v, (int, float, str, bool, type(None), list, dict))}
    return _meta_parameter_count(json.dumps(keep, sort_keys=True, default=str), fields["model_type"])


def weights_bytes(config_or_model, dtype) -> int:
    """Bytes the parameters take in ``dtype`` (``parameter_count x bytes_per_element``)."""
    return parameter_count(config_or_model) * bytes_per_element(dtype)


