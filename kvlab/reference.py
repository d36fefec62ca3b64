"""transformers' own generators: the references every generator of the book is checked against.

Greedy, batch 1: ``input_ids`` is a ``LongTensor [1, T]`` and the result ``[1, T + max_new_tokens]``,
prompt included. Chapter 1's naive generator (no cache), chapter 2's cached one, transformers'
``generate`` itself, and its compiled ``StaticKVCache`` generate (chapter 8).
"""

from __future__ import annotations
import torch
from .validate import check_inputs


@torch.no_grad()
def naive_generate(model, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Greedy decoding with no cache (chapter 1): every step re-runs the whole sequence (O(N^2) positions)."""
    ids = check_inputs(model, input_ids, max_new_tokens)
    for _ in range(max_new_tokens):
        logits = model(ids, use_cache=False).logits       # [1, t, vocab]: all positions recomputed
        next_id = logits[:, -1, :].argmax(dim=-1, keepdim=True)
        ids = torch.cat([ids, next_id], dim=1)
    return ids


@torch.no_grad()
def cached_generate(model, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Greedy decoding with transformers' ``DynamicCache`` (chapter 2): prefill the prompt once, then one
    token a step."""
    from transformers import DynamicCache

    ids = check_inputs(model, input_ids, max_new_tokens)
    if max_new_tokens == 0:
        return ids
    cache = DynamicCache(config=model.config)
    out = model(ids, cache=cache, use_cache=True)          # prefill: every prompt position, once
    next_id = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
    pieces = [ids, next_id]
    for _ in range(max_new_tokens - 1):
        out = model(next_id, cache=cache, use_cache=True)  # decode: one new position; positions
        next_id = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)  # continue from the cache length
        pieces.append(next_id)
    return torch.cat(pieces, dim=1)


@torch.no_grad()
def hf_greedy(model, input_ids: torch.Tensor, max_new_tokens: int, use_cache: bool = True) -> torch.Tensor:
    """transformers' own ``generate`` (greedy), the independent reference the graders trust."""
    ids = check_inputs(model, input_ids, max_new_tokens)
    if max_new_tokens == 0:
        return ids
    # eos_token_id=None: never stop early (our contract is exactly max_new_tokens new tokens);
    # unlike min_new_tokens, it leaves the logits untouched, so every token is the plain argmax.
    return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=max_new_tokens, eos_token_id=None,
                          pad_token_id=model.config.eos_token_id, use_cache=use_cache)


def hf_compile_config(device, backend="inductor", mode: str | None = None):
    """A transformers ``CompileConfig`` for ``generate`` (chapter 8): ``reduce-overhead`` (CUDA
    graphs) on CUDA, inductor's default mode elsewhere. transformers compiles the decode step by itself
    only on accelerators; its private ``_compile_all_devices`` flag, which transformers' own source
    describes as "often not optimal, but useful for testing purposes" on a CPU, asks it to there too. The flag is private: if this transformers release no longer reads it, a RuntimeError
    says so here, rather than ``generate`` running eagerly in a row that claims to be compiled."""
    from transformers import CompileConfig

    device = torch.device(device)
    if mode is None:
        mode = "reduce-overhead" if device.type == "cuda" else "default"
    config = CompileConfig(backend=backend, mode=mode, fullgraph=True, dynamic=False)
    if device.type != "cuda":
        if not honours_compile_all_devices():
            import transformers
            raise RuntimeError(
                f"transformers {transformers.__version__} no longer reads CompileConfig._compile_all_devices, the "
                f"private flag that makes generate compile its decode step on a {device.type}: its 'compiled' row "
                "would run eagerly. Install the release requirements-lab.txt pins (transformers>=5.24,<5.25), or "
                "leave the transformers compiled row out on this device.")
        config._compile_all_devices = True
    return config


def honours_compile_all_devices() -> bool:
    """Whether transformers' CompileConfig has ``_compile_all_devices`` and generate's rule for
    compiling by itself (``GenerationMixin._valid_auto_compile_criteria``) still reads it."""
    import inspect

    from transformers import CompileConfig
    from transformers.generation.utils import GenerationMixin

    rule = getattr(GenerationMixin, "_valid_auto_compile_criteria", None)
    try:
        source = inspect.getsource(rule) if rule is not None else ""
    except (OSError, TypeError):
        source = ""
    return hasattr(CompileConfig, "_compile_all_devices") and "_compile_all_devices" in source


@torch.no_grad()
def hf_static_generate(model, input_ids, max_new_tokens: int, compile_config=None) -> torch.Tensor:
    """transformers' greedy ``generate`` with ``cache_implementation="static"`` (chapter 8); the decode
    step compiled with ``compile_config`` (see :func:`hf_compile_config`), or eager when it is ``None``
    (on a GPU transformers would otherwise compile it on its own). transformers keeps the compiled
    step on the model and compiles again only for a config with other settings, or new shapes."""
    ids = check_inputs(model, input_ids, max_new_tokens)
    if max_new_tokens == 0:
        return ids
    how = {"compile_config": compile_config} if compile_config is not None else {"disable_compile": True}
    return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=max_new_tokens, eos_token_id=None,
                          pad_token_id=model.config.eos_token_id, cache_implementation="static", **how)


def first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """Index (along the last dim) of the first token where ``a`` and ``b`` differ; None if identical,
    0 if their shapes differ."""
    if a.shape != b.shape:
        return 0
    diff = (a.cpu() != b.cpu()).nonzero()
    return None if diff.numel() == 0 else int(diff[0, -1])


def naive_step(model, ids: torch.Tensor):
    """Chapter 1's step as a function to time: the whole prefix ``ids`` through a transformers model,
    no cache, and the next token from the last position's logits."""

    @torch.no_grad()
    def step():
        return model(ids, use_cache=False).logits[:, -1].argmax(-1)
    return step
