"""The lab-2 grader accepts real cached generators and rejects each known mistake with a pointed message.

The wrong implementations below include the two article bugs (source-claims.md): article A never
prefills, article B feeds the whole sequence back in alongside the cache.
"""

import copy

import pytest
import torch
from transformers import DynamicCache

from kvlab.course.checks import check_cached_generate
from kvlab.reference import cached_generate as reference
from kvlab.reference import naive_generate

from utils import expect_rejected, one_step_removed, own_copy

reference, naive_generate = own_copy(reference), own_copy(naive_generate)   # not the library's own



def greedy(out):
    return out.logits[:, -1, :].argmax(dim=-1, keepdim=True)


def test_accepts_reference(capsys):
    check_cached_generate(reference)
    assert "PASSED check_cached_generate" in capsys.readouterr().out


@torch.no_grad()
def cache_from_output(model, ids, n):
    """Also correct: let the model create the cache at the prefill and keep out.cache."""
    if n == 0:
        return ids
    out = model(ids, use_cache=True)
    pieces = [ids, greedy(out)]
    for _ in range(n - 1):
        out = model(pieces[-1], cache=out.cache, use_cache=True)
        pieces.append(greedy(out))
    return torch.cat(pieces, dim=1)


@torch.no_grad()
def deprecated_name(model, ids, n):
    """Also correct: the pre-5.24 argument name, still accepted (with a FutureWarning)."""
    if n == 0:
        return ids
    cache = DynamicCache(config=model.config)
    out = model(ids, past_key_values=cache, use_cache=True)
    pieces = [ids, greedy(out)]
    for _ in range(n - 1):
        out = model(pieces[-1], past_key_values=cache, use_cache=True)
        pieces.append(greedy(out))
    return torch.cat(pieces, dim=1)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("impl", [cache_from_output, deprecated_name])
def test_accepts_other_correct_loops(impl, capsys):
    check_cached_generate(impl)
    assert "PASSED" in capsys.readouterr().out


@torch.no_grad()
def article_a_no_prefill(model, ids, n):
    """Article A: feeds generated[:, -1:] from the first step, with an empty cache."""
    generated, cache = ids, None
    for _ in range(n):
        out = model(generated[:, -1:], cache=cache, use_cache=True)
        cache = out.cache
        generated = torch.cat([generated, greedy(out)], dim=1)
    return generated


@torch.no_grad()
def article_b_whole_sequence(model, ids, n):
    """Article B: the whole sequence goes back in at every step, together with the cache."""
    generated, cache = ids, None
    for _ in range(n):
        out = model(generated, cache=cache, use_cache=True)
        cache = out.cache
        generated = torch.cat([generated, greedy(out)], dim=1)
    return generated


@torch.no_grad()
def fresh_cache_each_step(model, ids, n):
    out = model(ids, cache=DynamicCache(config=model.config), use_cache=True)
    pieces = [ids, greedy(out)]
    for _ in range(n - 1):
        out = model(pieces[-1], cache=DynamicCache(config=model.config), use_cache=True)
        pieces.append(greedy(out))
    return torch.cat(pieces, dim=1)


def naive_use_cache_false(model, ids, n):
    return naive_generate(model, ids, n)            # passes use_cache=False


@torch.no_grad()
def naive_default_flags(model, ids, n):
    """A naive generator that never says use_cache=False: right tokens, but no cache is ever reused."""
    for _ in range(n):
        ids = torch.cat([ids, greedy(model(ids))], dim=1)
    return ids


@torch.no_grad()
def one_too_few(model, ids, n):
    return reference(model, ids, n - 1) if n > 1 else ids.clone()


@torch.no_grad()
def one_too_many(model, ids, n):
    """Prefill, then a decode step for each of the n tokens: n + 1 forward calls, n + 1 new tokens."""
    cache = DynamicCache(config=model.config)
    out = model(ids, cache=cache, use_cache=True)
    pieces = [ids, greedy(out)]
    for _ in range(n):
        out = model(pieces[-1], cache=cache, use_cache=True)
        pieces.append(greedy(out))
    return torch.cat(pieces, dim=1)


@torch.no_grad()
def wasted_last_forward(model, ids, n):
    """Right length, but the last token is fed through the model once more and its logits thrown away."""
    cache = DynamicCache(config=model.config)
    out = model(ids, cache=cache, use_cache=True)
    pieces = [ids, greedy(out)]
    for _ in range(n):
        out = model(pieces[-1], cache=cache, use_cache=True)
        pieces.append(greedy(out))
    return torch.cat(pieces[:-1], dim=1)


@torch.no_grad()
def only_new_tokens(model, ids, n):
    return reference(model, ids, n)[:, ids.shape[1]:]


_shared = {}


@torch.no_grad()
def reused_cache(model, ids, n):
    """One cache kept across calls (a module-level cache never reset): the second prompt sees the first."""
    cache = _shared.setdefault("cache", DynamicCache(config=model.config))
    out = model(ids, cache=cache, use_cache=True)
    pieces = [ids, greedy(out)]
    for _ in range(n - 1):
        out = model(pieces[-1], cache=cache, use_cache=True)
        pieces.append(greedy(out))
    return torch.cat(pieces, dim=1)


@torch.no_grad()
def cropped_between_steps(model, ids, n):
    """Drops the oldest part of the context: the cache is cropped by one token before each step."""
    cache = DynamicCache(config=model.config)
    out = model(ids, cache=cache, use_cache=True)
    pieces = [ids, greedy(out)]
    for _ in range(n - 1):
        cache.crop(-1)
        out = model(pieces[-1], cache=cache, use_cache=True)
        pieces.append(greedy(out))
    return torch.cat(pieces, dim=1)


@torch.no_grad()
def first_position_at_prefill(model, ids, n):
    """Right loop, wrong logits: the first new token is taken from the prefill's FIRST position."""
    cache = DynamicCache(config=model.config)
    out = model(ids, cache=cache, use_cache=True)
    pieces = [ids, out.logits[:, 0, :].argmax(-1, keepdim=True)]
    for _ in range(n - 1):
        out = model(pieces[-1], cache=cache, use_cache=True)
        pieces.append(greedy(out))
    return torch.cat(pieces, dim=1)


@torch.no_grad()
def deep_copied_each_step(model, ids, n):
    """Keeps a pristine copy of the prefill cache and decodes every step on a copy of THAT."""
    cache = DynamicCache(config=model.config)
    out = model(ids, cache=cache, use_cache=True)
    pieces = [ids, greedy(out)]
    for _ in range(n - 1):
        out = model(pieces[-1], cache=copy.deepcopy(cache), use_cache=True)
        pieces.append(greedy(out))
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize("impl, needles", [
    (article_a_no_prefill, ["no prefill", "article a"]),
    (article_b_whole_sequence, ["whole sequence", "article b"]),
    (fresh_cache_each_step, ["fresh cache at every step"]),
    (naive_use_cache_false, ["use_cache=false", "naive"]),
    (naive_default_flags, ["no cache", "naive"]),
    (one_too_few, ["off-by-one"]),
    (one_too_many, ["off-by-one"]),
    (wasted_last_forward, ["forward whose logits you never use"]),
    (only_new_tokens, ["only the new ones"]),
    (reused_cache, ["already holds"]),
    (cropped_between_steps, ["holding"]),
    (first_position_at_prefill, ["first position"]),
    (deep_copied_each_step, ["holding"]),
])
def test_rejects(impl, needles):
    _shared.clear()
    expect_rejected(check_cached_generate, impl, *needles)


# ------------------------------------------------ issue 18: hardened grader and generate_until

from kvlab.course.checks import check_generate_until  # noqa: E402
from kvlab.reference import cached_generate as reference_cached

reference_cached = own_copy(reference_cached)


@torch.no_grad()
def cached_stops_at_eos(model, ids, n):
    if n == 0:
        return ids
    cache = DynamicCache(config=model.config)
    out = model(ids, cache=cache, use_cache=True)
    pieces = [ids, greedy(out)]
    for _ in range(n - 1):
        if int(pieces[-1]) == model.config.eos_token_id:
            break
        out = model(pieces[-1], cache=cache, use_cache=True)
        pieces.append(greedy(out))
    return torch.cat(pieces, dim=1)


def cached_calls_generate(model, ids, n):
    return model.generate(ids, max_new_tokens=n, do_sample=False) if n else ids


def cached_casts(model, ids, n):
    model.to(torch.bfloat16)
    return reference_cached(model, ids, n)


@pytest.mark.parametrize("impl, needles", [
    (cached_stops_at_eos, ["end-of-text", "exactly"]),
    (cached_calls_generate, ["model.generate"]),
    (cached_casts, ["changed the model", "bfloat16"]),
])
def test_rejects_hardened(impl, needles):
    expect_rejected(check_cached_generate, impl, *needles)


@torch.no_grad()
def forward_directly(model, ids, n):
    """Unusual but correct: model.forward instead of model(...)."""
    if n == 0:
        return ids
    cache = DynamicCache(config=model.config)
    pieces = [ids, greedy(model.forward(ids, cache=cache, use_cache=True))]
    for _ in range(n - 1):
        pieces.append(greedy(model.forward(pieces[-1], cache=cache, use_cache=True)))
    return torch.cat(pieces, dim=1)


def test_accepts_model_forward(capsys):
    check_cached_generate(forward_directly)
    assert "PASSED" in capsys.readouterr().out


@torch.no_grad()
def until(model, ids, n, eos, keep_eos=True, look_in_prompt=False, extra_forward=False):
    if n < 0:
        raise ValueError("max_new_tokens must be >= 0")
    pieces, cache, nxt = [ids], DynamicCache(config=model.config), ids
    if look_in_prompt and eos in ids[0].tolist():
        return ids
    for _ in range(n):
        nxt = greedy(model(nxt, cache=cache, use_cache=True))
        if int(nxt) == eos:
            if keep_eos:
                pieces.append(nxt)
            if extra_forward:
                model(nxt, cache=cache, use_cache=True)
            break
        pieces.append(nxt)
    return torch.cat(pieces, dim=1)


def test_until_accepts_reference(capsys):
    check_generate_until(until)
    assert "PASSED check_generate_until" in capsys.readouterr().out


def no_stop(model, ids, n, eos):
    if n < 0:
        raise ValueError("n")
    return reference_cached(model, ids, n)


@pytest.mark.parametrize("impl, needles", [
    (no_stop, ["went on after"]),
    (lambda m, i, n, e: until(m, i, n, e, keep_eos=False), ["dropped the end-of-text"]),
    (lambda m, i, n, e: until(m, i, n, e, look_in_prompt=True), ["PROMPT"]),
    (lambda m, i, n, e: until(m, i, n, e, extra_forward=True), ["forward calls"]),
    (lambda m, i, n, e: until(m, i, max(n, 0), e), ["max_new_tokens=-1", "ValueError"]),
])
def test_until_rejects(impl, needles):
    expect_rejected(check_generate_until, impl, *needles)


# ------------------------------------------------ issue 24: the dtype it ran in, stale answers

def cached_under_bf16_autocast(model, ids, n):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return reference(model, ids, n)


_REMEMBERED: dict = {}


def cached_remembers_by_shape(model, ids, n):
    key = (ids.shape[1], n)
    if key not in _REMEMBERED:
        _REMEMBERED[key] = reference(model, ids, n)[:, ids.shape[1]:]
    return torch.cat([ids, _REMEMBERED[key]], 1)


@pytest.mark.parametrize("impl, needles", [
    (cached_under_bf16_autocast, ["autocast(bfloat16)"]),
    (cached_remembers_by_shape, ["earlier prompt of the same length"]),
])
def test_cached_rejects_other_dtype_and_stale(impl, needles):
    _REMEMBERED.clear()
    expect_rejected(check_cached_generate, impl, *needles)


def until_remembers_by_shape(model, ids, n, eos):
    key = (ids.shape[1], n, eos)
    if key not in _REMEMBERED:
        _REMEMBERED[key] = until(model, ids, n, eos)[:, ids.shape[1]:]
    return torch.cat([ids, _REMEMBERED[key]], 1)


def test_until_rejects_stale():
    _REMEMBERED.clear()
    expect_rejected(check_generate_until, until_remembers_by_shape, "expected")


def test_library_refused():
    from kvlab.reference import cached_generate

    expect_rejected(check_cached_generate, cached_generate, "kvlab.reference.cached_generate",
                    "write it yourself")


def test_the_library_one_step_removed_is_refused_by_what_runs():
    """Issue 34, kind 1, in lab 2: the library's cached generator reached without its name, and lab 1's
    generator that the lab imports for its timing cells (kvlab.reference.naive_generate), run inside
    the learner's function, are refused by what ran."""
    from kvlab import reference as library

    for how, impl in one_step_removed(library.cached_generate).items():
        expect_rejected(check_cached_generate, impl, "ran kvlab.reference.cached_generate", "write it yourself")
    until = lambda model, ids, n, eos: library.naive_generate(model, ids, n)       # noqa: E731
    expect_rejected(check_generate_until, until, "ran kvlab.reference.naive_generate", "write it yourself")
