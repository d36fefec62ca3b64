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
import operator
from collections.abc import Mapping

import torch

GIB = 2 ** 30

# ---------------------------------------------------------------------------------------------------
# Reading the attention shape out of any config


def config_field(config, *names, default=None):
    """The first of ``names`` that ``config`` (object or dict) sets to something other than None."""
    for name in names:
        value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if value is not None:
            return value
    return default


def check_int(value, what: str, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum``, or a ValueError naming ``what``."""
    try:
        n = operator.index(value)   # ints (and numpy ints) only: 12.5 layers is a bug upstream
    except TypeError:
        raise ValueError(f"{what} must be an integer, got {value!r}") from None
    if n < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {n}")
    return n


def check_count(value, what: str) -> int:
    return check_int(value, what, minimum=0)


def config_of(config):
    """The config itself, or a model's ``.config`` when a model was passed."""
    if not isinstance(config, Mapping) and hasattr(config, "config") and not hasattr(config, "to_dict"):
        return config.config
    return config


def kv_dims(config) -> tuple[int, int, int]:
    """``(n_layer, n_kv_heads, head_dim)``: the three shape factors of a config's KV cache.

    Reads GPT-2's names (``n_layer``, ``n_head``, ``n_embd``) and the Llama-style ones
    (``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
    ``hidden_size``). An explicit ``head_dim`` wins over ``hidden_size / num_attention_heads``.
    Accepts a config object, a dict, or a model (its ``.config``).
    """
    config = config_of(config)
    if config is None or isinstance(config, (str, bytes, int, float)):
        raise ValueError(f"expected a transformers config (or a dict of its fields), got {config!r}")
    n_layer = config_field(config, "num_hidden_layers", "n_layer", "num_layers")
    n_head = config_field(config, "num_attention_heads", "n_head")
    if n_layer is None or n_head is None:
        raise ValueError("config has no layer count (num_hidden_layers / n_layer) or no head count "
                         "(num_attention_heads / n_head); pass a decoder's transformers config")
    n_layer = check_int(n_layer, "the number of layers")
    n_head = check_int(n_head, "the number of attention heads")

    model_type = config_field(config, "model_type", default="")
    if model_type == "falcon" and not config_field(config, "new_decoder_architecture", default=False):
        # Falcon-7B's config keeps num_kv_heads == num_attention_heads but sets multi_query=True:
        # its attention then has a single key/value head (transformers' modeling_falcon does this).
        n_kv = 1 if config_field(config, "multi_query", default=True) else n_head
    elif model_type == "falcon":
        # Falcon-40B/180B (new decoder architecture): transformers expands the grouped K/V to every
        # query head *before* it stores them, so its cache holds num_attention_heads heads.
        n_kv = n_head
    else:
        n_kv = config_field(config, "num_key_value_heads", "num_kv_heads", "n_head_kv", default=n_head)
    n_kv = check_int(n_kv, "the number of key/value heads")
    if n_head % n_kv:
        raise ValueError(f"{n_head} query heads cannot be shared evenly by {n_kv} key/value heads")

    head_dim = config_field(config, "head_dim")
    if head_dim is None:
        hidden = config_field(config, "hidden_size", "n_embd", "d_model")
        if hidden is None:
            raise ValueError("config sets neither head_dim nor hidden_size / n_embd")
        hidden = check_int(hidden, "the hidden size")
        if hidden % n_head:
            raise ValueError(f"hidden size {hidden} is not divisible by {n_head} heads; "
                             "set head_dim explicitly")
        head_dim = hidden // n_head
    return n_layer, n_kv, check_int(head_dim, "head_dim")


def context_length(config) -> int | None:
    """The longest sequence a model attends over (GPT-2: ``n_positions``, 1024), from a config, a
    dict (the open-models table's ``context``) or a model; None when the config does not say."""
    n = config_field(config_of(config), "context", "max_position_embeddings", "n_positions")
    return None if n is None else int(n)


def attention_kind(config) -> str:
    """``MHA`` (a K/V head per query head), ``MQA`` (one K/V head) or ``GQA`` (in between)."""
    _, n_kv, _ = kv_dims(config)
    n_head = config_field(config_of(config), "num_attention_heads", "n_head")
    return "MHA" if n_kv == n_head else "MQA" if n_kv == 1 else f"GQA ({n_head // n_kv} q/kv)"


# ---------------------------------------------------------------------------------------------------
# Bytes per element

_DTYPE_ALIASES = {
    "fp64": torch.float64, "float64": torch.float64, "double": torch.float64,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "int8": torch.int8, "uint8": torch.uint8,
    "fp8": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
}
# Packed sub-byte dtypes report itemsize 1 in torch although they mean half a byte: refuse them.
_SUB_BYTE = {d for d in (getattr(torch, n, None) for n in (
    *(f"int{i}" for i in range(1, 8)), *(f"uint{i}" for i in range(1, 8)), "float4_e2m1fn_x2", "quint4x2",
    "quint2x4", "bits1x8", "bits2x4", "bits4x2")) if isinstance(d, torch.dtype)}
_REFUSED = (torch.bool, torch.complex64, torch.complex128, torch.complex32)


def as_dtype(dtype) -> torch.dtype:
    """A ``torch.dtype`` from a dtype or a common name (``"fp16"``, ``"bf16"``, ``"int8"``, ...)."""
    if isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        if key not in _DTYPE_ALIASES:
            raise ValueError(f"unknown dtype name {dtype!r}; use a torch.dtype or one of "
                             f"{sorted(_DTYPE_ALIASES)}")
        return _DTYPE_ALIASES[key]
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype (e.g. torch.float16), got {dtype!r}")
    return dtype


def bytes_per_element(dtype) -> int:
    """Bytes one element of ``dtype`` takes in a tensor: 4 for float32, 2 for float16/bfloat16, 1 for int8/fp8."""
    dtype = as_dtype(dtype)
    if dtype in _SUB_BYTE:
        raise ValueError(f"{dtype} is a packed sub-byte type: torch stores it in whole bytes, so the "
                         "bytes per element are not its itemsize; count bits per element yourself "
                         "(chapter 5 does this for int4 caches)")
    if dtype in _REFUSED:
        raise ValueError(f"{dtype} is not a type a KV cache is stored in; use a float or 8-bit integer dtype")
    return dtype.itemsize


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


def model_from_json(config_json: str, model_type: str, **kwargs):
    """A transformers causal LM built from a config's fields (as sorted JSON, so callers can cache)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = json.loads(config_json)
    fields.pop("model_type", None)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields), **kwargs)


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


