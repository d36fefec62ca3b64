"""How good a model's predictions are: held-out loss over windows, the book's perplexity protocol,
and the book's ONE perplexity text, so that every page that quotes "the perplexity" of a model quotes
the same measurement.

    perplexity(model, tok, quick)   -> {"ppl", "loss", "windows", "window", "tokens"}: the book's number
    describe(r)                     -> what that number was measured on, in words
"""

from __future__ import annotations
import math

import torch
from .configs import context_length
from .paths import TINY_DIR
from .validate import check_context, check_vocab, is_int

#: the first share of the bundled held-out text calibrates and trains (chapter 11); the rest is the
#: book's perplexity text
CALIBRATION_SHARE = 0.35


def heldout_split(tok, path=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(calibration/training ids, evaluation ids)``: the bundled held-out text (chapters the bundled
    models never saw in training), tokenized as one sequence and cut at :data:`CALIBRATION_SHARE`."""
    text = (path or TINY_DIR / "heldout.txt").read_text()
    ids = torch.tensor(tok(text, verbose=False).input_ids)
    cut = int(ids.numel() * CALIBRATION_SHARE)
    return ids[:cut], ids[cut:]


def perplexity_windows(model, quick: bool) -> int:
    """How many evenly spaced windows of the perplexity text the book scores: 4 in quick builds, else
    32 on a GPU, 8 for a full-size GPT-2 on a CPU, 16 for the bundled models on a CPU."""
    if quick:
        return 4
    cfg = model.config
    on_gpu = next(p for p in model.parameters() if p.is_floating_point()).device.type != "cpu"
    return 32 if on_gpu else 8 if getattr(cfg, "n_embd", getattr(cfg, "hidden_size", 0)) > 256 else 16


def perplexity(model, tok, quick: bool) -> dict:
    """The book's perplexity of ``model``: :func:`window_loss` over :func:`perplexity_windows` windows
    of the model's full context, evenly spread over the evaluation part of :func:`heldout_split`."""
    _, ids = heldout_split(tok)
    window = context_length(model)
    loss, n = window_loss(model, ids, window=window, max_windows=perplexity_windows(model, quick))
    return {"ppl": math.exp(loss), "loss": loss, "windows": n, "window": window, "tokens": ids.numel()}


def describe(r: dict) -> str:
    """What :func:`perplexity` measured, for a caption: windows, their length, the text."""
    return (f"{r['windows']} windows of {r['window']} tokens ({r['windows'] * (r['window'] - 1):,} next tokens "
            f"scored), evenly spread over the last {r['tokens']:,} tokens of the held-out text")


@torch.no_grad()
def window_loss(model, ids, window: int = 512, batch: int = 8,
                max_windows: int | None = None) -> tuple[float, int]:
    """The book's perplexity protocol (the model card, ``models/train_tiny.py``, the tests).

    Cut a 1-D sequence of token ids into consecutive, non-overlapping windows of ``window`` tokens
    (the last partial window is dropped; ``max_windows`` keeps an evenly spaced subset), run the
    model on each (``batch`` windows at a time, in eval mode) and average the cross-entropy over
    every predicted position (``window - 1`` per window). Returns ``(mean loss in nats, windows)``;
    the perplexity is ``exp`` of the loss.
    """
    ids = _window_args(model, ids, window, batch, max_windows)
    n = ids.numel() // window
    if n == 0:
        raise ValueError(f"need at least {window} tokens, got {ids.numel()}")
    windows = ids[:n * window].view(n, window)
    if max_windows is not None and n > max_windows:
        windows = windows[torch.linspace(0, n - 1, max_windows).long()]
    device = next(p for p in model.parameters() if p.is_floating_point()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        x = windows[i:i + batch].to(device)
        out = model(input_ids=x)
        logits = getattr(out, "logits", out).float()     # a transformers model, or the hand-built GPT-2
        total += torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten(),
                                                   reduction="sum").item()
        count += x[:, 1:].numel()
    model.train(was_training)
    return total / count, windows.shape[0]


def _window_args(model, ids, window, batch, max_windows) -> torch.Tensor:
    """Check :func:`window_loss`'s arguments; return the ids as a flat LongTensor (never rounded)."""

    ids = torch.as_tensor(ids)
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise ValueError(f"ids must be integer token ids, got {ids.dtype}; pass tokenizer(text).input_ids")
    ids = ids.long().flatten()
    check_vocab(model, ids)
    ctx = context_length(model)
    for value, what, lo in ((window, "window", 2), (batch, "batch", 1), (max_windows, "max_windows", 1)):
        if not (value is None and what == "max_windows") and (not is_int(value) or value < lo):
            raise ValueError(f"{what} must be an int >= {lo}, got {value!r}")
    check_context(window, ctx, "window", "pass at most that")
    return ids
