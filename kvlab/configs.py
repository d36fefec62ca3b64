"""Reading a model's shape and dtypes out of any config (transformers' or a plain dict).

GPT-2 names the fields ``n_layer``/``n_head``/``n_embd``/``n_positions``; Llama-style configs use
``num_hidden_layers``/``num_attention_heads``/``num_key_value_heads``/``head_dim``/``hidden_size``.
"""

from __future__ import annotations
from collections.abc import Mapping
import json
import torch
from . import validate   # (validate reads configs too: imported as a module, used at call time)


def config_field(config, *names, default=None):
    """The first of ``names`` that ``config`` (object or dict) sets to something other than None."""
    for name in names:
        value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if value is not None:
            return value
    return default


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
    n_layer = validate.check_int(n_layer, "the number of layers")
    n_head = validate.check_int(n_head, "the number of attention heads")
    return n_layer, kv_heads(config, n_head), head_dim_of(config, n_head)


def kv_heads(config, n_head: int) -> int:
    """The number of key/value heads a config's cache stores (``n_head`` unless it groups them)."""
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
    n_kv = validate.check_int(n_kv, "the number of key/value heads")
    if n_head % n_kv:
        raise ValueError(f"{n_head} query heads cannot be shared evenly by {n_kv} key/value heads")
    return n_kv


def head_dim_of(config, n_head: int) -> int:
    """A config's head size: an explicit ``head_dim``, else the hidden size over ``n_head``."""
    head_dim = config_field(config, "head_dim")
    if head_dim is None:
        hidden = config_field(config, "hidden_size", "n_embd", "d_model")
        if hidden is None:
            raise ValueError("config sets neither head_dim nor hidden_size / n_embd")
        hidden = validate.check_int(hidden, "the hidden size")
        if hidden % n_head:
            raise ValueError(f"hidden size {hidden} is not divisible by {n_head} heads; "
                             "set head_dim explicitly")
        head_dim = hidden // n_head
    return validate.check_int(head_dim, "head_dim")


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


def model_from_json(config_json: str, model_type: str, **kwargs):
    """A transformers causal LM built from a config's fields (as sorted JSON, so callers can cache)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = json.loads(config_json)
    fields.pop("model_type", None)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields), **kwargs)
