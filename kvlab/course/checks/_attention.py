"""What the attention graders of labs 3 and 8 share: float64 attention under a named mask and scale
(the right ones and the usual mistakes, one table each), and the diagnosis of a wrong output. Query
``i`` of a call sits at position ``offset + i`` (lab 3's ``past_len``, lab 8's ``pos``); key ``j`` at ``j``."""

from __future__ import annotations

import math

import torch

from ._common import confirmed, fail

SCALES = {"sqrt": lambda D: 1 / math.sqrt(D), "D": lambda D: 1 / D, "none": lambda D: 1.0,
          "tiny": lambda D: 1 / 8}          # kvlab-tiny's 1/sqrt(64), whatever the head size


def _visible(mask: str, T: int, S: int, offset: int) -> torch.Tensor:
    """Which keys each query sees, ``[T, S]``: the right rule and the usual mistakes."""
    query, key = offset + torch.arange(T)[:, None], torch.arange(S)[None, :]
    return {
        "causal": key <= query,
        "none": torch.ones(T, S, dtype=torch.bool),
        "topleft": key <= query - offset,                     # the offset ignored
        "strict": key < query,                                # each query's own key hidden
        "written": (key < offset + T).expand(T, S),           # unwritten slots hidden, the chunk's future not
        "chunk_only": (key <= query) | (key >= offset + T),   # causal among the new, unwritten slots let through
    }[mask]


def float64_attention(q, k, v, offset, mask: str = "causal", scale: str = "sqrt") -> torch.Tensor:
    """``softmax(q @ k^T * scale, hidden keys at -inf) @ v`` in float64."""
    q, k, v = q.double(), k.double(), v.double()
    T, S, D = q.shape[2], k.shape[2], q.shape[3]
    scores = torch.einsum("bhtd,bhsd->bhts", q, k) * SCALES[scale](D)
    hidden = ~_visible(mask, T, S, int(offset))
    return torch.einsum("bhts,bhsd->bhtd", torch.softmax(scores.masked_fill(hidden, float("-inf")), -1), v)


def where_wrong(got, want, offset, name: str) -> str:
    """Where the largest error sits: batch row, head, query (and its position), channel."""
    err = (got - want).abs()
    b, h, i, d = (int(x) for x in torch.unravel_index(err.argmax(), err.shape))
    rows = sorted({int(x) for x in (err.amax((1, 2, 3)) > 1e-5).nonzero()})
    queries = sorted({int(x) for x in (err.amax((0, 1, 3)) > 1e-5).nonzero()})
    return (f"the largest error, {float(err.max()):.2e}, is at batch row {b}, head {h}, query {i} (position "
            f"{name} + {i} = {int(offset) + i}), channel {d}; wrong batch rows: {rows}, wrong queries: {queries}")


def name_the_mistake(check: str, where: str, probes, offset, mistakes, otherwise: str):
    """Raise the failure for a wrong output. ``probes``: ``[(output, q, k, v)]`` on two inputs of the
    same shapes, the first one wrong. A remembered result is named first, then batch row 0 alone
    right, then the first of ``mistakes`` (``(float64_attention's mask/scale, message)``) that explains
    BOTH probes (one coincidence names nothing); else ``otherwise``."""
    if torch.equal(probes[0][0], probes[1][0]):
        raise fail(check, f"{where}: two calls with the same shapes and different values returned the same "
                          "output: your attention hands back a remembered result. Compute it from q, k, v at "
                          "every call")

    def explains(**kw):
        return lambda p: torch.allclose(p[0], float64_attention(*p[1:], offset, **kw), atol=1e-5)

    def row0(p):
        return p[1].shape[0] > 1 and torch.allclose(p[0][0], float64_attention(*p[1:], offset)[0], atol=1e-5)

    hypotheses = [(row0, "batch row 0 is right but the other rows are not: it only works for batch size 1; "
                         "keep the batch dimension in every operation")]
    hypotheses += [(explains(**kw), message) for kw, message in mistakes]
    raise fail(check, f"{where}: {confirmed(hypotheses, probes) or otherwise}")
