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
import operator

import torch

from kvlab.configs import context_length
from ._common import (GRADER_TEXTS, LearnerModel, expect_value_error, fail, grading_model,
                      grading_tokenizer, learner_call, passed, reference_greedy)
from kvlab.batching import one_by_one

NAME_BATCH = "check_make_batch"
NAME_GEN = "check_batched_generate"

# Mixed lengths on purpose: 1-token, short, medium and long prompts in one batch.
_MIXED = [GRADER_TEXTS[3], GRADER_TEXTS[5], GRADER_TEXTS[1], GRADER_TEXTS[0]]
# A prompt that holds the pad / end-of-text token as a real token (a mask built as ids != pad breaks).
_WITH_PAD = "Blessed <|endoftext|> be the LORD"


# Token ids used as the pad id / the end-of-text id in some make_batch cases (not 0, the model's).
_OTHER_PAD, _OTHER_EOS = 220, 13


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

# One row of a left-padded batch: (test, message). ``r`` holds the row's tensors and its prompt:
# ids/mask/pos (the row), real (the prompt's tokens), L, k (pads), T, pad, ctx, no_pad.
_ROW_RULES = [
    (lambda r: r.ids[r.k:].tolist() != r.real and r.k and r.ids[:r.L].tolist() == r.real,
     "row {i} ({L} tokens, {k} pads) has its tokens FIRST and the pads after them: that is right "
     "padding. Pad on the LEFT, so that every row's last real token is in the last column, where "
     "the next token is read (tokenizer(..., padding_side='left') or build the rows yourself)"),
    (lambda r: r.ids[r.k:].tolist() != r.real,
     "row {i}: expected the prompt's {L} tokens {head}... at the right end of the row, got "
     "{got}..."),
    (lambda r: r.k and r.ids[:r.k].tolist() != [r.pad] * r.k and r.no_pad,
     "the tokenizer has no pad token; row {i}'s pads are {pads}, expected the eos id {pad}: fall "
     "back to tokenizer.eos_token_id"),
    (lambda r: r.k and r.ids[:r.k].tolist() != [r.pad] * r.k,
     "row {i}'s pads are {pads}; pad with tokenizer.pad_token_id ({pad})"),
    (lambda r: r.k and r.mask.tolist() == [1] * r.T,
     "row {i} has {k} pads but its attention_mask is all ones: the mask must be 0 on pads (so no "
     "real token attends to them) and 1 on real tokens"),
    (lambda r: r.pad in r.real and r.mask[r.k:].tolist() != [1] * r.L,
     "row {i}'s prompt contains the pad id {pad} as a REAL token, and your mask hides it: build "
     "the mask from the prompt lengths, not from input_ids != pad_id"),
    (lambda r: r.mask.tolist() != [0] * r.k + [1] * r.L,
     "row {i}: attention_mask should be {k} zeros then {L} ones, got {mask}"),
    (lambda r: r.k and r.pos[r.k:].tolist() == list(range(r.k, r.T)),
     "row {i} ({k} pads): its first real token has position id {k}, the column number. Positions "
     "count real tokens only, 0 for the first one: a pad before a token does not move its position"),
    (lambda r: r.pos[r.k:].tolist() != list(range(r.L)),
     "row {i}: the position ids of its {L} real tokens should be 0..{L1}, got {gpos}..."),
    (lambda r: r.k and (int(r.pos[:r.k].min()) < 0 or int(r.pos[:r.k].max()) >= r.ctx),
     "row {i}: pad positions {ppos} are not valid indices into the position embedding "
     "(0..{ctx1}); clamp them, e.g. to 0"),
]


class _Row:
    def __init__(self, ids, mask, pos, real, T, pad, ctx, no_pad):
        self.ids, self.mask, self.pos, self.real, self.T = ids, mask, pos, real, T
        self.L, self.k, self.pad, self.ctx, self.no_pad = len(real), T - len(real), pad, ctx, no_pad

    def fmt(self, i) -> dict:
        return dict(i=i, L=self.L, k=self.k, head=self.real[:8], got=self.ids.tolist()[:12],
                    pads=sorted(set(self.ids[:self.k].tolist())), pad=self.pad,
                    mask=self.mask.tolist(),
                    L1=self.L - 1, gpos=self.pos[self.k:].tolist()[:10],
                    ppos=self.pos[:self.k].tolist(), ctx1=self.ctx - 1)


def _grade_one_batch(make_batch, tok, prompts, ctx, no_pad_token: bool) -> None:
    pad = tok.eos_token_id if tok.pad_token_id is None else tok.pad_token_id
    what = (f"with a tokenizer that has no pad token (like real GPT-2's), make_batch(tok, "
            f"<{len(prompts)} prompts>); fall back to tokenizer.eos_token_id" if no_pad_token
            else f"make_batch(tok, <{len(prompts)} prompts>)")
    result = learner_call(NAME_BATCH, what, make_batch, tok, prompts)
    if not isinstance(result, (tuple, list)) or len(result) != 3:
        raise fail(NAME_BATCH, "return a tuple (input_ids, attention_mask, position_ids)")
    names = ("input_ids", "attention_mask", "position_ids")
    tensors = [_as_long(x, n, NAME_BATCH) for x, n in zip(result, names)]
    rows = [_tokens(tok, p) for p in prompts]
    B, T = len(rows), max(len(r) for r in rows)
    for x, n in zip(tensors, names):
        if list(x.shape) != [B, T]:
            raise fail(NAME_BATCH, f"{B} prompts, the longest {T} tokens: {n} must have shape "
                                   f"[{B}, {T}], got {list(x.shape)} (pad every row to the "
                                   "longest prompt)")
    for i, real in enumerate(rows):
        row = _Row(*(t[i] for t in tensors), real, T, pad, ctx, no_pad_token)
        for broken, message in _ROW_RULES:
            if broken(row):
                raise fail(NAME_BATCH, message.format(**row.fmt(i)))


def check_make_batch(make_batch) -> None:
    """Grade a left-padding ``make_batch`` on fresh prompts, with and without a pad token."""
    model, tok0 = grading_model()
    ctx = context_length(model)
    no_pad = copy.deepcopy(tok0)
    no_pad.pad_token = None                     # what real GPT-2's tokenizer looks like
    # pad and end-of-text ids other than the grading model's 0, so a hard-coded 0 shows
    other_pad = copy.deepcopy(tok0)
    other_pad.pad_token = other_pad.convert_ids_to_tokens(_OTHER_PAD)
    other_eos = grading_tokenizer(no_pad, _OTHER_EOS)
    cases = [(_MIXED, tok0, False), (_MIXED[::-1], no_pad, True), ([GRADER_TEXTS[2]], tok0, False),
             ([GRADER_TEXTS[1], GRADER_TEXTS[1]], tok0, False),
             ([_WITH_PAD, GRADER_TEXTS[0]], tok0, False), (_MIXED[1:], other_pad, False),
             (_MIXED[:3], other_eos, True)]
    for prompts, tok, without_pad in cases:
        # a fresh copy per call: a make_batch that sets padding_side or pad_token must not leak
        _grade_one_batch(make_batch, copy.deepcopy(tok), prompts, ctx, without_pad)
    for bad, why in (([], "an empty list of prompts"), (["", GRADER_TEXTS[1]], "an empty prompt")):
        expect_value_error(NAME_BATCH, f"{why} (an all-pad row has no token to read the next one "
                                       "from)",
                           make_batch, copy.deepcopy(tok0), bad)
    passed(NAME_BATCH, f"{len(cases)} batches left-padded correctly (mask, position ids, pad id, "
                       "also with no pad token, pad and eos ids other than 0) and empty input "
                       "rejected")


# ----------------------------------------------------------------------------------- batched_generate

def _result_rows(out, B: int, n: int) -> list[list[int]]:
    """The contract's return value: one sequence of ``n`` new token ids per prompt: a list (or
    tuple) of lists, tuples or 1-D integer tensors, or a ``[B, n]`` integer tensor."""
    if isinstance(out, torch.Tensor) and not out.is_floating_point() and out.dim() == 2:
        out = list(out.cpu())
    if not isinstance(out, (list, tuple)):
        raise fail(NAME_GEN, f"return one list of new token ids per prompt (a list of lists, or "
                             f"a [batch, max_new_tokens] LongTensor), got {type(out).__name__}"
                             + (f" of shape {list(out.shape)}" if isinstance(out, torch.Tensor)
                                else ""))
    for r in out:
        ok = isinstance(r, (list, tuple)) or (isinstance(r, torch.Tensor) and r.dim() == 1
                                              and not r.is_floating_point())
        if not ok:
            raise fail(NAME_GEN, "each prompt's result must be a list of ints (or a 1-D integer "
                                 f"tensor), got {type(r).__name__}")
    if len(out) != B:
        raise fail(NAME_GEN, f"{B} prompts but {len(out)} results: return one list per prompt, in "
                             "the prompts' order")
    try:
        return [[operator.index(t) for t in r] for r in out]
    except TypeError as e:
        raise fail(NAME_GEN, f"every token id must be an integer: {e}") from None


def _prefill_order(first, rows) -> list[int]:
    """Which prompt each prefill row holds (a learner may sort the batch by length), matched by the
    tokens at the row's right end; also names right padding and a loop over the prompts."""
    B, W = first.ids.shape
    if B != len(rows):
        raise fail(NAME_GEN, f"{len(rows)} prompts, but the first forward pass had batch size "
                             f"{B}: you are generating the prompts ONE AT A TIME (or dropped "
                             "some). Pad them into one [batch, T] tensor and run one forward per "
                             "step over the whole batch")
    order, free = [], list(range(len(rows)))
    for i in range(B):
        row = first.ids[i].tolist()
        j = next((j for j in free if row[W - len(rows[j]):] == rows[j]), None)
        if j is None:
            if any(row[:len(rows[j])] == rows[j] for j in free):
                raise fail(NAME_GEN, f"prefill row {i} is RIGHT-padded: its pads come after the "
                                     "prompt, so the next token would be read from a pad. Pad on "
                                     "the left")
            raise fail(NAME_GEN, f"prefill row {i} does not end with any prompt's tokens (left "
                                 "padding)")
        order.append(j)
        free.remove(j)
    return order


def _expected_mask(first, lens) -> torch.Tensor:
    """0 on every pad, 1 on the real tokens (any number of extra left pads is fine if masked)."""
    B, W = first.ids.shape
    return torch.tensor([[0] * (W - L) + [1] * L for L in lens])


# The prefill's rules: (when, test, message); ``f`` the first call, ``m`` the expected mask.
_PREFILL = [
    (lambda f, m, lens, T: f.cache_len not in (None, 0) or f.ids.shape[1] < T,
     lambda f, m, lens, T: ("the first forward pass saw 1 token per row: NO PREFILL. With an "
                            "empty cache the model conditions on the last prompt token only; run "
                            "the whole padded batch once first" if f.ids.shape[1] == 1 else
                            f"the prefill must see the whole padded batch (>= {T} columns) with "
                            f"an empty cache; it saw {list(f.ids.shape)} with {f.cache_len} "
                            "cached positions")),
    (lambda f, m, lens, T: f.mask is None and len(set(lens)) > 1,
     lambda f, m, lens, T: "the prefill got NO attention_mask: the real tokens of the shorter "
                           "rows attend to the pads. Pass attention_mask (0 on pads, 1 on real "
                           "tokens)"),
    (lambda f, m, lens, T: f.pos is None and len(set(lens)) > 1,
     lambda f, m, lens, T: "the prefill got NO position_ids: transformers then numbers the "
                           "columns 0..T-1 in every row, so a row with k left pads starts at "
                           "position k. Pass position_ids that count each row's real tokens only, "
                           "from 0"),
    (lambda f, m, lens, T: f.mask is not None and not torch.equal(f.mask.long().expand_as(m), m),
     lambda f, m, lens, T: "the prefill's attention_mask should be 0 on the pads and 1 on real "
                           f"tokens; row 0 is {f.mask[0].tolist()}"),
    (lambda f, m, lens, T: f.pos is not None and any(
        f.pos.expand_as(m)[i, m.shape[1] - L:].tolist() != list(range(L))
        for i, L in enumerate(lens)),
     lambda f, m, lens, T: "the prefill's position ids of each row's real tokens must be 0..len-1 "
                           "(the pads before them do not count)"),
]

# A decode step's rules; ``c`` the call, ``s`` the step, ``W`` the prefill width, ``want_m`` its mask.
_DECODE = [
    (lambda c, s, W, m, lens: c.ids.shape[1] != 1,
     "decode step {s} fed {fed} tokens per row; with the cache, feed only the one new token of "
     "each row (the cache holds everything before it)"),
    (lambda c, s, W, m, lens: not c.cache_len,
     "decode step {s} got no cache (or an empty one): pass the same cache back at every step"),
    (lambda c, s, W, m, lens: c.cache_len != W + s - 1,
     "at decode step {s} the cache held {c.cache_len} positions, expected {cl}: feed every step's "
     "tokens through the same cache"),
    (lambda c, s, W, m, lens: c.mask is None and len(set(lens)) > 1,
     "decode step {s} got NO attention_mask (only the prefill had one): the new tokens then "
     "attend to the pads held in the cache. Pass the mask at every step, grown by one column of "
     "ones"),
    (lambda c, s, W, m, lens: c.mask is not None and c.mask.shape[-1] == W and s >= 1,
     "at decode step {s} the attention_mask still has the prefill's {W} columns but the cache + "
     "new token span {cl1}: the MASK DOES NOT GROW. transformers pads a short mask with zeros, "
     "which hides the generated tokens; append a column of ones at every step"),
    (lambda c, s, W, m, lens: c.mask is not None and not torch.equal(
        c.mask.long().expand(len(lens), -1),
        torch.cat([m, torch.ones(len(lens), s, dtype=torch.long)], 1)),
     "at decode step {s} the attention_mask should be the prefill mask followed by {s} column(s) "
     "of ones (the generated tokens are real), {cl1} columns in all"),
    (lambda c, s, W, m, lens: c.pos is None and len(set(lens)) > 1,
     "decode step {s} got NO position_ids: transformers then uses the cache length (which counts "
     "the pads) as every row's position. Pass each row's own position: its length + tokens so far "
     "- 1"),
    (lambda c, s, W, m, lens: c.pos is not None and
     c.pos.expand(len(lens), -1)[:, -1].tolist() != [L + s - 1 for L in lens],
     "at decode step {s} the position ids were {got_pos}, expected {want_pos} (each row's position "
     "advances by one per step from its own length)"),
]


def _check_calls(calls, rows, n, what="") -> list[int]:
    """Name the structural mistake, if any, from the recorded calls; return the prefill's order."""
    if not calls:
        raise fail(NAME_GEN, f"{what}: your function never called the model it was given (a "
                             "result remembered from an earlier call?)")
    first = calls[0]
    if first.ids is None:
        raise fail(NAME_GEN, "pass the token ids as input_ids (not inputs_embeds)")
    if first.ids.shape[0] == len(rows) and first.ids.shape[1] == 1 and max(map(len, rows)) > 1:
        raise fail(NAME_GEN, "the first forward pass saw 1 token per row: NO PREFILL. With an "
                             "empty cache the model conditions on the last prompt token only; run "
                             "the whole padded batch once first, then feed one token per step")
    order = _prefill_order(first, rows)
    lens = [len(rows[j]) for j in order]
    want_mask = _expected_mask(first, lens)
    for broken, message in _PREFILL:
        if broken(first, want_mask, lens, max(lens)):
            raise fail(NAME_GEN, message(first, want_mask, lens, max(lens)))
    if len(calls) not in (n, n + 1) and not (n == 0 and len(calls) <= 1):
        raise fail(NAME_GEN, f"max_new_tokens={n}: expected one forward pass per new token ({n}: "
                             f"the prefill, then {n - 1} decode steps), got {len(calls)}")
    W = first.ids.shape[1]
    for s, c in enumerate(calls[1:], start=1):
        if c.ids is None or c.ids.shape[0] != len(rows):
            raise fail(NAME_GEN, f"decode step {s} did not run the whole batch of {len(rows)} at "
                                 "once")
        got_pos = None if c.pos is None else c.pos.expand(len(lens), -1)[:, -1].tolist()
        fmt = dict(s=s, W=W, c=c, cl=W + s - 1, cl1=W + s, fed=c.ids.shape[1], got_pos=got_pos,
                   want_pos=[L + s - 1 for L in lens])
        for broken, message in _DECODE:
            if broken(c, s, W, want_mask, lens):
                raise fail(NAME_GEN, message.format(**fmt))
    return order


def _compare_rows(got, want, rows, n) -> None:
    if got == want:
        return
    if sorted(got) == sorted(want):
        raise fail(NAME_GEN, "every row's tokens are right, but the rows are not in the prompts' "
                             "order (did you sort the prompts by length?): return result i for "
                             "prompts[i]")
    i = next(i for i in range(len(rows)) if got[i] != want[i])
    if len(got[i]) != n:
        if len(got[i]) in (len(rows[i]) + n, max(map(len, rows)) + n):
            raise fail(NAME_GEN, f"row {i}: return only the NEW tokens ({n}), not the prompt or "
                                 "pads")
        raise fail(NAME_GEN, f"max_new_tokens={n}, but row {i} has {len(got[i])} tokens")
    j = next(j for j in range(n) if got[i][j] != want[i][j])
    raise fail(NAME_GEN, f"row {i} (prompt of {len(rows[i])} tokens): new token #{j + 1} is "
                         f"{got[i][j]}, generating this prompt alone gives {want[i][j]}. The "
                         "calls looked right, so check which logits you read (column -1 of the "
                         "last forward) and the argmax")


def _gen_cases(model, tok):
    """(name, prompts, n, grading-only eos id or None)."""
    g = GRADER_TEXTS
    cases = [("mixed lengths", _MIXED, 6, None),
             ("two prompts, one new token", [g[2], g[4]], 1, None),
             ("a 1-token prompt", [g[4], g[3]], 5, None),
             ("a single prompt", [g[0]], 4, None),
             ("max_new_tokens=0", _MIXED[:2], 0, None),
             ("the pad / end-of-text token inside a prompt", [_WITH_PAD, g[1]], 4, None),
             ("two other prompts, the same budget", [g[5], g[3]], 4, None)]
    ids = torch.tensor([tok(GRADER_TEXTS[3]).input_ids])
    early = int(reference_greedy(model, ids, 2)[0, -1])     # row 0's 2nd new token ends its text
    cases.append(("one row reaches end-of-text early", [GRADER_TEXTS[3], GRADER_TEXTS[0]], 6, early))
    return cases


def check_batched_generate(batched_generate) -> None:
    """Grade a learner's batched greedy generator against transformers' ``generate`` on each prompt
    alone, on a private copy of the model (pad id and end-of-text id differ in one case)."""
    model, tok0 = grading_model()
    guard = LearnerModel(NAME_GEN, model)
    cases = _gen_cases(model, tok0)
    memo = {}

    def alone(row, n):
        if (row, n) not in memo:
            memo[row, n] = reference_greedy(model, torch.tensor([row]), n)[0, len(row):].tolist()
        return memo[row, n]

    for name, prompts, n, eos in cases:
        tok = grading_tokenizer(tok0, eos)
        rows = [_tokens(tok0, p) for p in prompts]
        what = f"{name}: batched_generate(model, tok, <{len(prompts)} prompts>, {n})"
        with guard.case(eos) as mine:
            out = learner_call(NAME_GEN, what, batched_generate, mine, tok, prompts, n)
        got = _result_rows(out, len(prompts), n)
        if eos is not None and len(got[0]) < n and any(len(g) < n for g in got[1:]):
            raise fail(NAME_GEN, f"{what}: the rows stopped at {[len(g) for g in got]} tokens "
                                 f"when row 0 produced the end-of-text id {eos}: the contract is "
                                 f"exactly max_new_tokens={n} per row; never stop the whole batch "
                                 "when one row ends")
        if eos is not None and any(len(g) < n for g in got):
            raise fail(NAME_GEN, f"{what}: a row stopped at the end-of-text id {eos}; the "
                                 f"contract is exactly max_new_tokens={n} new tokens per row")
        if n:
            _check_calls(guard.calls, rows, n, what)
        want = [alone(tuple(r), n) for r in rows]
        _compare_rows(got, want, rows, n)
    with guard.case() as mine:
        expect_value_error(NAME_GEN, "an empty list of prompts", batched_generate, mine, tok0, [], 3)
    passed(NAME_GEN, f"{len(cases)} batches (mixed lengths, one prompt, 0 new tokens, the pad "
                     "token inside a prompt, a row that reaches end-of-text) equal each prompt "
                     "generated alone, one forward per step over the whole batch with the cache")


# ------------------------------------------------------------------------ per-row end-of-text

NAME_UNTIL = "check_batched_generate_until"


def _until_cases(model, tok):
    """(name, prompts, n, grading-only eos id): rows end at different steps, or never."""
    ids = torch.tensor([tok(GRADER_TEXTS[3]).input_ids])
    second = int(reference_greedy(model, ids, 2)[0, -1])             # row 0's 2nd new token
    alone = [reference_greedy(model, torch.tensor([tok(t).input_ids]), 1)[0, -1] for t in _MIXED[:2]]
    three = [GRADER_TEXTS[3], GRADER_TEXTS[0], GRADER_TEXTS[4]]
    return [("row 0 ends early, the others go on", three,
             6, second),
            ("a short batch whose first new token may be end-of-text", _MIXED[:2], 5, int(alone[0])
             if int(alone[0]) == int(alone[1]) else second),
            ("end-of-text never comes", _MIXED[1:3], 4, tok.vocab_size - 1),
            ("the end-of-text id also inside a prompt", [_WITH_PAD, GRADER_TEXTS[1]], 4,
             tok.eos_token_id)]


def _grade_until(got, want, calls, eos, what) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        if g == w:
            continue
        if len(g) < len(w) and g == w[:len(g)]:
            raise fail(NAME_UNTIL, f"{what}: row {i} stopped after {len(g)} tokens, but it has not "
                                   f"produced end-of-text ({eos}) yet: when one row ends, the "
                                   "others go on (never stop the whole batch for one row)")
        if len(g) > len(w) and g[:len(w)] == w:
            raise fail(NAME_UNTIL, f"{what}: row {i} goes on after its end-of-text token ({eos}, "
                                   f"new token #{len(w)}): cut each row right after its own "
                                   "end-of-text")
        raise fail(NAME_UNTIL, f"{what}: row {i} should be {w}, got {g}")
    steps = max(map(len, want))
    if len(calls) > steps:
        raise fail(NAME_UNTIL, f"{what}: {len(calls)} forward passes, but the longest row is done "
                               f"after {steps}: stop the loop once every row has ended (or the "
                               "budget is spent)")


def check_batched_generate_until(batched_generate_until) -> None:
    """Grade ``batched_generate_until(model, tokenizer, prompts, max_new_tokens)``: each row's greedy
    new tokens up to and including its own first end-of-text token (``tokenizer.eos_token_id``),
    computed as one batch, with grading-only end-of-text ids the model really produces."""

    model, tok0 = grading_model()
    guard = LearnerModel(NAME_UNTIL, model)
    cases = _until_cases(model, tok0)
    for name, prompts, n, eos in cases:
        tok = grading_tokenizer(tok0, eos)
        what = (f"{name} (eos_token_id={eos}): batched_generate_until(model, tok, <{len(prompts)}>, "
            f"{n})")
        with guard.case(eos) as mine:
            out = learner_call(NAME_UNTIL, what, batched_generate_until, mine, tok, prompts, n)
        if not isinstance(out, (list, tuple)) or len(out) != len(prompts):
            raise fail(NAME_UNTIL, f"{what}: return a list with one list of new token ids per "
                                   "prompt")
        got = [[int(t) for t in row] for row in out]
        first = guard.calls[0].ids if guard.calls else None
        if first is not None and first.shape[0] != len(prompts):
            raise fail(NAME_UNTIL, f"{what}: the first forward pass did not run the whole batch")
        want = one_by_one(model, tok, prompts, n, stop_at_eos=True)
        _grade_until(got, want, guard.calls, eos, what)
    passed(NAME_UNTIL, f"{len(cases)} batches (one row ends early, a short batch, none ends, eos "
                       "inside a prompt) stop row by row exactly like each prompt generated alone")
