"""Measuring quantized caches (chapter 5): the error of each axis and what it costs in quality."""

from __future__ import annotations
import math
import torch
import torch.nn.functional as F


@torch.no_grad()
def cached_kv(gpt, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[n_layer, heads, tokens, head_dim]`` of one prompt (1-D ids), from a
    full-precision cache of the hand-built GPT-2 (:class:`kvlab.gpt2.GPT2`)."""
    cache = gpt.new_cache(1, ids.numel())
    gpt(ids[None], cache)
    return cache.keys[:, 0], cache.values[:, 0]


def channel_ratio(x: torch.Tensor) -> list[float]:
    """Per layer, the largest channel's magnitude over the median channel's (``x``: [L, H, T, D])."""
    per_channel = x.abs().amax(dim=2).flatten(1)          # [L, H * D]: max over tokens
    return (per_channel.max(1).values / per_channel.median(1).values).tolist()


def token_ratio(x: torch.Tensor) -> list[float]:
    """Per layer, the largest token's magnitude over the median token's (max over channels)."""
    per_token = x.abs().amax(dim=3).flatten(1)            # [L, H * T]
    return (per_token.max(1).values / per_token.median(1).values).tolist()


def relative_error(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """``||x - x_hat|| / ||x||``."""
    return ((x_hat - x).norm() / x.norm()).item()


@torch.no_grad()
def score_through_cache(forward, cache, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Teacher-forced scoring through a cache: prefill ``ids[:, :prefill]``, then feed the remaining
    tokens one at a time, as generation would. ``forward(ids, cache) -> logits [B, t, vocab]``.

    Returns log-probabilities ``[B, S, vocab]`` of the predictions for tokens ``prefill .. end``
    (``S = ids.shape[1] - prefill``), in float32.
    """
    out = [forward(ids[:, :prefill], cache)[:, -1:].float().log_softmax(-1)]
    for t in range(prefill, ids.shape[1] - 1):
        out.append(forward(ids[:, t:t + 1], cache).float().log_softmax(-1))
    return torch.cat(out, dim=1)


def agreement(ref_logprobs: torch.Tensor, logprobs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Quality of ``logprobs`` against the full-precision ``ref_logprobs`` on the same ``targets``.

    ``ppl`` / ``ppl_ref``: perplexity of the true next tokens; ``ppl_change``: relative change;
    ``kl``: mean KL(full precision || quantized) of the next-token distributions, in nats;
    ``agree``: fraction of positions where both pick the same top-1 token.
    """
    nll, nll_ref = (-lp.gather(-1, targets[..., None]).mean().item() for lp in (logprobs, ref_logprobs))
    kl = F.kl_div(logprobs, ref_logprobs, log_target=True, reduction="none").sum(-1).mean().item()
    agree = (logprobs.argmax(-1) == ref_logprobs.argmax(-1)).float().mean().item()
    return {"ppl_ref": math.exp(nll_ref), "ppl": math.exp(nll), "ppl_change": math.exp(nll - nll_ref) - 1,
            "kl": max(kl, 0.0), "agree": agree}


@torch.no_grad()
def score_in_rounds(variants: dict, windows: torch.Tensor, prefill: int, per_round: int, budget=None) -> dict:
    """:func:`score_through_cache` for every variant (``name -> (forward, make_cache(rows))``), a round
    of ``per_round`` windows at a time: every variant scores a round's windows (one batch, a fresh
    cache) before the next round starts, so a ``budget`` (:class:`kvlab.timing.Budget`) that stops
    early leaves every variant scored on the same first windows.

    Returns ``{"logprobs": {name: [W, S, vocab]}, "caches": {name: the last round's cache},
    "rows": that round's windows, "windows": W}`` with ``W`` the windows scored."""
    rounds = -(-windows.shape[0] // per_round)
    out = {name: [] for name in variants}
    caches, rows = {}, 0
    for r in (range(rounds) if budget is None else budget.rounds(rounds)):
        chunk = windows[r * per_round:(r + 1) * per_round]
        rows = chunk.shape[0]
        for name, (forward, make_cache) in variants.items():
            caches[name] = make_cache(rows)
            out[name].append(score_through_cache(forward, caches[name], chunk, prefill))
    lps = {name: torch.cat(parts) for name, parts in out.items()}
    return {"logprobs": lps, "caches": caches, "rows": rows, "windows": next(iter(lps.values())).shape[0]}
