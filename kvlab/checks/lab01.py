"""Grader for lab 1: ``naive_generate(model, input_ids, max_new_tokens) -> LongTensor [1, T + N]``."""

from __future__ import annotations

import torch

from ..generate import hf_greedy
from ._common import check_generated_ids, fail, first_difference, fresh_prompts, grading_model, passed

NAME = "check_naive_generate"


@torch.no_grad()
def diagnose_token(model, seq: torch.Tensor, pos: int) -> str:
    """Explain why ``seq[0, pos]`` is not the greedy choice after ``seq[:, :pos]``."""
    prefix = seq[:, :pos]
    got = int(seq[0, pos])
    logits = model(prefix).logits[0].float()
    want = int(logits[-1].argmax())
    if prefix.shape[1] >= 2 and int(logits[-2].argmax()) == got:
        return ("it is the argmax of the SECOND-TO-LAST position's logits: the next token comes from "
                "logits[:, -1, :], the last position")
    if prefix.shape[1] >= 2 and int(logits[0].argmax()) == got:
        return ("it is the argmax of the FIRST position's logits: the next token comes from "
                "logits[:, -1, :], the last position")
    if int(model(prefix[:, -1:]).logits[0, -1].argmax()) == got:
        return ("it is what the model predicts when it sees ONLY THE LAST TOKEN: without a cache the model "
                "must be fed the whole sequence so far (prompt + generated tokens) at every step")
    rank = int((logits[-1] > logits[-1, got]).sum())
    prob = float(torch.softmax(logits[-1], -1)[got])
    return (f"the model's top choice there is token {want}, but you chose token {got} (rank {rank}, "
            f"probability {prob:.3f}): greedy decoding takes the argmax, it does not sample")


def check_naive_generate(naive_generate) -> None:
    """Grade a learner's naive greedy generator against ``model.generate(do_sample=False, use_cache=False)``."""
    model, tok = grading_model()
    cases = [(p, n) for p in fresh_prompts(tok, lengths=[1, 3]) for n in (1, 6, 17)]
    for prompt, n in cases:
        T = prompt.shape[1]
        before = prompt.clone()
        out = naive_generate(model, prompt, n)
        check_generated_ids(NAME, out, prompt, before, n)
        out = out.cpu()
        want = hf_greedy(model, prompt, n, use_cache=False)
        i = first_difference(out[0], want[0])
        if i >= 0:
            why = diagnose_token(model, out, i)
            raise fail(NAME, f"prompt of {T} tokens, max_new_tokens={n}: new token #{i - T + 1} (position {i}) "
                             f"is {int(out[0, i])}, the reference greedy token is {int(want[0, i])}: {why}")
        if not torch.equal(naive_generate(model, prompt, n).cpu(), out):
            raise fail(NAME, "two calls with the same prompt gave different tokens: greedy decoding is "
                             "deterministic (argmax), it must not sample")
    passed(NAME, f"{len(cases)} prompts/lengths match model.generate(do_sample=False, use_cache=False) token for token")
