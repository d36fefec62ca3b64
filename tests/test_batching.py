"""kvlab.batching: left-padded batches, and batched greedy generation equal to one prompt at a time."""

import copy

import pytest
import torch

from kvlab.batching import (batched_generate, generate_batch, make_batch, one_by_one, pad_fraction,
                            pad_token_id, positions_from_mask)
from kvlab.reference import hf_greedy

PROMPTS = [
    "And",
    "In the beginning God created the heaven and the earth. And the earth was without form, and void; "
    "and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters.",
    "The LORD is my shepherd;",
    "Blessed are the meek: for they shall inherit the earth.",
]


def test_make_batch_layout(tiny):
    _, tok = tiny
    lens = [len(tok(p).input_ids) for p in PROMPTS]
    ids, mask, pos = make_batch(tok, PROMPTS)
    T = max(lens)
    assert ids.shape == mask.shape == pos.shape == (len(PROMPTS), T)
    for i, (p, L) in enumerate(zip(PROMPTS, lens)):
        assert ids[i, T - L:].tolist() == tok(p).input_ids            # tokens on the right
        assert ids[i, :T - L].tolist() == [tok.pad_token_id] * (T - L)  # pads on the left
        assert mask[i].tolist() == [0] * (T - L) + [1] * L
        assert pos[i].tolist() == [0] * (T - L) + list(range(L))       # pads clamped to 0
    assert pad_fraction(mask) == pytest.approx(1 - sum(lens) / (len(lens) * T))


def test_make_batch_without_pad_token_falls_back_to_eos(tiny):
    _, tok = tiny
    no_pad = copy.deepcopy(tok)
    no_pad.pad_token = None
    with pytest.raises(ValueError):          # what real GPT-2's tokenizer does when asked to pad
        no_pad(PROMPTS, padding=True)
    ids, mask, _ = make_batch(no_pad, PROMPTS)
    assert pad_token_id(no_pad) == no_pad.eos_token_id
    assert set(ids[mask == 0].tolist()) == {no_pad.eos_token_id}
    assert no_pad.pad_token is None          # make_batch does not modify the tokenizer


def test_positions_from_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    assert positions_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0]]


def test_batched_equals_one_by_one(tiny):
    model, tok = tiny
    n = 24
    got = batched_generate(model, tok, PROMPTS, n)
    assert got == one_by_one(model, tok, PROMPTS, n)
    for p, row in zip(PROMPTS, got):         # and transformers' own generate, prompt by prompt
        ids = tok(p, return_tensors="pt").input_ids
        assert hf_greedy(model, ids, n)[0, ids.shape[1]:].tolist() == row
    # the result of a row does not depend on its neighbours
    assert batched_generate(model, tok, PROMPTS[::-1], n) == got[::-1]
    assert batched_generate(model, tok, PROMPTS[:1], n) == got[:1]


def test_zero_and_one_new_tokens(tiny):
    model, tok = tiny
    assert batched_generate(model, tok, PROMPTS, 0) == [[] for _ in PROMPTS]
    assert batched_generate(model, tok, PROMPTS, 1) == one_by_one(model, tok, PROMPTS, 1)


def test_stop_at_eos_per_row(tiny):
    """Rows stop at their own end-of-text token; the batch stops when every row has."""
    model, tok = tiny
    n = 12
    free = one_by_one(model, tok, PROMPTS, n)
    # Make a token that row 0 generates at step 3 play the role of end-of-text, so the test does not
    # depend on when the model chooses to end a text.
    stop = free[0][3]
    tok_stop = copy.deepcopy(tok)
    tok_stop.eos_token = tok.convert_ids_to_tokens(stop)
    assert tok_stop.eos_token_id == stop
    got = batched_generate(model, tok_stop, PROMPTS, n, stop_at_eos=True)
    assert got == one_by_one(model, tok_stop, PROMPTS, n, stop_at_eos=True)
    assert got[0] == free[0][:free[0].index(stop) + 1]
    for g, f in zip(got, free):
        assert g == (f[:f.index(stop) + 1] if stop in f else f)
    # When every row has stopped, no further forward passes are made.
    calls = []
    h = model.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        only_first = batched_generate(model, tok_stop, PROMPTS[:1], n, stop_at_eos=True)
    finally:
        h.remove()
    assert only_first == got[:1] and len(calls) == len(got[0])


def test_errors(tiny):
    model, tok = tiny
    ctx = model.config.n_positions
    with pytest.raises(ValueError, match="empty"):
        batched_generate(model, tok, [], 3)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        batched_generate(model, tok, ["And", ""], 3)
    with pytest.raises(ValueError, match="list of strings"):
        make_batch(tok, "a single string")
    with pytest.raises(ValueError, match="exceeds the model's context"):
        batched_generate(model, tok, PROMPTS, ctx)
    ids, mask, _ = make_batch(tok, PROMPTS)
    with pytest.raises(ValueError, match="shape of input_ids"):
        generate_batch(model, ids, mask[:, 1:], 3)
    with pytest.raises(ValueError, match="not left-padded"):
        generate_batch(model, ids, mask.flip(-1), 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        batched_generate(model, tok, PROMPTS, -1)
