"""KV-cache memory arithmetic (chapter 4), and the measurements that check it.

Every layer caches one key and one value tensor of shape ``[batch, kv_heads, seq_len, head_dim]``,
so a whole cache holds

    2 (K and V) x n_layer x kv_heads x head_dim x seq_len x batch x bytes_per_element

bytes. ``kv_heads`` is the number of *key/value* heads: equal to the query heads in classic
multi-head attention (GPT-2, Llama-2-7B), fewer with grouped-query attention (Llama-3, Mistral),
one with multi-query attention (Falcon-7B). ``head_dim`` is usually ``hidden_size / n_heads``, but
some configs set it explicitly to something else (Gemma-2), and then the explicit value is the one
the model uses.

    kv_cache_bytes(config, seq_len, batch_size, dtype)   # the formula, an exact int
    measured_cache_bytes(cache)                          # bytes really held by a cache's tensors
    max_batch_size(config, seq_len, dtype, free_bytes)   # the largest batch whose cache fits
    weights_bytes(config_or_model, dtype)                # what the parameters take

``config`` is a transformers ``PretrainedConfig`` or a plain dict with the same field names (GPT-2's
``n_layer``/``n_head``/``n_embd`` or the Llama-style ``num_hidden_layers``/``num_attention_heads``/
``num_key_value_heads``/``head_dim``/``hidden_size``), e.g. an entry of ``models/configs/open-models.json``.
"""

from __future__ import annotations

import functools
import html
import json
import operator
from collections.abc import Mapping

import torch

from .models import CONFIG_DIR

OPEN_MODELS_PATH = CONFIG_DIR / "open-models.json"

#: Nominal memory of three common GPUs (24 GB: RTX 3090/4090, 80 GB: A100/H100, 141 GB: H200), taken
#: as GiB (2**30 bytes). What a program can really use is a little less (CUDA context, allocator).
GPU_SIZES_GB = (24, 80, 141)
GIB = 2 ** 30
MIB = 2 ** 20

# ---------------------------------------------------------------------------------------------------
# Reading the attention shape out of any config


def _field(config, *names, default=None):
    """The first of ``names`` that ``config`` (object or dict) sets to something other than None."""
    for name in names:
        value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if value is not None:
            return value
    return default


def _positive_int(value, what: str) -> int:
    try:
        n = operator.index(value)   # ints (and numpy ints) only: 12.5 layers is a bug upstream
    except TypeError:
        raise ValueError(f"{what} must be an integer, got {value!r}") from None
    if n < 1:
        raise ValueError(f"{what} must be >= 1, got {n}")
    return n


def kv_dims(config) -> tuple[int, int, int]:
    """``(n_layer, n_kv_heads, head_dim)``: the three shape factors of a config's KV cache.

    Reads GPT-2's names (``n_layer``, ``n_head``, ``n_embd``) and the Llama-style ones
    (``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
    ``hidden_size``). An explicit ``head_dim`` wins over ``hidden_size / num_attention_heads``.
    Accepts a config object, a dict, or a model (its ``.config``).
    """
    if not isinstance(config, Mapping) and hasattr(config, "config") and not hasattr(config, "to_dict"):
        config = config.config   # a model was passed
    if config is None or isinstance(config, (str, bytes, int, float)):
        raise ValueError(f"expected a transformers config (or a dict of its fields), got {config!r}")
    n_layer = _field(config, "num_hidden_layers", "n_layer", "num_layers")
    n_head = _field(config, "num_attention_heads", "n_head")
    if n_layer is None or n_head is None:
        raise ValueError("config has no layer count (num_hidden_layers / n_layer) or no head count "
                         "(num_attention_heads / n_head); pass a decoder's transformers config")
    n_layer = _positive_int(n_layer, "the number of layers")
    n_head = _positive_int(n_head, "the number of attention heads")

    model_type = _field(config, "model_type", default="")
    if model_type == "falcon" and not _field(config, "new_decoder_architecture", default=False):
        # Falcon-7B's config keeps num_kv_heads == num_attention_heads but sets multi_query=True:
        # its attention then has a single key/value head (transformers' modeling_falcon does this).
        n_kv = 1 if _field(config, "multi_query", default=True) else n_head
    elif model_type == "falcon":
        # Falcon-40B/180B (new decoder architecture): transformers expands the grouped K/V to every
        # query head *before* it stores them, so its cache holds num_attention_heads heads.
        n_kv = n_head
    else:
        n_kv = _field(config, "num_key_value_heads", "num_kv_heads", "n_head_kv", default=n_head)
    n_kv = _positive_int(n_kv, "the number of key/value heads")
    if n_head % n_kv:
        raise ValueError(f"{n_head} query heads cannot be shared evenly by {n_kv} key/value heads")

    head_dim = _field(config, "head_dim")
    if head_dim is None:
        hidden = _field(config, "hidden_size", "n_embd", "d_model")
        if hidden is None:
            raise ValueError("config sets neither head_dim nor hidden_size / n_embd")
        hidden = _positive_int(hidden, "the hidden size")
        if hidden % n_head:
            raise ValueError(f"hidden size {hidden} is not divisible by {n_head} heads; "
                             "set head_dim explicitly")
        head_dim = hidden // n_head
    return n_layer, n_kv, _positive_int(head_dim, "head_dim")


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


def _count(value, what: str) -> int:
    try:
        n = operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an integer, got {value!r}") from None
    if n < 0:
        raise ValueError(f"{what} must be >= 0, got {n}")
    return n


def kv_cache_bytes(config, seq_len: int, batch_size: int, dtype) -> int:
    """Bytes of a full KV cache: ``2 x layers x kv_heads x head_dim x seq_len x batch x bytes``.

    The factor 2 is one tensor for keys and one for values; every layer has its own pair.
    """
    n_layer, n_kv, head_dim = kv_dims(config)
    seq_len = _count(seq_len, "seq_len")
    batch_size = _count(batch_size, "batch_size")
    return 2 * n_layer * n_kv * head_dim * seq_len * batch_size * bytes_per_element(dtype)


def bytes_per_token(config, dtype) -> int:
    """Cache bytes one more token of one sequence costs (all layers, keys and values)."""
    return kv_cache_bytes(config, 1, 1, dtype)


def max_batch_size(config, seq_len: int, dtype, free_bytes: int) -> int:
    """The largest batch whose cache of ``seq_len`` tokens per sequence fits in ``free_bytes`` (floor)."""
    per_sequence = kv_cache_bytes(config, seq_len, 1, dtype)
    free_bytes = _count(free_bytes, "free_bytes")
    if per_sequence == 0:
        raise ValueError("seq_len is 0: an empty cache takes no memory, so every batch size fits")
    return free_bytes // per_sequence   # floor: a partly fitting sequence does not fit


# ---------------------------------------------------------------------------------------------------
# Measuring what a cache really holds

#: Per-layer bookkeeping that is not cached keys/values: int64 scalars holding StaticCache's write
#: position and a sliding-window layer's window size.
_BOOKKEEPING = {"cumulative_length", "_sliding_window_tensor", "device"}


def _tensors(obj, depth: int = 0):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 8 and isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x, depth + 1)
    elif depth < 8 and isinstance(obj, Mapping):
        for x in obj.values():
            yield from _tensors(x, depth + 1)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view counts its whole storage, once)."""
    seen, total = set(), 0
    for t in tensors:
        try:
            storage = t.untyped_storage()
            key, size = (str(t.device), storage.data_ptr()), storage.nbytes()
        except (RuntimeError, NotImplementedError):   # exotic tensor subclasses
            key, size = (str(t.device), id(t)), t.numel() * t.element_size()
        if key not in seen:
            seen.add(key)
            total += size
    return total


def measured_cache_bytes(cache) -> int:
    """Bytes of tensor storage a cache holds right now, read from the tensors themselves.

    Works for a transformers ``Cache`` (walks every layer's tensors: ``keys``, ``values``, and the
    quantized copies and scales of quantized layers; skips scalar bookkeeping such as ``StaticCache``'s
    write position), a kvlab cache (walks its tensor attributes), or a list/tuple of tensors.
    Storage is counted once per distinct buffer, whole: a view of a bigger buffer counts the buffer.
    """
    if isinstance(cache, (list, tuple, torch.Tensor)):
        return _storage_bytes(_tensors(cache))
    from transformers.cache_utils import Cache as HFCache

    if isinstance(cache, HFCache):   # transformers' caches: a list of per-layer objects
        return _storage_bytes(t for layer in cache.layers for name, value in vars(layer).items()
                              if name not in _BOOKKEEPING for t in _tensors(value))
    if hasattr(cache, "nbytes") and hasattr(cache, "update"):            # a kvlab cache
        return _storage_bytes(t for value in vars(cache).values() for t in _tensors(value))
    raise ValueError(f"don't know how to read the tensors of a {type(cache).__name__}; pass a "
                     "transformers Cache, a kvlab cache, or a list of tensors")


@torch.no_grad()
def fill_dynamic_cache(model, seq_len: int, batch_size: int, decode_steps: int = 2, seed: int = 0):
    """Run ``model`` (a transformers causal LM) over random tokens: a prefill of ``seq_len -
    decode_steps`` tokens, then ``decode_steps`` one-token steps, all into one ``DynamicCache``.
    Returns the cache, holding ``seq_len`` tokens per sequence (what the formula's ``seq_len`` means)."""
    from transformers import DynamicCache

    seq_len, batch_size = _count(seq_len, "seq_len"), _positive_int(batch_size, "batch_size")
    decode_steps = min(decode_steps, seq_len - 1) if seq_len > 1 else 0
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    # ids from 1: token 0 is a pad id in some configs, and a pad token without a mask draws a warning
    ids = torch.randint(1, model.config.vocab_size, (batch_size, seq_len), generator=g).to(device)
    cache = DynamicCache(config=model.config)
    prefill = seq_len - decode_steps
    if prefill:
        model(ids[:, :prefill], cache=cache, use_cache=True)
    for t in range(prefill, seq_len):
        model(ids[:, t:t + 1], cache=cache, use_cache=True)
    if cache.get_seq_length() != seq_len:
        raise RuntimeError(f"cache holds {cache.get_seq_length()} tokens, expected {seq_len}")
    return cache


@functools.lru_cache(maxsize=16)
def _random_model(config_json: str, model_type: str, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = json.loads(config_json)
    fields.pop("model_type", None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields), dtype=dtype)
    return model.eval()


def measure_config(config, seq_len: int, batch_size: int, dtype) -> int:
    """Bytes a real ``DynamicCache`` holds after running a random-weight model built from ``config``
    (keep the config tiny) over ``seq_len`` tokens of ``batch_size`` sequences in ``dtype``."""
    dtype = as_dtype(dtype)
    fields = config.to_diff_dict() if hasattr(config, "to_diff_dict") else dict(config)
    fields["model_type"] = getattr(config, "model_type", None) or fields.get("model_type")
    fields.pop("dtype", None)
    fields.pop("torch_dtype", None)
    model = _random_model(json.dumps(fields, sort_keys=True, default=str), fields["model_type"], dtype)
    return measured_cache_bytes(fill_dynamic_cache(model, seq_len, batch_size))


class TensorMemoryTracker:
    """Current and peak bytes of tensor storage *allocated inside* a ``with`` block, on any device.

    A ``TorchDispatchMode`` sees every tensor operation; each output whose storage is new (not shared
    with one of the op's inputs: views and in-place results are not new memory) is counted until
    Python frees that storage. This measures tensors, not the allocator: on a GPU,
    ``torch.cuda.max_memory_allocated`` also counts the allocator's rounding and workspace.

        with TensorMemoryTracker() as mem:
            generate(...)
        mem.peak, mem.current   # bytes
    """

    def __init__(self):
        self.current = self.peak = 0
        self._live: dict = {}
        self._mode = None

    def _freed(self, key, n):
        self.current -= n
        self._live.pop(key, None)

    def __enter__(self):
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                inputs = {(str(t.device), t.untyped_storage().data_ptr())
                          for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
                for t in tree_flatten(out)[0]:
                    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                        continue
                    st = t.untyped_storage()
                    key = (str(t.device), st.data_ptr())
                    if key in inputs or key in tracker._live or st.nbytes() == 0:
                        continue
                    n = st.nbytes()
                    tracker._live[key] = n
                    tracker.current += n
                    tracker.peak = max(tracker.peak, tracker.current)
                    weakref.finalize(st, tracker._freed, key, n)   # fires when the storage is freed
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        return False


def saved_for_backward_bytes(fn) -> tuple[object, int]:
    """Run ``fn()`` and return ``(its result, bytes of the tensors autograd saved for a backward pass)``.

    Under ``torch.no_grad()`` nothing is saved (0). With gradients on, every layer's intermediate
    activations are kept alive until the graph is freed; that is memory a cache never needs.
    """
    storages = {}

    def pack(t):
        st = t.untyped_storage()
        storages[(str(t.device), st.data_ptr())] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, sum(storages.values())


# ---------------------------------------------------------------------------------------------------
# Weights


@functools.lru_cache(maxsize=64)
def _meta_parameter_count(config_json: str, model_type: str) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = json.loads(config_json)
    fields.pop("model_type", None)
    config = AutoConfig.for_model(model_type, **fields)
    with torch.device("meta"):   # shapes only: no memory, no initialisation cost
        model = AutoModelForCausalLM.from_config(config)
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


# ---------------------------------------------------------------------------------------------------
# Tables, the open models, and the calculator


def load_open_models() -> dict[str, dict]:
    """``models/configs/open-models.json``: name -> attention shape, parameters and sources."""
    data = json.loads(OPEN_MODELS_PATH.read_text())
    return {m["name"]: m for m in data["models"]}


def gpt2_models() -> dict[str, dict]:
    """The four GPT-2 sizes (``models/configs/gpt2*.json``) in the same form as :func:`load_open_models`."""
    from .models import GPT2_SIZES

    out = {}
    for size in GPT2_SIZES:
        cfg = json.loads((CONFIG_DIR / f"{size}.json").read_text())
        entry = {"name": size, "hf_repo": f"openai-community/{size}", **cfg,
                 "source": f"openai-community/{size} config.json on the Hugging Face Hub (models/configs/{size}.json); "
                           "parameters counted by transformers on the meta device"}
        entry["parameters"] = parameter_count({k: v for k, v in cfg.items()})
        entry["attention"] = "MHA"
        out[size] = entry
    return out


def all_models() -> dict[str, dict]:
    """GPT-2's four sizes, then the open models: the rows of the chapter's tables."""
    return {**gpt2_models(), **load_open_models()}


def human_bytes(n: float, binary: bool = True) -> str:
    """``16777216 -> '16.0 MiB'`` (binary, powers of 1024) or ``'16.8 MB'`` (decimal, powers of 1000)."""
    base, units = (1024, ["B", "KiB", "MiB", "GiB", "TiB"]) if binary else (1000, ["B", "kB", "MB", "GB", "TB"])
    x, i = float(n), 0
    while abs(x) >= base and i < len(units) - 1:
        x /= base
        i += 1
    return f"{int(x)} B" if i == 0 else f"{x:.1f} {units[i]}"


def attention_kind(config) -> str:
    """``MHA`` (a K/V head per query head), ``MQA`` (one K/V head) or ``GQA`` (in between)."""
    _, n_kv, _ = kv_dims(config)
    n_head = _field(config, "num_attention_heads", "n_head")
    return "MHA" if n_kv == n_head else "MQA" if n_kv == 1 else f"GQA ({n_head // n_kv} q/kv)"


def context_length(config) -> int | None:
    return _field(config, "context", "max_position_embeddings", "n_positions")


def calculator(config, seq_len: int, batch_size: int, dtype, weights_dtype=torch.float16,
               gpus_gb=GPU_SIZES_GB) -> dict:
    """Everything the chapter's calculator shows for one setting, as plain numbers.

    Returns ``cache_bytes``, ``weights_bytes`` (in ``weights_dtype``), ``total_bytes``, and per GPU
    size (GiB): whether it fits and the largest batch at this ``seq_len`` after the weights.
    """
    cache = kv_cache_bytes(config, seq_len, batch_size, dtype)
    weights = weights_bytes(config, weights_dtype)
    gpus = {}
    for gb in gpus_gb:
        free = gb * GIB - weights
        gpus[gb] = {"fits": cache + weights <= gb * GIB,
                    "max_batch": max_batch_size(config, seq_len, dtype, max(free, 0)) if seq_len else None}
    ctx = context_length(config)
    return {"cache_bytes": cache, "weights_bytes": weights, "total_bytes": cache + weights,
            "per_token_bytes": bytes_per_token(config, dtype), "gpus": gpus,
            "beyond_context": bool(ctx and seq_len > ctx), "context": ctx,
            "weights_dtype": str(as_dtype(weights_dtype)).replace("torch.", "")}


def plot_calculator(result: dict, ax, title: str = "") -> None:
    """Bar chart of a :func:`calculator` result: weights + cache against each GPU's memory."""
    gb = [g for g in result["gpus"]]
    w, c = result["weights_bytes"] / GIB, result["cache_bytes"] / GIB
    ax.bar(["weights + cache"], [w], color="0.6", label="weights")
    ax.bar(["weights + cache"], [c], bottom=[w], color="tab:orange", label="KV cache")
    for g, style in zip(gb, ("--", "-.", ":")):
        ax.axhline(g, color="tab:blue", ls=style, lw=1, label=f"{g} GiB GPU")
    ax.set(ylabel="GiB", title=title)
    ax.set_ylim(0, max(w + c, max(gb)) * 1.1)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))


def calculator_widget(configs: dict, default: str | None = None):
    """An ipywidgets calculator over ``configs`` (name -> config): model, context, batch, dtype.

    Returns the widget box (display it in a live notebook). The logic lives in :func:`calculator`;
    where no widget manager runs (the built book) it displays as its static numbers and chart.
    """
    import base64
    import io

    import ipywidgets as w
    from matplotlib.figure import Figure

    names = list(configs)
    model = w.Dropdown(options=names, value=default or names[0], description="model")
    ctx = w.IntSlider(value=8192, min=256, max=131072, step=256, description="context", continuous_update=False)
    batch = w.IntText(value=1, description="batch")
    dtype = w.Dropdown(options=["fp32", "fp16", "bf16", "int8"], value="fp16", description="cache dtype")
    text = w.HTML()          # the numbers (a widget value: testable without a kernel)
    image = w.Image(format="png")   # the bar chart, as PNG bytes

    def redraw(*_):
        try:
            r = calculator(configs[model.value], ctx.value, max(batch.value, 0), dtype.value)
        except ValueError as e:
            text.value = f"<pre>error: {html.escape(str(e))}</pre>"
            return
        box.result = r
        text.value = "<pre>" + html.escape(calculator_text(model.value, ctx.value, max(batch.value, 0),
                                                           dtype.value, r)) + "</pre>"
        # Render off-screen into the Image widget rather than plt.show() inside an Output widget:
        # no display messages are captured mid-execution, which kept headless runs (nbclient) from
        # occasionally waiting forever for a kernel that had already finished.
        fig = Figure(figsize=(5, 3))
        ax = fig.add_subplot()
        plot_calculator(r, ax, title=f"{model.value}, {ctx.value:,} tokens x {batch.value}")
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=90)
        image.value = buf.getvalue()

    class Calculator(w.VBox):
        def _repr_mimebundle_(self, **kwargs):
            # A live notebook renders the widget; a page without a widget manager (the built book,
            # nbviewer, GitHub) shows this static fallback: the current numbers and chart.
            bundle = super()._repr_mimebundle_(**kwargs)
            png = base64.b64encode(image.value).decode()
            bundle["text/html"] = (f'<div class="kvlab-widget-fallback">{text.value}'
                                   f'<img alt="KV cache and weights against GPU memory" '
                                   f'src="data:image/png;base64,{png}"/></div>')
            return bundle

    box = Calculator([w.HBox([model, dtype]), w.HBox([ctx, batch]), text, image])
    box.text, box.image, box.redraw = text, image, redraw   # handles for tests and for a manual refresh
    for control in (model, ctx, batch, dtype):
        control.observe(redraw, names="value")
    redraw()
    return box


def calculator_text(name: str, seq_len: int, batch_size: int, dtype, r: dict) -> str:
    lines = [f"{name}: {seq_len:,} tokens x batch {batch_size} in {dtype}: KV cache "
             f"{human_bytes(r['cache_bytes'])} ({r['per_token_bytes']:,} bytes per token), "
             f"weights ({r['weights_dtype']}) {human_bytes(r['weights_bytes'])}"]
    if r["beyond_context"]:
        lines.append(f"  (hypothetical: the model's context is {r['context']:,} tokens)")
    for gb, g in r["gpus"].items():
        lines.append(f"  {gb:>3} GiB GPU: {'fits' if g['fits'] else 'does NOT fit'}; "
                     f"largest batch at this context after the weights: {g['max_batch']}")
    return "\n".join(lines)
