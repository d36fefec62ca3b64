"""Speculative decoding (chapter 10): draft k tokens cheaply, verify them in ONE target forward, keep
the longest prefix the target agrees with plus the target's own next token, and rewind every cache.

The invariant of every loop here: the target's cache holds all tokens but the last (``seq_len ==
len(tokens) - 1``); the last token is *pending*, the first input of the next forward. A step feeds
``[pending, d1 .. dk]`` at positions ``L-1 .. L-1+k`` (``L = len(tokens)``). Logit row ``i`` is the
target's prediction after input ``i``, so the draft token ``d(i+1)`` is accepted while it equals row
``i``'s choice. With ``n`` accepted, the step emits ``d1 .. dn`` and the target's row-``n`` token (the
*bonus*: a correction after a rejection, a free extra token when all ``k`` were accepted), and the
cache is rewound to ``L + n``: the pending token and the accepted drafts stay, the rejected ones go,
and the bonus becomes the new pending token. Every cache of the book has ``rewind(length)``;
transformers' ``DynamicCache`` rewinds with ``crop(-count)`` (:class:`HFCache`).

Drafts (all offline, one small interface: ``start``, ``propose``, ``accept``):

* :class:`PromptLookupDraft`: the tokens that followed the last earlier occurrence of the text's
  trailing n-gram (no model; what transformers' ``prompt_lookup_num_tokens`` does);
* :class:`ModelDraft`: a small model with its own cache (``kvlab-nano`` for ``kvlab-tiny``; distilgpt2
  for gpt2-medium where the Hub is reachable), rewound to what was accepted;
* :class:`SelfDraft`: the target's first ``m`` layers plus its final norm and head. On a
  :class:`~kvlab.cache.PreallocatedCache` it writes into the target's own buffers for those layers.

Speculative sampling (Leviathan et al., Chen et al., 2023): :func:`accept_or_resample`. Ties: a
verify pass computes ``k+1`` rows in one matrix product, plain decoding one row at a time; the sums
may differ in the last bits, so two near-tied logits can swap. The book's equality checks run in
float64 (where no tie of the bundled models comes near that), see ``tests/test_speculative.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .batching import cut_at
from .cache import SlidingWindowKVCache
from .pastlen import PastLenCache
from .validate import check_context, check_inputs, is_int as _is_int
from .gpt2 import GPT2
from .drafts import ModelDraft, PromptLookupDraft, SelfDraft, first_layers, share_first_layers  # noqa: F401

# ---------------------------------------------------------------------------------------------------
# Checks at the boundary


def check_k(k) -> int:
    if not _is_int(k) or k < 1:
        raise ValueError(f"k (tokens drafted per step) must be an int >= 1, got {k!r}; k=1 already "
                         "verifies one drafted token per target step")
    return int(k)


def vocab_of(model) -> int:
    cfg = model.config
    return getattr(cfg, "vocab_size")


def context_of(model) -> int:
    cfg = model.config
    return getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings")


def check_draft(target, draft, total_len: int) -> None:
    """The draft must speak the target's vocabulary and fit the whole run in its own context."""
    vocab = getattr(draft, "vocab_size", None)
    if vocab is not None and vocab != vocab_of(target):
        raise ValueError(f"the draft has a vocabulary of {vocab} tokens, the target {vocab_of(target)}: a "
                         "draft must share the target's tokenizer (token ids mean the same text)")
    check_context(total_len, getattr(draft, "context", None), "the run in the draft (prompt + max_new_tokens)",
                  fix="use a draft with a longer context, or generate less")


def check_same_tokenizer(tok_a, tok_b) -> None:
    """Two tokenizers that map every token string to the same id (a draft's and its target's)."""
    if tok_a.get_vocab() != tok_b.get_vocab():
        raise ValueError("the draft's tokenizer differs from the target's (same size or not, the ids do not "
                         "mean the same text): pick a draft trained with the target's tokenizer")


def check_rewindable(cache) -> None:
    """Refuse, before any work, a cache that cannot forget rejected tokens."""
    if isinstance(cache, PastLenCache) or not hasattr(cache, "rewind"):
        raise ValueError(f"a {type(cache).__name__} cannot rewind(length): speculation must drop rejected "
                         "tokens; use a kvlab cache (PreallocatedCache, StaticKVCache, PagedCache) or HFCache")
    if isinstance(cache, SlidingWindowKVCache):
        raise ValueError("a sliding-window cache drops old tokens and then cannot rewind past them: use a "
                         "PreallocatedCache for speculative decoding")


# ---------------------------------------------------------------------------------------------------
# The target: the hand-built GPT-2, or a transformers model with a DynamicCache


class HFCache:
    """transformers' ``DynamicCache`` behind kvlab's ``seq_len`` / ``rewind(length)``.

    ``DynamicCache.crop`` takes a *negative count*: ``crop(-3)`` drops the last three tokens, while a
    positive argument is refused (in transformers 5; older versions read it as the length to keep).
    So a rewind to ``length`` drops ``seq_len - length`` tokens, and dropping none must not call
    ``crop(-0)``, which is ``crop(0)``."""

    def __init__(self, config=None):
        from transformers import DynamicCache
        self.inner = DynamicCache(config=config) if config is not None else DynamicCache()

    @property
    def seq_len(self) -> int:
        return self.inner.get_seq_length()

    def rewind(self, length: int) -> None:
        drop = self.seq_len - length
        if not _is_int(length) or drop < 0 or length < 0:
            raise ValueError(f"rewind length must be an int between 0 and {self.seq_len}, got {length!r}")
        if drop:
            self.inner.crop(-drop)

    def reset(self) -> None:
        self.rewind(0)


def new_cache(model, max_len: int):
    """An empty cache for ``model``: a :class:`PreallocatedCache` for ours, an :class:`HFCache` otherwise."""
    return model.new_cache(1, max_len=max_len) if isinstance(model, GPT2) else HFCache(model.config)


def logits_of(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """Logits ``[T, vocab]`` of ``ids [1, T]`` continuing ``cache``, for either kind of model."""
    if isinstance(model, GPT2):
        return model(ids, cache)[0]
    inner = cache.inner if isinstance(cache, HFCache) else cache
    return model(input_ids=ids, cache=inner, use_cache=True).logits[0]


# ---------------------------------------------------------------------------------------------------
# Greedy: verify, accept, rewind


@dataclass
class SpecStats:
    """What a run did: per target step, the tokens drafted and the drafts accepted."""

    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.drafted)

    @property
    def tried(self) -> int:
        """Drafts the target really judged: a step that rejects tried ``n + 1``, one that accepts all
        ``k`` tried ``k`` (the drafts after a rejection were never compared)."""
        return sum(n + (n < d) for d, n in zip(self.drafted, self.accepted))

    @property
    def alpha(self) -> float:
        """Per-token acceptance rate, the estimate the theory's formula wants: accepted over *tried*
        (a step stops at its first rejection, so accepted / drafted would come out too low)."""
        return sum(self.accepted) / self.tried if self.tried else float("nan")

    @property
    def tokens_per_step(self) -> float:
        """Tokens emitted per target forward after the prefill (accepted drafts + the bonus)."""
        return (sum(self.accepted) + self.steps) / self.steps if self.steps else float("nan")


def verify(model, cache, tokens: list[int], drafted: list[int]) -> list[int]:
    """One target step (the lab's exercise; this is the library's): feed the pending token and the
    drafts, accept the agreeing prefix, add the target's own next token, rewind. Returns the new tokens."""
    L = len(tokens)
    check_context(L + len(drafted), context_of(model), f"{L} tokens + {len(drafted)} drafted",
                  fix="draft at most the context left minus one (the target's own token needs a position)")
    x = torch.tensor([[tokens[-1], *drafted]], device=next(model.parameters()).device)
    choice = logits_of(model, x, cache).argmax(dim=-1).tolist()    # row i: the target's token after x[i]
    n = 0
    while n < len(drafted) and drafted[n] == choice[n]:
        n += 1
    cache.rewind(L + n)          # keep the pending token and the n accepted drafts; drop the rest
    return drafted[:n] + [choice[n]]


def _prepare(model, input_ids, max_new_tokens, draft, k, cache):
    ids = check_inputs(model, input_ids, max_new_tokens)
    k = check_k(k)
    check_draft(model, draft, ids.shape[1] + max_new_tokens)
    cache = new_cache(model, ids.shape[1] + max_new_tokens) if cache is None else cache
    check_rewindable(cache)
    cache.reset()
    return ids, k, cache


@torch.no_grad()
def speculative_generate(model, input_ids, max_new_tokens: int, draft, k: int = 4, cache=None,
                         eos_token_id: int | None = None, step=verify):
    """Greedy speculative decoding: the same tokens as plain greedy decoding (``[1, T + new]``, fewer if
    ``eos_token_id`` is emitted), in fewer target forwards. Returns ``(ids, SpecStats)``. ``step`` is
    the verify-accept-rewind function (the lab passes the learner's)."""
    ids, k, cache = _prepare(model, input_ids, max_new_tokens, draft, k, cache)
    T, end = ids.shape[1], ids.shape[1] + max_new_tokens
    tokens, stats = ids[0].tolist(), SpecStats()
    if max_new_tokens:
        tokens.append(int(logits_of(model, ids, cache)[-1].argmax()))   # prefill: the first new token
        draft.start(tokens, end, cache)
    while T < len(tokens) < end and tokens[-1] != eos_token_id:
        room = min(k, end - len(tokens) - 1)     # a step emits up to room + 1 tokens: never past the end
        drafted = draft.propose(tokens, room)[0][:room] if room else []
        new = step(model, cache, tokens, drafted)
        stats.drafted.append(len(drafted))
        stats.accepted.append(len(new) - 1)
        new = cut_at(new, eos_token_id)             # generation ends at EOS: drafts after it are not emitted
        tokens += new
        draft.accept(tokens)
    if cache.seq_len > len(tokens) - 1:      # an EOS inside the accepted drafts: forget what followed
        cache.rewind(len(tokens) - 1)
    return torch.tensor([tokens], device=ids.device), stats


@torch.no_grad()
def greedy_reference(model, input_ids, max_new_tokens: int, eos_token_id: int | None = None, cache=None):
    """Plain greedy decoding, one target forward per token, stopping after ``eos_token_id``."""
    ids = check_inputs(model, input_ids, max_new_tokens)
    cache = new_cache(model, ids.shape[1] + max_new_tokens) if cache is None else cache
    cache.reset()
    tokens, x = ids[0].tolist(), ids
    for _ in range(max_new_tokens):
        tokens.append(int(logits_of(model, x, cache)[-1].argmax()))
        if tokens[-1] == eos_token_id:
            break
        x = torch.tensor([tokens[-1:]], device=ids.device)
    return torch.tensor([tokens], device=ids.device)


# ---------------------------------------------------------------------------------------------------
# Speculative sampling


def accept_or_resample(p: torch.Tensor, q: torch.Tensor | None, drafted: list[int], generator=None) -> list[int]:
    """The rejection rule of speculative sampling. ``p`` ``[k+1, V]``: the target's distributions after
    the pending token and each draft; ``q`` ``[k, V]``: the ones the draft sampled from (None: the
    draft was deterministic, q one-hot). Draft ``i`` is kept with probability ``min(1, p/q)``; at the
    first rejection the token is drawn from ``norm(max(0, p - q))``; if all are kept, from ``p[k]``.
    The emitted tokens are then distributed exactly as the target's own samples."""
    for i, d in enumerate(drafted):
        qi = q[i] if q is not None else torch.nn.functional.one_hot(torch.tensor(d), p.shape[-1]).to(p)
        if float(torch.rand((), generator=generator, dtype=p.dtype)) < min(1.0, float(p[i, d] / qi[d])):
            continue
        residual = (p[i] - qi).clamp(min=0)
        return drafted[:i] + [int(torch.multinomial(residual / residual.sum(), 1, generator=generator))]
    return list(drafted) + [int(torch.multinomial(p[len(drafted)], 1, generator=generator))]


@torch.no_grad()
def speculative_sample(model, input_ids, max_new_tokens: int, draft, k: int = 4, temperature: float = 1.0,
                       generator=None, cache=None):
    """Speculative sampling at ``temperature``: every token distributed as the target's own sample."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for sampling (greedy: speculative_generate), got {temperature!r}")
    ids, k, cache = _prepare(model, input_ids, max_new_tokens, draft, k, cache)
    T, end = ids.shape[1], ids.shape[1] + max_new_tokens
    tokens, stats = ids[0].tolist(), SpecStats()
    probs = lambda x: torch.softmax(logits_of(model, x, cache).double() / temperature, dim=-1)  # noqa: E731
    if max_new_tokens:
        tokens.append(int(torch.multinomial(probs(ids)[-1], 1, generator=generator)))
        draft.start(tokens, end, cache)
    while T < len(tokens) < end:
        room = min(k, end - len(tokens) - 1)
        drafted, q = draft.propose(tokens, room, temperature, generator) if room else ([], None)
        drafted, q = drafted[:room], (q[:room] if q is not None else None)
        L = len(tokens)
        p = probs(torch.tensor([[tokens[-1], *drafted]], device=ids.device))
        new = accept_or_resample(p, q, drafted, generator)
        cache.rewind(L + len(new) - 1)
        stats.drafted.append(len(drafted))
        stats.accepted.append(len(new) - 1)
        tokens += new
        draft.accept(tokens)
    return torch.tensor([tokens], device=ids.device), stats
