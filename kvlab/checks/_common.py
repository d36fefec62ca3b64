"""Shared helpers for the graders: the grading model, fresh prompts, pass messages."""

from __future__ import annotations

import functools

import torch

# Prompts a learner has not seen in the notebooks (graders must not be passable by memorising).
GRADER_TEXTS = [
    "And the LORD spake unto Moses in the wilderness, saying,",
    "Behold, the days come",
    "Now when the king heard these words, he rent his clothes, and",
    "Blessed",
    "For the wages of sin is death; but the gift",
    "And it came to pass after these things, that the men of the city gathered together at the gate "
    "and said unto him, Where are they which came in to thee this night?",
]


@functools.lru_cache(maxsize=2)
def grading_model(name: str = "kvlab-tiny"):
    """The model graders run on: the bundled one (offline, fast, deterministic), fp32, CPU."""
    from ..models import load

    torch.manual_seed(0)
    return load(name, device="cpu", dtype=torch.float32)


def fresh_prompts(tok, lengths=None) -> list[torch.Tensor]:
    """Grader prompts of several lengths, each ``[1, T]`` (lengths ``T`` from 1 up)."""
    prompts = [tok(t, return_tensors="pt").input_ids for t in GRADER_TEXTS]
    if lengths is not None:
        # plus synthetic prompts of the given lengths (token ids spread over the vocabulary)
        prompts += [torch.tensor([[(37 * i + 11 + n) % tok.vocab_size for i in range(n)]]) for n in lengths]
    return prompts


def passed(check: str, detail: str) -> None:
    print(f"PASSED {check}: {detail}")


def fail(check: str, message: str) -> AssertionError:
    return AssertionError(f"{check} FAILED: {message}")


def first_difference(a: torch.Tensor, b: torch.Tensor) -> int:
    """Index of the first differing element of two 1-D tensors of equal length (-1 if equal)."""
    diff = (a != b).nonzero()
    return int(diff[0]) if diff.numel() else -1


def check_generated_ids(check: str, out, prompt: torch.Tensor, before: torch.Tensor, n: int) -> None:
    """The shape contract of every single-prompt generator: a LongTensor ``[1, T + n]`` that starts
    with the prompt, which must not have been modified. Raises with a pointed message otherwise."""
    T = prompt.shape[1]
    if not isinstance(out, torch.Tensor):
        raise fail(check, f"return a torch.Tensor of token ids, got {type(out).__name__}")
    if not torch.equal(prompt, before):
        raise fail(check, "your function modified input_ids in place; build a new tensor instead")
    if out.dtype != torch.long:
        raise fail(check, f"token ids must be torch.long, got {out.dtype}")
    if out.dim() != 2 or out.shape[0] != 1:
        raise fail(check, f"return shape [1, T + max_new_tokens]; got {list(out.shape)}")
    L = out.shape[1]
    if L != T + n:
        if L == n:
            raise fail(check, f"prompt of {T} tokens, max_new_tokens={n}: you returned {L} tokens, only the "
                              "new ones. Return the prompt followed by the new tokens.")
        if L in (T + n - 1, T + n + 1):
            raise fail(check, f"prompt of {T} tokens, max_new_tokens={n}: expected {T + n} tokens, got {L} "
                              f"(you generated {L - T} new tokens: an off-by-one in your loop)")
        raise fail(check, f"prompt of {T} tokens, max_new_tokens={n}: expected {T + n} tokens, got {L}")
    if not torch.equal(out[:, :T].cpu(), prompt):
        raise fail(check, "the result must start with the prompt, unchanged")
