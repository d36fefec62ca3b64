"""Attention over a ragged step: each query scores the keys it may see, and nothing else (chapter 9).

A ragged step lays the tokens of several sequences side by side in one row ``[1, N]`` (decode tokens
and prompt chunks), so the linear layers run once over all of them with no padding. Attention is the
one place where the sequences must stay apart: the query of sequence ``i`` may see sequence ``i``'s
keys up to its own position, and nothing else. Gathering every sequence's keys and masking the others
out would be correct, but it would *score* every (query, key) pair of the step: the padding moves
from the matrix products into attention and grows with the square of the batch.

:class:`Segments` is what a ragged cache returns as ``key_pos``: the step cut into segments, each a
set of queries with the keys they may see, read from their blocks. Two ways to run them:

* :meth:`Segments.reference`, the readable one: per sequence, its keys gathered from its blocks and
  the model's attention with the one rule (:func:`kvlab.cache.visible`) as its mask. A prompt chunk
  then scores its whole ``n x (start + n)`` rectangle, the masked future half of its own square
  included.
* :meth:`Segments.attend`, the one the engine runs:

  - decode rows (one query each) whose sequences hold the same number of keys are one batch
    ``[b, H, 1, L]`` where every key is visible (no mask at all): exactly the visible pairs;
  - a prompt chunk is, by default, one fused attention call with the one rule as its mask: it
    scores the masked future half of its own ``n x n`` square too, as a causal kernel's diagonal
    tiles do;
  - with ``exact=True``, a prompt chunk is cut into pieces in which every pair is visible
    (:func:`causal_chunk`), so the step scores the visible pairs and nothing else: its
    cached prefix (a rectangle), the diagonal, and the causal triangle of its own tokens split
    recursively into full rectangles (the dyadic split: at level ``h``, queries ``[2jh + h, 2jh + 2h)``
    over keys ``[2jh, 2jh + h)``, for every ``j`` at once, as one strided view). Each piece's
    softmax comes with its log-sum-exp, and the pieces of a query are merged exactly
    (:func:`merge_into`): the online-softmax merge that FlashAttention runs over its key tiles and
    FlashDecoding over the splits of a long context. It is exact, and on a CPU it is slower than
    the one fused call (one operator per level instead of one in all; chapter 9 measures both).

Decode rows read their keys one of two ways: the batched gather above (every key copied out of its
block into a workspace, then the model's attention), or in place, with no copy (what vLLM's
paged-attention kernel does): :class:`PagedDecode` runs :mod:`kvlab.pagedkernel`'s C++ loop on a CPU
and elsewhere :func:`paged_decode`, compiled by inductor into loops that load each key straight from
its block through the block table; it falls back to the gather, saying so, where neither can run.
The engine's default (``paged=None``) reads in place where the C++ loop runs (a CPU, float32 pools, a
C++ compiler) and gathers everywhere else.

A GPU engine does all of this in ONE kernel launch and without a gather: varlen FlashAttention takes
the queries and keys packed end to end with their offsets (``cu_seqlens``) and skips the tiles above
the diagonal; FlashInfer or vLLM's paged kernels read the keys straight from the blocks through the
block tables. On a CPU, without such a kernel, the keys of a segment are first copied out of the
blocks into a workspace the runner keeps from step to step (:class:`Workspace`).
"""

from __future__ import annotations

import math
import warnings

import torch

from . import pagedkernel
from .cache import EMPTY, visible


# ---------------------------------------------------------------------------------------------------
# Exact attention from pieces in which every pair is visible


def partial_attention(q, k, v):
    """Softmax attention of ``q`` (already scaled by ``1/sqrt(D)``) over ``k``, ``v`` where every pair
    is visible: ``(out, lse)``, ``out`` ``[..., n, D]`` normalised over these keys only and ``lse``
    ``[..., n, 1]``, each row's log of the sum of its exponentiated scores (what a merge needs)."""
    s = q @ k.transpose(-2, -1)
    lse = s.logsumexp(-1, keepdim=True)
    return (s - lse).exp() @ v, lse


def merge_into(out, lse, out2, lse2) -> None:
    """Merge the partial result ``(out2, lse2)`` of some keys into ``(out, lse)`` of others, in place
    (``out``, ``lse`` may be views): the result is attention over both sets of keys, exactly.
    Each part is rescaled by its share of the total mass, ``exp(lse_part - lse_both)``."""
    both = torch.logaddexp(lse, lse2)
    out.mul_((lse - both).exp()).add_(out2 * (lse2 - both).exp())
    lse.copy_(both)


def causal_chunk(q, k, v, start: int, tally=None):
    """Causal attention of a prompt chunk, scoring the visible pairs only: ``q`` ``[..., n, D]``, the
    queries at positions ``start .. start + n - 1``; ``k``, ``v`` ``[..., start + n, D]``, the keys of
    their sequence up to the newest. ``tally`` (a one-element list) counts the pairs scored, per
    leading row. Computed in at least float32 (a log-sum-exp merge in half precision loses digits)."""
    dtype = q.dtype
    work = torch.promote_types(dtype, torch.float32)
    n, scale = q.shape[-2], 1.0 / math.sqrt(q.shape[-1])
    q, k, v = (q * scale).to(work), k.to(work), v.to(work)
    kt, vt = k[..., start:, :], v[..., start:, :]          # the chunk's own keys
    out, lse = vt.clone(), (q * kt).sum(-1, keepdim=True)  # the diagonal: each query with its own key
    scored = n + n * start
    if start:                                              # the cached prefix: a full rectangle
        merge_into(out, lse, *partial_attention(q, k[..., :start, :], v[..., :start, :]))
    h = 1
    while h < n:                                           # the triangle, level by level
        whole = n // (2 * h) * 2 * h                       # rows in whole periods of 2h
        if whole:
            split = lambda t, half: t[..., :whole, :].unflatten(-2, (whole // (2 * h), 2, h)).select(-3, half)  # noqa: E731
            merge_into(split(out, 1), split(lse, 1), *partial_attention(split(q, 1), split(kt, 0), split(vt, 0)))
            scored += whole // 2 * h
        if n - whole > h:                                  # the last period, cut short: one more piece
            rows = slice(whole + h, n)
            merge_into(out[..., rows, :], lse[..., rows, :],
                       *partial_attention(q[..., rows, :], kt[..., whole:whole + h, :], vt[..., whole:whole + h, :]))
            scored += (n - whole - h) * h
        h *= 2
    if tally is not None:
        tally[0] += scored
    return out.to(dtype)


# ---------------------------------------------------------------------------------------------------
# Decode attention read straight from the blocks


def paged_decode(q, pool_k, pool_v, tables, length: int):
    """Attention of decode rows whose sequences hold ``length`` keys each, every key visible: ``q``
    ``[b, H, 1, D]``, one layer's pools ``[blocks, H, block_size, D]``, ``tables`` ``[b, width]``.
    Written as a product-and-sum over the head dimension and one over the keys (not as matrix
    products), so that inductor compiles each into a loop that loads every key from its block
    through the table, with no copy; run eagerly, the indexing copies like the gather does."""
    bs = pool_k.shape[2]
    pos = torch.arange(length, device=q.device)
    blk, off = tables[:, pos // bs], pos % bs                     # each key's block and slot: [b, L], [L]
    work = torch.promote_types(q.dtype, torch.float32)           # scores and their sums in at least fp32
    qs = q[:, :, 0].to(work) * (1.0 / math.sqrt(q.shape[-1]))     # [b, H, D]
    scores = (qs[:, None] * pool_k[blk, :, off].to(work)).sum(-1)  # [b, L, H]
    p = scores.softmax(1)
    out = (p[..., None] * pool_v[blk, :, off].to(work)).sum(1)     # [b, H, D]
    return out[:, :, None].to(q.dtype)


class PagedDecode:
    """Decode rows read in place: on a CPU with float32 pools, :mod:`kvlab.pagedkernel`'s hand-written
    loop (built once); elsewhere :func:`paged_decode`, compiled once per process (``dynamic=True``: a
    few shapes compile, then any batch and length reuse them). ``usable()`` is False where inductor
    cannot run (a CPU without a C++ compiler, a device other than cpu/cuda) or after a compile failed
    (warned once); the caller then uses the gather."""

    def __init__(self):
        self.fn, self.broken = None, None

    def usable(self, device) -> bool:
        if self.broken is not None:
            return False
        kind = torch.device(device).type
        if kind == "cpu":
            return pagedkernel.has_compiler()
        return kind == "cuda"

    def __call__(self, q, pool_k, pool_v, tables, length: int):
        if pagedkernel.usable(q, pool_k):             # on a CPU, the hand-written loop (kvlab.pagedkernel)
            out = pagedkernel.paged_decode(q, pool_k, pool_v, tables, length)
            if out is not None:
                return out
        if self.fn is None:
            self.fn = torch.compile(paged_decode, dynamic=True)
        try:
            return self.fn(q, pool_k, pool_v, tables, length)
        except compile_failures() as e:    # a bug of ours (a KeyError, a shape error) still raises
            self.broken = e
            warnings.warn(f"torch.compile could not build the paged decode kernel ({type(e).__name__}); "
                          "decode rows use the block gather from now on", stacklevel=2)
            return paged_decode(q, pool_k, pool_v, tables, length)


def compile_failures() -> tuple:
    """The exception types that mean "torch.compile could not build this here": dynamo wraps a
    backend's failure in ``BackendCompilerFailed`` (``InductorError`` is a subclass), and a C++ or
    CUDA build that fails raises ``CppCompileError`` / ``CUDACompileError``. Looked up by class, not by
    name, so an unrelated error whose name merely contains "Compile" is never swallowed."""
    import torch._dynamo.exc as dynamo_exc
    import torch._inductor.exc as inductor_exc
    found = [getattr(dynamo_exc, "BackendCompilerFailed", None)]
    found += [getattr(inductor_exc, n, None) for n in ("InductorError", "CppCompileError", "CUDACompileError")]
    return tuple(t for t in found if isinstance(t, type))


PAGED_DECODE = PagedDecode()          # one per process: its compiled code serves every runner


# ---------------------------------------------------------------------------------------------------
# The segments of a step


class Workspace:
    """Buffers the runner keeps from step to step for the keys and values a step gathers out of the
    blocks: reusing them spares a fresh allocation (page faults on a CPU) in every layer of every step."""

    def __init__(self):
        self.buffers: dict[int, torch.Tensor] = {}

    def take(self, slot: int, shape, like: torch.Tensor) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self.buffers.get(slot)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = self.buffers[slot] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel].view(shape)


class Segments:
    """The ``key_pos`` of a ragged step: which queries see which keys, sequence by sequence.

    ``decode``: ``{length: (columns, tables)}``, decode rows grouped by their sequence's key count;
    ``chunks``: ``(first column, count, table, positions)`` for every other sequence. ``tables`` are
    LongTensors of block ids (``[b, width]``, or ``[width]`` for a chunk). ``gather`` reads one
    sequence's keys from one layer's pool (lab 9's ``paged_gather`` contract) or None for the
    batched block gather. ``exact``: chunks through :func:`causal_chunk` (only the visible pairs)
    instead of one masked call. ``paged``: decode rows through :data:`PAGED_DECODE` (keys read in place)
    if True, through the gather and the model's attention if False; None (the default) reads them in
    place where :mod:`kvlab.pagedkernel`'s C++ loop runs (a CPU, float32, a compiler) and gathers them
    elsewhere. ``scored`` counts the (query, key) pairs :meth:`attend` scored, all
    layers together.
    """

    def __init__(self, n_tokens: int, decode: dict, chunks: list, gather=None, workspace: Workspace | None = None,
                 exact: bool = False, paged: bool | None = None):
        self.n_tokens, self.decode, self.chunks, self.gather, self.exact = n_tokens, decode, chunks, gather, exact
        self.paged = False if gather is not None else paged     # a learner's gather is always the one used
        self.workspace = workspace or Workspace()
        self.scored = [0]
        self._masks: dict = {}          # the chunks' masks, made once per step (the same in every layer)
        self._index: dict = {}          # the gathers' row indices, made once per step

    def pairs(self) -> tuple[int, int]:
        """``(scored, visible)`` in one layer: the (query, key) pairs :meth:`attend` scores, and those the
        one rule lets through (equal with ``exact``; otherwise each chunk adds its masked half)."""
        seen = sum(L * cols.numel() for L, (cols, _) in self.decode.items())
        scored = seen
        for _, n, _, pos in self.chunks:
            visible_here = n * int(pos[0]) + n * (n + 1) // 2
            seen += visible_here
            scored += visible_here if self.exact else n * (int(pos[-1]) + 1)
        return scored, seen

    def keys(self, pool_layer: torch.Tensor, tables: torch.Tensor, length: int, slot: int | None = None):
        """``[b, H, length, D]``: the first ``length`` slots of each table's blocks, in token order, from
        one layer's pool ``[blocks, H, block_size, D]``; into workspace buffer ``slot`` if given (valid
        until that slot is taken again)."""
        rows = tables if tables.dim() == 2 else tables[None]
        if self.gather is not None:     # a pluggable gather (lab 9's contract), one sequence at a time
            return torch.stack([self.gather(pool_layer, t.tolist(), length) for t in rows])
        # ONE copy, heads first, of exactly the slots attention reads: seen as [blocks * H * block_size, D],
        # row ((block * H) + head) * block_size + offset is one key of one head; reading the rows in the
        # order (sequence, head, position) lays each head's keys side by side in token order, the layout
        # chapter 3's cache hands attention, contiguous (no unused tail of the last block is copied)
        b = rows.shape[0]
        _, H, bs, D = pool_layer.shape
        index = self._slot_index(rows, H, bs, length)
        out = None if slot is None else self.workspace.take(slot, (index.numel(), D), pool_layer)
        x = torch.index_select(pool_layer.view(-1, D), 0, index, out=out)
        return x.view(b, H, length, D)

    def _slot_index(self, rows: torch.Tensor, H: int, bs: int, length: int) -> torch.Tensor:
        """Rows of the flat pool for the first ``length`` positions of every table, in the order
        (sequence, head, position): made once per table per step (the same in every layer, for keys
        and values)."""
        key = (rows.data_ptr(), tuple(rows.shape), tuple(rows.stride()), length, H, bs)   # tables live all step
        if key not in self._index:
            pos = torch.arange(length, device=rows.device)
            block = rows[:, pos // bs]                                                     # [b, length]
            heads = torch.arange(H, device=rows.device)[None, :, None]
            self._index[key] = ((block[:, None, :] * H + heads) * bs + (pos % bs)).reshape(-1)
        return self._index[key]

    def attend(self, q, pool_k, pool_v, attention_fn, additive: bool):
        """``q`` ``[1, H, N, D]`` over one layer's pools: ``[1, H, N, D]``. Decode rows through
        ``attention_fn(q, k, v, None)`` (the model's attention, every key visible); a prompt chunk through
        ``attention_fn`` with its mask, or :func:`causal_chunk` if ``exact``. A model whose attention is not the library's own
        (a learner's, a counting one) gets :meth:`reference` instead, which hands it every mask."""
        if not _is_default(attention_fn):
            return self.reference(q, pool_k, pool_v, attention_fn, additive)
        if not self.chunks and len(self.decode) == 1:            # one batch: every row decodes, same length
            (L, (cols, tables)), = self.decode.items()
            if cols.numel() == self.n_tokens:                      # the columns are 0..N-1, in order
                return self._decode(q[0].transpose(0, 1)[:, :, None], pool_k, pool_v, L, tables,
                                    attention_fn)[:, :, 0].transpose(0, 1)[None]
        out = torch.empty_like(q)
        for L, (cols, tables) in self.decode.items():            # every key visible: no mask to apply
            qs = q[0][:, cols].transpose(0, 1)[:, :, None]        # [b, H, 1, D]
            out[0][:, cols] = self._decode(qs, pool_k, pool_v, L, tables, attention_fn)[:, :, 0].transpose(0, 1)
        for start, n, table, pos in self.chunks:
            L = int(pos[-1]) + 1
            k, v = self.keys(pool_k, table, L, 0), self.keys(pool_v, table, L, 1)
            if self.exact:
                out[:, :, start:start + n] = causal_chunk(q[:, :, start:start + n], k, v, int(pos[0]), self.scored)
            else:                                                # one fused call; the mask hides the future half
                out[:, :, start:start + n] = attention_fn(q[:, :, start:start + n], k, v,
                                                          self.mask(pos, additive, q.dtype, q.device))
                self.scored[0] += n * L
        return out

    def _decode(self, qs, pool_k, pool_v, L, tables, attention_fn):
        """``qs`` ``[b, H, 1, D]``: rows of one length ``L``, every key visible (no mask to apply)."""
        self.scored[0] += qs.shape[0] * L
        if self.paged is None and pagedkernel.usable(qs, pool_k):     # the default: in place where the C++ loop runs
            out = pagedkernel.paged_decode(qs, pool_k, pool_v, tables, L)
            if out is not None:                                         # None: its build failed (warned once)
                return out
        elif self.paged and PAGED_DECODE.usable(qs.device):
            return PAGED_DECODE(qs, pool_k, pool_v, tables, L)
        k, v = self.keys(pool_k, tables, L, 0), self.keys(pool_v, tables, L, 1)
        return attention_fn(qs, k, v, None)

    def reference(self, q, pool_k, pool_v, attention_fn, additive: bool):
        """The readable way, one sequence at a time: its keys gathered from its blocks (a fresh copy),
        ``attention_fn(q, k, v, mask)`` with the one rule as the mask (a prompt chunk scores its whole
        rectangle). :meth:`attend` must give the same output (``tests/test_ragged.py`` says how close)."""
        out = torch.empty_like(q)
        for cols, table, pos in self.sequences():
            L = int(pos[-1]) + 1
            k, v = self.keys(pool_k, table, L), self.keys(pool_v, table, L)
            out[0][:, cols] = attention_fn(q[0][:, cols][None], k, v, self.mask(pos, additive, q.dtype, q.device))[0]
        return out

    def sequences(self):
        """``(columns, table, positions)`` per sequence of the step, decode rows and chunks alike."""
        for L, (cols, tables) in self.decode.items():
            for c, t in zip(cols.tolist(), tables):
                yield [c], t, torch.tensor([L - 1])
        for start, n, table, pos in self.chunks:
            yield list(range(start, start + n)), table, pos

    def mask(self, pos, additive: bool, dtype, device):
        """The one rule for queries at ``pos`` over keys ``0 .. pos[-1]``: ``[1, 1, n, L]`` (bool, or 0/-inf
        if ``additive``)."""
        key = (int(pos[0]), len(pos), additive)
        if key not in self._masks:
            pos = pos.to(device)
            seen = visible(pos[None], torch.arange(int(pos[-1]) + 1, device=device)[None, None])[:, None]
            self._masks[key] = (torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(~seen, float("-inf"))
                                if additive else seen)
        return self._masks[key]

    def dense(self, pool_k, pool_v):
        """The step as ONE masked attention would see it (keys of every sequence side by side, ``key_pos``
        ``[1, N, S]`` with ``EMPTY`` for another sequence's keys): for a model that knows no segments
        (the tests' fake model). It scores every pair; the engine never uses it."""
        parts = [(cols, t, int(pos[-1]) + 1) for cols, t, pos in self.sequences()]
        ks = [self.keys(pool_k, t, L)[0] for _, t, L in parts]
        vs = [self.keys(pool_v, t, L)[0] for _, t, L in parts]
        key_pos = torch.full((1, self.n_tokens, sum(L for *_, L in parts)), EMPTY, dtype=torch.long)
        at = 0
        for cols, _, L in parts:
            key_pos[0, cols, at:at + L] = torch.arange(L)
            at += L
        return torch.cat(ks, 1)[None], torch.cat(vs, 1)[None], key_pos.to(pool_k.device)


def _is_default(attention_fn) -> bool:
    """Whether ``attention_fn`` is the library's own (:func:`kvlab.gpt2.masked_attention`, SDPA)."""
    from .gpt2 import masked_attention      # here, not at the top: kvlab.gpt2 imports this module
    return attention_fn is masked_attention
