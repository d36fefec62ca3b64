"""Sampling parameters per request, and the one sampler (chapter 9).

A request may ask for greedy decoding (``temperature=0``, the default and what the equivalence tests
use) or for sampling: the logits divided by ``temperature``, cut to the ``top_k`` most likely tokens
and to the smallest set whose probability reaches ``top_p``, then one draw. ``seed`` gives the
request its own random generator, so its tokens do not depend on what it was batched with: the same
request with the same seed gives the same tokens, alone or in any batch. ``stop`` ends it on any of
those tokens; ``n`` asks for that many samples of the prompt, which share the prompt's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..validate import check_int


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0          # 0: greedy (argmax)
    top_k: int = 0                    # 0: no cut
    top_p: float = 1.0                # 1: no cut
    seed: int | None = None           # None: a generator seeded from torch's global one
    stop: tuple[int, ...] = ()        # tokens that end the request (kept in its output)
    n: int = 1                        # samples of the prompt

    def __post_init__(self):
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a number >= 0 (0: greedy), got {self.temperature!r}")
        check_int(self.top_k, "top_k (0: keep every token)", 0)
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            check_int(self.seed, "seed", 0)
        check_int(self.n, "n (samples of the prompt)", 1)
        if not isinstance(self.stop, tuple) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in self.stop):
            raise ValueError(f"stop must be a tuple of token ids, got {self.stop!r}")

    def generator(self, offset: int = 0) -> torch.Generator | None:
        """The request's own generator (sample ``offset`` of ``n`` gets ``seed + offset``)."""
        if self.temperature == 0:
            return None
        seed = self.seed if self.seed is not None else int(torch.randint(2 ** 62, ()).item())
        return torch.Generator().manual_seed(seed + offset)


def is_greedy(params: SamplingParams | None) -> bool:
    """Whether ``params`` asks for the argmax (no parameters, or temperature 0)."""
    return params is None or params.temperature == 0


def sample(logits: torch.Tensor, params: SamplingParams | None, generator: torch.Generator | None) -> int:
    """One token from one row of logits ``[vocab]``: argmax when greedy, else one draw from the
    tempered distribution cut by top-k and top-p (on the CPU, so a seed means the same on any device)."""
    if is_greedy(params):
        return int(logits.argmax())
    x = logits.detach().float().cpu() / params.temperature
    if params.top_k:
        kth = torch.topk(x, min(params.top_k, x.numel())).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1:
        order = torch.argsort(x, descending=True)
        before = torch.softmax(x[order], -1).cumsum(-1) - torch.softmax(x[order], -1)   # mass above each token
        x[order[before >= params.top_p]] = float("-inf")                               # the first always stays
    return int(torch.multinomial(torch.softmax(x, -1), 1, generator=generator))
