"""Where decode time goes (chapter 7): the bytes a decode step must move, and the floor they set.

One greedy decode step of a batch of ``B`` sequences that already hold ``S`` cached positions reads

    every weight once                                   (whatever B is)
    + the cached keys and values of all B rows         (chapter 4's formula)

and does about ``2 x B`` FLOPs per weight used in a matrix product, plus ``4 x B x layers x heads x
head_dim x S`` in attention: for every cached position and query head, ``2 x head_dim`` for the score
``q.k`` and ``2 x head_dim`` for adding that position's value into the output. A machine that
moves ``bandwidth`` bytes/s and computes ``flops`` FLOP/s cannot do the step faster than

    step_time_floor = max(bytes / bandwidth, FLOPs / flops)

    probes.machine(device) -> {bandwidth, flops}   (measured in kvlab.probes; this module only counts)
    decode_step_bytes(model, batch_size, seq_len)  decode_step_flops(model, batch_size, seq_len)
    step_time_floor(model, batch_size, seq_len, bandwidth, flops) -> seconds

``model`` is any model the book uses: a transformers model (real, ``kvlab-tiny``, shape-only), the
hand-built :class:`kvlab.gpt2.GPT2`, or a shape-only model on the ``meta`` device (:func:`meta_model`),
which costs nothing to build, so GPT-2 XL and the 70B open models are evaluated for free.

The book's convention for the bytes: every parameter tensor once, biases and norms included, except
the look-up tables a step only indexes: of an untied input embedding and of a learned position
table a step reads the ``B`` rows it looks up, not the table. The LM head is read whole (every row
of it makes a logit), and a tied LM head *is* the token embedding, so that table is read whole, once.
The cache at the model's dtype; the keys and values the step writes are left out (one position).

    step_bytes / step_flops / forward_floor(model, tokens, logit_rows, ...)   # any forward, e.g. a
        prefill chunk: N tokens through the network, only R rows of them through the LM head
"""

from __future__ import annotations

import functools
import math

import torch

from .configs import as_dtype, bytes_per_element, config_field, kv_dims
from .validate import check_count, check_int
from .memory import kv_cache_bytes
from .catalogue import all_models

# ---------------------------------------------------------------------------------------------------
# What the model is made of


def _config(model):
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise ValueError(f"expected a model with a .config (transformers or kvlab.gpt2.GPT2), "
                         f"got {type(model).__name__}")
    return cfg


def _params(model) -> list[torch.nn.Parameter]:
    """Every parameter once: ``parameters()`` already skips a tied tensor's second name."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"expected a torch model (nn.Module), got {type(model).__name__}")
    params = list(model.parameters())
    if not params:
        raise ValueError("the model has no parameters")
    return params


def model_dtype(model) -> torch.dtype:
    """The dtype the model computes (and caches) in: that of its first floating-point parameter."""
    return next(p.dtype for p in _params(model) if p.is_floating_point())


def weight_bytes(model) -> int:
    """Bytes of every parameter tensor, each counted once (tied weights once), at its own dtype."""
    return sum(p.numel() * p.element_size() for p in _params(model))


def lm_head(model) -> torch.Tensor:
    """The ``[vocab, hidden]`` matrix that turns the last hidden state into logits."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        return head.weight
    if hasattr(model, "wte"):            # kvlab.gpt2.GPT2: logits = h @ wte.weight.T (tied, no module)
        return model.wte.weight
    raise ValueError(f"cannot find the LM head of {type(model).__name__}")


def lookup_tables(model) -> list[torch.Tensor]:
    """The tables a step only indexes (every ``nn.Embedding``: the input embedding, a learned
    position table), except a tied LM head, which is read in full to make the logits."""
    head, found = lm_head(model), []
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding) and m.weight is not head and all(m.weight is not t for t in found):
            found.append(m.weight)
    return found


def lookup_bytes(model) -> int:
    """Bytes of the look-up tables (whole): what the convention replaces by the rows a step reads."""
    return sum(t.numel() * t.element_size() for t in lookup_tables(model))


def lookup_share(model) -> float:
    """Share of the weight bytes held in look-up tables a step reads only ``B`` rows of (an untied
    input embedding, a learned position table). Llama-3.1-8B's ``embed_tokens``: 6.5%."""
    return lookup_bytes(model) / weight_bytes(model)




def weight_read_bytes(model, rows: int) -> int:
    """Weight bytes a forward of ``rows`` tokens reads: every tensor once, but only ``rows`` rows of
    each look-up table (one gathered row per token, a repeated token counted again: the count
    stays linear in the batch, which :func:`critical_batch` relies on)."""
    rows = check_count(rows, "rows")
    tables = lookup_tables(model)
    rows_read = sum(rows * t[0].numel() * t.element_size() for t in tables)
    return weight_bytes(model) - lookup_bytes(model) + rows_read


def matmul_weights(model) -> int:
    """Number of weights used in matrix products: every 2-D weight of a Linear / Conv1D, and the LM
    head once. Embedding look-ups (a row read, no arithmetic) are left out."""
    head = lm_head(model)
    seen, n = {id(head)}, head.numel()
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Embedding) or not isinstance(w, torch.Tensor) or w.dim() != 2:
            continue
        if id(w) not in seen:
            seen.add(id(w))
            n += w.numel()
    return n


# ---------------------------------------------------------------------------------------------------
# The two counts and the floor


def cache_read_bytes(model, batch_size: int, seq_len: int, dtype=None) -> int:
    """Bytes of the cached keys and values a step reads: chapter 4's formula, at the model's dtype
    (or ``dtype``: chapter 5's quantized cache)."""
    return kv_cache_bytes(_config(model), seq_len, batch_size, dtype or model_dtype(model))


def _per_token_kv(model) -> int:
    return cache_read_bytes(model, 1, 1)


def step_bytes(model, tokens: int, logit_rows: int, cached: int) -> int:
    """Bytes any forward step reads: ``tokens`` new tokens through the network (all rows together),
    ``cached`` key/value positions read from the cache (summed over rows). The LM head is read whole
    when ``logit_rows`` > 0 and not at all when no row asks for logits (a prefill chunk that ends
    inside the prompt)."""
    tokens, logit_rows, cached = (check_count(tokens, "tokens"), check_count(logit_rows, "logit_rows"),
                                  check_count(cached, "cached"))
    if logit_rows > tokens:
        raise ValueError(f"logit_rows ({logit_rows}) cannot exceed tokens ({tokens})")
    head = lm_head(model)
    skip_head = 0 if logit_rows else head.numel() * head.element_size()
    return weight_read_bytes(model, tokens) - skip_head + cached * _per_token_kv(model)


def step_flops(model, tokens: int, logit_rows: int, attended: int) -> int:
    """FLOPs of any forward step: ``2 x tokens`` per weight of every matrix product but the LM head,
    ``2 x logit_rows`` per LM-head weight (only rows that produce logits go through it), and
    ``4 x head_dim`` per (query head, key position) pair scored: ``attended`` pairs per layer and
    query head, summed over the step's tokens."""
    tokens, logit_rows, attended = (check_count(tokens, "tokens"), check_count(logit_rows, "logit_rows"),
                                    check_count(attended, "attended"))
    if logit_rows > tokens:
        raise ValueError(f"logit_rows ({logit_rows}) cannot exceed tokens ({tokens})")
    cfg = _config(model)
    n_layer, _, head_dim = kv_dims(cfg)
    n_head = config_field(cfg, "num_attention_heads", "n_head")      # every QUERY head scores the keys
    head = lm_head(model).numel()
    return (2 * tokens * (matmul_weights(model) - head) + 2 * logit_rows * head
            + 4 * n_layer * n_head * head_dim * attended)


def forward_floor(model, tokens: int, logit_rows: int, cached: int, attended: int, bandwidth: float,
                  flops: float) -> float:
    """Floor of any forward step (a prefill, a decode step, a mixed batch of both): the larger of
    :func:`step_bytes` / bandwidth and :func:`step_flops` / flops. A prefill of ``T`` prompt tokens
    from empty is ``tokens=T, logit_rows=1, cached=0, attended=T(T-1)/2`` (each token scores the
    earlier ones, in the decode step's convention of ``S`` cached positions)."""
    bandwidth, flops = _rate(bandwidth, "bandwidth (bytes/s)"), _rate(flops, "flops (FLOP/s)")
    return max(step_bytes(model, tokens, logit_rows, cached) / bandwidth,
               step_flops(model, tokens, logit_rows, attended) / flops)


def decode_step_bytes(model, batch_size: int, seq_len: int) -> int:
    """Bytes one decode step reads: every weight once (``B`` rows of each look-up table) + the cache
    of ``seq_len`` positions per row."""
    batch_size, seq_len = check_count(batch_size, "batch_size"), check_count(seq_len, "seq_len")
    return step_bytes(model, batch_size, batch_size, batch_size * seq_len)


def decode_step_flops(model, batch_size: int, seq_len: int) -> int:
    """FLOPs of one decode step: ``2 x B x matmul weights + 4 x B x layers x heads x head_dim x S``."""
    batch_size, seq_len = check_count(batch_size, "batch_size"), check_count(seq_len, "seq_len")
    return step_flops(model, batch_size, batch_size, batch_size * seq_len)


def _rate(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise ValueError(f"{what} must be a number (per second), got {value!r}")
    value = float(value)
    if not 0 < value < float("inf"):
        raise ValueError(f"{what} must be a finite number > 0, got {value}")
    return value




def step_time_floor(model, batch_size: int, seq_len: int, bandwidth: float, flops: float) -> float:
    """The least time one decode step can take: the larger of moving its bytes and doing its FLOPs."""
    batch_size = check_int(batch_size, "batch_size", 1, fix="a step decodes at least one sequence")
    seq_len = check_int(seq_len, "seq_len", 0)
    bandwidth, flops = _rate(bandwidth, "bandwidth (bytes/s)"), _rate(flops, "flops (FLOP/s)")
    return max(decode_step_bytes(model, batch_size, seq_len) / bandwidth,
               decode_step_flops(model, batch_size, seq_len) / flops)


def _per_element(dtype_or_bytes) -> float:
    """Bytes per element from a dtype, or a number of bytes as is (0.5 for a packed 4-bit format)."""
    if isinstance(dtype_or_bytes, (int, float)) and not isinstance(dtype_or_bytes, bool):
        if dtype_or_bytes <= 0:
            raise ValueError(f"bytes per element must be > 0, got {dtype_or_bytes}")
        return dtype_or_bytes
    return bytes_per_element(dtype_or_bytes)


def step_terms(model, batch_size: int, seq_len: int, bandwidth: float, flops: float,
               cache_dtype=None, weights_dtype=None) -> dict:
    """The floor's parts, in seconds: reading the weights, reading the cache, computing; and which
    bounds the step. ``cache_dtype`` / ``weights_dtype`` (a dtype, or bytes per element such as 0.5
    for int4) re-price the bytes for a quantized format; the FLOPs stay the same."""
    bandwidth, flops = _rate(bandwidth, "bandwidth (bytes/s)"), _rate(flops, "flops (FLOP/s)")
    w = weight_read_bytes(model, batch_size)
    if weights_dtype is not None:
        w = w / weight_bytes(model) * sum(p.numel() for p in _params(model)) * _per_element(weights_dtype)
    c = cache_read_bytes(model, batch_size, seq_len)
    if cache_dtype is not None:
        c = c / bytes_per_element(model_dtype(model)) * _per_element(cache_dtype)
    t = {"weights": w / bandwidth, "cache": c / bandwidth,
         "compute": decode_step_flops(model, batch_size, seq_len) / flops}
    memory = t["weights"] + t["cache"]
    t.update(weight_bytes=w, cache_bytes=c, memory=memory, floor=max(memory, t["compute"]),
             bound="compute" if t["compute"] > memory else ("cache" if t["cache"] > t["weights"] else "weights"))
    return t


def generation_floor(model, batch_size: int, prompt_len: int, new_tokens: int, bandwidth: float,
                     flops: float) -> float:
    """Floor of a whole greedy generation: one step per new token, the ``i``-th at ``prompt_len + i``
    cached positions (the prefill is priced as one step: it too reads every weight once)."""
    bandwidth, flops = _rate(bandwidth, "bandwidth (bytes/s)"), _rate(flops, "flops (FLOP/s)")
    batch_size, prompt_len = check_int(batch_size, "batch_size", 1), check_int(prompt_len, "prompt_len", 0)
    new_tokens = check_int(new_tokens, "new_tokens", 0)
    (b0, db), (f0, df) = _per_position(decode_step_bytes, model, batch_size), _per_position(decode_step_flops, model, batch_size)
    return sum(max((b0 + db * s) / bandwidth, (f0 + df * s) / flops)
               for s in range(prompt_len, prompt_len + new_tokens))


def generation_bytes(model, batch_size: int, prompt_len: int, new_tokens: int) -> int:
    """Bytes a whole greedy generation reads, step by step as :func:`generation_floor` prices them (its
    memory term alone: over a bandwidth, the floor with free arithmetic)."""
    batch_size, prompt_len = check_int(batch_size, "batch_size", 1), check_int(prompt_len, "prompt_len", 0)
    new_tokens = check_int(new_tokens, "new_tokens", 0)
    b0, db = _per_position(decode_step_bytes, model, batch_size)
    return sum(b0 + db * s for s in range(prompt_len, prompt_len + new_tokens))


def _per_position(count, model, batch_size: int) -> tuple[int, int]:
    """``count(model, B, seq_len)`` is linear in ``seq_len``: its intercept and slope, taken once (not a
    model walk per step)."""
    c0 = count(model, batch_size, 0)
    return c0, count(model, batch_size, 1) - c0


# ---------------------------------------------------------------------------------------------------
# Derived quantities the chapter reads off the formulas


def arithmetic_intensity(model, batch_size: int, seq_len: int) -> float:
    """FLOPs per byte moved by one decode step (about the batch size / bytes per weight, at short context)."""
    return decode_step_flops(model, batch_size, seq_len) / decode_step_bytes(model, batch_size, seq_len)




def critical_batch(model, seq_len: int, bandwidth: float, flops: float, limit: int = 1 << 30) -> int | None:
    """The smallest batch whose step is bound by compute (FLOPs time > bytes time) at ``seq_len``
    cached positions per row; ``None`` if there is none (or none up to ``limit``).

    Both counts are linear in the batch: bytes = ``W + B x b``, FLOPs = ``B x f``, so the batch is
    ``W / bandwidth / (f / flops - b / bandwidth)``; when each row's own bytes take longer than its
    FLOPs (``b / bandwidth >= f / flops``: long contexts, whose attention reads the cache at a
    constant :func:`attention_intensity`) no batch is compute-bound."""
    bandwidth, flops = _rate(bandwidth, "bandwidth"), _rate(flops, "flops")
    limit = check_int(limit, "limit (the largest batch to try)", 1)
    w = decode_step_bytes(model, 1, seq_len)
    b, f = decode_step_bytes(model, 2, seq_len) - w, decode_step_flops(model, 1, seq_len)
    w -= b                                         # the part read once whatever the batch
    gain = f / flops - b / bandwidth               # seconds of compute over bytes added per row
    if gain <= 0:
        return None
    B = max(1, math.floor(w / bandwidth / gain))
    bound = lambda n: step_terms(model, n, seq_len, bandwidth, flops)["bound"] == "compute"
    while B > 1 and bound(B - 1):                  # the closed form, settled on the exact test
        B -= 1
    while not bound(B):
        B += 1
    return B if B <= limit else None


def critical_batch_curve(model, contexts, bandwidth: float, flops: float) -> list[int | None]:
    """:func:`critical_batch` at each context length of ``contexts`` (``None``: never compute-bound)."""
    return [critical_batch(model, s, bandwidth, flops) for s in contexts]


def attention_intensity(model, dtype=None) -> float:
    """FLOPs per byte of the attention over the cache, per row: ``4 x H_q x d`` FLOPs for ``2 x H_kv
    x d x element size`` bytes per position, that is ``2 x H_q / (H_kv x element size)``. It does not
    depend on the batch (every row reads its own cache) nor on the context: below the ridge, the
    attention of long contexts is bound by memory at any batch. GQA raises it by ``H_q / H_kv``."""
    cfg = _config(model)
    _, n_kv, _ = kv_dims(cfg)
    n_head = config_field(cfg, "num_attention_heads", "n_head")
    return 2 * n_head / (n_kv * _per_element(dtype or model_dtype(model)))


def crossover_length(model, dtype=None) -> int:
    """The context length (per row, batch 1) at which the cache a step reads outweighs the weights."""
    per_token = cache_read_bytes(model, 1, 1, dtype)
    return -(-weight_read_bytes(model, 1) // per_token)


def generation_bytes(model, batch_size: int, prompt_len: int, new_tokens: int) -> int:
    """Bytes a greedy generation reads in the decode convention: one step per new token, the
    ``i``-th at ``prompt_len + i`` cached positions (the prefill priced as one step)."""
    return sum(decode_step_bytes(model, batch_size, s) for s in range(prompt_len, prompt_len + new_tokens))


def achieved_bandwidth(model, batch_size: int, prompt_len: int, new_tokens: int, seconds: float) -> float:
    """Bytes/s a generation that took ``seconds`` streamed: :func:`generation_bytes` / seconds, the
    figure gpt-fast reports, comparable across machines and with the read probe."""
    return generation_bytes(model, batch_size, prompt_len, new_tokens) / _rate(seconds, "seconds")


# ---------------------------------------------------------------------------------------------------
# Shape-only models on the meta device


def meta_model(name_or_config, dtype=torch.float32):
    """A transformers model with the right shapes and no storage (``meta`` device): a GPT-2 size
    (``"gpt2"`` ... ``"gpt2-xl"``, optionally ``"shape:"``-prefixed), an open model of chapter 4's
    table by name, a dict of config fields with ``model_type``, or a transformers config."""
    if not isinstance(name_or_config, (str, dict)) and not hasattr(name_or_config, "to_dict"):
        raise ValueError(f"meta_model takes a model name, a dict of config fields or a transformers "
                         f"config, got {type(name_or_config).__name__}")
    if isinstance(name_or_config, str):
        return _meta_by_name(name_or_config, as_dtype(dtype))
    return _meta_model(name_or_config, dtype)


@functools.lru_cache(maxsize=32)
def _meta_by_name(name: str, dtype: torch.dtype):
    return _meta_model(name, dtype)    # shapes never change: build each named model once


def _meta_model(name_or_config, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM


    config = name_or_config
    if isinstance(config, str):
        table = all_models()
        key = config.removeprefix("shape:")
        if key not in table:
            raise ValueError(f"unknown model {config!r}; known: {sorted(table)}")
        config = table[key]
    if isinstance(config, dict):
        fields = {k: v for k, v in config.items()
                  if k not in ("name", "hf_repo", "parameters", "note", "source", "attention")
                  and not k.startswith("_")}
        config = AutoConfig.for_model(fields.pop("model_type", "gpt2"), **fields)
    kv_dims(config)        # layers, heads, head size: ints >= 1, refused here rather than built as 0 layers
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=as_dtype(dtype))
    if isinstance(name_or_config, str):
        model.kvlab_name = name_or_config
    elif isinstance(name_or_config, dict):
        model.kvlab_name = name_or_config.get("name", config.model_type)
    else:
        model.kvlab_name = config.model_type
    model.kvlab_kind = "shape-only (meta)"
    return model.eval()
