"""The lab-2 grader accepts real cached generators and rejects each known mistake with a pointed message.

The wrong implementations below include the two article bugs (source-claims.md): article A never
prefills, article B feeds the whole sequence back in alongside the cache.
"""

import copy

import pytest
import torch
from transformers import DynamicCache

from kvlab.checks import check_cached_generate
from kvlab.generate import cached_generate as reference
from kvlab.generate import naive_generate

from conftest import expect_rejected


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
