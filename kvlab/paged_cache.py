"""Paged memory in the one cache interface (chapter 9): the pool of blocks and chapter 3's ``Cache`` on it.

:class:`PagedPool` puts a pool and lab 9's allocator together; :class:`PagedCache` wraps it in
chapter 3's ``Cache`` interface so ``kvlab.gpt2.generate`` runs on paged memory unchanged. The
allocator and the gathers are in :mod:`kvlab.paged`; the serving engine's ragged step is in
:mod:`kvlab.serving.runner` and :mod:`kvlab.ragged`.
"""

from __future__ import annotations
import torch
from .cache import Cache
from .paged import BlockAllocator, OutOfBlocks, batched_gather, blocks_for, blocks_to_grow, copy_block
from .configs import kv_dims
from .validate import check_int


class PagedPool:
    """One pool of blocks per layer for keys and one for values, plus lab 9's allocator that hands them
    out: the store under :class:`PagedCache`. (The serving engine does not use it: its runner owns its
    pool and its block manager is its allocator.)

    ``allocator_cls`` and ``gather`` are pluggable (the lab grades a learner's through them):
    ``gather=None`` reads a batch with :func:`batched_gather`; otherwise ``gather(pool, table, n)`` is
    called once per sequence and layer (like :func:`paged_gather`).
    """

    def __init__(self, n_layer: int, n_head: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype=torch.float32, device="cpu", allocator_cls=BlockAllocator, gather=None):
        check_int(num_blocks, "num_blocks (blocks in the pool)", 1)     # before allocating the pools
        check_int(block_size, "block_size (token slots per block)", 1)
        shape = (n_layer, num_blocks, n_head, block_size, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.n_layer, self.n_head, self.head_dim = n_layer, n_head, head_dim
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype, self.device = dtype, self.keys.device
        self.allocator = allocator_cls(num_blocks, block_size)
        self.gather = gather
        self.lengths: dict[object, int] = {}   # tokens written per sequence: the one length the model side reads
        self.copies = 0                        # copy-on-write copies made so far

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int, **kwargs) -> "PagedPool":
        cfg, p = model.config, next(model.parameters())
        return cls(*kv_dims(cfg), num_blocks, block_size, p.dtype, p.device, **kwargs)

    def reserve(self, seq_id, n: int) -> list[tuple[int, int]]:
        """``(block, offset)`` slots for ``n`` more tokens of ``seq_id`` (a new sequence is allocated);
        copies the contents of any shared block that had to be replaced, in every layer. All or
        nothing: a request the free blocks cannot hold raises before anything changes."""
        n = check_int(n, "n (tokens to reserve)", 0)
        if seq_id not in self.lengths:
            table = self.allocator.allocate(seq_id, n)
            self.lengths[seq_id] = n
            return [(table[p // self.block_size], p % self.block_size) for p in range(n)]
        self._check_room(seq_id, n)
        slots = []
        for _ in range(n):
            block, offset, copy_from = self.allocator.append_slot(seq_id)
            if copy_from is not None:
                copy_block(self.keys, self.values, copy_from, block)   # copy-on-write: the whole block
                self.copies += 1
            slots.append((block, offset))
        self.lengths[seq_id] += n
        return slots

    def _check_room(self, seq_id, n: int) -> None:
        """Raise :class:`OutOfBlocks` unless the free list holds every block ``n`` more tokens of
        ``seq_id`` need (:func:`blocks_to_grow`)."""
        held = self.lengths[seq_id]
        need = blocks_to_grow(self.allocator, seq_id, held, held + n, self.block_size)
        if need > self.num_free:
            raise OutOfBlocks(f"sequence {seq_id!r} needs {need} more block(s) for {n} token(s) but only "
                              f"{self.num_free} of {self.num_blocks} are free: nothing was reserved; free "
                              "or preempt a sequence first")

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

    def reset(self):
        for s in list(self.lengths):
            self.free(s)

    def rewind(self, seq_id, length: int) -> None:
        """Forget the tokens of ``seq_id`` from position ``length`` on; its blocks after them go back."""
        if seq_id not in self.lengths or not isinstance(length, int) or not 0 <= length <= self.lengths[seq_id]:
            raise ValueError(f"rewind needs a sequence held and a length between 0 and its "
                             f"{self.lengths.get(seq_id)} tokens, got {seq_id!r}, {length!r}")
        if not hasattr(self.allocator, "truncate"):
            raise ValueError("this allocator has no truncate(seq_id, num_tokens): a paged rewind needs one")
        self.allocator.truncate(seq_id, length)
        self.lengths[seq_id] = length

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

    Built like a :class:`kvlab.cache.PreallocatedCache`; row ``i`` of the batch is sequence ``i``, and
    a token's slot in its sequence is its position. The pool has room for ``batch_size * max_len``
    tokens but a sequence takes blocks only as it grows.
    """

    bookkeeping = ("_slots",)

    def __init__(self, n_layer, batch_size, n_head, head_dim, max_len, dtype=torch.float32, device="cpu",
                 block_size: int = 16):
        num_blocks = batch_size * blocks_for(max_len, block_size)
        self.paged = PagedPool(n_layer, n_head, head_dim, num_blocks, block_size, dtype, device)
        self.n_layer, self.batch_size, self._len = n_layer, batch_size, 0
        self.n_head, self.head_dim, self.dtype, self.device = n_head, head_dim, dtype, self.paged.device
        self._slots = None

    def store(self, layer, k, v, positions):
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
        self._advance(layer, T)
        return keys[:, :, :n], values[:, :, :n], torch.arange(n, device=k.device)[None, None]

    def reset(self):
        self.paged.reset()
        self._len = 0

    def rewind(self, length: int) -> None:
        self._check_rewind(length)
        for i in list(self.paged.lengths):
            self.paged.rewind(i, length)
        self._len = length

    @property
    def nbytes(self):
        return self.paged.blocks_used * self.paged.bytes_per_block
