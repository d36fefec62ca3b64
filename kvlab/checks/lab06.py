"""Graders for lab 6 (batched generation).

* ``make_batch(tokenizer, prompts) -> (input_ids, attention_mask, position_ids)``, left padded;
* ``batched_generate(model, tokenizer, prompts, max_new_tokens) -> list[list[int]]``, the greedy new
  tokens of every prompt, one forward pass over the whole batch per step, with the cache.

The generator is graded on two things: its tokens must equal transformers' greedy ``generate`` run on
each prompt alone, and a forward pre-hook on the grading model records every call (input shape,
attention mask, position ids, cache length) to check that the work really was batched and cached,
and to name the mistake when the tokens differ.
"""

from __future__ import annotations

import copy
import inspect

import torch

from ..generate import context_length, hf_greedy
from ._common import GRADER_TEXTS, fail, grading_model, passed

NAME_BATCH = "check_make_batch"
NAME_GEN = "check_batched_generate"

# Mixed lengths on purpose: 1-token, short, medium and long prompts in one batch.
_MIXED = [GRADER_TEXTS[3], GRADER_TEXTS[5], GRADER_TEXTS[1], GRADER_TEXTS[0]]


def _tokens(tok, text) -> list[int]:
    return tok(text).input_ids


def _as_long(x, what: str, check: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise fail(check, f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype == torch.bool:
        x = x.long()
    if x.is_floating_point() or x.is_complex():
        raise fail(check, f"{what} must hold integers (torch.long), got {x.dtype}")
    return x.detach().cpu().long()


# ----------------------------------------------------------------------------------------- make_batch

def _grade_one_batch(make_batch, tok, prompts, ctx, no_pad_token: bool) -> None:
    want_pad = tok.eos_token_id if tok.pad_token_id is None else tok.pad_token_id
    try:
        result = make_batch(tok, prompts)
    except Exception as e:  # noqa: BLE001 - we explain the learner's exception instead of dumping it
        if no_pad_token:
            raise fail(NAME_BATCH, f"with a tokenizer that has no pad token (like real GPT-2's, "
                                   f"tokenizer.pad_token is None) your make_batch raised {type(e).__name__}: "
                                   f"{e}. Fall back to the eos token: pad_id = tokenizer.pad_token_id if it is "
                                   "not None, else tokenizer.eos_token_id (pads are masked, so any known id works)")
        raise
    if not isinstance(result, (tuple, list)) or len(result) != 3:
        raise fail(NAME_BATCH, "return a tuple (input_ids, attention_mask, position_ids)")
    ids, mask, pos = (_as_long(x, n, NAME_BATCH) for x, n in zip(result, ("input_ids", "attention_mask", "position_ids")))
    rows = [_tokens(tok, p) for p in prompts]
    B, T = len(rows), max(len(r) for r in rows)
    for x, n in ((ids, "input_ids"), (mask, "attention_mask"), (pos, "position_ids")):
        if list(x.shape) != [B, T]:
            raise fail(NAME_BATCH, f"{len(prompts)} prompts, the longest {T} tokens: {n} must have shape "
                                   f"[{B}, {T}], got {list(x.shape)} (pad every row to the longest prompt)")
    for i, (real, p) in enumerate(zip(rows, prompts)):
        L, k = len(real), T - len(real)
        if ids[i, k:].tolist() != real:
            if k and ids[i, :L].tolist() == real:
                raise fail(NAME_BATCH, f"row {i} ({L} tokens, {k} pads) has its tokens FIRST and the pads after "
                                       "them: that is right padding. Pad on the LEFT, so that every row's last "
                                       "real token is in the last column, where the next token is read "
                                       "(tokenizer(..., padding_side='left') or build the rows yourself)")
            raise fail(NAME_BATCH, f"row {i}: expected the prompt's {L} tokens {real[:8]}... at the right end "
                                   f"of the row, got {ids[i].tolist()[:12]}...")
        if k and ids[i, :k].tolist() != [want_pad] * k:
            if no_pad_token:
                raise fail(NAME_BATCH, f"the tokenizer has no pad token; row {i}'s pads are "
                                       f"{sorted(set(ids[i, :k].tolist()))}, expected the eos id {want_pad}: "
                                       "fall back to tokenizer.eos_token_id")
            raise fail(NAME_BATCH, f"row {i}'s pads are {sorted(set(ids[i, :k].tolist()))}; pad with "
                                   f"tokenizer.pad_token_id ({want_pad})")
        want_mask = [0] * k + [1] * L
        if mask[i].tolist() != want_mask:
            if k and mask[i].tolist() == [1] * T:
                raise fail(NAME_BATCH, f"row {i} has {k} pads but its attention_mask is all ones: the mask must "
                                       "be 0 on pads (so no real token attends to them) and 1 on real tokens")
            raise fail(NAME_BATCH, f"row {i}: attention_mask should be {want_mask}, got {mask[i].tolist()}")
        got_pos = pos[i, k:].tolist()
        if got_pos != list(range(L)):
            if k and got_pos == list(range(k, T)):
                raise fail(NAME_BATCH, f"row {i} ({k} pads): its first real token has position id {k}, the "
                                       "column number. Positions count real tokens only, 0 for the first "
                                       "one: position_ids = attention_mask.cumsum(-1) - 1 (pads clamped to 0)")
            raise fail(NAME_BATCH, f"row {i}: the position ids of its {L} real tokens should be 0..{L - 1}, "
                                   f"got {got_pos[:10]}...")
        if k and (int(pos[i, :k].min()) < 0 or int(pos[i, :k].max()) >= ctx):
            raise fail(NAME_BATCH, f"row {i}: pad positions {pos[i, :k].tolist()} are not valid indices into the "
                                   f"position embedding (0..{ctx - 1}); clamp them, e.g. to 0")


def check_make_batch(make_batch) -> None:
    """Grade a learner's left-padding ``make_batch`` on fresh prompts, with and without a pad token."""
    model, tok0 = grading_model()
    ctx = context_length(model)
    no_pad = copy.deepcopy(tok0)
    no_pad.pad_token = None                     # what real GPT-2's tokenizer looks like
    cases = [(_MIXED, False), (_MIXED[::-1], True), ([GRADER_TEXTS[2]], False),
             ([GRADER_TEXTS[1], GRADER_TEXTS[1]], False)]
    for prompts, without_pad in cases:
        # a fresh copy per call: a make_batch that sets padding_side or pad_token must not leak
        tok = copy.deepcopy(no_pad if without_pad else tok0)
        _grade_one_batch(make_batch, tok, prompts, ctx, without_pad)
    for bad, why in (([], "an empty list of prompts"), (["", GRADER_TEXTS[1]], "an empty prompt")):
        try:
            make_batch(copy.deepcopy(tok0), bad)
        except ValueError:
            continue
        except Exception as e:  # noqa: BLE001
            raise fail(NAME_BATCH, f"for {why} raise a ValueError that says what is wrong, not "
                                   f"{type(e).__name__}: {e}")
        raise fail(NAME_BATCH, f"{why} must raise ValueError: an empty row would be all pads, with no "
                               "real token to read the next one from")
    passed(NAME_BATCH, f"{len(cases)} batches left-padded correctly (mask, position ids, pad id, also with "
                       "no pad token) and empty input rejected")


# ----------------------------------------------------------------------------------- batched_generate

class _Recorder:
    """A forward pre-hook that records what each model call was given."""

    def __init__(self, model):
        self.sig = inspect.signature(model.forward)
        self.calls: list[dict] = []

    def __call__(self, module, args, kwargs):
        try:
            bound = self.sig.bind_partial(*args, **kwargs).arguments
        except TypeError:
            bound = dict(kwargs)
        extra = bound.get("kwargs", {})
        cache = bound.get("cache", None) or extra.get("past_key_values") or kwargs.get("past_key_values")
        ids = bound.get("input_ids")
        mask, pos = bound.get("attention_mask"), bound.get("position_ids")
        self.calls.append({
            "ids": None if ids is None else ids.detach().cpu().clone(),
            "mask": None if mask is None else mask.detach().cpu().long().clone(),
            "pos": None if pos is None else pos.detach().cpu().long().clone(),
            "cache_len": int(cache.get_seq_length()) if hasattr(cache, "get_seq_length") else 0,
        })


def _run_recorded(batched_generate, model, tok, prompts, n):
    rec = _Recorder(model)
    handle = model.register_forward_pre_hook(rec, with_kwargs=True)

    def refuse(*a, **k):
        raise fail(NAME_GEN, "do not call model.generate: write the loop yourself (prefill, then one "
                             "forward per step), that is the exercise")

    model.generate = refuse                      # an instance attribute shadows the method
    try:
        out = batched_generate(model, tok, prompts, n)
    finally:
        handle.remove()
        del model.generate
    return out, rec.calls


def _check_calls(calls, rows, n) -> None:
    """Name the structural mistake, if any, from the recorded model calls."""
    B, T = len(rows), max(len(r) for r in rows)
    lens = [len(r) for r in rows]
    padded = len(set(lens)) > 1
    if not calls:
        raise fail(NAME_GEN, "your function never called the model it was given")
    first = calls[0]
    if first["ids"] is None:
        raise fail(NAME_GEN, "pass the token ids as input_ids (not inputs_embeds)")
    if first["ids"].shape[0] != B:
        raise fail(NAME_GEN, f"{B} prompts, but the first forward pass had batch size {first['ids'].shape[0]}: "
                             "you are generating the prompts ONE AT A TIME. Pad them into one [batch, T] tensor "
                             "and run one forward per step over the whole batch")
    if any(c["ids"] is not None and c["ids"].shape[0] != B for c in calls):
        raise fail(NAME_GEN, f"some forward passes did not have batch size {B}: every step must run the whole "
                             "batch at once (do not loop over the prompts)")
    if first["cache_len"] != 0 or first["ids"].shape[1] != T:
        if first["ids"].shape[1] == 1 and T > 1:
            raise fail(NAME_GEN, f"the first forward pass saw 1 token per row (the longest prompt has {T}): "
                                 "NO PREFILL. With an empty cache the model then conditions on the last prompt "
                                 "token only; run the whole padded batch once first, then feed one token per step")
        raise fail(NAME_GEN, f"the first forward pass (the prefill) must see the whole padded batch, "
                             f"[{B}, {T}] with an empty cache; it saw {list(first['ids'].shape)} with "
                             f"{first['cache_len']} cached positions")
    ids = first["ids"]
    for i, r in enumerate(rows):
        k = T - len(r)
        if k and ids[i, :len(r)].tolist() == r:
            raise fail(NAME_GEN, f"row {i} ({len(r)} tokens, {k} pads) is RIGHT-padded: its pads come after the "
                                 "prompt, so the next token would be read from a pad. Pad on the left")
        if ids[i, k:].tolist() != r:
            raise fail(NAME_GEN, f"row {i} of the prefill does not end with the prompt's tokens (left padding)")
    want_mask = torch.tensor([[0] * (T - L) + [1] * L for L in lens])
    if padded:
        if first["mask"] is None:
            raise fail(NAME_GEN, "the prefill got NO attention_mask: the real tokens of the shorter rows attend "
                                 "to the pads. Pass attention_mask (0 on pads, 1 on real tokens)")
        if first["pos"] is None:
            raise fail(NAME_GEN, "the prefill got NO position_ids: transformers then numbers the columns 0..T-1 "
                                 "in every row, so a row with k left pads starts at position k. Pass "
                                 "position_ids = attention_mask.cumsum(-1) - 1 (pads clamped to 0)")
    if first["mask"] is not None and not torch.equal(first["mask"].expand(B, -1), want_mask):
        raise fail(NAME_GEN, f"the prefill's attention_mask should be 0 on the pads and 1 on real tokens; "
                             f"row 0 is {first['mask'][0].tolist()}")
    if first["pos"] is not None:
        pos = first["pos"].expand(B, -1)
        for i, L in enumerate(lens):
            if pos[i, T - L:].tolist() != list(range(L)):
                raise fail(NAME_GEN, f"prefill row {i} ({T - L} pads): position ids of its real tokens are "
                                     f"{pos[i, T - L:].tolist()[:8]}..., they must be 0..{L - 1} "
                                     "(attention_mask.cumsum(-1) - 1)")
    if len(calls) not in (n, n + 1):
        raise fail(NAME_GEN, f"max_new_tokens={n}: expected one forward pass per new token ({n}: the prefill, "
                             f"then {n - 1} decode steps), got {len(calls)}")
    for s, c in enumerate(calls[1:], start=1):
        cache_len = T + s - 1                     # prefill + the tokens fed since
        if c["ids"].shape[1] != 1:
            raise fail(NAME_GEN, f"decode step {s} fed {c['ids'].shape[1]} tokens per row; with the cache, feed "
                                 "only the one new token of each row (the cache holds everything before it)")
        if c["cache_len"] == 0:
            raise fail(NAME_GEN, f"decode step {s} got no cache (or an empty one): pass the same cache "
                                 "(e.g. a DynamicCache, or out.cache) back at every step")
        if c["cache_len"] != cache_len:
            raise fail(NAME_GEN, f"at decode step {s} the cache held {c['cache_len']} positions, expected "
                                 f"{cache_len}: feed every step's tokens through the same cache")
        if padded and c["mask"] is None:
            raise fail(NAME_GEN, f"decode step {s} got NO attention_mask (only the prefill had one): the new "
                                 "tokens then attend to the pads held in the cache. Pass the mask at every step, "
                                 "grown by one column of ones")
        if c["mask"] is not None:
            width = c["mask"].shape[-1]
            if width != cache_len + 1:
                if width == T:
                    raise fail(NAME_GEN, f"at decode step {s} the attention_mask still has the prefill's {T} "
                                         f"columns but the cache + new token span {cache_len + 1}: the MASK DOES "
                                         "NOT GROW. transformers pads a short mask with zeros, which hides the "
                                         "generated tokens; append a column of ones at every step")
                raise fail(NAME_GEN, f"at decode step {s} the attention_mask has {width} columns; it must cover "
                                     f"the {cache_len} cached positions and the new one ({cache_len + 1})")
            want = torch.cat([want_mask, torch.ones(B, s, dtype=torch.long)], 1)
            if not torch.equal(c["mask"].expand(B, -1), want):
                raise fail(NAME_GEN, f"at decode step {s} the attention_mask should be the prefill mask followed "
                                     f"by {s} column(s) of ones (the generated tokens are real)")
        if padded and c["pos"] is None:
            raise fail(NAME_GEN, f"decode step {s} got NO position_ids: transformers then uses the cache length "
                                 "(which counts the pads) as every row's position. Pass each row's own position: "
                                 "its prompt length + the tokens generated so far - 1")
        if c["pos"] is not None:
            want_pos = [L + s - 1 for L in lens]
            got_pos = c["pos"].expand(B, -1)[:, -1].tolist()
            if got_pos != want_pos:
                raise fail(NAME_GEN, f"at decode step {s} the position ids were {got_pos}, expected {want_pos} "
                                     "(each row's position advances by one per step from its own length)")


def check_batched_generate(batched_generate) -> None:
    """Grade a learner's batched greedy generator against transformers' ``generate`` on each prompt alone."""
    model, tok0 = grading_model()
    cases = [(_MIXED, 8), ([GRADER_TEXTS[2], GRADER_TEXTS[4]], 1), ([GRADER_TEXTS[4], GRADER_TEXTS[3]], 5),
             ([GRADER_TEXTS[0]], 4)]
    for prompts, n in cases:
        tok = copy.deepcopy(tok0)
        rows = [_tokens(tok0, p) for p in prompts]
        out, calls = _run_recorded(batched_generate, model, tok, prompts, n)
        try:
            got = [[int(t) for t in row] for row in out]
        except (TypeError, ValueError):
            raise fail(NAME_GEN, f"return a list with one list of new token ids per prompt, got "
                                 f"{type(out).__name__}") from None
        if len(got) != len(prompts):
            raise fail(NAME_GEN, f"{len(prompts)} prompts but {len(got)} results: return one list per prompt, "
                                 "in the prompts' order")
        for i, (g, r) in enumerate(zip(got, rows)):
            if len(g) != n:
                if len(g) == len(r) + n or len(g) == max(map(len, rows)) + n:
                    raise fail(NAME_GEN, f"row {i}: return only the NEW tokens ({n}), not the prompt or pads")
                raise fail(NAME_GEN, f"max_new_tokens={n}, but row {i} has {len(g)} tokens")
        _check_calls(calls, rows, n)
        for i, (g, r) in enumerate(zip(got, rows)):
            want = hf_greedy(model, torch.tensor([r]), n)[0, len(r):].tolist()
            if g != want:
                j = next(j for j in range(n) if g[j] != want[j])
                raise fail(NAME_GEN, f"row {i} (prompt of {len(r)} tokens, {max(map(len, rows)) - len(r)} pads): new "
                                     f"token #{j + 1} is {g[j]}, generating this prompt alone gives {want[j]}. The "
                                     "calls looked right, so check which logits you read (column -1 of the last "
                                     "forward) and that you take the argmax")
    passed(NAME_GEN, f"{len(cases)} batches of mixed lengths equal each prompt generated alone (transformers "
                     "generate), one forward per step over the whole batch with the cache")
