"""The lab-1 grader accepts the reference and rejects each known mistake with a pointed message."""

import pytest
import torch

from kvlab.checks import check_naive_generate
from kvlab.generate import naive_generate as reference

from conftest import expect_rejected


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
