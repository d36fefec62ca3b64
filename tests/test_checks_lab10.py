"""Lab 10's graders against the mistakes learners make, and against unusual correct solutions."""

import pytest
import torch

from kvlab.course.checks import check_speculative_step, check_speedup_prediction
from kvlab.speculative import verify as library_verify

from utils import one_step_removed
from utils import expect_rejected


def make_step(bonus="target", rewind=0, rewind_draft=True, off_by_one=False, eos=True, one_forward=True):
    """A verify-accept-rewind step with one mistake switched on (the defaults: a correct step)."""

    @torch.no_grad()
    def step(target, cache, draft, tokens, k, eos_token_id=None):
        drafted = draft.propose(tokens, k)
        L = len(tokens)
        dev = target.wte.weight.device
        if one_forward:
            choice = target(torch.tensor([[tokens[-1], *drafted]], device=dev), cache)[0].argmax(-1).tolist()
        else:                                   # one forward per token: right tokens, no speculation
            choice = [int(target(torch.tensor([[t]], device=dev), cache)[0, -1].argmax())
                      for t in [tokens[-1], *drafted]]
        limit = len(drafted) - 1 if off_by_one else len(drafted)
        n = 0
        while n < limit and drafted[n] == choice[n]:
            n += 1
        new = drafted[:n] + {"target": [choice[n]], "draft": drafted[n:n + 1] or [choice[n]], "none": []}[bonus]
        if eos and eos_token_id is not None and eos_token_id in new:
            new = new[:new.index(eos_token_id) + 1]
        keep = L + len(new) - 1
        if rewind is not None:
            cache.rewind(keep + rewind)
        if rewind_draft:
            draft.cache.rewind(min(draft.cache.seq_len, keep))
        return new
    return step


def test_a_correct_step_passes(capsys):
    check_speculative_step(make_step())
    assert "PASSED check_speculative_step" in capsys.readouterr().out


@pytest.mark.parametrize("step, needles", [
    (make_step(bonus="none"), ["target's own token is missing"]),
    (make_step(bonus="draft"), ["REJECTED draft token"]),
    (make_step(rewind=None), ["was not rewound"]),
    (make_step(rewind=-1), ["one token too far"]),
    (make_step(rewind=1), ["one token too many"]),
    (make_step(rewind_draft=False), ["draft's cache was left ahead"]),
    (make_step(off_by_one=True), ["every draft is accepted", "k + 1"]),
    (make_step(eos=False), ["after the end-of-text token"]),
    (make_step(one_forward=False), ["ONE forward", "[1, 1, 1, 1, 1]"]),
], ids=["bonus forgotten", "bonus from the draft", "cache not rewound", "rewound one too far",
        "rewound one too short", "draft cache ahead", "off by one at full acceptance", "EOS ignored",
        "a forward per token"])
def test_each_mistake_is_named(step, needles):
    expect_rejected(check_speculative_step, step, *needles)


def test_unusual_correct_steps_pass():
    """Acceptance counted with tensor ops; the draft's cache reset instead of rewound (wasteful, correct);
    a tensor returned; positions given explicitly."""

    @torch.no_grad()
    def vectorised(target, cache, draft, tokens, k, eos_token_id=None):
        d = torch.tensor(draft.propose(tokens, k), dtype=torch.long)
        L = len(tokens)
        x = torch.cat([torch.tensor([tokens[-1]]), d])[None]
        pos = torch.arange(L - 1, L + len(d))[None]
        choice = target(x, cache, positions=pos)[0].argmax(-1)
        n = int(torch.cumprod((d == choice[:len(d)]).long(), 0).sum()) if len(d) else 0
        new = torch.cat([d[:n], choice[n:n + 1]])
        if eos_token_id is not None and (new == eos_token_id).any():
            new = new[:int((new == eos_token_id).nonzero()[0]) + 1]
        cache.rewind(L + len(new) - 1)
        draft.cache.reset()
        return new

    check_speculative_step(vectorised)


def test_a_library_step_is_refused():
    def lazy(target, cache, draft, tokens, k, eos_token_id=None):
        return library_verify(target, cache, tokens, draft.propose(tokens, k))

    expect_rejected(check_speculative_step, lazy, "library")


# ---------------------------------------------------------------------------------------------------
# The prediction


def e_ok(alpha, k):
    return k + 1 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def s_ok(alpha, k, c, v):
    return e_ok(alpha, k) / (k * c + v)


def choose_ok(alpha, c, v):
    return max(v, key=lambda k: s_ok(alpha, k, c, v[k]))


MEASURED = {"alpha": 0.5, "c": 0.2, "V": {1: 1.2, 2: 1.5, 4: 2.2}, "speedup": {1: 0.8, 2: 0.7, 4: 0.6}}


def test_prediction_passes_and_is_graded_against_the_measurement(capsys):
    check_speedup_prediction(e_ok, s_ok, choose_ok, False, MEASURED)
    assert "PASSED check_speedup_prediction" in capsys.readouterr().out
    expect_rejected(lambda pays: check_speedup_prediction(e_ok, s_ok, choose_ok, pays, MEASURED), True, "pays=True")
    near = dict(MEASURED, speedup={1: 1.05, 2: 0.7, 4: 0.6})        # within the noise: either answer stands
    check_speedup_prediction(e_ok, s_ok, choose_ok, True, near)
    check_speedup_prediction(e_ok, s_ok, choose_ok, False, near)


@pytest.mark.parametrize("fns, needles", [
    ((lambda a, k: 1.0 * k if a == 1 else (1 - a ** k) / (1 - a), s_ok, choose_ok), ["exponent is k + 1"]),
    ((lambda a, k: (1 - a ** (k + 1)) / (1 - a), s_ok, choose_ok), ["expected_tokens(1.0"]),
    ((e_ok, lambda a, k, c, v: e_ok(a, k) / (k * c + 1), choose_ok), ["V(k) taken as 1"]),
    ((e_ok, lambda a, k, c, v: e_ok(a, k) / (c + v), choose_ok), ["k * c"]),
    ((e_ok, s_ok, lambda a, c, v: max(v, key=lambda k: e_ok(a, k))), ["most tokens per step"]),
], ids=["bonus left out of E", "alpha = 1 divides by zero", "V ignored", "draft cost once", "k by tokens per step"])
def test_prediction_mistakes(fns, needles):
    expect_rejected(lambda f: check_speedup_prediction(*f, False, MEASURED), fns, *needles)


def test_the_library_one_step_removed_is_refused_by_what_runs():
    """Issue 34, kind 1, in lab 10: the library's verify reached without its name is refused, naming
    what ran; calling the target and its cache's rewind (what the step is handed) is allowed (every
    correct step above does)."""
    for how, verify in one_step_removed(library_verify).items():
        def step(target, cache, draft, tokens, k, eos_token_id=None, _verify=verify):
            return _verify(target, cache, tokens, draft.propose(tokens, k))
        expect_rejected(check_speculative_step, step, "ran kvlab.speculative.verify", "write it yourself")
