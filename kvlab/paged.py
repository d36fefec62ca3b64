"""A paged KV cache (chapter 9): fixed-size blocks, block tables, reference counts, copy-on-write.

Chapter 3's cache reserves one contiguous ``[max_len]`` stretch per sequence. Here every layer's keys
and values live in one *pool* of ``num_blocks`` blocks of ``block_size`` token slots each::

    keys[layer]: [num_blocks, heads, block_size, head_dim]

and a sequence owns a *block table*, the list of its blocks in token order: position ``p`` sits in
block ``table[p // block_size]`` at offset ``p % block_size``. Blocks are handed out as a sequence
grows and go back to a free list when it ends, so the waste is at most one partly filled block per
sequence. Sequences that start with the same tokens can point at the same blocks (``fork``); a
reference count says how many tables hold a block, and a shared block that is partly filled is
copied before anyone appends to it (copy-on-write).

    alloc = BlockAllocator(num_blocks=64, block_size=16)
    table = alloc.allocate("a", 40)          # 3 blocks, room for 40 tokens (48 slots)
    block, offset, copy_from = alloc.append_slot("a")   # where token 41 goes
    alloc.fork("a", "b"); alloc.free("a"); alloc.free("b")

:class:`kvlab.paged_cache.PagedPool` puts a pool and this allocator together, and
:class:`kvlab.paged_cache.PagedCache` wraps it in chapter 3's ``Cache`` interface so
``kvlab.gpt2.generate`` runs on paged memory unchanged. The serving engine (:mod:`kvlab.serving`)
keeps its own pool in its runner and its own allocator, the block manager (which adds the prefix
cache); this allocator is lab 9's reference, tested against the block manager on the same scenarios.
"""

from __future__ import annotations

import operator
from collections import deque

import torch
from .validate import check_int



class OutOfBlocks(RuntimeError):
    """Raised when a request needs a block and the free list is empty."""


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
    check_int(block_size, "block_size", 1)
    return -(-check_int(num_tokens, "num_tokens", 0) // block_size)




def blocks_to_grow(allocator, seq_id, held: int, upto: int, bs: int) -> int:
    """Blocks an allocator (lab 9's contract: ``block_table``, ``refcount``) of blocks of ``bs`` slots
    must hand out for ``seq_id`` to grow from ``held`` tokens to ``upto``: new blocks, plus one to copy
    a shared, partly filled last block into (copy-on-write)."""
    table = allocator.block_table(seq_id)
    shared_tail = upto > held and held % bs != 0 and allocator.refcount(table[-1]) > 1
    return max(0, blocks_for(upto, bs) - len(table)) + int(shared_tail)


class BlockAllocator:
    """Hands out blocks of a pool to sequences; counts references; copies on write.

    Only bookkeeping: it never touches a tensor. ``append_slot`` says where the next token goes and,
    when a shared block had to be replaced, which block's contents the caller must copy first.
    """

    def __init__(self, num_blocks: int, block_size: int):
        check_int(num_blocks, "num_blocks (blocks in the pool)", 1)
        check_int(block_size, "block_size (token slots per block)", 1)
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = deque(range(num_blocks))        # FIFO: the least recently freed block goes out first
        self._refcount = [0] * num_blocks
        self._tables: dict[object, list[int]] = {}
        self._lengths: dict[object, int] = {}        # tokens each sequence holds

    # -- helpers --------------------------------------------------------------------------------
    def _take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} free block(s) but only {len(self._free)} of {self.num_blocks} are "
                              "free: wait for a sequence to finish (or preempt one) before admitting more")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._refcount[b] = 1
        return blocks

    def _table(self, seq_id) -> list[int]:
        _check_seq_id(seq_id)
        if seq_id not in self._tables:
            raise KeyError(f"unknown sequence {seq_id!r}: allocate() or fork() it first")
        return self._tables[seq_id]

    # -- the contract ---------------------------------------------------------------------------
    def allocate(self, seq_id, num_tokens: int) -> list[int]:
        """Block table of a new sequence that holds ``num_tokens`` tokens (its prompt)."""
        if _check_seq_id(seq_id) in self._tables:
            raise ValueError(f"sequence {seq_id!r} already has blocks; free() it first")
        check_int(num_tokens, "num_tokens (the prompt's length)", 0)
        self._tables[seq_id] = self._take(blocks_for(num_tokens, self.block_size))  # all or nothing
        self._lengths[seq_id] = num_tokens
        return list(self._tables[seq_id])

    def fork(self, parent_id, child_id) -> None:
        """The child starts as a copy of the parent: same blocks (shared, counted), same length."""
        table = self._table(parent_id)
        if _check_seq_id(child_id) in self._tables:
            raise ValueError(f"sequence {child_id!r} already exists")
        for b in table:
            self._refcount[b] += 1
        self._tables[child_id] = list(table)          # its own list: a later copy-on-write is private
        self._lengths[child_id] = self._lengths[parent_id]

    def append_slot(self, seq_id) -> tuple[int, int, int | None]:
        """Room for one more token: ``(block, offset, copy_from)``."""
        table, n = self._table(seq_id), self._lengths[seq_id]
        offset, copy_from = n % self.block_size, None
        if n == len(table) * self.block_size:         # every slot taken: a fresh block, nothing to copy
            table.append(self._take(1)[0])
        elif self._refcount[table[-1]] > 1:           # a shared, partly filled block: copy on write
            copy_from = table[-1]
            table[-1] = self._take(1)[0]
            self._refcount[copy_from] -= 1            # the others keep the original
        self._lengths[seq_id] = n + 1
        return table[-1], offset, copy_from

    def free(self, seq_id) -> None:
        """Drop a sequence; a block returns to the free list when no table holds it any more."""
        for b in self._table(seq_id):
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                self._free.append(b)
        del self._tables[seq_id], self._lengths[seq_id]

    def truncate(self, seq_id, num_tokens: int) -> None:
        """Keep only the first ``num_tokens`` tokens of a sequence (a rewind): the blocks after them are
        released (back to the free list when no other table holds them)."""
        table, n = self._table(seq_id), self._lengths[seq_id]
        if not isinstance(num_tokens, int) or not 0 <= num_tokens <= n:
            raise ValueError(f"num_tokens must be an int between 0 and the {n} tokens of {seq_id!r}, "
                             f"got {num_tokens!r}")
        keep = blocks_for(num_tokens, self.block_size)
        for b in table[keep:]:
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                self._free.append(b)
        del table[keep:]
        self._lengths[seq_id] = num_tokens

    def block_table(self, seq_id) -> list[int]:
        return list(self._table(seq_id))

    def refcount(self, block: int) -> int:
        """How many block tables hold ``block`` (0: it is free)."""
        if not _is_block_id(block, self.num_blocks):
            raise ValueError(f"block must be a block id, an int in [0, {self.num_blocks}), got {block!r}")
        return self._refcount[block]

    @property
    def num_free(self) -> int:
        return len(self._free)


def _is_block_id(b, num_blocks: int) -> bool:
    """An integer (Python, numpy or a 0-d tensor; not a bool) in ``[0, num_blocks)``."""
    if isinstance(b, bool):
        return False
    try:
        return 0 <= operator.index(b) < num_blocks
    except TypeError:
        return False


def _check_seq_id(seq_id):
    """A sequence id is a dict key: it must be hashable (a str, an int, a tuple...)."""
    try:
        hash(seq_id)
    except TypeError:
        raise ValueError(f"a sequence id must be hashable (an int or a str, say), got the "
                         f"{type(seq_id).__name__} {seq_id!r}") from None
    return seq_id


# ---------------------------------------------------------------------------------------------------
# Reading a sequence's keys back


def _check_gather(pool: torch.Tensor, table, seq_len, what: str = "seq_len") -> None:
    """``pool`` is ``[num_blocks, heads, block_size, head_dim]``; ``table`` lists block ids of that
    pool; ``seq_len`` is an int that fits in the table."""
    if not isinstance(pool, torch.Tensor) or pool.dim() != 4:
        raise ValueError("pool must be one layer's keys or values, a tensor [num_blocks, heads, block_size, "
                         f"head_dim], got {getattr(pool, 'shape', type(pool).__name__)}; index the layer first")
    check_int(seq_len, what, 0)
    bad = [b for b in table if not _is_block_id(b, pool.shape[0])]
    if bad:
        raise ValueError(f"block table {list(table)} holds {bad[0]!r}, not a block id of this pool "
                         f"(ints in [0, {pool.shape[0]})); pass the allocator's block_table(seq_id)")
    if seq_len > len(table) * pool.shape[2]:
        raise ValueError(f"{what}={seq_len} needs {blocks_for(seq_len, pool.shape[2])} blocks of "
                         f"{pool.shape[2]} but the table has {len(table)}: ask for at most "
                         f"{len(table) * pool.shape[2]} positions, or reserve more blocks first")


def paged_gather(pool: torch.Tensor, block_table, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` positions of one sequence, ``[heads, seq_len, head_dim]``, written plainly.

    ``pool`` is one layer's keys (or values), ``[num_blocks, heads, block_size, head_dim]``. The
    blocks are read in the order of the table (the order of the tokens), not the order of their ids.
    """
    _check_gather(pool, block_table, seq_len)
    bs = pool.shape[2]
    if seq_len == 0:
        return pool.new_zeros(pool.shape[1], 0, pool.shape[3])
    blocks = [pool[b] for b in block_table[:blocks_for(seq_len, bs)]]   # each [heads, block_size, head_dim]
    return torch.cat(blocks, dim=1)[:, :seq_len]


def block_index(tables: list[list[int]], device=None) -> torch.Tensor:
    """The block tables of a batch as one LongTensor ``[batch, width]``, ``width`` the longest table's
    length; shorter tables are padded with block 0 (whatever it holds is hidden by the lengths)."""
    width = max(len(t) for t in tables)
    idx = torch.zeros(len(tables), width, dtype=torch.long)
    for i, t in enumerate(tables):
        idx[i, :len(t)] = torch.as_tensor(list(t), dtype=torch.long)
    return idx.to(device)


def batched_gather(pool: torch.Tensor, tables: list[list[int]], lengths: list[int]):
    """Every sequence of a batch in one indexing op (the faster gather).

    Returns ``(x, valid)``: ``x`` is ``[batch, heads, S, head_dim]`` with ``S`` the longest table's
    slots, ``valid`` is ``[batch, S]`` (True on real positions). Short tables are padded with block 0,
    whose contents ``valid`` hides.
    """
    if not tables or len(lengths) != len(tables):
        raise ValueError(f"batched_gather needs one length per block table (and at least one table): got "
                         f"{len(tables)} tables but {len(lengths)} lengths; pass lengths=[n for each table]")
    for i, (t, n) in enumerate(zip(tables, lengths)):
        _check_gather(pool, t, n, f"lengths[{i}]")
    idx = block_index(tables, pool.device)
    x = pool[idx]                                                    # [B, width, heads, bs, D]
    B, width, H, bs, D = x.shape
    x = x.permute(0, 2, 1, 3, 4).reshape(B, H, width * bs, D)
    valid = torch.arange(width * bs, device=pool.device)[None] < torch.tensor(lengths, device=pool.device)[:, None]
    return x, valid


def copy_block(keys: torch.Tensor, values: torch.Tensor, src: int, dst: int) -> None:
    """Copy-on-write's copy: block ``src`` into block ``dst``, every layer, keys and values
    (``[layers, blocks, heads, block_size, head_dim]``). The one copy both paged stores make."""
    keys[:, dst] = keys[:, src]
    values[:, dst] = values[:, src]


# ---------------------------------------------------------------------------------------------------
# The pool and its allocator


