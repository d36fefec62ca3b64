"""The lab-6 graders accept the reference and reject each known batching mistake with a pointed message."""

import functools

import pytest
import torch
from transformers import DynamicCache

from kvlab.batching import batched_generate as reference_generate
from kvlab.batching import make_batch as reference_make_batch
from kvlab.batching import positions_from_mask
from kvlab.checks import check_batched_generate, check_make_batch
from kvlab.generate import cached_generate

from conftest import expect_rejected


def test_accepts_reference(capsys):
    check_make_batch(reference_make_batch)
    check_batched_generate(reference_generate)
    out = capsys.readouterr().out
    assert "PASSED check_make_batch" in out and "PASSED check_batched_generate" in out


def test_accepts_tokenizer_padding(capsys):
    """A make_batch built on the tokenizer's own padding (the transformers way) is fine too."""
    def via_tokenizer(tok, prompts):
        if not prompts or any(not p for p in prompts):
            raise ValueError("empty prompt")
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        enc = tok(prompts, padding=True, padding_side="left", return_tensors="pt")
        return enc.input_ids, enc.attention_mask, positions_from_mask(enc.attention_mask)

    check_make_batch(via_tokenizer)
    assert "PASSED" in capsys.readouterr().out


# ------------------------------------------------------------------------------- wrong make_batch

def _batch(tok, prompts, padding="left", positions="mask", mask="real", fallback=True, reject_empty=True):
    if reject_empty and (not prompts or any(not p for p in prompts)):
        raise ValueError("empty")
    if fallback and tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(prompts, padding=True, padding_side=padding, return_tensors="pt")
    ids, am = enc.input_ids, enc.attention_mask
    pos = {"mask": positions_from_mask(am),
           "columns": torch.arange(ids.shape[1]).expand_as(ids),
           "unclamped": am.cumsum(-1) - 1}[positions]
    return ids, (torch.ones_like(am) if mask == "ones" else am), pos


@pytest.mark.parametrize("impl, needles", [
    (functools.partial(_batch, padding="right"), ["right padding"]),
    (functools.partial(_batch, positions="columns"), ["cumsum"]),
    (functools.partial(_batch, positions="unclamped"), ["clamp"]),
    (functools.partial(_batch, mask="ones"), ["all ones"]),
    (functools.partial(_batch, fallback=False), ["no pad token", "eos"]),
    (functools.partial(_batch, reject_empty=False), ["empty", "valueerror"]),
])
def test_make_batch_rejects(impl, needles):
    expect_rejected(check_make_batch, impl, *needles)


# ------------------------------------------------------------------------- wrong batched_generate

@torch.no_grad()
def _generate(model, tok, prompts, n, padding="left", positions=True, mask="grows", prefill=True,
              feed_all=False):
    """One batched greedy loop with switches; each switch reproduces one known mistake."""
    enc = tok(prompts, padding=True, padding_side=padding, return_tensors="pt")
    ids, am = enc.input_ids, enc.attention_mask
    B = ids.shape[0]
    cache = DynamicCache(config=model.config)
    feed_ids, feed_mask = ids, am
    feed_pos = positions_from_mask(am) if positions else None
    if not prefill:                                  # article A: last column only, empty cache
        feed_ids, feed_mask = ids[:, -1:], am[:, -1:]
        feed_pos = feed_pos[:, -1:] if positions else None
    new = []
    for step in range(n):
        out = model(input_ids=feed_ids, attention_mask=None if mask == "none" else feed_mask,
                    position_ids=feed_pos, cache=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1)
        new.append(nxt)
        am = torch.cat([am, am.new_ones(B, 1)], 1)
        ids = torch.cat([ids, nxt[:, None]], 1)
        if feed_all:                                 # article B: the whole sequence again, with the cache
            feed_ids, feed_mask = ids, am
            feed_pos = positions_from_mask(am) if positions else None
            continue
        feed_ids = nxt[:, None]
        feed_mask = {"grows": am, "none": None, "prefill only": None, "frozen": enc.attention_mask}[mask]
        feed_pos = am.sum(-1, keepdim=True) - 1 if positions else None
    return torch.stack(new, 1).tolist()


def one_at_a_time(model, tok, prompts, n):
    out = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        out.append(cached_generate(model, ids, n)[0, ids.shape[1]:].tolist())
    return out


def uses_generate(model, tok, prompts, n):
    enc = tok(prompts, padding=True, padding_side="left", return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[:, enc.input_ids.shape[1]:].tolist()


def with_prompt(model, tok, prompts, n):
    new = reference_generate(model, tok, prompts, n)
    return [tok(p).input_ids + r for p, r in zip(prompts, new)]


@pytest.mark.parametrize("impl, needles", [
    (functools.partial(_generate, padding="right"), ["right-padded"]),
    (functools.partial(_generate, positions=False), ["no position_ids"]),
    (functools.partial(_generate, mask="none"), ["no attention_mask"]),
    (functools.partial(_generate, mask="prefill only"), ["only the prefill"]),
    (functools.partial(_generate, mask="frozen"), ["does not grow"]),
    (functools.partial(_generate, prefill=False), ["no prefill"]),
    (functools.partial(_generate, padding="right", positions=False, prefill=False), ["no prefill"]),
    (functools.partial(_generate, feed_all=True), ["only the one new token"]),
    (one_at_a_time, ["one at a time"]),
    (uses_generate, ["model.generate"]),
    (with_prompt, ["only the new tokens"]),
])
def test_batched_generate_rejects(impl, needles):
    expect_rejected(check_batched_generate, impl, *needles)


def test_hook_is_removed():
    """The grader instruments its model with a hook; nothing may stay attached after a failure."""
    from kvlab.checks._common import grading_model

    model, _ = grading_model()
    with pytest.raises(AssertionError):
        check_batched_generate(one_at_a_time)
    assert not model._forward_pre_hooks and "generate" not in vars(model)
