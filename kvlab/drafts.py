"""The drafts of speculative decoding (chapter 10): what proposes the next ``k`` tokens.

One small interface, which :func:`kvlab.speculative.speculative_generate` calls::

    draft.start(tokens, max_len, target_cache)   # a new run: the prompt and the first new token
    draft.propose(tokens, k, temperature=0, generator=None) -> (k tokens, q [k, vocab] or None)
    draft.accept(tokens)                         # tokens is the text after the step: drop the rest
    draft.vocab_size, draft.context              # None where it does not apply (prompt lookup)

``q`` is the distribution each token was sampled from (speculative sampling needs it); None means
the draft is deterministic (greedy, or prompt lookup), i.e. ``q`` is one-hot.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn as nn

from .cache import PreallocatedCache
from .validate import is_int as _is_int
from .gpt2 import GPT2


# ---------------------------------------------------------------------------------------------------
# Drafts


class PromptLookupDraft:
    """No model: find the most recent earlier occurrence of the last ``n`` tokens (``n`` from
    ``max_ngram`` down to ``min_ngram``) and propose the tokens that followed it. Nothing to rewind."""

    vocab_size = context = None

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not (_is_int(min_ngram) and _is_int(max_ngram) and 1 <= min_ngram <= max_ngram):
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram!r}, {max_ngram!r}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.name = f"prompt lookup (n-gram {min_ngram}-{max_ngram})"

    def start(self, tokens, max_len, target_cache=None) -> None:
        pass

    def propose(self, tokens: list[int], k: int, temperature: float = 0.0, generator=None):
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):     # most recent match first
                if tokens[start:start + n] == tail:
                    return tokens[start + n:start + n + k], None    # deterministic: q is one-hot
        return [], None

    def accept(self, tokens: list[int]) -> None:
        pass


class ModelDraft:
    """A smaller model of the same tokenizer, with its own cache. Its cache always holds a prefix of
    the text: after a step it is rewound to ``min(its length, len(tokens) - 1)``, i.e. it keeps what
    was accepted, never a rejected draft (nor the bonus token, which it has not seen yet)."""

    def __init__(self, model: GPT2, name: str | None = None):
        self.model = model
        self.vocab_size, self.context = model.config.vocab_size, model.config.n_positions
        self.name = name or getattr(model, "kvlab_name", "draft model")
        self.cache = None

    def start(self, tokens, max_len, target_cache=None) -> None:
        self.cache = self.model.new_cache(1, max_len=max_len)

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        """Run the tokens its cache has not seen; the logits after the last one, ``[vocab]``."""
        new = torch.tensor([tokens[self.cache.seq_len:]], device=self.model.wte.weight.device)
        return self.model(new, self.cache, last_only=True)[0, -1]

    def propose(self, tokens: list[int], k: int, temperature: float = 0.0, generator=None):
        """``k`` tokens continuing ``tokens`` (greedy, or sampled at ``temperature``) and, when
        sampled, the distributions they were drawn from ``[k, vocab]``."""
        logits, out, qs = self._feed(tokens), [], []
        for i in range(k):
            if temperature > 0:
                q = torch.softmax(logits.double() / temperature, dim=-1)
                out.append(int(torch.multinomial(q, 1, generator=generator)))
                qs.append(q)
            else:
                out.append(int(logits.argmax()))
            if i + 1 < k:   # the last drafted token is never fed: only the verify pass needs it
                logits = self._feed(tokens + out)
        return out, (torch.stack(qs) if qs else None)

    def accept(self, tokens: list[int]) -> None:
        self.cache.rewind(min(self.cache.seq_len, len(tokens) - 1))


def first_layers(model: GPT2, m: int) -> GPT2:
    """The target's first ``m`` blocks with its embeddings, final norm and head: shared, not copied."""
    if not _is_int(m) or not 1 <= m < model.config.n_layer:
        raise ValueError(f"a self-draft needs 1 <= layers < {model.config.n_layer} (the target's), got {m!r}")
    with torch.device("meta"):   # build the shell without allocating weights, then share the target's
        draft = GPT2(replace(model.config, n_layer=m), model.attention_fn)
    draft.wte, draft.wpe, draft.ln_f = model.wte, model.wpe, model.ln_f
    draft.h = nn.ModuleList(list(model.h)[:m])
    draft.kvlab_name = f"{getattr(model, 'kvlab_name', 'target')}[:{m} layers]"
    return draft.eval()


def share_first_layers(cache: PreallocatedCache, m: int) -> PreallocatedCache:
    """A cache whose layers ARE the first ``m`` layers of ``cache`` (views of the same buffers), with
    its own length: self-speculation's shared cache (chapter 10). The target has already written
    those layers for every token it verified."""
    view = PreallocatedCache.__new__(PreallocatedCache)
    view.__dict__.update(cache.__dict__)
    view.n_layer, view.keys, view.values = m, cache.keys[:m], cache.values[:m]
    view._len, view._checked_model = cache.seq_len, False
    return view


class SelfDraft(ModelDraft):
    """Self-speculation: the target's first ``m`` layers draft (:func:`first_layers`).

    Sharing: on a :class:`PreallocatedCache` the draft's cache is a view of the target's first ``m``
    layers (:func:`share_first_layers`). Every token the target has verified already sits there, so
    the draft never prefills and never catches up: before proposing, its length is simply set to the
    target's. Its own writes land in the target's slots past the target's length, which the next
    verify pass overwrites before reading them; so only the target's length needs a rewind, and the
    draft's next length comes from it. No second copy of those layers' keys and values, and none of
    their compute for the prompt. On other caches it keeps its own cache (a :class:`ModelDraft`)."""

    def __init__(self, target: GPT2, m: int, share: bool = True):
        super().__init__(first_layers(target, m))
        self.share, self.shared, self.m = share, False, m
        self.name = f"self-draft ({m} of {target.config.n_layer} layers)"

    def start(self, tokens, max_len, target_cache=None) -> None:
        self.shared = self.share and type(target_cache) is PreallocatedCache
        self.target_cache = target_cache
        if not self.shared:
            super().start(tokens, max_len)

    def propose(self, tokens, k, temperature=0.0, generator=None):
        if self.shared:
            self.cache = share_first_layers(self.target_cache, self.m)   # the target's length, its slots
        return super().propose(tokens, k, temperature, generator)

    def accept(self, tokens) -> None:
        if not self.shared:
            super().accept(tokens)
