"""How good a model's predictions are: held-out loss over windows, the book's perplexity protocol."""

from __future__ import annotations
import torch
from .validate import is_int, check_vocab
from .configs import context_length
from .validate import check_context


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
