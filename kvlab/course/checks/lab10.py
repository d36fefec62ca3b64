"""Graders for lab 10: speculative decoding.

* ``check_speculative_step(step)``: the learner's greedy verify-accept-rewind step,
  ``step(target, cache, draft, tokens, k, eos_token_id=None) -> new tokens``, on prompts it has not
  seen and scripted drafts that reject at the first, a middle and the last position, accept every
  draft, hold an end-of-text token; then whole runs with a real draft, token for token against plain
  greedy decoding. The target and the draft run in float64 here, so no near-tie of the logits can
  flip between the verify pass and plain decoding: a difference is a mistake.
* ``check_speedup_prediction(expected_tokens, predicted_speedup, choose_k, pays, measured)``: the
  theory's formulas on unseen numbers (float64 reference), then the learner's prediction against
  the learner's own measurement.

Each mistake below is named only when it explains the failing scenario on two different prompts
(:func:`._common.confirmed`); otherwise the message says what was expected and what came back.
"""

from __future__ import annotations

import copy
import functools
import math
import numbers

import torch

from ._common import GRADER_TEXTS, confirmed, fail, grading_model, learner_call, passed
from kvlab.gpt2 import GPT2
from kvlab.speculative import greedy_reference

NAME_STEP = "check_speculative_step"
NAME_PREDICT = "check_speedup_prediction"


# ---------------------------------------------------------------------------------------------------
# The draft the grader hands in: a real small model and its own cache, its proposals scripted or not


class LabDraft:
    """``propose(tokens, k)``: ``k`` tokens continuing ``tokens``; the draft's cache then holds the
    text it has seen plus its proposals but the last (as a real draft's does). ``script(tokens, k)``,
    when given, decides the tokens (a scripted rejection); the model still runs them through its cache."""

    def __init__(self, model: GPT2, max_len: int, script=None):
        self.model, self.script = model, script
        self.cache = model.new_cache(1, max_len)

    @torch.no_grad()
    def propose(self, tokens, k: int) -> list[int]:
        tokens = [int(t) for t in tokens]
        if self.cache.seq_len > len(tokens) - 1:
            raise fail(NAME_STEP, f"the draft's cache holds {self.cache.seq_len} tokens but the text has only "
                                  f"{len(tokens)}: the draft's cache was left ahead of the accepted text")
        dev = self.model.wte.weight.device
        feed = lambda ids: self.model(torch.tensor([ids], device=dev), self.cache, last_only=True)[0, -1]  # noqa: E731
        if k == 0:
            return []
        if self.script is not None:
            out = list(self.script(tokens, k))
            feed(tokens[self.cache.seq_len:] + out[:-1])
            return out
        logits, out = feed(tokens[self.cache.seq_len:]), []
        for i in range(k):
            out.append(int(logits.argmax()))
            if i + 1 < k:
                logits = feed(out[-1:])
        return out


@functools.lru_cache(maxsize=1)
def _models():
    """The target (kvlab-tiny) and the draft (kvlab-nano), hand-built, float64, and the tokenizer."""
    from kvlab.loading import load

    hf, tok = grading_model("kvlab-tiny")
    nano = load("kvlab-nano", device="cpu")[0]
    return GPT2.from_hf(hf).double().eval(), GPT2.from_hf(nano).double().eval(), tok


class Counted:
    """The learner's private copy of the target, counting its forward calls and their token counts."""

    def __init__(self, target: GPT2):
        self.model = copy.deepcopy(target)
        inner, self.calls = self.model.forward, []

        def forward(input_ids, *args, **kwargs):
            self.calls.append(int(input_ids.shape[-1]))
            return inner(input_ids, *args, **kwargs)
        self.model.forward = forward


# ---------------------------------------------------------------------------------------------------
# One step from a known state: what came back, and what should have


SCENARIOS = [   # name, k, the draft position the script gets wrong (None: none), the end-of-text position
    ("rejects the first draft", 4, 0, None),
    ("rejects a middle draft", 5, 2, None),
    ("rejects the last draft", 3, 2, None),
    ("accepts every draft", 4, None, None),
    ("k = 1, accepted", 1, None, None),
    ("k = 1, rejected", 1, 0, None),
    ("an end-of-text token among the accepted drafts", 5, None, 2),
    ("no draft at all (k = 0: a plain decode step)", 0, None, None),
]


def _tokens_of(check, out) -> list[int]:
    if isinstance(out, torch.Tensor):
        out = out.reshape(-1).tolist()
    if not isinstance(out, (list, tuple)) or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                                     for t in out):
        raise fail(check, f"step must return the new tokens as a list of ints, got {type(out).__name__}: {out!r}")
    return [int(t) for t in out]


def _eos_position(ref, at):
    """A position >= ``at`` whose token does not occur earlier in ``ref`` (a real end-of-text there)."""
    return next((i for i in range(at, len(ref)) if ref[i] not in ref[:i]), None)


@torch.no_grad()
def observe(step, prompt: list[int], scenario) -> dict:
    """Run the learner's step once from a prefilled state; everything the diagnosis needs."""
    name, k, wrong_at, eos_at = scenario
    target, nano, _ = _models()
    tokens = greedy_reference(target, torch.tensor([prompt]), 1)[0].tolist()   # the prompt + 1st token
    L = len(tokens)
    ref = greedy_reference(target, torch.tensor([tokens]), k + 1)[0, L:].tolist()   # the target's next k+1
    drafted = list(ref[:k])
    if wrong_at is not None:
        drafted[wrong_at] = (drafted[wrong_at] + 1) % target.config.vocab_size
    n = k if wrong_at is None else wrong_at
    expected, eos = ref[:n + 1], None
    if eos_at is not None:
        e = _eos_position(ref[:k], eos_at)
        eos, expected = ref[e], ref[:e + 1]
    counted = Counted(target)
    cache = counted.model.new_cache(1, L + k + 4)
    counted.model(torch.tensor([tokens[:-1]]), cache)            # the cache holds all but the pending token
    counted.calls.clear()
    draft = LabDraft(nano, L + k + 4, script=lambda t, kk: drafted[:kk])
    out = learner_call(NAME_STEP, f"step(target, cache, draft, tokens, k={k}, eos_token_id={eos}) "
                                  f"[scenario: {name}]", step, counted.model, cache, draft, list(tokens), k, eos)
    return {"name": name, "k": k, "L": L, "n": n, "ref": ref, "drafted": drafted, "expected": expected,
            "eos": eos, "out": _tokens_of(NAME_STEP, out), "cache": cache.seq_len,
            "draft_cache": draft.cache.seq_len, "calls": list(counted.calls)}


def _right(o) -> bool:
    keep = o["L"] + len(o["expected"]) - 1
    return (o["out"] == o["expected"] and o["cache"] == keep and o["draft_cache"] <= keep
            and o["calls"] == [o["k"] + 1])


def _keep(o):
    return o["L"] + len(o["expected"]) - 1


MISTAKES = [   # (explains(observation), message): the first that explains BOTH probes is named
    (lambda o: o["n"] == o["k"] and o["eos"] is None and o["out"] == o["ref"][:o["k"]],
     "when every draft is accepted you emitted k tokens, not k + 1: your accepted count stops one short of "
     "k (or skips the bonus at full acceptance); row k of the logits, after the last draft, is a free token"),
    (lambda o: o["out"] == o["expected"][:-1] and o["eos"] is None,
     "the target's own token is missing: after the n accepted drafts, add the target's choice at row n "
     "(the correction after a rejection, the free extra token when all k were accepted). A step must "
     "always emit at least one token, or generation never advances"),
    (lambda o: o["n"] < o["k"] and o["out"] == o["drafted"][:o["n"] + 1],
     "after the last accepted draft you emitted the REJECTED draft token: the token that follows must be "
     "the target's own choice at that row (logits row n, argmax), not the draft's"),
    (lambda o: o["eos"] is not None and o["out"][:len(o["expected"])] == o["expected"]
     and len(o["out"]) > len(o["expected"]),
     "you emitted tokens after the end-of-text token: generation ends at eos_token_id, so cut the new "
     "tokens right after the first one (drafts after it are never emitted)"),
    (lambda o: o["out"] == o["expected"] and o["calls"] != [o["k"] + 1],
     "verify every draft in ONE forward of k + 1 tokens (the pending last token, then the k drafts): "
     "that single pass is the whole point of speculation; your step made forward calls of these token counts"),
    (lambda o: o["out"] == o["expected"] and o["cache"] == o["L"] + o["k"] and o["L"] + o["k"] != _keep(o),
     "the target's cache was not rewound: after the verify pass it holds every drafted token, rejected ones "
     "included; rewind it to len(tokens) + len(new) - 1 (all but the new pending token)"),
    (lambda o: o["out"] == o["expected"] and o["cache"] == _keep(o) - 1,
     "the target's cache was rewound one token too far: it must keep the pending token and every accepted "
     "draft, len(tokens) + len(new) - 1 tokens (only the newest token is left out, to be fed next)"),
    (lambda o: o["out"] == o["expected"] and o["cache"] == _keep(o) + 1,
     "the target's cache keeps one token too many: the newest token (the target's own) was never fed "
     "through it; rewind to len(tokens) + len(new) - 1"),
    (lambda o: o["out"] == o["expected"] and o["cache"] == _keep(o) and o["draft_cache"] > _keep(o),
     "the draft's cache was left ahead: it still holds drafts the target rejected (or the text past an "
     "end-of-text); rewind it too, to at most len(tokens) + len(new) - 1"),
]


def _generic(o) -> str:
    return (f"scenario '{o['name']}' (k={o['k']}, {o['L']} tokens so far): expected new tokens {o['expected']}, "
            f"the target's cache at {_keep(o)} and the draft's at most there, one forward of {o['k'] + 1} "
            f"tokens; got {o['out']}, the target's cache at {o['cache']}, the draft's at {o['draft_cache']}, "
            f"forward calls of {o['calls']} tokens")


def _grade_scenario(step, prompts, scenario) -> None:
    probes = [observe(step, p, scenario) for p in prompts]
    wrong = [o for o in probes if not _right(o)]
    if not wrong:
        return
    message = confirmed(MISTAKES, probes)
    detail = _generic(wrong[0])
    if message and "forward calls" in message:
        message += f" {wrong[0]['calls']}"
    raise fail(NAME_STEP, f"{message}. ({detail})" if message else detail)


# ---------------------------------------------------------------------------------------------------
# Whole runs: the learner's step in the speculative loop, against plain greedy decoding


@torch.no_grad()
def speculative_loop(step, target, draft_model, prompt: list[int], new_tokens: int, k: int) -> list[int]:
    """The loop around a step (the one the lab gives the learner): prefill, first token, then steps
    that never draft past the end of the run."""
    end = len(prompt) + new_tokens
    cache = target.new_cache(1, end)
    tokens = list(prompt) + [int(target(torch.tensor([prompt]), cache)[0, -1].argmax())]
    draft = LabDraft(draft_model, end)
    while len(tokens) < end:
        room = min(k, end - len(tokens) - 1)
        new = _tokens_of(NAME_STEP, learner_call(NAME_STEP, "step(...) in the speculative loop", step, target,
                                                 cache, draft, list(tokens), room, None))
        if not 1 <= len(new) <= room + 1:
            raise fail(NAME_STEP, f"a step with {room} drafts returned {len(new)} tokens: it must return between "
                                  f"1 and {room + 1} (the accepted drafts, then the target's own token)")
        tokens += new
        if cache.seq_len != len(tokens) - 1 or draft.cache.seq_len > len(tokens) - 1:
            raise fail(NAME_STEP, f"after a step the target's cache holds {cache.seq_len} tokens (must be "
                                  f"{len(tokens) - 1}) and the draft's {draft.cache.seq_len} (at most that)")
    return tokens


def _grade_run(step, prompt, new_tokens, k) -> None:
    target, nano, _ = _models()
    got = speculative_loop(step, Counted(target).model, nano, prompt, new_tokens, k)
    want = greedy_reference(target, torch.tensor([prompt]), new_tokens)[0].tolist()
    if got != want:
        at = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        raise fail(NAME_STEP, f"a whole run with kvlab-nano drafting (k={k}, {len(prompt)}-token prompt) differs "
                              f"from plain greedy decoding at token {at}: {got[at]} instead of {want[at]}")


def check_speculative_step(step) -> None:
    """Grade ``step(target, cache, draft, tokens, k, eos_token_id=None) -> new tokens``."""
    target, _, tok = _models()
    prompts = [tok(t).input_ids for t in GRADER_TEXTS[1:3]]
    for scenario in SCENARIOS:
        _grade_scenario(step, prompts, scenario)
    long = [(37 * i + 5) % target.config.vocab_size for i in range(target.config.n_positions - 9)]
    for prompt, n, k in ((tok(GRADER_TEXTS[0]).input_ids, 20, 3), (tok(GRADER_TEXTS[4]).input_ids, 16, 6),
                         (long, 9, 5)):
        _grade_run(step, prompt, n, k)
    passed(NAME_STEP, f"{len(SCENARIOS)} scripted scenarios on 2 unseen prompts each (rejections at the first, "
                      "a middle and the last draft, full acceptance, end-of-text, k = 0 and 1), and 3 whole runs "
                      "with kvlab-nano drafting (one filling the context) equal plain greedy decoding; both caches "
                      "rewound right")


# ---------------------------------------------------------------------------------------------------
# The prediction: the theory's formulas, then the learner's own measurement


def _e(alpha, k):
    return k + 1.0 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def _s(alpha, k, c, v):
    return _e(alpha, k) / (k * c + v)


def _close(a, b) -> bool:
    return isinstance(a, numbers.Real) and math.isclose(float(a), b, rel_tol=1e-6, abs_tol=1e-9)


def _grade_formulas(expected_tokens, predicted_speedup, choose_k) -> None:
    for alpha, k in ((0.5, 1), (0.8, 4), (0.0, 3), (1.0, 5), (0.37, 7), (0.999999, 2)):
        got = learner_call(NAME_PREDICT, f"expected_tokens({alpha}, {k})", expected_tokens, alpha, k)
        if not _close(got, _e(alpha, k)):
            hint = (" (that is the formula without the target's own token: the exponent is k + 1)"
                    if _close(got, _e(alpha, k - 1)) else " (alpha = 1: every draft accepted gives k + 1)"
                    if alpha == 1 else "")
            raise fail(NAME_PREDICT, f"expected_tokens({alpha}, {k}) = {got!r}, the theory gives {_e(alpha, k):.6f}{hint}")
    for alpha, k, c, v in ((0.6, 3, 0.15, 1.2), (0.8, 5, 0.05, 1.0), (0.4, 2, 0.5, 2.0)):
        got = learner_call(NAME_PREDICT, f"predicted_speedup({alpha}, {k}, {c}, {v})", predicted_speedup, alpha, k, c, v)
        if not _close(got, _s(alpha, k, c, v)):
            hint = (" (with V(k) taken as 1: use the measured V(k))" if _close(got, _s(alpha, k, c, 1.0)) else
                    " (the draft runs k times: its cost is k * c)" if _close(got, _e(alpha, k) / (c + v)) else "")
            raise fail(NAME_PREDICT, f"predicted_speedup({alpha}, {k}, {c}, {v}) = {got!r}, the theory gives "
                                     f"{_s(alpha, k, c, v):.6f}{hint}")
    cases = ((0.7, 0.05, {1: 1.0, 2: 1.02, 4: 1.05, 8: 1.6}), (0.5, 0.3, {1: 1.1, 2: 1.2, 3: 1.3, 6: 1.6}),
             (0.9, 0.01, {1: 1.0, 3: 1.0, 5: 1.01, 9: 1.02}))
    for alpha, c, v in cases:
        want = max(v, key=lambda k: _s(alpha, k, c, v[k]))
        got = learner_call(NAME_PREDICT, f"choose_k({alpha}, {c}, {v})", choose_k, alpha, c, dict(v))
        if got != want:
            by_e = max(v, key=lambda k: _e(alpha, k))
            hint = (": that k makes the most tokens per step, but the speed-up also pays for drafting and "
                    "verifying them" if got == by_e else "")
            raise fail(NAME_PREDICT, f"choose_k({alpha}, {c}, {v}) = {got!r}; the theory's best is k={want} "
                                     f"(speed-up {_s(alpha, want, c, v[want]):.3f}){hint}")


def check_speedup_prediction(expected_tokens, predicted_speedup, choose_k, pays, measured: dict) -> None:
    """``measured``: the learner's own ``{"alpha", "c", "V": {k: V(k)}, "speedup": {k: measured}}``;
    ``pays``: the learner's answer, does speculation beat plain greedy here at the chosen k?"""
    _grade_formulas(expected_tokens, predicted_speedup, choose_k)
    a, c, v, clock = measured["alpha"], measured["c"], measured["V"], measured["speedup"]
    k = learner_call(NAME_PREDICT, "choose_k(your alpha, c, V)", choose_k, a, c, dict(v))
    if k not in clock:
        raise fail(NAME_PREDICT, f"your choose_k picked k={k} from your measurement, but you timed only k in "
                                 f"{sorted(clock)}: time the k you chose")
    s = clock[k]
    if not isinstance(pays, bool):
        raise fail(NAME_PREDICT, f"pays must be True or False, got {pays!r}")
    if abs(s - 1) > 0.10 and pays != (s > 1):
        raise fail(NAME_PREDICT, f"you answered pays={pays}, but your own measurement at k={k} is a speed-up of "
                                 f"{s:.2f}x: speculation {'beat' if s > 1 else 'lost to'} plain greedy here")
    passed(NAME_PREDICT, f"the theory's formulas on unseen numbers; from your measurement it picks k={k}, predicting "
                         f"{_s(a, k, c, v[k]):.2f}x; your clock said {s:.2f}x"
                         + (" (within 10% of even: either answer to 'pays' stands)" if abs(s - 1) <= 0.10 else ""))
