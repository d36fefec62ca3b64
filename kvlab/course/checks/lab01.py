"""Graders for lab 1.

* ``check_naive_generate(naive_generate)``: ``naive_generate(model, input_ids, max_new_tokens) ->
  LongTensor [1, T + N]`` against ``model.generate(do_sample=False, use_cache=False)``;
* ``check_sample_generate(sample_generate)``: ``sample_generate(model, input_ids, max_new_tokens,
  temperature, top_k)`` against transformers' sampler under the same seed.

Each case runs the learner on a private copy of the grading model (``model.generate`` refused,
every forward call recorded, any change to the model named).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.configs import context_length
from kvlab.reference import first_difference
from ._common import (LearnerModel, check_generated_ids, confirmed, expect_value_error, fail,
                      fresh_prompts, grading_model, learner_call, passed, reference_greedy, run_cases,
                      stopped_early, synthetic)

NAME = "check_naive_generate"
NAME_SAMPLE = "check_sample_generate"


@dataclass
class Case:
    name: str
    prompt: torch.Tensor
    n: int
    eos: int | None = None      # a grading-only end-of-text id (one the model really predicts)


def grading_eos(want: torch.Tensor, T: int, at: int = 2) -> int:
    """An id the greedy continuation emits as new token ``at + 1`` and nowhere before."""
    seq = want[0].tolist()
    for j in range(T + at, len(seq)):
        if seq[j] not in seq[:j]:
            return seq[j]
    return seq[T + at]


def single_prompt_cases(model, tok, sizes=(1, 4, 9)) -> list[Case]:
    """The contract's edges: a 1-token prompt, max_new_tokens=0, the context filled exactly, the
    pad/eos id inside a prompt, and a grading-only end-of-text id the model emits."""
    prompts = fresh_prompts(tok)
    ctx = context_length(model)
    eos_prompt = torch.cat([prompts[1], torch.tensor([[tok.eos_token_id]]), prompts[3]], 1)
    want = reference_greedy(model, prompts[2], 8)
    texts = [Case(f"grader text {i}", p, n) for i, p in enumerate(prompts[:3]) for n in sizes[i % 2:]]
    # the same length and budget as an earlier case, other tokens: a remembered answer shows
    twin = Case("grader text 0's length again, other tokens",
                synthetic(prompts[0].shape[1], tok.vocab_size, salt=5), sizes[1])
    return texts + [
        twin,
        Case("a one-token prompt", synthetic(1, tok.vocab_size), 6),
        Case("max_new_tokens=0", prompts[0], 0),
        Case("a prompt that fills the context exactly", synthetic(ctx - 2, tok.vocab_size), 2),
        Case("a prompt with the end-of-text/pad id inside it", eos_prompt, 5),
        Case("a model whose end-of-text id comes up", prompts[2], 8,
             grading_eos(want, prompts[2].shape[1]))]


@torch.no_grad()
def _token_probe(model, seq: torch.Tensor, pos: int):
    """What the grader needs to explain ``seq[0, pos]``: the chosen id, the logits after the prefix,
    and what the model predicts from the last prefix token alone."""
    prefix = seq[:, :pos]
    logits = model(prefix).logits[0].float()
    alone = int(model(prefix[:, -1:]).logits[0, -1].argmax())
    return int(seq[0, pos]), logits, alone


# Why a generated token is not the greedy one: (holds for one probe, message). A reason is named only
# when it holds at two generated positions (one coincidence must not name a mistake).
_TOKEN_MISTAKES = [
    (lambda got, lg, alone: lg.shape[0] >= 2 and int(lg[-2].argmax()) == got,
     "it is the argmax of the SECOND-TO-LAST position's logits: the next token comes from the "
     "LAST position's logits"),
    (lambda got, lg, alone: lg.shape[0] >= 2 and int(lg[0].argmax()) == got,
     "it is the argmax of the FIRST position's logits: the next token comes from the LAST "
     "position's logits"),
    (lambda got, lg, alone: alone == got,
     "it is what the model predicts when it sees ONLY THE LAST TOKEN: without a cache the "
     "model must be fed the whole sequence so far (prompt + generated tokens) at every step"),
]


def diagnose_token(model, seq: torch.Tensor, pos: int, others=()) -> str:
    """Explain why ``seq[0, pos]`` is not the greedy choice after ``seq[:, :pos]``. A mistake is
    named only when it also explains the first wrong token of every one of ``others`` (the
    learner's output on another prompt, as ``(seq, pos)``); else the message says what differs."""
    got, logits, alone = _token_probe(model, seq, pos)
    want = int(logits[-1].argmax())
    gap = float(logits[-1, want] - logits[-1, got])
    if gap < 1e-2:
        return (f"its logit is only {gap:.1e} below the top one: a precision difference. Did you "
                "run the model in another dtype (half precision, autocast) or change its weights?")
    probes = [(got, logits, alone)] + [_token_probe(model, s, p) for s, p in others]
    if len(probes) >= 2:
        named = confirmed([(lambda p, f=f: f(*p), m) for f, m in _TOKEN_MISTAKES], probes)
        if named is not None:
            return named
    rank = int((logits[-1] > logits[-1, got]).sum())
    prob = float(torch.softmax(logits[-1], -1)[got])
    why = (f"the model's top choice there is token {want}, but you chose token {got} (rank {rank}, "
           f"probability {prob:.3f})")
    if len(probes) >= 2:
        return why + ", and so on another prompt: greedy decoding takes the argmax, it does not sample"
    return why + "; on another prompt your tokens came out right, so look for what differs here"


def no_cache_rule(check: str, calls, T: int) -> None:
    """Lab 1 forbids a cache: every call feeds the whole sequence so far and passes no cache."""
    for k, c in enumerate(calls, start=1):
        fed = None if c.ids is None else c.ids.shape[-1]
        if c.cache is not None or c.use_cache is True:
            raise fail(check, f"forward call #{k} passed a cache (cache=..., or use_cache=True): "
                              "lab 1 forbids a cache. Feed the whole sequence so far with "
                              "use_cache=False")
        if fed is not None and fed < T + k - 1:
            raise fail(check, f"forward call #{k} fed {fed} token(s), the sequence so far has "
                              f"{T + k - 1}: the model sees only the last token(s). Without a "
                              "cache it must be fed the whole sequence (prompt + generated "
                              "tokens) at every step")


def stale(check: str, prompt, out, want, answers) -> None:
    """Name a generator that hands back an earlier answer: its new tokens are those of an earlier
    prompt of the same length (a result remembered by shape, or kept from the previous call)."""
    T = prompt.shape[1]
    if torch.equal(out, want):
        return
    for earlier, new in answers:
        if earlier.shape == prompt.shape and not torch.equal(earlier, prompt) \
                and out.shape[1] == T + len(new) and torch.equal(out[0, T:], new):
            raise fail(check, f"prompt of {T} tokens: your new tokens are exactly those of an "
                              f"EARLIER prompt of the same length ({new.tolist()[:6]}...), not "
                              "this prompt's: your function remembers an earlier answer (a "
                              "result kept by shape, or state left from the previous call). "
                              "Compute every call from the prompt it is given")


def compare_tokens(check: str, model, out, want, T: int, n: int, other=None) -> None:
    """The tokens, token for token; on a difference, the reason, confirmed on ``other()``: the
    learner's output and the reference for another prompt of the same length."""
    i = first_difference(out[0], want[0])
    if i is not None:
        others = []
        if other is not None:
            seq, ref = other()
            j = first_difference(seq[0], ref[0]) if seq.shape == ref.shape else None
            others = [(seq, j)] if j is not None else []
        why = diagnose_token(model, out, i, others)
        raise fail(check, f"prompt of {T} tokens, max_new_tokens={n}: new token #{i - T + 1} "
                          f"(position {i}) is {int(out[0, i])}, the reference greedy token is "
                          f"{int(want[0, i])}: {why}")


def grade_single_prompts(check: str, fn_name: str, fn, use_cache: bool, rule, on_call=None) -> int:
    """The one loop of labs 1 and 2: every case of :func:`single_prompt_cases` through the learner's
    generator on a private copy of the model, then the shared checks (stops, shape, tokens) and the
    lab's own ``rule(calls, T, n)`` on the forward calls it made. Returns the number of cases."""
    model, tok = grading_model()
    guard = LearnerModel(check, model)
    answers: list = []          # (prompt, new tokens) of the cases graded so far

    def grade(case: Case) -> None:
        T, n = case.prompt.shape[1], case.n
        want = reference_greedy(model, case.prompt, n, use_cache=use_cache)
        before = case.prompt.clone()
        with guard.case(case.eos, on_call=on_call(T, n) if on_call else None) as mine:
            out = learner_call(check, f"{case.name}: {fn_name}(model, <[1, {T}] prompt>, {n})",
                               fn, mine, case.prompt, n)
        if case.eos is not None:
            stopped_early(check, out, T, n, case.eos)
        check_generated_ids(check, out, case.prompt, before, n)
        stale(check, case.prompt, out.cpu(), want, answers)
        rule(guard.calls, T, n)
        def other():                    # another prompt of this length, three more tokens
            prompt = synthetic(T, tok.vocab_size, salt=29)
            ref = reference_greedy(model, prompt, n + 3, use_cache=use_cache)
            with guard.case(case.eos) as mine:
                more = learner_call(check, f"{case.name}: {fn_name}(model, <another [1, {T}] "
                                           f"prompt>, {n + 3})", fn, mine, prompt, n + 3)
            return (more.cpu() if isinstance(more, torch.Tensor) else ref), ref

        compare_tokens(check, model, out.cpu(), want, T, n, other)
        answers.append((case.prompt, out[0, T:].cpu()))

    return run_cases(single_prompt_cases(model, tok), grade)


def check_naive_generate(naive_generate) -> None:
    """Grade a learner's naive greedy generator against ``model.generate(do_sample=False,
    use_cache=False)``, on a private copy of the model, with no cache allowed."""
    count = grade_single_prompts(NAME, "naive_generate", naive_generate, use_cache=False,
                                 rule=lambda calls, T, n: no_cache_rule(NAME, calls, T))
    passed(NAME, f"{count} cases (1-token prompt, 0 new tokens, a full context, eos inside the "
                 "prompt, an eos id that comes up) match model.generate(do_sample=False, "
                 "use_cache=False)")


# --------------------------------------------------------------------------------------- sampling

@torch.no_grad()
def simulate_sampling(model, prompt, n, seed, temperature, top_k, scale="divide"):
    """The sampler the contract describes (and its usual mistakes), one multinomial draw per step."""
    torch.manual_seed(seed)
    ids = prompt
    for _ in range(n):
        logits = model(ids, use_cache=False).logits[:, -1, :].float()
        logits = {"divide": logits / temperature, "multiply": logits * temperature,
                  "none": logits}[scale]
        if top_k:
            kth = torch.topk(logits, top_k).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        ids = torch.cat([ids, torch.multinomial(torch.softmax(logits, -1), 1)], 1)
    return ids


@torch.no_grad()
def hf_sample(model, prompt, n, seed, temperature, top_k):
    """transformers' own sampler (temperature, then top-k), seeded like the learner's run."""
    torch.manual_seed(seed)
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                          temperature=temperature, top_k=top_k or 0, top_p=1.0, max_new_tokens=n,
                          eos_token_id=None, pad_token_id=model.config.eos_token_id, use_cache=False)


_SAMPLING_MISTAKES = [
    (dict(scale="multiply"), "you MULTIPLY the logits by the temperature; divide them (logits / "
                             "T): a low temperature must sharpen the distribution"),
    (dict(scale="none"), "the temperature is ignored: divide the logits by it before the softmax"),
    (dict(top_k=None), "top_k is ignored: keep only the top_k largest logits (set the others to "
                       "-inf)"),
]


def _diagnose_sampling(model, out, case) -> str:
    prompt, n, seed, t, k = case
    greedy = reference_greedy(model, prompt, n, use_cache=False)
    if torch.equal(out, greedy):
        return ("these are the GREEDY tokens: you took the most likely token at every step; sampling "
                "draws it at random from the softmax probabilities")
    for change, message in _SAMPLING_MISTAKES:
        args = dict(temperature=t, top_k=k, scale="divide") | change
        if torch.equal(simulate_sampling(model, prompt, n, seed, **args), out):
            return message
    return ("they differ from transformers' sampler under the same seed, and no single known mistake "
            "explains it: the contract is one draw per step from the global generator, from the "
            "softmax of the top-k-filtered logits divided by the temperature, and no other random draw")


# (prompt: an index into the grader's prompts, or "one token"), new tokens, seed, temperature, top_k.
# The first samples hot (1.4, no top-k): a greedy or mis-seeded sampler shows at once; the second
# repeats it under another seed: a remembered answer shows.
_SAMPLE_CASES = [(3, 10, 12, 1.4, None), (3, 10, 16, 1.4, None), (0, 12, 11, 0.7, 20), (2, 8, 13, 1.0, 5),
                 (1, 6, 14, 0.3, 1), ("one token", 5, 15, 2.0, 50)]


def _sampled(guard, sample_generate, what, case, seed):
    prompt, n, _, t, k = case
    with guard.case() as mine:
        torch.manual_seed(seed)
        return learner_call(NAME_SAMPLE, what, sample_generate, mine, prompt, n, t, k)


def _refuse_an_ignored_seed(model, guard, sample_generate, what, case, out, want) -> None:
    """The same tokens under another seed, where transformers' sampler gives others: the learner's
    sampler does not draw from the generator torch.manual_seed sets (greedy tokens aside: named later)."""
    prompt, n, seed, t, k = case
    if torch.equal(out, reference_greedy(model, prompt, n, use_cache=False)):
        return
    other = _sampled(guard, sample_generate, what, case, seed + 1000)
    if torch.equal(other.cpu(), out) and not torch.equal(want, hf_sample(model, prompt, n, seed + 1000, t, k)):
        raise fail(NAME_SAMPLE, f"{what} gave the same tokens after torch.manual_seed({seed}) and after "
                                f"torch.manual_seed({seed + 1000}): your sampler does not draw from the global "
                                "generator that torch.manual_seed sets (a generator of your own, or a "
                                "remembered result)")


def _grade_sample(model, guard, sample_generate, case) -> None:
    prompt, n, seed, t, k = case
    what = f"sample_generate(model, <[1, {prompt.shape[1]}]>, {n}, temperature={t}, top_k={k})"
    out = _sampled(guard, sample_generate, what, case, seed)
    check_generated_ids(NAME_SAMPLE, out, prompt, prompt.clone(), n)
    want = hf_sample(model, prompt, n, seed, t, k)
    if torch.equal(out.cpu(), want):
        return
    _refuse_an_ignored_seed(model, guard, sample_generate, what, case, out.cpu(), want)
    raise fail(NAME_SAMPLE, f"{what} after torch.manual_seed({seed}): " + _diagnose_sampling(model, out.cpu(), case))


def check_sample_generate(sample_generate) -> None:
    """Grade ``sample_generate(model, input_ids, max_new_tokens, temperature, top_k)`` against
    ``model.generate(do_sample=True, ...)`` run after the same ``torch.manual_seed``."""
    model, tok = grading_model()
    prompts = fresh_prompts(tok)
    guard = LearnerModel(NAME_SAMPLE, model)
    cases = [(synthetic(1, tok.vocab_size) if p == "one token" else prompts[p], *rest)
             for p, *rest in _SAMPLE_CASES]
    count = run_cases(cases, lambda case: _grade_sample(model, guard, sample_generate, case))
    for bad in (0, -1.0):
        with guard.case() as mine:
            expect_value_error(NAME_SAMPLE, f"temperature={bad}", sample_generate, mine, prompts[0], 2, bad, None)
    passed(NAME_SAMPLE, f"{count} seeded runs (temperatures 0.3..2, top_k 1..50 or none) equal "
                        "transformers' sampler token for token; temperature <= 0 rejected")

