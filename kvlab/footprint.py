"""Measuring memory (chapters 2 and 4): what tensors really hold, to check the arithmetic against.

    measured_cache_bytes(cache)          # bytes held by a cache's tensors (transformers' or kvlab's)
    fill_dynamic_cache(model, T, B)      # a real DynamicCache holding T tokens of B sequences
    measure_config(config, T, B, dtype)  # the same for a random-weight model built from a config
    with TensorMemoryTracker() as mem:   # peak and current bytes allocated inside the block
        ...
    saved_for_backward_bytes(fn)         # bytes autograd keeps for a backward pass

The formula these are compared with is in ``kvlab.memory``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping

import torch

from .cache import tensor_bytes
from .configs import as_dtype, model_from_json
from .validate import check_count, check_int

#: Per-layer bookkeeping that is not cached keys/values: int64 scalars holding StaticKVCache's write
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


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Identifies the buffer behind ``t``: two views of one buffer share a key."""
    return str(t.device), t.untyped_storage().data_ptr()


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view counts its whole storage, once)."""
    seen, total = set(), 0
    for t in tensors:
        try:
            key, size = _storage_key(t), t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):   # exotic tensor subclasses
            key, size = (str(t.device), id(t)), tensor_bytes(t)
        if key not in seen:
            seen.add(key)
            total += size
    return total


def measured_cache_bytes(cache) -> int:
    """Bytes of tensor storage a cache holds right now, read from the tensors themselves.

    Works for a transformers ``Cache`` (walks every layer's tensors: ``keys``, ``values``, and the
    quantized copies and scales of quantized layers; skips scalar bookkeeping such as ``StaticKVCache``'s
    write position), a kvlab cache (walks its tensor attributes, less the positions it keeps, its
    ``bookkeeping``: 8 bytes a token, not keys or values), or a list/tuple of tensors.
    Storage is counted once per distinct buffer, whole: a view of a bigger buffer counts the buffer.
    """
    if isinstance(cache, (list, tuple, torch.Tensor)):
        return _storage_bytes(_tensors(cache))
    from transformers.cache_utils import Cache as HFCache

    if isinstance(cache, HFCache):   # transformers' caches: a list of per-layer objects
        return _storage_bytes(t for layer in cache.layers for name, value in vars(layer).items()
                              if name not in _BOOKKEEPING for t in _tensors(value))
    if hasattr(cache, "nbytes") and hasattr(cache, "update"):            # a kvlab cache
        skip = getattr(cache, "bookkeeping", ())                          # positions, not keys/values
        return _storage_bytes(t for name, value in vars(cache).items() if name not in skip
                              for t in _tensors(value))
    raise ValueError(f"don't know how to read the tensors of a {type(cache).__name__}; pass a "
                     "transformers Cache, a kvlab cache, or a list of tensors")


@torch.no_grad()
def fill_dynamic_cache(model, seq_len: int, batch_size: int, decode_steps: int = 2, seed: int = 0):
    """Run ``model`` (a transformers causal LM) over random tokens: a prefill of ``seq_len -
    decode_steps`` tokens, then ``decode_steps`` one-token steps, all into one ``DynamicCache``.
    Returns the cache, holding ``seq_len`` tokens per sequence (what the formula's ``seq_len`` means)."""
    from transformers import DynamicCache

    seq_len, batch_size = check_count(seq_len, "seq_len"), check_int(batch_size, "batch_size")
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
    torch.manual_seed(0)
    return model_from_json(config_json, model_type, dtype=dtype).eval()


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
    """Current and peak bytes of tensor storage *allocated inside* a ``with`` block, on any device
    (chapter 2; chapter 4 uses it too).

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
                inputs = {_storage_key(t) for t in tree_flatten((args, kwargs))[0]
                          if isinstance(t, torch.Tensor)}
                for t in tree_flatten(out)[0]:
                    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                        continue
                    st, key = t.untyped_storage(), _storage_key(t)
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
        storages[_storage_key(t)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, sum(storages.values())
