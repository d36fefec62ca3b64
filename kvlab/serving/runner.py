"""The runner: one scheduled step becomes ONE call of the model's forward (chapter 9).

The runner owns the pool (the keys and values of every block, allocated once, as nano-vllm's
``allocate_kv_cache`` does); the block manager only says which block holds what. A step's tokens
(decode tokens of some sequences, prompt chunks of others) are laid side by side as one ragged batch
``[1, N]``: no padding, each token with its own position in its own sequence. The cache handed to the
forward is a :class:`RaggedStep`: it writes each token's keys and values into its sequence's block
and answers with :class:`kvlab.ragged.Segments`, so that in attention each query scores the keys of
its own sequence only, read from its blocks. Logits are read only at the last token of a sequence
whose chunk reaches its end (the rows that get a new token).
"""

from __future__ import annotations

import torch

from ..cache import Cache
from ..configs import kv_dims
from ..paged import blocks_for, copy_block
from ..ragged import Segments, Workspace
from .sampling import is_greedy, sample
from .sequence import Sequence


def allocate_kv_cache(model, num_blocks: int, block_size: int):
    """The pool's keys and values, ``[layers, blocks, heads, block_size, head_dim]`` each (lab 9's
    layout), in the model's dtype and on its device (allocated up front, like vLLM's). Heads before
    slots: a sequence's keys gathered out of the blocks are then heads-first, each head's keys side
    by side, the layout attention reads fastest (measured in chapter 9: a heads-interleaved layout,
    vLLM's for FlashAttention, made the CPU's attention about twice as slow)."""
    n_layer, n_head, head_dim = kv_dims(model.config)
    p = next(model.parameters())
    shape = (n_layer, num_blocks, n_head, block_size, head_dim)
    return torch.zeros(shape, dtype=p.dtype, device=p.device), torch.zeros(shape, dtype=p.dtype, device=p.device)


class RaggedStep(Cache):
    """The cache the forward sees for one ragged step over the pool: one row (``batch_size = 1``)
    whose positions are planned here (each token's position in its own sequence), so the model is
    called with ``positions=None`` and asks :meth:`next_positions`, as for any cache."""

    batch_size = 1

    def __init__(self, keys, values, positions, blocks, offsets, segments: Segments):
        self.pool_keys, self.pool_values, self.segments = keys, values, segments
        self.n_layer, _, self.n_head, _, self.head_dim = keys.shape
        self.dtype, self.device = keys.dtype, keys.device
        self.positions, self.blocks, self.offsets = positions, blocks, offsets
        self._slots = None

    def next_positions(self, batch: int, T: int, device=None):
        if (batch, T) != tuple(self.positions.shape):
            raise ValueError(f"this step was planned for [1, {self.positions.shape[1]}] tokens, got [{batch}, {T}]")
        return self.positions

    def check_room(self, T: int, limit: int) -> None:
        """Checked per sequence at submit (prompt + max_new_tokens within the context)."""

    def store(self, layer: int, k, v, positions=None):
        """Write the step's ``k``, ``v`` ``[1, H, N, D]`` at their slots; return this layer's pools and
        the step's :class:`Segments` (the model's attention reads each sequence's keys through it)."""
        K, V = self.pool_keys[layer], self.pool_values[layer]      # [blocks, H, block_size, D]
        if self._slots is None:     # each (token, head)'s row of the flat pool: the same in every layer
            bs, heads = K.shape[2], torch.arange(self.n_head, device=self.device)
            self._slots = ((self.blocks[:, None] * self.n_head + heads) * bs + self.offsets[:, None]).reshape(-1)
        # one row copy per (token, head), in place: much cheaper than advanced indexing on dims 0 and 2
        K.view(-1, self.head_dim).index_copy_(0, self._slots, k[0].transpose(0, 1).reshape(-1, self.head_dim))
        V.view(-1, self.head_dim).index_copy_(0, self._slots, v[0].transpose(0, 1).reshape(-1, self.head_dim))
        return K, V, self.segments

    def reset(self):
        raise RuntimeError("a RaggedStep lives for one step; the engine frees blocks, not the forward")

    def rewind(self, length: int):
        raise RuntimeError("a RaggedStep lives for one step; rewind a sequence through the engine")

    def last_positions(self):
        return None          # each sequence's positions are planned here, not a row's

    @property
    def nbytes(self) -> int:
        return 0             # it owns no storage: the runner does


def step_inputs(work: list[tuple[Sequence, int]], block_size: int, device=None, gather=None, workspace=None,
                exact: bool = False, paged: bool | None = None):
    """Token ids ``[1, N]``, positions ``[1, N]``, the new tokens' slots (blocks, offsets), the step's
    :class:`Segments` and the logit rows of a step. Built sequence by sequence from the block tables:
    the cost grows with the new tokens and the blocks, never with every key of every sequence."""
    ids, pos, blocks, offsets, select, decode, chunks, col = [], [], [], [], [], {}, [], 0
    for seq, n in work:
        start, table = seq.num_computed, seq.block_table
        end = start + n
        if n < 1 or end > seq.num_tokens or len(table) * block_size < end:
            raise ValueError(f"sequence {seq.rid!r}: cannot run tokens {start}..{end - 1} (it has "
                             f"{seq.num_tokens} tokens and room for {len(table) * block_size})")
        ids += seq.tokens[start:end]
        pos += range(start, end)
        blocks += [table[p // block_size] for p in range(start, end)]
        offsets += [p % block_size for p in range(start, end)]
        used = table[:blocks_for(end, block_size)]
        if n == 1:                       # a decode row: grouped with the rows of the same length
            cols, tables = decode.setdefault(end, ([], []))
            cols.append(col)
            tables.append(used)
        else:
            chunks.append((col, n, used, start))
        col += n
        if end == seq.num_tokens:        # the chunk reaches the newest token: its logits give the next
            select.append(col - 1)
    as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)   # noqa: E731
    segs = Segments(col, {L: (as_long(c), as_long(t)) for L, (c, t) in decode.items()},
                    [(s, n, as_long(t), torch.arange(p, p + n)) for s, n, t, p in chunks], gather, workspace, exact,
                    paged)
    return as_long([ids]), as_long([pos]), as_long(blocks), as_long(offsets), segs, select


class Runner:
    """Runs scheduled steps on ``model`` through the pool it owns (``keys``/``values``
    ``[layers, blocks, heads, block_size, head_dim]``). ``gather`` (lab 9's ``paged_gather``
    contract: one sequence from one layer's ``[blocks, heads, block_size, head_dim]``) replaces the
    batched block gather when given; ``exact`` scores a prompt chunk's visible pairs only
    (:func:`kvlab.ragged.causal_chunk`) instead of one masked call; ``paged`` (True) reads a decode row's keys
    in place (:class:`kvlab.ragged.PagedDecode`) instead of copying them out of the blocks first (False);
    None, the default, reads them in place where :mod:`kvlab.pagedkernel`'s C++ loop runs and copies
    them elsewhere."""

    def __init__(self, model, num_blocks: int, block_size: int, gather=None, exact: bool = False,
                 paged: bool | None = None):
        self.model, self.block_size, self.gather, self.exact, self.paged = model, block_size, gather, exact, paged
        self.keys, self.values = allocate_kv_cache(model, num_blocks, block_size)
        self.device = self.keys.device
        self.workspace = Workspace()      # the buffers a step gathers keys into, kept from step to step

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: the whole block, every layer, keys and values."""
        for src, dst in copies:
            copy_block(self.keys, self.values, src, dst)

    def prepare(self, work: list[tuple[Sequence, int]]):
        """The step's inputs and its cache: ``(ids, view, rows)``."""
        ids, pos, blocks, offsets, segs, select = step_inputs(work, self.block_size, self.device, self.gather,
                                                                  self.workspace, self.exact, self.paged)
        view = RaggedStep(self.keys, self.values, pos, blocks, offsets, segs)
        return ids, view, torch.tensor(select, dtype=torch.long, device=self.device)

    @torch.no_grad()
    def run(self, work: list[tuple[Sequence, int]]) -> list[int | None]:
        """One forward over the step; the new token of each sequence whose chunk ends at its newest
        token (None for a prompt chunk that does not)."""
        ids, view, rows = self.prepare(work)
        logits = self.model(ids, cache=view, select=rows)    # positions: the view's plan
        greedy = iter(logits[0].argmax(-1).tolist())          # every row's argmax in one call, one sync
        rows_out = iter(logits[0])                # the LM head ran only on the rows that get a token
        out = []
        for seq, n in work:
            if seq.num_computed + n != seq.num_tokens:
                out.append(None)
                continue
            row, best = next(rows_out), next(greedy)
            out.append(best if is_greedy(seq.sampling) else sample(row, seq.sampling, seq.generator))
        return out
