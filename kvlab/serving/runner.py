"""The runner: one scheduled step becomes ONE call of the model's forward (chapter 9).

The step's tokens (decode tokens of some sequences, prompt chunks of others) are laid side by side
as one ragged batch ``[1, N]``: no padding, each token with its own position in its own sequence.
The cache handed to the forward is a :class:`RaggedStep`: it writes each token's keys and values into
its sequence's block, gathers the keys of the step's sequences, and says, per query, which of them it
may see (``key_pos``: the key's position if it belongs to the query's sequence, ``EMPTY`` otherwise),
so the one mask rule of the library (``key_pos >= 0`` and ``key_pos <= position``) keeps every token
inside its own sequence. Logits are read only at the last token of a sequence whose chunk reaches
its end (the rows that get a new token).
"""

from __future__ import annotations

import torch

from ..cache import EMPTY, Cache
from ..paged_cache import PagedPool
from .sequence import Sequence



class RaggedStep(Cache):
    """The cache the forward sees for one ragged step over a paged pool: one row (``batch_size = 1``)
    whose positions are planned here (each token's position in its own sequence), so the model is
    called with ``positions=None`` and asks :meth:`next_positions`, as for any cache."""

    batch_size = 1

    def __init__(self, pool, positions, slots, key_slots, key_pos, spans, gather=None):
        self.pool, self.gather, self.spans = pool, gather, spans   # spans: (block table, length) per sequence
        dev = pool.keys.device
        _, _, self.n_head, _, self.head_dim = pool.keys.shape
        self.dtype, self.device = pool.keys.dtype, dev
        self.blocks, self.offsets = (torch.tensor(x, dtype=torch.long, device=dev) for x in zip(*slots))
        self.key_blocks, self.key_offsets = (torch.tensor(x, dtype=torch.long, device=dev) for x in zip(*key_slots))
        self.key_pos = key_pos.to(dev)                  # [1, N, S]
        self.positions = positions.to(dev)              # [1, N]
        self.n_layer = pool.keys.shape[0]

    def next_positions(self, batch: int, T: int, device=None):
        if (batch, T) != tuple(self.positions.shape):
            raise ValueError(f"this step was planned for [1, {self.positions.shape[1]}] tokens, got [{batch}, {T}]")
        return self.positions

    def check_room(self, T: int, limit: int) -> None:
        """Checked per sequence at submit (prompt + max_new_tokens within the context)."""

    def store(self, layer: int, k, v, positions=None):
        """Store the step's ``k``, ``v`` ``[1, H, N, D]``; return the step's sequences' keys, values
        ``[1, H, S, D]`` and ``key_pos [1, N, S]``."""
        K, V = self.pool.keys[layer], self.pool.values[layer]        # [blocks, H, block_size, D]
        K[self.blocks, :, self.offsets] = k[0].transpose(0, 1)      # one row [H, D] per token
        V[self.blocks, :, self.offsets] = v[0].transpose(0, 1)
        if self.gather is None:     # every key of the step's sequences in one indexing op
            keys = K[self.key_blocks, :, self.key_offsets].transpose(0, 1)[None]
            values = V[self.key_blocks, :, self.key_offsets].transpose(0, 1)[None]
        else:                       # a pluggable gather (lab 9's), one sequence at a time
            keys = torch.cat([self.gather(K, t, n) for t, n in self.spans], dim=1)[None]
            values = torch.cat([self.gather(V, t, n) for t, n in self.spans], dim=1)[None]
        return keys, values, self.key_pos

    def reset(self):
        raise RuntimeError("a RaggedStep lives for one step; the engine frees blocks, not the forward")

    def rewind(self, length: int):
        raise RuntimeError("a RaggedStep lives for one step; rewind a sequence through the engine")

    def last_positions(self):
        return None          # each sequence's positions are planned here, not a row's

    @property
    def nbytes(self) -> int:
        return 0             # it owns no storage: the pool does


def ragged_inputs(work: list[tuple[Sequence, int]], block_size: int):
    """Token ids, positions, slots, key slots, per-query ``key_pos`` and the logit rows of a step."""
    ids, pos, qseq, slots, key_slots, kpos, kseq, spans, select = [], [], [], [], [], [], [], [], []
    for j, (seq, n) in enumerate(work):
        start, table = seq.num_computed, seq.block_table
        end = start + n
        if n < 1 or end > seq.num_tokens or len(table) * block_size < end:
            raise ValueError(f"sequence {seq.rid!r}: cannot run tokens {start}..{end - 1} (it has "
                             f"{seq.num_tokens} tokens and room for {len(table) * block_size})")
        ids += seq.tokens[start:end]
        pos += range(start, end)
        qseq += [j] * n
        slots += [(table[p // block_size], p % block_size) for p in range(start, end)]
        key_slots += [(table[p // block_size], p % block_size) for p in range(end)]
        kpos += range(end)
        kseq += [j] * end
        spans.append((list(table), end))
        if end == seq.num_tokens:          # the chunk reaches the newest token: its logits give the next
            select.append(len(ids) - 1)
    qs, ks = torch.tensor(qseq), torch.tensor(kseq)
    key_pos = torch.where(qs[:, None] == ks[None, :], torch.tensor(kpos)[None, :], EMPTY)[None]
    return torch.tensor([ids]), torch.tensor([pos]), slots, key_slots, key_pos, spans, select


class Runner:
    """Runs scheduled steps on ``model`` through a paged pool (``keys``/``values``
    ``[layers, blocks, heads, block_size, head_dim]``)."""

    def __init__(self, model, pool: PagedPool, gather=None):
        self.model, self.pool, self.gather = model, pool, gather
        self.device = pool.keys.device

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: the whole block, every layer, keys and values."""
        for src, dst in copies:
            self.pool.keys[:, dst] = self.pool.keys[:, src]
            self.pool.values[:, dst] = self.pool.values[:, src]

    @torch.no_grad()
    def run(self, work: list[tuple[Sequence, int]]) -> list[int | None]:
        """One forward over the step; the new token of each sequence whose chunk ends at its newest
        token (None for a prompt chunk that does not)."""
        ids, pos, slots, key_slots, key_pos, spans, select = ragged_inputs(work, self.pool.block_size)
        view = RaggedStep(self.pool, pos, slots, key_slots, key_pos, spans, self.gather)
        rows = torch.tensor(select, dtype=torch.long, device=self.device)
        logits = self.model(ids.to(self.device), cache=view, select=rows)    # positions: the view's plan
        new = logits[0].argmax(-1).tolist()       # the LM head ran only on the rows that get a token
        out, it = [], iter(new)
        for seq, n in work:
            out.append(next(it) if seq.num_computed + n == seq.num_tokens else None)
        return out
