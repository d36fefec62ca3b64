"""The serving engine's invariant: every request gets the tokens its prompt would get generated alone.

:func:`reference_tokens` is chapter 3's cached greedy loop on one prompt; :class:`References` computes
it once per distinct request and names the requests of an engine that did not match it.
"""

from __future__ import annotations

import torch

from ..batching import cut_at
from ..gpt2 import generate
from .engine import Engine
from .sampling import sample
from .sequence import Sequence, Status


@torch.no_grad()
def reference_tokens(model, prompt, max_new_tokens: int, eos_token_id=None) -> list[int]:
    """What the hand-built GPT-2 generates for this prompt alone (chapter 3's cached greedy loop)."""

    ids = torch.tensor([list(prompt)], device=model.wte.weight.device)
    return cut_at(generate(model, ids, max_new_tokens)[0, len(prompt):].tolist(), eos_token_id)


@torch.no_grad()
def sampled_reference(model, prompt, max_new_tokens: int, params, offset: int = 0) -> list[int]:
    """What sample ``offset`` of a request with sampling ``params`` draws alone: the whole text through
    the model at every step (no cache, chapter 1's loop), the same sampler, its own generator."""
    ids, gen, out = list(prompt), params.generator(offset), []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids], device=model.wte.weight.device), last_only=True)[0, -1]
        out.append(sample(logits, params, gen))
        ids.append(out[-1])
        if out[-1] in params.stop:
            break
    return out


class References:
    """Each prompt's tokens generated alone, computed once (the invariant is checked on every run)."""

    def __init__(self, model):
        self.model, self.done = model, {}

    def __call__(self, seq: Sequence) -> list[int]:
        key = (seq.prompt, seq.max_new_tokens, seq.eos_token_id)
        if key not in self.done:
            self.done[key] = reference_tokens(self.model, seq.prompt, seq.max_new_tokens, seq.eos_token_id)
        return self.done[key]

    def mismatches(self, eng: Engine) -> list:
        """Ids of the requests that did not finish with their prompt's tokens generated alone."""
        return [s.rid for s in eng.seqs.values() if s.status is not Status.FINISHED or s.output != self(s)]
