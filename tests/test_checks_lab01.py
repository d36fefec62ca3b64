"""The lab-1 grader accepts the reference and rejects each known mistake with a pointed message."""

import pytest
import torch

from kvlab.course.checks import check_naive_generate
from kvlab.reference import naive_generate as reference

from utils import expect_rejected, one_step_removed, own_copy

reference = own_copy(reference)          # the graders refuse the library's own code



def test_accepts_reference(capsys):
    check_naive_generate(reference)
    assert "PASSED check_naive_generate" in capsys.readouterr().out


@torch.no_grad()
def only_new_tokens(model, ids, n):
    return reference(model, ids, n)[:, ids.shape[1]:]


@torch.no_grad()
def one_too_few(model, ids, n):
    return reference(model, ids, max(n - 1, 0))


@torch.no_grad()
def one_too_many(model, ids, n):
    for _ in range(n + 1):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids


@torch.no_grad()
def sampling(model, ids, n):
    for _ in range(n):
        probs = torch.softmax(model(ids).logits[:, -1], -1)
        ids = torch.cat([ids, torch.multinomial(probs, 1)], 1)
    return ids


@torch.no_grad()
def wrong_position(model, ids, n):
    for _ in range(n):
        pos = -2 if ids.shape[1] > 1 else -1
        ids = torch.cat([ids, model(ids).logits[:, pos].argmax(-1, keepdim=True)], 1)
    return ids


@torch.no_grad()
def first_position(model, ids, n):
    for _ in range(n):
        ids = torch.cat([ids, model(ids).logits[:, 0].argmax(-1, keepdim=True)], 1)
    return ids


@torch.no_grad()
def last_token_only(model, ids, n):
    for _ in range(n):
        ids = torch.cat([ids, model(ids[:, -1:]).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids


@torch.no_grad()
def returns_list(model, ids, n):
    return reference(model, ids, n)[0].tolist()


@torch.no_grad()
def mutates_input(model, ids, n):
    out = reference(model, ids, n)
    ids.zero_()
    return out


@pytest.mark.parametrize("impl, needles", [
    (only_new_tokens, ["only the new ones"]),
    (one_too_few, ["off-by-one"]),
    (one_too_many, ["off-by-one"]),
    (sampling, ["sample"]),
    (wrong_position, ["second-to-last"]),
    (first_position, ["first position"]),
    (last_token_only, ["only the last token"]),
    (returns_list, ["torch.tensor"]),
    (mutates_input, ["in place"]),
])
def test_rejects(impl, needles):
    expect_rejected(check_naive_generate, impl, *needles)


# ------------------------------------------------ issue 18: hardened grader (edges, model, shortcuts)

from transformers import DynamicCache  # noqa: E402

from kvlab.course.checks import check_sample_generate  # noqa: E402


@torch.no_grad()
def stops_at_eos(model, ids, n):
    for _ in range(n):
        nxt = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], 1)
        if int(nxt) == model.config.eos_token_id:
            break
    return ids


@torch.no_grad()
def uses_a_cache(model, ids, n):
    cache, nxt, out = DynamicCache(config=model.config), ids, ids
    for _ in range(n):
        nxt = model(nxt, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        out = torch.cat([out, nxt], 1)
    return out


def calls_generate(model, ids, n):
    return model.generate(ids, max_new_tokens=n, do_sample=False)


def casts_to_half(model, ids, n):
    model.half()
    return reference(model, ids, n)


def edits_weights(model, ids, n):
    with torch.no_grad():
        model.transformer.wte.weight[1] += 1.0
    return reference(model, ids, n)


def leaves_a_hook(model, ids, n):
    model.transformer.h[0].register_forward_hook(lambda *a: None)
    return reference(model, ids, n)


def switches_to_train(model, ids, n):
    model.train()
    return reference(model, ids, n)


@torch.no_grad()
def at_least_one_token(model, ids, n):
    for _ in range(max(n, 1)):
        ids = torch.cat([ids, model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids


@torch.no_grad()
def crashes(model, ids, n):
    nxt = model(ids, use_cache=False).logits[:, -1].argmax(-1)      # [1], not [1, 1]
    return torch.cat([ids, nxt], 1)


@pytest.mark.parametrize("impl, needles", [
    (stops_at_eos, ["end-of-text", "exactly"]),
    (uses_a_cache, ["forbids a cache"]),
    (calls_generate, ["model.generate"]),
    (casts_to_half, ["changed the model", "torch.float16"]),
    (edits_weights, ["edited in place", "wte"]),
    (leaves_a_hook, ["hook"]),
    (switches_to_train, ["training mode"]),
    (at_least_one_token, ["max_new_tokens=0"]),
    (crashes, ["naive_generate(model", "raised RuntimeError"]),
])
def test_rejects_hardened(impl, needles):
    expect_rejected(check_naive_generate, impl, *needles)


@torch.no_grad()
def via_forward(model, ids, n):
    """Unusual but correct: model.forward called directly, a while loop."""
    while ids.shape[1] < ids.shape[1] + n and n > 0:
        ids = torch.cat([ids, model.forward(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
        n -= 1
    return ids


def test_accepts_model_forward(capsys):
    check_naive_generate(via_forward)
    assert "PASSED" in capsys.readouterr().out


@torch.no_grad()
def sampler(model, ids, n, temperature=1.0, top_k=None, scale=lambda l, t: l / t, draws=1):
    if temperature <= 0:
        raise ValueError("temperature must be > 0")
    for _ in range(n):
        logits = scale(model(ids, use_cache=False).logits[:, -1, :], temperature)
        if top_k is not None:
            logits = logits.masked_fill(logits < torch.topk(logits, top_k).values[:, -1:], float("-inf"))
        for _ in range(draws - 1):
            torch.rand(1)
        ids = torch.cat([ids, torch.multinomial(torch.softmax(logits, -1), 1)], 1)
    return ids


def test_sampler_accepts_reference(capsys):
    check_sample_generate(sampler)
    assert "PASSED check_sample_generate" in capsys.readouterr().out


@torch.no_grad()
def greedy_sampler(model, ids, n, temperature=1.0, top_k=None):
    if temperature <= 0:
        raise ValueError("temperature")
    return reference(model, ids, n)


def no_value_error(model, ids, n, temperature=1.0, top_k=None):
    return sampler(model, ids, n, max(temperature, 1e-3), top_k)


@pytest.mark.parametrize("impl, needles", [
    (greedy_sampler, ["GREEDY"]),
    (lambda m, i, n, t=1.0, k=None: sampler(m, i, n, t, k, scale=lambda l, t: l * t), ["MULTIPLY"]),
    (lambda m, i, n, t=1.0, k=None: sampler(m, i, n, t, None), ["top_k is ignored"]),
    (lambda m, i, n, t=1.0, k=None: sampler(m, i, n, t, k, draws=2), ["same seed"]),
    (no_value_error, ["temperature=0", "ValueError"]),
])
def test_sampler_rejects(impl, needles):
    expect_rejected(check_sample_generate, impl, *needles)


@torch.no_grad()
def article_a_step_count(model, ids, n):
    """Article A's loop bound: ``range(max_length - len(input_ids))`` on a ``[1, T]`` tensor. ``len``
    is the batch size, 1, so the loop runs ``max_length - 1`` steps whatever the prompt's length."""
    max_length = ids.shape[1] + n
    for _ in range(max_length - len(ids)):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids


def test_rejects_article_a_step_count():
    # right for a one-token prompt (len() happens to equal T), wrong for every longer one
    expect_rejected(check_naive_generate, article_a_step_count, "prompt of", "expected")


# ------------------------------------------------ issue 24: the dtype it ran in, stale answers

def under_bf16_autocast(model, ids, n):
    """Runs every forward under bf16 autocast: on these prompts the argmax happens not to change."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return reference(model, ids, n)


_REMEMBERED: dict = {}


def remembers_by_shape(model, ids, n):
    """Keeps the new tokens of the first prompt of each (length, budget) and hands them out again."""
    key = (ids.shape[1], n)
    if key not in _REMEMBERED:
        _REMEMBERED[key] = reference(model, ids, n)[:, ids.shape[1]:]
    return torch.cat([ids, _REMEMBERED[key]], 1)


@pytest.mark.parametrize("impl, needles", [
    (under_bf16_autocast, ["autocast(bfloat16)", "float32"]),
    (remembers_by_shape, ["earlier prompt of the same length", "remembers"]),
])
def test_rejects_other_dtype_and_stale(impl, needles):
    _REMEMBERED.clear()
    expect_rejected(check_naive_generate, impl, *needles)


_SEEDED = torch.Generator()


def own_generator_sampler(model, ids, n, temperature=1.0, top_k=None):
    """Draws from a generator of its own, seeded once: the same tokens whatever manual_seed says."""
    _SEEDED.manual_seed(0)
    state = torch.random.get_rng_state()
    torch.random.set_rng_state(_SEEDED.get_state())
    try:
        return sampler(model, ids, n, temperature, top_k)
    finally:
        torch.random.set_rng_state(state)


def test_sampler_rejects_a_seed_of_its_own():
    expect_rejected(check_sample_generate, own_generator_sampler, "same tokens after torch.manual_seed", "global generator")


def test_library_refused():
    from kvlab.reference import naive_generate

    expect_rejected(check_naive_generate, naive_generate, "kvlab.reference.naive_generate",
                    "write it yourself")


@torch.no_grad()
def second_to_last_on_grader_text_0_only(model, ids, n):
    """Takes the second-to-last position's argmax, but only for prompts that start like grader text
    0: one prompt cannot tell this from a coincidence, so the grader must not name the mistake."""
    from kvlab.course.checks._common import GRADER_TEXTS
    from kvlab.loading import load

    first = load("kvlab-tiny")[1](GRADER_TEXTS[0]).input_ids[0]
    if int(ids[0, 0]) != first or ids.shape[1] < 2:
        return reference(model, ids, n)
    for _ in range(n):
        ids = torch.cat([ids, model(ids).logits[:, -2].argmax(-1, keepdim=True)], 1)
    return ids


def test_a_diagnosis_needs_a_second_prompt():
    msg = expect_rejected(check_naive_generate, second_to_last_on_grader_text_0_only,
                          "on another prompt your tokens came out right")
    assert "SECOND-TO-LAST" not in msg


def test_the_library_one_step_removed_is_refused_by_what_runs(capsys):
    """Issue 34, kind 1, in lab 1: the library's generator with no name of it in the learner's code (an
    attribute of its module in a lambda, a default argument) is refused, naming what ran; a generator
    that runs one of kvlab's tools (an input check) is still the learner's own."""
    from kvlab import reference as library
    from kvlab import validate

    for how, impl in one_step_removed(library.naive_generate).items():
        expect_rejected(check_naive_generate, impl, "ran kvlab.reference.naive_generate", "write it yourself")

    def checked(model, ids, n):
        validate.check_int(n, "max_new_tokens", minimum=0)
        return reference(model, ids, n)
    check_naive_generate(checked)
    assert "PASSED check_naive_generate" in capsys.readouterr().out
