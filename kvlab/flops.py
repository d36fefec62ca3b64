"""What a forward pass computes (chapter 1): positions processed and FLOPs, counted from a config."""

from __future__ import annotations
from .validate import check_counts


def positions_processed_naive(prompt_len: int, new_tokens: int) -> int:
    """Token-positions a naive generator pushes through the model: T + (T+1) + ... + (T+N-1)."""
    check_counts(prompt_len=prompt_len, new_tokens=new_tokens)
    return sum(prompt_len + i for i in range(new_tokens))


def positions_processed_cached(prompt_len: int, new_tokens: int) -> int:
    """With a cache: the prompt once, then one position per further token."""
    check_counts(prompt_len=prompt_len, new_tokens=new_tokens)
    return prompt_len + max(new_tokens - 1, 0) if new_tokens else 0


def forward_flops(config, n_new: int, n_past: int = 0, all_logits: bool = True) -> int:
    """Multiply-add FLOPs (2 per multiply-accumulate) of one GPT-2 forward over ``n_new`` positions
    that attend to ``n_past`` cached ones as well.

    Per layer: q/k/v projection 6nd^2, output projection 2nd^2, MLP 16nd^2 (so 24nd^2 in the linear
    layers), attention scores and weighted sum 2 x 2nd(n_past + n) (a dense kernel scores the full
    rectangle, masked or not). The LM head costs 2dV per position whose logits are computed
    (transformers computes all of them unless told otherwise). Embeddings, norms and softmax are
    left out: they are a few percent at most.
    """
    check_counts(n_new=n_new, n_past=n_past)
    d, L, V = config.n_embd, config.n_layer, config.vocab_size
    n, t = n_new, n_past + n_new
    per_layer = 24 * n * d * d + 4 * n * t * d
    head_positions = n if all_logits else 1
    return L * per_layer + 2 * head_positions * d * V
