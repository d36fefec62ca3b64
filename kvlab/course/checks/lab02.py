"""Grader for lab 2: ``cached_generate(model, input_ids, max_new_tokens) -> LongTensor [1, T + N]``.

Two things are graded. The tokens: they must equal transformers' own greedy ``model.generate`` on
fresh prompts. And the cache: right tokens can come from a generator that never uses the cache
(the naive one of lab 1), so the grader watches every forward call the learner makes, through a
wrapper around ``forward`` on a private copy of the grading model, and requires a real cached loop:

* call 1 is the prefill: the whole prompt, ``T`` tokens, with no cache or an empty one;
* every later call feeds exactly one new token, with a cache that already holds every earlier
  token (its ``get_seq_length()`` equals the new token's position);
* ``max_new_tokens`` calls in all (the prefill's logits give the first new token).

The hook raises at the first call that breaks a rule, with a message that names the mistake
(the article bugs among them: no prefill, the whole sequence fed back alongside the cache).
"""

from __future__ import annotations

import torch

from ._common import (Call, LearnerModel, expect_value_error, fail, fresh_prompts, grading_model,
                      learner_call, passed, reference_greedy, run_cases, synthetic)
from .lab01 import grade_single_prompts, grading_eos

NAME = "check_cached_generate"
NAME_UNTIL = "check_generate_until"

# The rules of a cached loop, one row per named mistake: (applies to, test, message). ``k`` is the
# call's number, ``T`` the prompt length, ``n`` max_new_tokens, ``pos`` the position of the token a
# decode call feeds (T + k - 2). The first row whose test holds names the mistake.
_RULES = [
    ("any", lambda c, k, T, n, pos: c.ids is None,
     "call the model with token ids (input_ids, and the cache), not inputs_embeds"),
    ("any", lambda c, k, T, n, pos: c.cache is not None and c.cache_len is None,
     "the cache you passed is not a transformers Cache: create one with DynamicCache(config="
     "model.config) (transformers >= 5 no longer takes tuples of tensors), or reuse out.cache"),
    ("any", lambda c, k, T, n, pos: c.use_cache is False,
     "passed use_cache=False: that is the naive generator of lab 1, running without a cache. Pass "
     "use_cache=True and a cache object"),
    ("any", lambda c, k, T, n, pos: k > max(n, 1),
     "max_new_tokens={n} takes exactly {n} forward call(s) (the prefill's last logits give the "
     "first new token, then one call per further token): an off-by-one in your loop, or a forward "
     "whose logits you never use"),
    ("prefill", lambda c, k, T, n, pos: bool(c.cache_len),
     "the first call got a cache that already holds {c.cache_len} tokens. Start every generation "
     "from a new, empty cache; a cache left over from another prompt makes the model attend to "
     "its keys"),
    ("prefill", lambda c, k, T, n, pos: c.ids.shape[-1] == 1 and T > 1,
     "fed 1 token to an empty cache: there is no prefill. The model then conditions on the last "
     "prompt token only (the bug of article A). Call the model once on the WHOLE prompt first"),
    ("prefill", lambda c, k, T, n, pos: c.ids.shape[-1] != T,
     "fed {fed} tokens; the prefill must process the whole prompt, all {T}, in one call"),
    ("decode", lambda c, k, T, n, pos: c.cache is None,
     "passed no cache (fed {fed} tokens): this generator recomputes the sequence like the "
     "naive one. Keep the cache from the prefill and pass it back with cache=... at every step"),
    ("decode", lambda c, k, T, n, pos: c.cache_len == 0,
     "got an EMPTY cache: you create a fresh cache at every step, so the new token sees nothing "
     "before it. Create the cache once, before the loop, and pass the same object at every step"),
    ("decode", lambda c, k, T, n, pos: c.ids.shape[-1] > 1 and c.cache_len >= pos,
     "fed {fed} tokens with a cache that already holds {c.cache_len}: you feed the whole "
     "sequence back in alongside the cache (the bug of article B). Feed only the newest token"),
    ("decode", lambda c, k, T, n, pos: c.ids.shape[-1] != 1,
     "fed {fed} tokens; after the prefill every call feeds exactly one token, the one "
     "generated last (shape [1, 1])"),
    ("decode", lambda c, k, T, n, pos: c.cache_len != pos,
     "fed the token at position {pos} with a cache holding {c.cache_len} tokens; it must hold "
     "exactly the {pos} tokens before it. Pass the same cache through the loop; do not crop or "
     "copy it"),
]


def watch(T: int, n: int):
    """An ``on_call`` for the recorder that raises at the first call breaking a rule (before a wrong
    loop can run past the model's context)."""
    def on_call(c: Call, k: int) -> None:
        kind, pos = ("prefill" if k == 1 else "decode"), T + k - 2
        for applies, broken, message in _RULES:
            if applies in ("any", kind) and broken(c, k, T, n, pos):
                where = f"prompt of {T} tokens, max_new_tokens={n}, forward call #{k}"
                fmt = dict(c=c, k=k, T=T, n=n, pos=pos, fed=c.ids.shape[-1])
                raise fail(NAME, f"{where}: " + message.format(**fmt))
    return on_call


def enough_calls(calls, T: int, n: int) -> None:
    """A cached loop makes one forward call per new token (the first one is the prefill)."""
    if len(calls) < n:
        raise fail(NAME, f"prompt of {T} tokens, max_new_tokens={n}: that takes {n} forward "
                         f"call(s), you made {len(calls)}; where do the other tokens "
                         "come from?")


def check_cached_generate(cached_generate) -> None:
    """Grade a learner's cached greedy generator: tokens equal to ``model.generate`` (greedy), and a
    real cached loop (one prefill over the prompt, then one token per call on a cache that holds all
    earlier tokens, ``max_new_tokens`` calls in all), on a private copy of the model."""
    count = grade_single_prompts(NAME, "cached_generate", cached_generate, use_cache=True,
                                 rule=enough_calls, on_call=watch)
    passed(NAME, f"{count} cases (1-token prompt, 0 new tokens, a full context, eos inside the "
                 "prompt, an eos id that comes up) match model.generate(do_sample=False), with "
                 "one prefill and then one token per forward call on a growing cache")


# ------------------------------------------------------------------------------ stop at end-of-text

@torch.no_grad()
def hf_until(model, prompt, n, eos):
    """transformers' greedy generate, stopping after the end-of-text id (kept in the output)."""
    if n == 0:
        return prompt
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                          max_new_tokens=n, eos_token_id=eos, pad_token_id=eos, use_cache=True)


def _until_cases(model, tok):
    p = fresh_prompts(tok)
    greedy = reference_greedy(model, p[2], 10)
    T = p[2].shape[1]
    first, later, never = int(greedy[0, T]), grading_eos(greedy, T, 3), tok.vocab_size - 1
    in_prompt = int(p[0][0, 2])
    return [("the first new token is end-of-text", p[2], 10, first),
            ("end-of-text comes up as new token #4", p[2], 10, later),
            ("end-of-text never comes up", p[1], 8, never),
            ("the same length and budget, other tokens", synthetic(p[1].shape[1], tok.vocab_size),
             8, never),
            ("the end-of-text id also appears inside the prompt", p[0], 6, in_prompt),
            ("max_new_tokens=0", p[3], 0, first)]


def check_generate_until(generate_until) -> None:
    """Grade ``generate_until(model, input_ids, max_new_tokens, eos_token_id)``: greedy with the
    cache, stopping right after the first generated end-of-text token (which is kept)."""
    model, tok = grading_model()
    guard = LearnerModel(NAME_UNTIL, model)

    def grade(case) -> None:
        name, prompt, n, eos = case
        want = hf_until(model, prompt, n, eos)
        what = f"{name}: generate_until(model, <[1, {prompt.shape[1]}]>, {n}, eos_token_id={eos})"
        with guard.case() as mine:
            out = learner_call(NAME_UNTIL, what, generate_until, mine, prompt, n, eos)
        if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[0] != 1:
            raise fail(NAME_UNTIL, f"{what}: return a LongTensor [1, T + k], got "
                                   f"{getattr(out, 'shape', type(out).__name__)}")
        got, L = out.cpu(), want.shape[1]
        if got.shape[1] > L and torch.equal(got[:, :L], want):
            raise fail(NAME_UNTIL, f"{what}: you went on after the end-of-text token (new token "
                                   f"#{L - prompt.shape[1]}): stop right after it, and keep it")
        if got.shape[1] == L - 1 and torch.equal(got, want[:, :-1]):
            raise fail(NAME_UNTIL, f"{what}: you dropped the end-of-text token: keep it as the "
                                   "last one")
        if got.shape[1] < L and int(eos) in prompt[0].tolist():
            raise fail(NAME_UNTIL, f"{what}: you stopped early; the end-of-text id is in the "
                                   "PROMPT: only a generated end-of-text ends the text")
        if not torch.equal(got, want):
            raise fail(NAME_UNTIL, f"{what}: expected {want[0, prompt.shape[1]:].tolist()}, got "
                                   f"{got[0, prompt.shape[1]:].tolist()}")
        if len(guard.calls) > max(L - prompt.shape[1], 0):
            raise fail(NAME_UNTIL, f"{what}: {len(guard.calls)} forward calls for "
                                   f"{L - prompt.shape[1]} new tokens: after the end-of-text "
                                   "token, or for the last token, no further forward call is "
                                   "needed")

    count = run_cases(_until_cases(model, tok), grade)
    with guard.case() as mine:
        expect_value_error(NAME_UNTIL, "max_new_tokens=-1", generate_until, mine,
                           fresh_prompts(tok)[0], -1, 0)
    passed(NAME_UNTIL, f"{count} cases (end-of-text first, later, never, inside the prompt, 0 "
                       "tokens) equal transformers' generate with that eos_token_id")
