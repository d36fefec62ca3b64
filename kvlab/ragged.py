"""Attention over a ragged step: each query scores the keys of its own sequence only (chapter 9).

A ragged step lays the tokens of several sequences side by side in one row ``[1, N]`` (decode tokens
and prompt chunks), so the linear layers run once over all of them with no padding. Attention is the
one place where the sequences must stay apart: the query of sequence ``i`` may see sequence ``i``'s
keys, and nothing else. Gathering every sequence's keys and masking the others out would be correct,
but it would *score* every (query, key) pair of the step: the padding moves from the matrix products
into attention and grows with the square of the batch.

:class:`Segments` is what a ragged cache returns as ``key_pos``: the step cut into segments, each a
set of queries with the keys they may see. The model hands it its queries and it runs the model's
own attention function once per segment:

* decode rows (one query each) whose sequences hold the same number of keys are one segment, a batch
  ``[b, H, 1, L]`` where every key is visible (no mask at all);
* every other sequence (a prompt chunk, or a decode row of a length no other row has) is a segment of
  its own, ``[1, H, n, L]``, with the one rule (:func:`kvlab.cache.visible`) as its mask.

So the pairs scored are the visible ones, plus, inside a prompt chunk, the future half of the
chunk's own ``n x n`` square, which the mask hides (a causal kernel computes its diagonal tiles too).
A GPU engine does the same in ONE kernel launch: varlen FlashAttention takes the queries and keys
packed end to end with their offsets (``cu_seqlens``), and FlashInfer or vLLM's paged kernels read
the keys straight from the blocks through the block tables, so no segment loop and no gather copy.
"""

from __future__ import annotations

import torch

from .cache import EMPTY, visible


class Segments:
    """The ``key_pos`` of a ragged step: which queries see which keys, sequence by sequence.

    ``decode``: ``{length: (columns, tables)}``, decode rows grouped by their sequence's key count;
    ``chunks``: ``(first column, count, table, positions)`` for every other sequence. ``tables`` are
    LongTensors of block ids (``[b, width]``, or ``[width]`` for a chunk). ``gather`` reads one
    sequence's keys from one layer's pool (lab 9's ``paged_gather`` contract) or None for the
    batched block gather.
    """

    def __init__(self, n_tokens: int, decode: dict, chunks: list, gather=None):
        self.n_tokens, self.decode, self.chunks, self.gather = n_tokens, decode, chunks, gather
        self._masks: dict = {}          # the chunks' masks, made once per step (the same in every layer)

    def pairs(self) -> tuple[int, int]:
        """(pairs the segments score, pairs the one rule lets through): what the step's attention costs."""
        scored = sum(L * cols.numel() for L, (cols, _) in self.decode.items())
        seen = scored
        for _, n, _, pos in self.chunks:
            L = int(pos[-1]) + 1
            scored += n * L
            seen += int(visible(pos[None], torch.arange(L)[None, None]).sum())
        return scored, seen

    def keys(self, pool_layer: torch.Tensor, tables: torch.Tensor, length: int) -> torch.Tensor:
        """``[b, H, length, D]``: the first ``length`` slots of each table's blocks, in token order, from
        one layer's pool ``[blocks, block_size, H, D]``."""
        rows = tables if tables.dim() == 2 else tables[None]
        if self.gather is not None:     # a pluggable gather (lab 9's contract: [blocks, H, bs, D]), per sequence
            view = pool_layer.transpose(1, 2)
            return torch.stack([self.gather(view, t.tolist(), length) for t in rows])
        # one copy: whole blocks in table order (index_select on the block dim, the fastest gather
        # measured here) are the keys in token order; heads first is then a view
        b, width = rows.shape
        x = pool_layer.index_select(0, rows.reshape(-1))                   # [b * width, bs, H, D]
        _, bs, H, D = x.shape
        return x.view(b, width * bs, H, D)[:, :length].transpose(1, 2)

    def mask(self, i: int, additive: bool, dtype, device):
        """The one rule for chunk ``i``: ``[1, 1, n, L]`` (bool, or 0/-inf if ``additive``)."""
        if i not in self._masks:
            pos = self.chunks[i][3].to(device)
            seen = visible(pos[None], torch.arange(int(pos[-1]) + 1, device=device)[None, None])[:, None]
            self._masks[i] = (torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(~seen, float("-inf"))
                              if additive else seen)
        return self._masks[i]

    def attend(self, q, pool_k, pool_v, attention_fn, additive: bool):
        """``q`` ``[1, H, N, D]`` over one layer's pools: ``[1, H, N, D]``, each segment through
        ``attention_fn(q, k, v, mask)`` (the model's own attention)."""
        if not self.chunks and len(self.decode) == 1:            # one segment: every row decodes, same length
            (L, (cols, tables)), = self.decode.items()
            if cols.numel() == self.n_tokens:                      # the columns are 0..N-1, in order
                return self._decode(q[0].transpose(0, 1)[:, :, None], pool_k, pool_v, L, tables, attention_fn,
                                    additive)[:, :, 0].transpose(0, 1)[None]
        out = torch.empty_like(q)
        for L, (cols, tables) in self.decode.items():            # every key visible: no mask to apply
            qs = q[0][:, cols].transpose(0, 1)[:, :, None]        # [b, H, 1, D]
            out[0][:, cols] = self._decode(qs, pool_k, pool_v, L, tables, attention_fn, additive)[:, :, 0].transpose(0, 1)
        for i, (start, n, table, pos) in enumerate(self.chunks):
            L = int(pos[-1]) + 1
            k, v = self.keys(pool_k, table, L), self.keys(pool_v, table, L)
            mask = self.mask(i, additive, q.dtype, q.device)
            out[:, :, start:start + n] = attention_fn(q[:, :, start:start + n], k, v, mask)
        return out

    def _decode(self, qs, pool_k, pool_v, L, tables, attention_fn, additive):
        """``qs`` ``[b, H, 1, D]``: rows of one length ``L``, every key visible (no mask to apply)."""
        k, v = self.keys(pool_k, tables, L), self.keys(pool_v, tables, L)
        full = None if additive else torch.ones(1, 1, 1, L, dtype=torch.bool, device=qs.device)
        return attention_fn(qs, k, v, full)

    def dense(self, pool_k, pool_v):
        """The step as ONE masked attention would see it (keys of every sequence side by side, ``key_pos``
        ``[1, N, S]`` with ``EMPTY`` for another sequence's keys): for a model that knows no segments
        (the tests' fake model). It scores every pair; the engine never uses it."""
        parts = [(cols, t, L) for L, (c, ts) in self.decode.items() for cols, t in zip(c.tolist(), ts)]
        parts += [(list(range(s, s + n)), t, int(pos[-1]) + 1) for s, n, t, pos in self.chunks]
        ks = [self.keys(pool_k, t, L)[0] for _, t, L in parts]
        vs = [self.keys(pool_v, t, L)[0] for _, t, L in parts]
        key_pos = torch.full((1, self.n_tokens, sum(L for *_, L in parts)), EMPTY, dtype=torch.long)
        at = 0
        for cols, _, L in parts:
            key_pos[0, cols, at:at + L] = torch.arange(L)
            at += L
        return torch.cat(ks, 1)[None], torch.cat(vs, 1)[None], key_pos.to(pool_k.device)
