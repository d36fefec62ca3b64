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

:class:`PagedKVCache` puts the pool and an allocator together for the scheduler of
:mod:`kvlab.serving`; :class:`PagedCache` wraps it in chapter 3's ``Cache`` interface so
``kvlab.gpt2.generate`` runs on paged memory unchanged.
"""

from __future__ import annotations

import operator
from collections import deque

import torch

from .cache import Cache


class OutOfBlocks(RuntimeError):
    """Raised when a request needs a block and the free list is empty."""


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
    _count(block_size, "block_size", minimum=1)
    return -(-_count(num_tokens, "num_tokens") // block_size)


def _count(value, what: str, minimum: int = 0) -> int:
    """``value`` as an int >= ``minimum``; a bool, a float or a smaller number is refused."""
    try:
        n = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        n = None
    if n is None or n < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}, got {value!r}")
    return n


class BlockAllocator:
    """Hands out blocks of a pool to sequences; counts references; copies on write.

    Only bookkeeping: it never touches a tensor. ``append_slot`` says where the next token goes and,
    when a shared block had to be replaced, which block's contents the caller must copy first.
    """

    def __init__(self, num_blocks: int, block_size: int):
        _count(num_blocks, "num_blocks (blocks in the pool)", minimum=1)
        _count(block_size, "block_size (token slots per block)", minimum=1)
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
        _count(num_tokens, "num_tokens (the prompt's length)")
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
    _count(seq_len, what)
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
    bs, width = pool.shape[2], max(len(t) for t in tables)
    idx = torch.zeros(len(tables), width, dtype=torch.long)
    for i, t in enumerate(tables):
        idx[i, :len(t)] = torch.as_tensor(list(t), dtype=torch.long)
    x = pool[idx.to(pool.device)]                                    # [B, width, heads, bs, D]
    B, _, H, _, D = x.shape
    x = x.permute(0, 2, 1, 3, 4).reshape(B, H, width * bs, D)
    valid = torch.arange(width * bs, device=pool.device)[None] < torch.tensor(lengths, device=pool.device)[:, None]
    return x, valid


# ---------------------------------------------------------------------------------------------------
# The pool and its allocator


class PagedKVCache:
    """One pool of blocks per layer for keys and one for values, plus the allocator that hands them out.

    ``allocator_cls`` and ``gather`` are pluggable (the lab grades a learner's through them):
    ``gather=None`` reads a batch with :func:`batched_gather`; otherwise ``gather(pool, table, n)`` is
    called once per sequence and layer (like :func:`paged_gather`).
    """

    def __init__(self, n_layer: int, n_head: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype=torch.float32, device="cpu", allocator_cls=BlockAllocator, gather=None):
        shape = (n_layer, num_blocks, n_head, block_size, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.n_layer, self.num_blocks, self.block_size = n_layer, num_blocks, block_size
        self.allocator = allocator_cls(num_blocks, block_size)
        self.gather = gather
        self.lengths: dict[object, int] = {}   # tokens written per sequence (kept here, not asked of the allocator)
        self.copies = 0                        # copy-on-write copies made so far

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int, **kwargs) -> "PagedKVCache":
        cfg, p = model.config, next(model.parameters())
        return cls(cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, num_blocks, block_size,
                   p.dtype, p.device, **kwargs)

    def reserve(self, seq_id, n: int) -> list[tuple[int, int]]:
        """``(block, offset)`` slots for ``n`` more tokens of ``seq_id`` (a new sequence is allocated);
        copies the contents of any shared block that had to be replaced, in every layer."""
        if seq_id not in self.lengths:
            table = self.allocator.allocate(seq_id, n)
            self.lengths[seq_id] = n
            return [(table[p // self.block_size], p % self.block_size) for p in range(n)]
        slots = []
        for _ in range(n):
            block, offset, copy_from = self.allocator.append_slot(seq_id)
            if copy_from is not None:
                self.keys[:, block] = self.keys[:, copy_from]     # copy-on-write: the whole block
                self.values[:, block] = self.values[:, copy_from]
                self.copies += 1
            slots.append((block, offset))
        self.lengths[seq_id] += n
        return slots

    def fork(self, parent_id, child_id) -> None:
        self.allocator.fork(parent_id, child_id)
        self.lengths[child_id] = self.lengths[parent_id]

    def free(self, seq_id) -> None:
        self.allocator.free(seq_id)
        del self.lengths[seq_id]

    def write(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, k, v) -> None:
        """Store ``k``, ``v`` (``[N, heads, head_dim]``, one row per token) at the given slots."""
        self.keys[layer][blocks, :, offsets] = k      # advanced indices on dims 0 and 2: rows [N, heads, D]
        self.values[layer][blocks, :, offsets] = v

    def read(self, layer: int, tables: list[list[int]], lengths: list[int]):
        """Keys, values ``[batch, heads, S, head_dim]`` and ``valid [batch, S]`` for a batch of tables."""
        if self.gather is None:
            k, valid = batched_gather(self.keys[layer], tables, lengths)
            v, _ = batched_gather(self.values[layer], tables, lengths)
            return k, v, valid
        S = max(lengths)
        k = self.keys.new_zeros(len(tables), self.keys.shape[2], S, self.keys.shape[4])
        v = torch.zeros_like(k)
        for i, (t, n) in enumerate(zip(tables, lengths)):   # the plain way: one sequence at a time
            k[i, :, :n] = self.gather(self.keys[layer], t, n)
            v[i, :, :n] = self.gather(self.values[layer], t, n)
        valid = torch.arange(S, device=k.device)[None] < torch.tensor(lengths, device=k.device)[:, None]
        return k, v, valid

    @property
    def num_free(self) -> int:
        n = self.allocator.num_free    # a property in the contract; a method is accepted too
        return int(n() if callable(n) else n)

    @property
    def blocks_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.keys[:, 0].numel() * self.keys.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool (allocated up front, like vLLM's)."""
        return self.keys.numel() * self.keys.element_size() * 2


class PagedCache(Cache):
    """Chapter 3's ``Cache`` interface on paged memory: ``kvlab.gpt2.generate`` runs on it unchanged.

    Built like a :class:`kvlab.cache.PreallocatedCache`; row ``i`` of the batch is sequence ``i``.
    The pool has room for ``batch_size * max_len`` tokens but a sequence takes blocks only as it grows.
    """

    def __init__(self, n_layer, batch_size, n_head, head_dim, max_len, dtype=torch.float32, device="cpu",
                 block_size: int = 16):
        num_blocks = batch_size * blocks_for(max_len, block_size)
        self.paged = PagedKVCache(n_layer, n_head, head_dim, num_blocks, block_size, dtype, device)
        self.n_layer, self.batch_size, self._len = n_layer, batch_size, 0
        self._slots = None

    def update(self, layer, k, v):
        B, H, T, D = k.shape
        if B != self.batch_size:
            raise ValueError(f"cache built for batch {self.batch_size}, got keys {list(k.shape)}")
        if layer == 0:   # the first layer of a pass reserves the slots of the T new tokens of every row
            slots = [self.paged.reserve(i, T) for i in range(B)]
            self._slots = torch.tensor(slots, dtype=torch.long, device=k.device).reshape(B * T, 2)
        blocks, offsets = self._slots[:, 0], self._slots[:, 1]
        flat = lambda x: x.transpose(1, 2).reshape(B * T, H, D)   # noqa: E731  [B*T, H, D], row-major
        self.paged.write(layer, blocks, offsets, flat(k), flat(v))
        n = self._len + T
        tables = [self.paged.allocator.block_table(i) for i in range(B)]
        keys, values, _ = self.paged.read(layer, tables, [n] * B)
        if layer == self.n_layer - 1:
            self._len = n
        return keys[:, :, :n], values[:, :, :n]

    def reset(self):
        for i in list(self.paged.lengths):
            self.paged.free(i)
        self._len = 0

    @property
    def seq_len(self):
        return self._len

    @property
    def nbytes(self):
        return self.paged.blocks_used * self.paged.bytes_per_block
