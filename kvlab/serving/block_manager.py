"""The block manager: which blocks of the pool each sequence holds (chapter 9). Bookkeeping only.

It hands blocks out on demand (``grow``), counts references (a block may sit in several tables),
copies on write (a shared, partly filled block is replaced by a private copy before anyone writes
into it; the runner copies the tensors), and keeps an **automatic prefix cache**:

* once a block is full, it is registered under a key made of its tokens *and its parent's key*, so
  a key names the whole prefix up to the end of that block, not just 16 tokens;
* a new sequence looks its prompt up block by block (``allocate``); each hit forks the block
  (one more reference) instead of recomputing it;
* a freed block that is registered is not wiped: it waits, unreferenced, in least-recently-used order,
  and is still a hit for a later prompt; when the free list is empty the oldest of them is evicted:
  its key is forgotten *before* the block is handed out for other tokens.

Counters: ``hits`` (blocks found), ``hit_tokens`` (prompt tokens not recomputed), ``evictions``,
``copies`` (copy-on-write). Every method either completes or raises before changing anything.
"""

from __future__ import annotations

import hashlib
import inspect
from array import array
from collections import OrderedDict, deque

from ..paged import OutOfBlocks, blocks_for, blocks_to_grow
from .sequence import Sequence
from ..validate import check_int


class BlockManager:
    """Blocks for sequences, with reference counts, copy-on-write and an LRU prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        for name, v in (("num_blocks", num_blocks), ("block_size", block_size)):
            check_int(v, name, 1)
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self._free = deque(range(num_blocks))             # never registered (or wiped): no key
        self.cached: OrderedDict[int, None] = OrderedDict()   # registered, unreferenced: least recently used first
        self._ref = [0] * num_blocks
        self.key_of: list = [None] * num_blocks           # the key a registered block is found by (None: none)
        self.block_of: dict = {}                          # key -> the block registered under it
        self.hits = self.hit_tokens = self.evictions = self.copies = 0
        self._chained = "parent" in inspect.signature(self._keys).parameters   # can extend a chain

    # -- queries --------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now: the free list plus unreferenced cached blocks."""
        return len(self._free) + len(self.cached)

    def refcount(self, block: int) -> int:
        return self._ref[check_int(block, "block", 0, self.num_blocks - 1, fix="a block id of this pool")]

    def _keys(self, tokens, parent: bytes = b"") -> list:
        """Chained keys of the full blocks of ``tokens``: key i names tokens[: (i + 1) * block_size]
        (after ``parent``, the key of the blocks before them). SHA-256 of the parent's key and the
        block's tokens, as vLLM offers: two different prefixes share a key only by a hash collision."""
        keys, bs = [], self.block_size
        for i in range(len(tokens) // bs):
            parent = hashlib.sha256(parent + array("q", tokens[i * bs:(i + 1) * bs]).tobytes()).digest()
            keys.append(parent)
        return keys

    def lookup(self, tokens) -> list[int]:
        """The cached blocks that hold a prefix of ``tokens``, longest first match (changes nothing).
        The last token is never a hit: its logits are what the step must produce."""
        if not self.prefix_caching:
            return []
        found = []
        for key in self._keys(list(tokens)[:len(tokens) - 1]):
            block = self.block_of.get(key)
            if block is None or self.key_of[block] != key:
                break
            found.append(block)
        return found

    def blocks_needed(self, seq: Sequence, upto: int) -> int:
        """New blocks ``seq`` needs to hold ``upto`` tokens (a copy-on-write counts as one); for a
        sequence without blocks, after its prefix-cache hits (a hit on a cached block counts, since
        it leaves the pool of blocks that can be handed out)."""
        if not seq.block_table:
            hits = self.lookup(seq.tokens)
            return blocks_for(upto, self.block_size) - len(hits) + sum(self._ref[b] == 0 for b in hits)
        n = max(0, blocks_for(upto, self.block_size) - len(seq.block_table))
        return n + self._needs_copy(seq)

    def can_hold(self, seq: Sequence, upto: int) -> bool:
        return self.blocks_needed(seq, upto) <= self.num_free

    def _needs_copy(self, seq: Sequence) -> bool:
        """The next write lands in a block that another table holds too (partly filled, shared)."""
        i = seq.num_computed // self.block_size
        return i < len(seq.block_table) and self._ref[seq.block_table[i]] > 1

    # -- mutations ------------------------------------------------------------------------------
    def _take(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfBlocks(f"need {n} free block(s) but only {self.num_free} of {self.num_blocks} are free: "
                              "preempt a sequence or wait for one to finish")
        out = []
        for _ in range(n):
            b = self._free.popleft() if self._free else self.evict()
            self._ref[b] = 1
            out.append(b)
        return out

    def evict(self) -> int:
        """Take the least recently used unreferenced cached block out of the cache: forget its key
        first (it is about to hold other tokens) and return it."""
        b, _ = self.cached.popitem(last=False)
        del self.block_of[self.key_of[b]]
        self.key_of[b] = None
        self.evictions += 1
        return b

    def allocate(self, seq: Sequence, upto: int) -> list[tuple[int, int]]:
        """Blocks for ``seq`` to hold ``upto`` tokens. A sequence without blocks first takes its
        prefix-cache hits (``num_computed`` jumps past them). Returns the ``(src, dst)`` block copies
        the caller must make (copy-on-write). All or nothing."""
        if not seq.block_table and seq.num_computed == 0:
            if self.blocks_needed(seq, upto) > self.num_free:
                raise OutOfBlocks(f"{seq.rid!r} needs {self.blocks_needed(seq, upto)} blocks, "
                                  f"{self.num_free} are free")
            hits = self.lookup(seq.tokens)
            for b in hits:                          # a hit forks the cached block
                self.cached.pop(b, None)
                self._ref[b] += 1
            seq.block_table = list(hits)
            seq.num_computed = len(hits) * self.block_size
            seq.cached_tokens += seq.num_computed
            self.hits, self.hit_tokens = self.hits + len(hits), self.hit_tokens + seq.num_computed
        return self.grow(seq, upto)

    def grow(self, seq: Sequence, upto: int) -> list[tuple[int, int]]:
        """Room for ``upto`` tokens; the block the next token goes to made private. All or nothing."""
        new = self._take(self.blocks_needed(seq, upto))    # raises before any change
        copies = []
        if self._needs_copy(seq):
            i = seq.num_computed // self.block_size
            src, dst = seq.block_table[i], new.pop()
            self._ref[src] -= 1                             # the other holders keep the original
            seq.block_table[i] = dst
            copies.append((src, dst))
            self.copies += 1
        seq.block_table.extend(new)
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Explicit sharing: the child holds the parent's blocks and tokens so far (no copy yet)."""
        if child.block_table:
            raise ValueError(f"sequence {child.rid!r} already holds blocks")
        for b in parent.block_table:
            self._ref[b] += 1
        child.block_table = list(parent.block_table)
        child.num_computed = parent.num_computed
        child.committed = 0

    def commit(self, seq: Sequence) -> None:
        """After a step: register the blocks of ``seq`` that are now full (their tokens are computed)."""
        if not self.prefix_caching:
            return
        full, bs, keys = seq.num_computed // self.block_size, self.block_size, seq.block_keys
        if len(keys) < full and self._chained:   # hash only the blocks that became full since last time
            keys += self._keys(seq.tokens[len(keys) * bs:full * bs], keys[-1] if keys else b"")
        elif len(keys) < full:            # a subclass's _keys(tokens) without a parent: all of them again
            keys[:] = self._keys(seq.tokens[:full * bs])
        for i in range(seq.committed, full):
            b, key = seq.block_table[i], keys[i]
            if self.key_of[b] is None and key not in self.block_of:   # the first copy of a prefix wins
                self.key_of[b], self.block_of[key] = key, b
        seq.committed = full

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep the blocks that hold ``seq``'s first ``num_tokens`` tokens; the rest go back (a rewind:
        chapter 10's rejected drafts). A kept partly filled block is overwritten by the next tokens."""
        keep = blocks_for(num_tokens, self.block_size)
        tail, seq.block_table = seq.block_table[keep:], seq.block_table[:keep]
        self._release(tail)
        seq.committed = min(seq.committed, num_tokens // self.block_size)

    def _release(self, blocks) -> None:
        for b in reversed(blocks):    # the tail first: it is the least likely to be shared
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self.key_of[b] is not None:
                    self.cached[b] = None
                else:
                    self._free.append(b)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; an unreferenced block goes to the free list, or (if it is
        registered) to the most recently used end of the cache."""
        self._release(seq.block_table)
        seq.block_table = []


class AllocatorBlocks:
    """The block manager's interface over lab 9's ``BlockAllocator`` contract (``allocate``, ``fork``,
    ``append_slot``, ``free``, ``block_table``, ``refcount``, ``num_free``), so the engine can run on a
    learner's allocator. No prefix cache: only explicit sharing (``fork``) and copy-on-write."""

    prefix_caching = False

    def __init__(self, allocator_cls, num_blocks: int, block_size: int):
        self.a = allocator_cls(num_blocks, block_size)
        self.num_blocks, self.block_size = num_blocks, block_size
        self._room: dict = {}          # tokens the allocator has been asked to hold, per sequence
        self.hits = self.hit_tokens = self.evictions = self.copies = 0

    @property
    def num_free(self) -> int:
        n = self.a.num_free            # a property in the contract; a method is accepted too
        return int(n() if callable(n) else n)

    def refcount(self, block: int) -> int:
        return self.a.refcount(block)

    def lookup(self, tokens) -> list[int]:
        return []

    def blocks_needed(self, seq: Sequence, upto: int) -> int:
        room = self._room.get(seq.rid)
        if room is None:
            return blocks_for(upto, self.block_size)
        return blocks_to_grow(self.a, seq.rid, room, upto, self.block_size)

    def can_hold(self, seq: Sequence, upto: int) -> bool:
        return self.blocks_needed(seq, upto) <= self.num_free

    def allocate(self, seq: Sequence, upto: int) -> list[tuple[int, int]]:
        if seq.rid in self._room:
            return self.grow(seq, upto)
        if self.blocks_needed(seq, upto) > self.num_free:
            raise OutOfBlocks(f"{seq.rid!r} needs {self.blocks_needed(seq, upto)} blocks, {self.num_free} free")
        self.a.allocate(seq.rid, upto)
        self._room[seq.rid] = upto
        seq.block_table = [int(b) for b in self.a.block_table(seq.rid)]
        return []

    def grow(self, seq: Sequence, upto: int) -> list[tuple[int, int]]:
        if self.blocks_needed(seq, upto) > self.num_free:
            raise OutOfBlocks(f"{seq.rid!r} needs {self.blocks_needed(seq, upto)} blocks, {self.num_free} free")
        copies = []
        for _ in range(self._room[seq.rid], upto):
            block, _, copy_from = self.a.append_slot(seq.rid)
            if copy_from is not None:
                copies.append((int(copy_from), int(block)))
        self._room[seq.rid] = max(upto, self._room[seq.rid])
        self.copies += len(copies)
        seq.block_table = [int(b) for b in self.a.block_table(seq.rid)]
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        self.a.fork(parent.rid, child.rid)
        self._room[child.rid] = self._room[parent.rid]
        child.block_table = [int(b) for b in self.a.block_table(child.rid)]
        child.num_computed = parent.num_computed

    def commit(self, seq: Sequence) -> None:
        pass

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        raise ValueError("lab 9's allocator contract has no truncate, so a sequence on it cannot rewind "
                         "(chapter 10's batched speculation): run it on the engine's BlockManager")

    def free(self, seq: Sequence) -> None:
        self.a.free(seq.rid)
        del self._room[seq.rid]
        seq.block_table = []
