"""Where decode time goes (chapter 7): the bytes a decode step must move, and the floor they set.

One greedy decode step of a batch of ``B`` sequences that already hold ``S`` cached positions reads

    every weight once                                   (whatever B is)
    + the cached keys and values of all B rows         (chapter 4's formula)

and does about ``2 x B`` FLOPs per weight used in a matrix product, plus ``4 x B x layers x heads x
head_dim x S`` in attention (the scores ``q.k`` and the weighted sum of the values). A machine that
moves ``bandwidth`` bytes/s and computes ``flops`` FLOP/s cannot do the step faster than

    step_time_floor = max(bytes / bandwidth, FLOPs / flops)

    measure_bandwidth(device) -> bytes/s           measure_matmul_flops(device, dtype) -> FLOP/s
    decode_step_bytes(model, batch_size, seq_len)  decode_step_flops(model, batch_size, seq_len)
    step_time_floor(model, batch_size, seq_len, bandwidth, flops) -> seconds

``model`` is any model the book uses: a transformers model (real, ``kvlab-tiny``, shape-only), the
hand-built :class:`kvlab.gpt2.GPT2`, or a shape-only model on the ``meta`` device (:func:`meta_model`),
which costs nothing to build, so GPT-2 XL and the 70B open models are evaluated for free.

The book's convention for the bytes: every parameter tensor once (a tied LM head is the token
embedding, read once), the position table counted whole although a step reads one row of it
(it is small), biases and norms included; the cache at the model's dtype.
"""

from __future__ import annotations

import functools
import statistics

import torch
import torch.utils.benchmark as benchmark

from .memory import as_dtype, bytes_per_element, check_count, check_int, config_field, kv_cache_bytes, kv_dims
from .models import check_device

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


def _lm_head(model) -> torch.Tensor:
    """The ``[vocab, hidden]`` matrix that turns the last hidden state into logits."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        return head.weight
    if hasattr(model, "wte"):            # kvlab.gpt2.GPT2: logits = h @ wte.weight.T (tied, no module)
        return model.wte.weight
    raise ValueError(f"cannot find the LM head of {type(model).__name__}")


def position_table_share(model) -> float:
    """Share of the weight bytes in a learned position table (``wpe``), which a step reads one row
    of although the book's convention counts it whole; 0 for rotary models, which have none."""
    table = next((m.weight for name, m in model.named_modules() if name.split(".")[-1] == "wpe"), None)
    return 0.0 if table is None else table.numel() * table.element_size() / weight_bytes(model)


def matmul_weights(model) -> int:
    """Number of weights used in matrix products: every 2-D weight of a Linear / Conv1D, and the LM
    head once. Embedding look-ups (a row read, no arithmetic) are left out."""
    head = _lm_head(model)
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


def decode_step_bytes(model, batch_size: int, seq_len: int) -> int:
    """Bytes one decode step reads: every weight once + the cache of ``seq_len`` positions per row."""
    batch_size, seq_len = check_count(batch_size, "batch_size"), check_count(seq_len, "seq_len")
    return weight_bytes(model) + cache_read_bytes(model, batch_size, seq_len)


def decode_step_flops(model, batch_size: int, seq_len: int) -> int:
    """FLOPs of one decode step: ``2 x B x matmul weights + 4 x B x layers x heads x head_dim x S``."""
    batch_size, seq_len = check_count(batch_size, "batch_size"), check_count(seq_len, "seq_len")
    cfg = _config(model)
    n_layer, _, head_dim = kv_dims(cfg)
    n_head = config_field(cfg, "num_attention_heads", "n_head")      # every QUERY head scores the keys
    return 2 * batch_size * matmul_weights(model) + 4 * batch_size * n_layer * n_head * head_dim * seq_len


def _rate(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise ValueError(f"{what} must be a number (per second), got {value!r}")
    value = float(value)
    if not 0 < value < float("inf"):
        raise ValueError(f"{what} must be a finite number > 0, got {value}")
    return value


def _whole(value, what: str, minimum: int = 0) -> int:
    """``value`` as an int >= ``minimum`` (not a bool, not a float), or a ValueError naming ``what``."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an int >= {minimum}, got {value!r}")
    return check_int(value, what, minimum)


def step_time_floor(model, batch_size: int, seq_len: int, bandwidth: float, flops: float) -> float:
    """The least time one decode step can take: the larger of moving its bytes and doing its FLOPs."""
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
    w = weight_bytes(model)
    if weights_dtype is not None:
        w = sum(p.numel() for p in _params(model)) * _per_element(weights_dtype)
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
    batch_size, prompt_len = _whole(batch_size, "batch_size", 1), _whole(prompt_len, "prompt_len")
    new_tokens = _whole(new_tokens, "new_tokens")
    # both counts are linear in seq_len: take the intercept and slope once, not a model walk per step
    b0, f0 = decode_step_bytes(model, batch_size, 0), decode_step_flops(model, batch_size, 0)
    db = decode_step_bytes(model, batch_size, 1) - b0
    df = decode_step_flops(model, batch_size, 1) - f0
    return sum(max((b0 + db * s) / bandwidth, (f0 + df * s) / flops)
               for s in range(prompt_len, prompt_len + new_tokens))


# ---------------------------------------------------------------------------------------------------
# Derived quantities the chapter reads off the formulas


def arithmetic_intensity(model, batch_size: int, seq_len: int) -> float:
    """FLOPs per byte moved by one decode step (about the batch size / bytes per weight, at short context)."""
    return decode_step_flops(model, batch_size, seq_len) / decode_step_bytes(model, batch_size, seq_len)


def ridge_point(bandwidth: float, flops: float) -> float:
    """FLOPs per byte at which a machine's compute time equals its memory time."""
    return _rate(flops, "flops") / _rate(bandwidth, "bandwidth")


def critical_batch(model, seq_len: int, bandwidth: float, flops: float, limit: int = 1 << 20) -> int | None:
    """The smallest batch whose step is compute-bound (FLOPs time >= bytes time), ``None`` if none up
    to ``limit`` (the cache grows with the batch as fast as the FLOPs do at long contexts)."""
    lo, hi = 1, _whole(limit, "limit (the largest batch to try)", 1)
    bound = lambda b: step_terms(model, b, seq_len, bandwidth, flops)["bound"] == "compute"
    if not bound(hi):
        return None
    while lo < hi:                       # the compute share grows with the batch: bisect
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if not bound(mid) else (lo, mid)
    return lo


def crossover_length(model, dtype=None) -> int:
    """The context length (per row) at which the cache a step reads outweighs the weights."""
    per_token = cache_read_bytes(model, 1, 1, dtype)
    return -(-weight_bytes(model) // per_token)


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

    from .calculator import all_models

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


# ---------------------------------------------------------------------------------------------------
# The two numbers of the machine


def _threads(device, threads: int | None) -> int:
    if torch.device(device).type != "cpu":
        return torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def median_seconds(fn, device, repeats: int = 7, warmup: int = 2, threads: int | None = None) -> float:
    """Median seconds per call of ``fn``: CUDA events on a GPU, torch.utils.benchmark on a CPU."""
    repeats, warmup = _whole(repeats, "repeats", 1), _whole(warmup, "warmup")
    for _ in range(warmup):
        fn()
    if torch.device(device).type == "cuda":
        samples = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            samples.append(start.elapsed_time(end) / 1e3)
        return statistics.median(samples)
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads or torch.get_num_threads())
    return statistics.median(timer.timeit(1).median for _ in range(repeats))


def _default_copy_mib(device) -> int:
    from .timing import QUICK
    if torch.device(device).type == "cuda":
        return 1024
    return 64 if QUICK else 256       # well beyond any CPU's last-level cache


def measure_bandwidth(device="cpu", size_mib: int | None = None, threads: int | None = None,
                      repeats: int = 7, verbose: bool = True) -> float:
    """Bytes/s a large tensor copy achieves (read + write bytes both counted), median of ``repeats``.

    On a CPU the thread count is fixed (``threads``, else torch's current one) and printed: the
    bandwidth one thread can pull is often far below what all cores can.
    """
    device = check_device(device)
    size_mib = None if size_mib is None else _whole(size_mib, "size_mib", 1)
    threads, repeats = None if threads is None else _whole(threads, "threads", 1), _whole(repeats, "repeats", 1)
    threads = _threads(device, threads)
    n = (size_mib or _default_copy_mib(device)) * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device, repeats=repeats, threads=threads)
    bw = 2 * src.numel() * src.element_size() / seconds
    if verbose:
        where = f"{threads} threads" if device.type == "cpu" else str(device)
        print(f"bandwidth: {bw / 1e9:.1f} GB/s  (copy of {n * 4 / 2**20:.0f} MiB, {where})")
    return bw


def measure_matmul_flops(device="cpu", dtype=torch.float32, n: int | None = None,
                         threads: int | None = None, repeats: int = 5, verbose: bool = True) -> float:
    """FLOP/s an ``n x n`` by ``n x n`` matrix product achieves (``2 n^3`` FLOPs), median of ``repeats``."""
    from .timing import QUICK

    device, dtype = check_device(device), as_dtype(dtype)
    n = None if n is None else _whole(n, "n (the matrix size)", 1)
    threads, repeats = None if threads is None else _whole(threads, "threads", 1), _whole(repeats, "repeats", 1)
    threads = _threads(device, threads)
    n = n or (8192 if device.type == "cuda" else 512 if QUICK else 1024)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    seconds = median_seconds(lambda: a @ b, device, repeats=repeats, threads=threads)
    rate = 2 * n ** 3 / seconds
    if verbose:
        where = f"{threads} threads" if device.type == "cpu" else str(device)
        print(f"matmul: {rate / 1e9:.1f} GFLOP/s  ({n}x{n} {str(dtype).removeprefix('torch.')}, {where})")
    return rate


def machine(device="cpu", dtype=torch.float32, threads: int | None = None, verbose: bool = True) -> dict:
    """Both numbers of the machine at once, with its ridge point (FLOPs per byte)."""
    device, dtype = check_device(device), as_dtype(dtype)     # before the first measurement
    bw = measure_bandwidth(device, threads=threads, verbose=verbose)
    fl = measure_matmul_flops(device, dtype, threads=threads, verbose=verbose)
    return {"bandwidth": bw, "flops": fl, "ridge": fl / bw, "threads": torch.get_num_threads()}


def cpu_cache_bytes() -> int | None:
    """Size of the largest CPU cache level (bytes) as Linux reports it, or None if unknown."""
    best = None
    for index in range(8):
        path = f"/sys/devices/system/cpu/cpu0/cache/index{index}/size"
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        mult = {"K": 1024, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        size = int(text.rstrip("KMG")) * mult
        best = max(best or 0, size)
    return best
