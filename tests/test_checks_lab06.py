"""The lab-6 graders accept the reference and reject each known batching mistake with a pointed message."""

import functools

import pytest
import torch
from transformers import DynamicCache

from kvlab.batching import batched_generate as reference_generate
from kvlab.batching import make_batch as reference_make_batch
from kvlab.batching import positions_from_mask
from kvlab.course.checks import check_batched_generate, check_make_batch
from kvlab.reference import cached_generate

from utils import expect_rejected, one_step_removed, own_copy

# the graders refuse the library's own code: the tests hand in copies, as a learner's would be
reference_generate, reference_make_batch = own_copy(reference_generate), own_copy(reference_make_batch)
cached_generate = own_copy(cached_generate)
positions_from_mask = own_copy(positions_from_mask)



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
    (functools.partial(_batch, positions="columns"), ["the column number", "real tokens only"]),
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
    from kvlab.course.checks._common import grading_model

    model, _ = grading_model()
    with pytest.raises(AssertionError):
        check_batched_generate(one_at_a_time)
    assert not model._forward_pre_hooks and "generate" not in vars(model)


# ------------------------------------------------ issue 18: unusual correct solutions, new mistakes

import re  # noqa: E402
from pathlib import Path  # noqa: E402

from kvlab.course.checks import check_batched_generate_until  # noqa: E402


@torch.no_grad()
def _loop(model, ids, am, n, forward=None):
    """A correct batched greedy loop over an already padded batch; returns [B, n] as lists."""
    forward = forward or model
    B, cache, new = ids.shape[0], DynamicCache(config=model.config), []
    pos = positions_from_mask(am)
    out = forward(input_ids=ids, attention_mask=am, position_ids=pos, cache=cache, use_cache=True)
    for step in range(n):
        new.append(out.logits[:, -1].argmax(-1))
        if step == n - 1:
            break
        am = torch.cat([am, am.new_ones(B, 1)], 1)
        pos = pos[:, -1:] + 1
        out = forward(input_ids=new[-1][:, None], attention_mask=am, position_ids=pos, cache=cache,
                      use_cache=True)
    return torch.stack(new, 1).tolist() if new else [[] for _ in range(B)]


def _pad_left(rows, width, pad):
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    am = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, am


def sorted_and_restored(model, tok, prompts, n, restore=True):
    """Unusual but correct: sort the prompts by length, then put the results back in order."""
    if not prompts:
        raise ValueError("no prompts")
    rows = [tok(p).input_ids for p in prompts]
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    ids, am = _pad_left([rows[i] for i in order], max(map(len, rows)), tok.pad_token_id)
    new = _loop(model, ids, am, n)
    if not restore:
        return new
    out = [None] * len(rows)
    for slot, i in enumerate(order):
        out[i] = new[slot]
    return out


def padded_to_multiple_of_8(model, tok, prompts, n):
    """Unusual but correct: extra masked pads (width rounded up to a multiple of 8), tuples out."""
    if not prompts:
        raise ValueError("no prompts")
    rows = [tok(p).input_ids for p in prompts]
    width = -(-max(map(len, rows)) // 8) * 8
    new = _loop(model, *_pad_left(rows, width, tok.pad_token_id), n)
    return tuple(tuple(r) for r in new)


def via_forward(model, tok, prompts, n):
    """Unusual but correct: model.forward called directly."""
    if not prompts:
        raise ValueError("no prompts")
    rows = [tok(p).input_ids for p in prompts]
    ids, am = _pad_left(rows, max(map(len, rows)), tok.pad_token_id)
    return _loop(model, ids, am, n, forward=model.forward)


@pytest.mark.parametrize("impl", [sorted_and_restored, padded_to_multiple_of_8, via_forward])
def test_accepts_unusual_correct(impl, capsys):
    check_batched_generate(impl)
    assert "PASSED check_batched_generate" in capsys.readouterr().out


def returns_tensor(model, tok, prompts, n):
    return torch.tensor(reference_generate(model, tok, prompts, n))


def stops_whole_batch(model, tok, prompts, n):
    out = reference_generate(model, tok, prompts, n)
    eos = tok.eos_token_id
    stop = min((r.index(eos) + 1 for r in out if eos in r), default=n)
    return [r[:stop] for r in out]


def no_value_error(model, tok, prompts, n):
    return reference_generate(model, tok, prompts, n) if prompts else []


@pytest.mark.parametrize("impl, needles", [
    (returns_tensor, ["list", "Tensor"]),
    (functools.partial(sorted_and_restored, restore=False), ["order", "sort"]),
    (stops_whole_batch, ["whole batch"]),
    (no_value_error, ["empty list", "ValueError"]),
])
def test_batched_generate_rejects_hardened(impl, needles):
    expect_rejected(check_batched_generate, impl, *needles)


def mask_from_pad_id(tok, prompts):
    """Builds the mask as ids != pad: wrong when a prompt holds the pad token as a real token."""
    ids, _, _ = reference_make_batch(tok, prompts)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    am = (ids != pad).long()
    return ids, am, positions_from_mask(am)


def test_make_batch_rejects_mask_from_pad_id():
    expect_rejected(check_make_batch, mask_from_pad_id, "REAL token")


def test_chapter_6_variant_generate_does_not_pass():
    """The chapter's visible helper must not pass the lab as pasted (issue 18)."""
    import copy as copy_module

    src = (Path(__file__).parents[1] / "book" / "ch06_batched_generation.md").read_text()
    cell = re.search(r"(@torch\.no_grad\(\)\ndef variant_generate.*?\n    return [^\n]*\n)", src, re.S)
    env = {"torch": torch, "copy": copy_module, "DynamicCache": DynamicCache,
           "positions_from_mask": positions_from_mask, "device": torch.device("cpu")}
    exec(cell.group(1), env)
    expect_rejected(check_batched_generate, env["variant_generate"], "list")


@torch.no_grad()
def _until(model, tok, prompts, n, whole_batch=False, cut=True, extra=False):
    rows = [tok(p).input_ids for p in prompts]
    ids, am = _pad_left(rows, max(map(len, rows)), tok.pad_token_id)
    pos, eos = positions_from_mask(am), tok.eos_token_id
    cache, res, done = DynamicCache(config=model.config), [[] for _ in rows], [False] * len(rows)
    for _ in range(n):
        out = model(input_ids=ids, attention_mask=am, position_ids=pos, cache=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1)
        for i, t in enumerate(nxt.tolist()):
            if not done[i] or not cut:
                res[i].append(t)
            done[i] = done[i] or t == eos
        if all(done) or (whole_batch and any(done)):
            break
        ids, pos = nxt[:, None], pos[:, -1:] + 1
        am = torch.cat([am, am.new_ones(len(rows), 1)], 1)
    if extra:                                        # one forward pass too many
        model(input_ids=ids[:, -1:], attention_mask=am, position_ids=pos, cache=cache, use_cache=True)
    return res


def test_until_accepts_and_rejects(capsys):
    check_batched_generate_until(_until)
    assert "PASSED check_batched_generate_until" in capsys.readouterr().out
    expect_rejected(check_batched_generate_until, functools.partial(_until, whole_batch=True),
                    "others go on")
    expect_rejected(check_batched_generate_until, functools.partial(_until, cut=False),
                    "goes on after its end-of-text")
    expect_rejected(check_batched_generate_until, functools.partial(_until, extra=True),
                    "forward passes")


# ------------------------------------------------ issue 24: hard-coded ids, unusual returns, dtypes

def make_batch_pads_with_zero(tok, prompts):
    """Right for the grading model (pad id 0), wrong for any tokenizer whose pad id is not 0."""
    if not prompts or any(not p for p in prompts):
        raise ValueError("empty")
    rows = [tok(p).input_ids for p in prompts]
    B, T = len(rows), max(map(len, rows))
    ids, mask = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, T - len(r):], mask[i, T - len(r):] = torch.tensor(r), 1
    return ids, mask, positions_from_mask(mask)


def test_make_batch_rejects_a_hard_coded_pad_id():
    expect_rejected(check_make_batch, make_batch_pads_with_zero, "pads are [0]", "pad_token_id (220)")


@torch.no_grad()
def rows_as_a_long_tensor(model, tok, prompts, n):
    """Correct: the older past_key_values= keyword, and a [B, n] LongTensor returned."""
    ids, mask, pos = reference_make_batch(tok, prompts)
    B = ids.shape[0]
    if n == 0:
        return torch.zeros(B, 0, dtype=torch.long)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                past_key_values=DynamicCache(config=model.config), use_cache=True)
    columns = []
    for step in range(n):
        columns.append(out.logits[:, -1].argmax(-1))
        if step == n - 1:
            break
        mask, pos = torch.cat([mask, mask.new_ones(B, 1)], 1), pos[:, -1:] + 1
        out = model(input_ids=columns[-1][:, None], attention_mask=mask, position_ids=pos,
                    past_key_values=out.past_key_values, use_cache=True)
    return torch.stack(columns, 1)


def rows_as_tensors(model, tok, prompts, n):
    return list(rows_as_a_long_tensor(model, tok, prompts, n))


def rows_of_numpy_ints(model, tok, prompts, n):
    return [list(r) for r in rows_as_a_long_tensor(model, tok, prompts, n).numpy()]


@pytest.mark.parametrize("impl", [rows_as_a_long_tensor, rows_as_tensors, rows_of_numpy_ints])
def test_batched_accepts_other_containers(impl, capsys):
    check_batched_generate(impl)
    assert "PASSED check_batched_generate" in capsys.readouterr().out


def batched_under_bf16_autocast(model, tok, prompts, n):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return reference_generate(model, tok, prompts, n)


_ANSWERS: dict = {}


def batched_remembers_by_size(model, tok, prompts, n):
    key = (len(prompts), n)
    if key not in _ANSWERS:
        _ANSWERS[key] = reference_generate(model, tok, prompts, n)
    return _ANSWERS[key]


@pytest.mark.parametrize("impl, needles", [
    (batched_under_bf16_autocast, ["autocast(bfloat16)"]),
    (batched_remembers_by_size, ["two other prompts", "never called the model"]),
])
def test_batched_rejects_issue_24(impl, needles):
    _ANSWERS.clear()
    expect_rejected(check_batched_generate, impl, *needles)


def test_library_refused():
    from kvlab import batching

    expect_rejected(check_make_batch, batching.make_batch, "kvlab.batching.make_batch")
    expect_rejected(check_batched_generate, batching.batched_generate, "write it yourself")


def test_the_library_one_step_removed_is_refused_by_what_runs():
    """Issue 34, kind 1, in lab 6: the library's batch builder without its name, a generator built on it
    (a default argument), and one_by_one (imported by the lab for its comparison cell) run inside the
    learner's generator are refused by what ran."""
    from kvlab import batching

    for how, impl in one_step_removed(batching.make_batch).items():
        expect_rejected(check_make_batch, impl, "ran kvlab.batching.make_batch", "write it yourself")

    def on_the_library_batch(model, tokenizer, prompts, n, _batch=batching.make_batch):
        _batch(tokenizer, prompts)
        return reference_generate(model, tokenizer, prompts, n)
    expect_rejected(check_batched_generate, on_the_library_batch, "ran kvlab.batching.make_batch")
    alone = lambda model, tokenizer, prompts, n: batching.one_by_one(model, tokenizer, prompts, n)   # noqa: E731
    expect_rejected(check_batched_generate, alone, "ran kvlab.batching.one_by_one")
