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

from .cache import visible


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
        """``[b, H, length, D]``: the first ``length`` slots of each table's blocks, in token order."""
        if self.gather is not None:     # a pluggable gather, one sequence at a time
            rows = tables if tables.dim() == 2 else tables[None]
            return torch.stack([self.gather(pool_layer, t.tolist(), length) for t in rows])
        # the blocks in table order (index_select on the block dim copies whole blocks, the fastest
        # gather measured here), then heads before tokens: [b, H, width * bs, D], contiguous for SDPA
        rows = tables if tables.dim() == 2 else tables[None]
        b, width = rows.shape
        x = pool_layer.index_select(0, rows.reshape(-1))                   # [b * width, H, bs, D]
        _, H, bs, D = x.shape
        x = x.view(b, width, H, bs, D).permute(0, 2, 1, 3, 4).contiguous()
        return x.view(b, H, width * bs, D)[:, :, :length]

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
        out = torch.empty_like(q)
        for L, (cols, tables) in self.decode.items():            # every key visible: no mask to apply
            qs = q[0][:, cols].transpose(0, 1)[:, :, None]        # [b, H, 1, D]
            k, v = self.keys(pool_k, tables, L), self.keys(pool_v, tables, L)
            full = None if additive else torch.ones(1, 1, 1, L, dtype=torch.bool, device=q.device)
            out[0][:, cols] = attention_fn(qs, k, v, full)[:, :, 0].transpose(0, 1)
        for i, (start, n, table, pos) in enumerate(self.chunks):
            L = int(pos[-1]) + 1
            k, v = self.keys(pool_k, table, L), self.keys(pool_v, table, L)
            mask = self.mask(i, additive, q.dtype, q.device)
            out[:, :, start:start + n] = attention_fn(q[:, :, start:start + n], k, v, mask)
        return out

    def dense(self, pool_k, pool_v):
        """The step as ONE masked attention would see it (keys of every sequence side by side, ``key_pos``
        ``[1, N, S]`` with ``EMPTY`` for another sequence's keys): for a model that knows no segments
        (the tests' fake model). It scores every pair; the engine never uses it."""
        parts = [(cols, t, L) for L, (c, ts) in self.decode.items() for cols, t in zip(c.tolist(), ts)]
        parts += [(list(range(s, s + n)), t, int(pos[-1]) + 1) for s, n, t, pos in self.chunks]
        ks = [self.keys(pool_k, t, L)[0] for _, t, L in parts]
        vs = [self.keys(pool_v, t, L)[0] for _, t, L in parts]
        key_pos = torch.full((1, self.n_tokens, sum(L for *_, L in parts)), -1, dtype=torch.long)
        at = 0
        for cols, _, L in parts:
            key_pos[0, cols, at:at + L] = torch.arange(L)
            at += L
        return torch.cat(ks, 1)[None], torch.cat(vs, 1)[None], key_pos.to(pool_k.device)
