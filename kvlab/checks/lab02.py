"""Grader for lab 2: ``cached_generate(model, input_ids, max_new_tokens) -> LongTensor [1, T + N]``.

Two things are graded. The tokens: they must equal transformers' own greedy ``model.generate`` on
fresh prompts. And the cache: right tokens can come from a generator that never uses the cache
(the naive one of lab 1), so the grader watches every forward call the learner makes, through a
forward pre-hook on the grading model, and requires the shape of a real cached loop:

* call 1 is the prefill: the whole prompt, ``T`` tokens, with no cache or an empty one;
* every later call feeds exactly one new token, with a cache that already holds every earlier
  token (its ``get_seq_length()`` equals the new token's position);
* ``max_new_tokens`` calls in all (the prefill's logits give the first new token).

The hook raises at the first call that breaks a rule, with a message that names the mistake
(the article bugs among them: no prefill, the whole sequence fed back alongside the cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..generate import hf_greedy
from ._common import check_generated_ids, fail, first_difference, fresh_prompts, grading_model, passed
from .lab01 import diagnose_token

NAME = "check_cached_generate"

# Names under which a cache can reach GPT2LMHeadModel.forward: the current one and the deprecated
# one (transformers < 5.24; still accepted, with a FutureWarning, until 5.40).
_CACHE_KWARGS = ("cache", "past_key_values")


@dataclass
class _Call:
    """What one forward call of the learner's loop looked like, seen from a pre-hook."""

    n_new: int              # tokens in input_ids (the positions this call computes)
    cache: object           # the cache object passed in, or None
    cache_len: int | None   # its get_seq_length() before the call (None: no cache passed)
    use_cache: object       # the use_cache argument as passed (None: not passed)


def _inspect_call(args, kwargs) -> _Call:
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        raise fail(NAME, "call the model with token ids, model(input_ids, cache=...), not inputs_embeds")
    cache = next((kwargs[k] for k in _CACHE_KWARGS if kwargs.get(k) is not None), None)
    if cache is None and len(args) > 1:          # model(ids, cache) positionally
        cache = args[1]
    cache_len = None
    if cache is not None:
        if not hasattr(cache, "get_seq_length"):
            raise fail(NAME, f"the cache you passed is a {type(cache).__name__}, not a transformers Cache: "
                             "create one with DynamicCache(config=model.config) (transformers >= 5 no longer "
                             "takes tuples of tensors), or reuse the .cache of the previous output")
        cache_len = int(cache.get_seq_length())
    return _Call(int(ids.shape[-1]), cache, cache_len, kwargs.get("use_cache"))


class _Watch:
    """Checks each forward call against the cached-loop contract as it happens (raising at the first
    violation, before a wrong loop can run past the model's context)."""

    def __init__(self, model, T: int, n: int):
        self.model, self.T, self.n = model, T, n
        self.calls: list[_Call] = []

    def __enter__(self):
        self.handle = self.model.register_forward_pre_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self.handle.remove()
        return False

    def _hook(self, module, args, kwargs):
        call = _inspect_call(args, kwargs)
        self.calls.append(call)
        self._check(call, len(self.calls))
        return None

    def _check(self, c: _Call, k: int) -> None:
        T, n = self.T, self.n
        where = f"prompt of {T} tokens, max_new_tokens={n}, forward call #{k}"
        if c.use_cache is False:
            raise fail(NAME, f"{where} passed use_cache=False: that is the naive generator of lab 1, "
                             "running without a cache. Pass use_cache=True and a cache object.")
        if k > n:
            raise fail(NAME, f"{where}: max_new_tokens={n} takes exactly {n} forward call(s) (the prefill's "
                             "last logits give the first new token, then one call per further token), but "
                             f"this is call #{k}: an off-by-one in your loop, or a forward whose logits you "
                             "never use")
        if k == 1:
            if c.cache_len:
                raise fail(NAME, f"{where}: the first call got a cache that already holds {c.cache_len} "
                                 "tokens. Start every generation from a new, empty cache; a cache left over "
                                 "from another prompt makes the model attend to that prompt's keys.")
            if c.n_new != T:
                if c.n_new == 1 and T > 1:
                    raise fail(NAME, f"{where} fed 1 token to an empty cache: there is no prefill. The "
                                     "model then conditions on the last prompt token only (the bug of "
                                     "article A, which feeds generated[:, -1:] from the first step). "
                                     "Call the model once on the WHOLE prompt first, then one token a step.")
                raise fail(NAME, f"{where} fed {c.n_new} tokens; the prefill must process the whole prompt, "
                                 f"all {T} tokens, in one call")
            return
        pos = T + k - 2                     # position of the token this call feeds
        if c.cache is None:
            raise fail(NAME, f"{where} passed no cache (fed {c.n_new} tokens): this generator does not use "
                             "a cache at all, it recomputes the sequence like the naive one. Keep the cache "
                             "from the prefill (or out.cache) and pass it back with cache=... at every step.")
        if c.cache_len == 0:
            raise fail(NAME, f"{where} got an EMPTY cache: you create a fresh cache at every step, so "
                             f"the new token sees nothing before it. Create the cache once, before the loop, "
                             "and pass the same object at every step (it grows in place).")
        if c.n_new > 1 and c.cache_len is not None and c.cache_len >= pos:
            raise fail(NAME, f"{where} fed {c.n_new} tokens together with a cache that already holds "
                             f"{c.cache_len}: you feed the whole sequence back in alongside the cache (the "
                             "bug of article B). The cached keys and the re-fed ones are duplicated and the "
                             "re-fed tokens get positions after the cache's. Feed only the newest token.")
        if c.n_new != 1:
            raise fail(NAME, f"{where} fed {c.n_new} tokens; after the prefill every call feeds exactly one "
                             "token, the one generated last (shape [1, 1])")
        if c.cache_len != pos:
            raise fail(NAME, f"{where} fed the token at position {pos} with a cache holding {c.cache_len} "
                             f"tokens; it must hold exactly the {pos} tokens before it. Pass the same cache "
                             "object through the whole loop, and do not crop or copy it between steps.")


def _check_shape(out, prompt, before, n) -> None:
    check_generated_ids(NAME, out, prompt, before, n)


def check_cached_generate(cached_generate) -> None:
    """Grade a learner's cached greedy generator: tokens equal to ``model.generate`` (greedy), and a
    real cached loop (one prefill over the prompt, then one token per call on a cache that holds all
    earlier tokens, ``max_new_tokens`` calls in all)."""
    model, tok = grading_model()
    cases = [(p, n) for p in fresh_prompts(tok, lengths=[1, 3]) for n in (1, 6, 17)]
    for prompt, n in cases:
        T = prompt.shape[1]
        want = hf_greedy(model, prompt, n)        # the reference runs outside the watch
        before = prompt.clone()
        with _Watch(model, T, n) as watch:
            out = cached_generate(model, prompt, n)
        _check_shape(out, prompt, before, n)
        if not watch.calls:
            raise fail(NAME, "the grader saw no forward call on the model it passed you: call the model "
                             "argument itself as model(...) (not model.forward, not another model)")
        if len(watch.calls) < n:
            raise fail(NAME, f"prompt of {T} tokens, max_new_tokens={n}: that takes {n} forward call(s), "
                             f"you made {len(watch.calls)}; where do the other tokens come from?")
        out = out.cpu()
        i = first_difference(out[0], want[0])
        if i >= 0:
            why = diagnose_token(model, out, i)
            raise fail(NAME, f"prompt of {T} tokens, max_new_tokens={n}: new token #{i - T + 1} (position {i}) "
                             f"is {int(out[0, i])}, the reference greedy token is {int(want[0, i])}: {why}")
        with _Watch(model, T, n):
            again = cached_generate(model, prompt, n).cpu()
        if not torch.equal(again, out):
            raise fail(NAME, "two calls with the same prompt gave different tokens: greedy decoding is "
                             "deterministic (argmax), it must not sample; and each call needs its own new "
                             "cache")
    passed(NAME, f"{len(cases)} prompts/lengths match model.generate(do_sample=False) token for token, "
                 "with one prefill and then one token per forward call on a growing cache")
