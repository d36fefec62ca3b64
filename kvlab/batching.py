"""Batched greedy generation with a KV cache: padding, the attention mask and position ids.

Prompts of different lengths go through the model together as one ``[B, T]`` tensor, padded to the
longest. Three things make each row's tokens equal to generating that prompt alone (chapter 6 shows
each one failing when it is left out):

* **left padding**: every row's last real token sits in the last column, the one the next token is
  read from, and the new tokens of all rows append as one new column;
* **the attention mask** (1 = real token, 0 = pad): no real token may attend to a pad. It describes
  every position the cache holds, so it grows by one column per decode step;
* **position ids from the mask**: a row with ``k`` pads has its first real token in column ``k``
  but at position 0, so positions are counted over real tokens only (``mask.cumsum(-1) - 1``).

    input_ids, attention_mask, position_ids = make_batch(tokenizer, prompts)
    new_tokens = batched_generate(model, tokenizer, prompts, max_new_tokens)   # list of lists
"""

from __future__ import annotations

import torch

from .validate import check_budget, check_ids
from .cache import EMPTY
from .reference import cached_generate


def pad_token_id(tokenizer) -> int:
    """The id to pad with: the tokenizer's pad token, else its end-of-text (eos) token.

    Real GPT-2's tokenizer has no pad token (``tokenizer.pad_token is None``), and asking it to pad
    raises. Padding with eos is the usual fix and is safe: pads are masked out, so no real token ever
    attends to them and their logits are never read; any id the model can embed would do. Adding a
    new ``[PAD]`` token would be worse: the model has no trained embedding for it.
    """
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    if tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    raise ValueError("the tokenizer has neither a pad token nor an eos token; set tokenizer.pad_token "
                     "to a token the model already knows before batching")


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch: 0, 1, 2, ... over each row's real tokens.

    ``cumsum - 1`` counts the real tokens before each column; on the left pads it gives -1, which we
    clamp to 0 (transformers 5.24's ``generate`` writes 0 there too, with ``masked_fill``). The value is irrelevant as long as
    it is a valid index into the position embedding: no real token attends to a pad, and a pad's own
    logits are never read.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def make_batch(tokenizer, prompts, device=None):
    """Tokenize ``prompts`` (a list of strings) into one left-padded batch.

    Returns ``(input_ids, attention_mask, position_ids)``, each a ``LongTensor [B, T]`` where ``T`` is
    the longest prompt in tokens: pads (see :func:`pad_token_id`) on the left with mask 0, the prompt's
    tokens on the right with mask 1 and positions ``0 .. len - 1``. The tokenizer is not modified.
    """
    if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a list of strings, got {type(prompts).__name__}; "
                         "for one prompt pass [prompt]")
    if not prompts:
        raise ValueError("prompts is empty: a batch needs at least one prompt")
    rows = []
    for i, text in enumerate(prompts):
        if not isinstance(text, str):
            raise ValueError(f"prompt {i} is a {type(text).__name__}, not a string")
        ids = tokenizer(text).input_ids
        if len(ids) == 0:
            raise ValueError(f"prompt {i} is empty (0 tokens): its row would be all pads, with no token "
                             "to read the next one from; start it with the bos/eos token instead")
        rows.append(ids)
    pad = pad_token_id(tokenizer)
    B, T = len(rows), max(len(r) for r in rows)
    input_ids = torch.full((B, T), pad, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    for i, ids in enumerate(rows):
        input_ids[i, T - len(ids):] = torch.tensor(ids, dtype=torch.long)   # left padding
        attention_mask[i, T - len(ids):] = 1
    position_ids = positions_from_mask(attention_mask)
    return input_ids.to(device), attention_mask.to(device), position_ids.to(device)


def _check_batch(model, input_ids, attention_mask, max_new_tokens) -> None:
    check_ids(input_ids, batched=True, hint="build it with make_batch")
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        got = list(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask must have the shape of input_ids {list(input_ids.shape)}, got {got}")
    if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise ValueError("attention_mask must hold only 0 (pad) and 1 (real token)")
    lengths = attention_mask.sum(-1)
    if bool((lengths == 0).any()):
        raise ValueError(f"row {int((lengths == 0).nonzero()[0])} of attention_mask is all zeros: a prompt "
                         "needs at least one real token")
    # Left padding: once a row's mask turns to 1 it stays 1, so every row's last column is real.
    if bool((attention_mask[:, 1:] < attention_mask[:, :-1]).any()):
        raise ValueError("the batch is not left-padded (a 0 follows a 1 in attention_mask): the next token is "
                         "read from the last column, which must hold every row's last real token")
    check_budget(model, int(lengths.max()), max_new_tokens, what=f"prompt {int(lengths.argmax())}")


@torch.no_grad()
def generate_batch(model, input_ids, attention_mask, max_new_tokens: int, eos_token_id=None, pad_id=None):
    """Greedy new tokens for a left-padded batch, one forward per step with a ``DynamicCache`` (chapter 6).

    Returns a ``LongTensor [B, n]`` of new tokens, ``n = max_new_tokens`` unless ``eos_token_id`` is
    given and every row has produced it (then generation stops early). A row that has finished is fed
    ``pad_id`` from then on (it must stay in the batch: the cache is one tensor per layer) and its
    later columns hold ``pad_id``.
    """
    from transformers import DynamicCache

    _check_batch(model, input_ids, attention_mask, max_new_tokens)
    device = next(model.parameters()).device
    ids, mask = input_ids.to(device), attention_mask.to(device).long()
    B = ids.shape[0]
    if max_new_tokens == 0:
        return ids.new_zeros((B, 0))
    if eos_token_id is not None and pad_id is None:
        pad_id = eos_token_id
    cache = DynamicCache(config=model.config)
    # Prefill: the whole padded batch once; the mask hides the pads, positions count real tokens.
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask),
                cache=cache, use_cache=True)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    columns = []
    for step in range(max_new_tokens):
        next_ids = out.logits[:, -1, :].argmax(dim=-1)       # left padding: column -1 is real in every row
        if eos_token_id is not None:
            next_ids = torch.where(done, torch.full_like(next_ids, pad_id), next_ids)
            done |= next_ids == eos_token_id
        columns.append(next_ids)
        if step == max_new_tokens - 1 or bool(done.all()):
            break                                            # the last token needs no forward pass
        # Decode: one token per row. The cache now holds one more column, so the mask grows by a
        # column of ones (the new tokens are real), and each row's position is its real-token count - 1.
        mask = torch.cat([mask, mask.new_ones((B, 1))], dim=1)
        position_ids = mask.sum(dim=-1, keepdim=True) - 1
        out = model(input_ids=next_ids[:, None], attention_mask=mask, position_ids=position_ids,
                    cache=cache, use_cache=True)
    return torch.stack(columns, dim=1)


def positions_with_pads(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions of a left-padded batch for the hand-built GPT-2: like :func:`positions_from_mask`, but
    a pad gets ``kvlab.cache.EMPTY`` (-1), so the cache stores it at a position no query ever sees:
    the pads are data, not a mask of their own."""

    return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, EMPTY)


@torch.no_grad()
def generate_padded(model, input_ids, attention_mask, max_new_tokens: int, cache=None) -> torch.Tensor:
    """Greedy new tokens ``[B, max_new_tokens]`` of a left-padded batch through the hand-built GPT-2
    (:class:`kvlab.gpt2.GPT2`) and its one forward: the pads go in at position ``EMPTY``, every row's
    real tokens at ``0, 1, 2, ...``; each decode step continues every row from its own last position.
    ``cache`` (reset first) defaults to a :class:`kvlab.cache.PreallocatedCache` just big enough."""
    _check_batch(model, input_ids, attention_mask, max_new_tokens)
    device = model.wte.weight.device
    ids, mask = input_ids.to(device), attention_mask.to(device)
    B, T = ids.shape
    cache = cache if cache is not None else model.new_cache(B, max_len=T + max_new_tokens)
    cache.reset()
    positions = positions_with_pads(mask)
    logits = model(ids, cache, positions=positions, last_only=True)       # prefill, pads included
    new = ids.new_empty(B, max_new_tokens)
    nxt = positions[:, -1:] + 1                                          # left padding: column -1 is real
    for t in range(max_new_tokens):
        new[:, t] = logits[:, -1].argmax(dim=-1)
        if t + 1 < max_new_tokens:
            logits = model(new[:, t:t + 1], cache, positions=nxt, last_only=True)
            nxt = nxt + 1
    return new


def batched_generate(model, tokenizer, prompts, max_new_tokens: int, stop_at_eos: bool = False) -> list[list[int]]:
    """Greedy new token ids of each prompt, computed for all prompts together.

    Equal, token for token, to generating each prompt alone (``kvlab.reference.cached_generate``).
    With ``stop_at_eos`` a row stops at the tokenizer's end-of-text token (kept as its last token)
    and the whole batch stops once every row has; otherwise each row gets ``max_new_tokens`` tokens.
    """
    device = next(model.parameters()).device
    input_ids, attention_mask, _ = make_batch(tokenizer, prompts, device)
    eos = None
    if stop_at_eos:
        if tokenizer.eos_token_id is None:
            raise ValueError("stop_at_eos needs a tokenizer with an eos token")
        eos = int(tokenizer.eos_token_id)
    new = generate_batch(model, input_ids, attention_mask, max_new_tokens,
                         eos_token_id=eos, pad_id=pad_token_id(tokenizer)).tolist()
    return [cut_at(row, eos) for row in new]


def cut_at(tokens: list[int], eos) -> list[int]:
    """``tokens`` up to and including the first ``eos`` (all of them if ``eos`` is None or absent)."""
    if eos is not None and eos in tokens:
        return tokens[:tokens.index(eos) + 1]
    return tokens


def one_by_one(model, tokenizer, prompts, max_new_tokens: int, stop_at_eos: bool = False) -> list[list[int]]:
    """The reference batching must reproduce: each prompt alone through ``cached_generate``."""

    device = next(model.parameters()).device
    eos = tokenizer.eos_token_id if stop_at_eos else None
    out = []
    for text in prompts:
        ids = tokenizer(text, return_tensors="pt").input_ids.to(device)
        new = cached_generate(model, ids, max_new_tokens)[0, ids.shape[1]:].tolist()
        out.append(cut_at(new, eos))
    return out


def pad_fraction(attention_mask: torch.Tensor) -> float:
    """Share of a padded batch's positions that are pads (work spent on nothing)."""
    return float((attention_mask == 0).float().mean())
