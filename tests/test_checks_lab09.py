"""Lab 9 graders: every wrong allocator / gather the issue lists (and more) is rejected with a message
naming the mistake; unusual correct ones pass."""

import pytest
import torch

from kvlab.course.checks import check_block_allocator, check_paged_gather, check_paged_generate
from kvlab.paged import BlockAllocator as LibraryAllocator
from kvlab.paged import OutOfBlocks
from kvlab.paged import paged_gather as library_gather

from utils import expect_rejected, hands_over_code, own_copy

# A learner's own code, as the rule of the labs asks: the library's source run again outside kvlab.
# The wrong variants below each change one method of it.
BlockAllocator, paged_gather = own_copy(LibraryAllocator), own_copy(library_gather)

# ---------------------------------------------------------------------------------------------------
# Correct, but unlike the library's


class LifoTupleAllocator:
    """LIFO free list, highest ids first, tuples for tables, refcounts derived by counting tables,
    num_free a method, MemoryError when full."""

    def __init__(self, num_blocks, block_size):
        self.bs, self.free_list, self.tables, self.lens = block_size, list(range(num_blocks)), {}, {}

    def _get(self):
        if not self.free_list:
            raise MemoryError("out of KV blocks")
        return self.free_list.pop()

    def allocate(self, seq_id, num_tokens):
        need = -(-num_tokens // self.bs)
        if need > len(self.free_list):
            raise MemoryError("out of KV blocks")
        self.tables[seq_id] = tuple(self._get() for _ in range(need))
        self.lens[seq_id] = num_tokens
        return self.tables[seq_id]

    def fork(self, parent_id, child_id):
        self.tables[child_id], self.lens[child_id] = self.tables[parent_id], self.lens[parent_id]  # immutable

    def append_slot(self, seq_id):
        t, n = self.tables[seq_id], self.lens[seq_id]
        copy_from = None
        if n % self.bs == 0:
            t = t + (self._get(),)
        elif self.refcount(t[-1]) > 1:
            copy_from, t = t[-1], t[:-1] + (self._get(),)
        self.tables[seq_id], self.lens[seq_id] = t, n + 1
        return t[-1], n % self.bs, copy_from

    def free(self, seq_id):
        t = self.tables.pop(seq_id)
        del self.lens[seq_id]
        for b in set(t):
            if self.refcount(b) == 0:
                self.free_list.append(b)

    def block_table(self, seq_id):
        return self.tables[seq_id]

    def refcount(self, block):
        return sum(block in t for t in self.tables.values())

    def num_free(self):
        return len(self.free_list)


def gather_loop(pool, block_table, seq_len):
    bs = pool.shape[2]
    return torch.stack([pool[block_table[p // bs], :, p % bs] for p in range(seq_len)], dim=1)


def gather_index_select(pool, block_table, seq_len):
    idx = torch.as_tensor(list(block_table))
    x = pool.index_select(0, idx).transpose(0, 1)               # [H, n, bs, D]
    return x.flatten(1, 2)[:, :seq_len]


def test_correct_allocator_and_gather_pass():
    check_block_allocator(BlockAllocator)
    check_paged_gather(lambda pool, table, n: paged_gather(pool, table, n))


def test_the_library_handed_in_is_told_to_write_its_own():
    expect_rejected(check_block_allocator, LibraryAllocator, "kvlab.paged.BlockAllocator", "write it yourself")
    expect_rejected(check_paged_gather, library_gather, "kvlab.paged.paged_gather", "write it yourself")


class CopiedMethods(LibraryAllocator):
    """The library's methods bound into a class of the learner's (a subclass that re-types nothing)."""

    allocate, fork, append_slot, free = (LibraryAllocator.allocate, LibraryAllocator.fork,
                                         LibraryAllocator.append_slot, LibraryAllocator.free)


class Forwarding:
    """Composition: every method hands on to the library's allocator."""

    def __init__(self, num_blocks, block_size):
        self.inner = LibraryAllocator(num_blocks, block_size)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_the_library_one_step_removed_is_refused_by_what_runs():
    """Issue 34, kind 1: an attribute chain in a lambda, a default argument, composition, a subclass;
    each refused with the library function it ran, on the unit check AND on the end-to-end one."""
    import kvlab.paged

    lam = lambda pool, table, n: kvlab.paged.paged_gather(pool, table, n)         # noqa: E731
    def default_arg(pool, table, n, _g=library_gather):
        return _g(pool, table, n)
    for gather in (lam, default_arg):
        expect_rejected(check_paged_gather, gather, "ran kvlab.paged.paged_gather")
        expect_rejected(lambda g: check_paged_generate(BlockAllocator, g), gather, "ran kvlab.paged.paged_gather")
    expect_rejected(check_block_allocator, Forwarding, "ran kvlab.paged.BlockAllocator")
    expect_rejected(lambda a: check_paged_generate(a, paged_gather), Forwarding, "ran kvlab.paged.BlockAllocator")
    expect_rejected(check_block_allocator, CopiedMethods, "built on kvlab.paged.BlockAllocator")
    expect_rejected(lambda a: check_paged_generate(a, paged_gather), CopiedMethods,
                    "built on kvlab.paged.BlockAllocator")


class NumpyIds(BlockAllocator):
    """Correct, with numpy integers as block ids (the engine accepts them)."""

    def allocate(self, seq_id, num_tokens):
        import numpy as np
        return [np.int64(b) for b in super().allocate(seq_id, num_tokens)]

    def block_table(self, seq_id):
        import numpy as np
        return [np.int32(b) for b in super().block_table(seq_id)]


def test_numpy_block_ids_are_accepted():
    check_block_allocator(NumpyIds)


class AliasedTable(BlockAllocator):
    def block_table(self, seq_id):
        return self._tables[seq_id]                         # the allocator's own list


class AliasedAllocate(BlockAllocator):
    def allocate(self, seq_id, num_tokens):
        super().allocate(seq_id, num_tokens)
        return self._tables[seq_id]


class DropsRefBeforeCopy(BlockAllocator):
    def append_slot(self, seq_id):
        table, n = self._tables[seq_id], self._lengths[seq_id]
        if n < len(table) * self.block_size and self._refcount[table[-1]] > 1:
            old = table[-1]
            self._refcount[old] -= 1                        # dropped first...
            table[-1] = self._take(1)[0]                    # ...then the pool is found empty
            self._lengths[seq_id] = n + 1
            return table[-1], n % self.block_size, old
        return super().append_slot(seq_id)


class BumpsLengthFirst(BlockAllocator):
    def append_slot(self, seq_id):
        self._lengths[seq_id] += 1                          # counted before the block is taken
        self._lengths[seq_id] -= 1
        n = self._lengths[seq_id]
        self._lengths[seq_id] = n + 1
        try:
            table = self._tables[seq_id]
            copy_from = None
            if n == len(table) * self.block_size:
                table.append(self._take(1)[0])
            elif self._refcount[table[-1]] > 1:
                copy_from = table[-1]
                table[-1] = self._take(1)[0]
                self._refcount[copy_from] -= 1
            return table[-1], n % self.block_size, copy_from
        except Exception:
            raise                                           # ...and left bumped when the pool is empty


class FreeBlockRefcountNonzero(BlockAllocator):
    def refcount(self, block):
        return max(1, self._refcount[block])


def test_unusual_correct_allocator_passes():
    check_block_allocator(LifoTupleAllocator)


@pytest.mark.parametrize("gather", [gather_loop, gather_index_select])
def test_unusual_correct_gathers_pass(gather):
    check_paged_gather(gather)


def test_paged_generate_accepts_correct_pieces(tiny):
    check_paged_generate(BlockAllocator, gather_index_select)
    check_paged_generate(LifoTupleAllocator, gather_loop)


def test_library_allocator_raises_when_full():
    a = LibraryAllocator(2, 4)
    a.allocate("x", 8)
    with pytest.raises(OutOfBlocks, match="free"):
        a.append_slot("x")
    with pytest.raises(ValueError):
        LibraryAllocator(0, 4)


# ---------------------------------------------------------------------------------------------------
# Wrong allocators, each a one-method change of the library's


class FreeWhileShared(BlockAllocator):
    def free(self, seq_id):
        for b in self._tables.pop(seq_id):
            self._refcount[b] = 0
            self._free.append(b)
        del self._lengths[seq_id]


class NoCopyOnWrite(BlockAllocator):
    def append_slot(self, seq_id):
        table, n = self._tables[seq_id], self._lengths[seq_id]
        if n == len(table) * self.block_size:
            table.append(self._take(1)[0])
        self._lengths[seq_id] = n + 1
        return table[-1], n % self.block_size, None


def _boundary_variant(test):
    class Wrong(BlockAllocator):
        def append_slot(self, seq_id):
            table, n = self._tables[seq_id], self._lengths[seq_id]
            if test(n, len(table) * self.block_size):
                table.append(self._take(1)[0])
            self._lengths[seq_id] = n + 1
            return table[-1], n % self.block_size, None
    return Wrong


NewBlockAtLastSlot = _boundary_variant(lambda n, cap: n + 1 >= cap)   # a block early
NoNewBlockAtFirstSlot = _boundary_variant(lambda n, cap: n > cap)     # a block late


class LeakOnFree(BlockAllocator):
    def free(self, seq_id):
        del self._tables[seq_id], self._lengths[seq_id]


class LeakOnCopy(BlockAllocator):
    def append_slot(self, seq_id):
        table, n = self._tables[seq_id], self._lengths[seq_id]
        if n < len(table) * self.block_size and self._refcount[table[-1]] > 1:
            old = table[-1]
            table[-1] = self._take(1)[0]          # forgets to drop the old block's count
            self._lengths[seq_id] = n + 1
            return table[-1], n % self.block_size, old
        return super().append_slot(seq_id)


class AllocateFloor(BlockAllocator):
    def allocate(self, seq_id, num_tokens):
        self._tables[seq_id] = self._take(num_tokens // self.block_size)
        self._lengths[seq_id] = num_tokens
        return list(self._tables[seq_id])


class AllocateExtra(BlockAllocator):
    def allocate(self, seq_id, num_tokens):
        self._tables[seq_id] = self._take(num_tokens // self.block_size + 1)
        self._lengths[seq_id] = num_tokens
        return list(self._tables[seq_id])


class ForkSharesList(BlockAllocator):
    def fork(self, parent_id, child_id):
        for b in self._tables[parent_id]:
            self._refcount[b] += 1
        self._tables[child_id] = self._tables[parent_id]        # the same list object
        self._lengths[child_id] = self._lengths[parent_id]


class ForkNoRefcount(BlockAllocator):
    def fork(self, parent_id, child_id):
        self._tables[child_id] = list(self._tables[parent_id])
        self._lengths[child_id] = self._lengths[parent_id]


class CopyAlways(BlockAllocator):
    def append_slot(self, seq_id):
        table, n = self._tables[seq_id], self._lengths[seq_id]
        if 0 < n < len(table) * self.block_size:
            old = table[-1]
            table[-1] = self._take(1)[0]
            self._refcount[old] -= 1
            if self._refcount[old] == 0:
                self._free.append(old)
            self._lengths[seq_id] = n + 1
            return table[-1], n % self.block_size, old
        return super().append_slot(seq_id)


class CopyAtBoundary(BlockAllocator):
    def append_slot(self, seq_id):
        table, n = self._tables[seq_id], self._lengths[seq_id]
        shared_full = n == len(table) * self.block_size and table and self._refcount[table[-1]] > 1
        block, offset, copy_from = super().append_slot(seq_id)
        return block, offset, table[-2] if shared_full else copy_from


class NoErrorWhenFull(BlockAllocator):
    def _take(self, n):
        out = [self._free.popleft() for _ in range(min(n, len(self._free)))]
        out += [0] * (n - len(out))                # hands out block 0 again instead of raising
        for b in out:
            self._refcount[b] = 1
        return out


class NotAtomic(BlockAllocator):
    def _take(self, n):
        out = []
        for _ in range(n):
            if not self._free:
                raise RuntimeError("no free block")   # the blocks already taken leak
            out.append(self._free.popleft())
            self._refcount[out[-1]] = 1
        return out


class WrongOffset(BlockAllocator):
    def append_slot(self, seq_id):
        block, offset, copy_from = super().append_slot(seq_id)
        return block, (offset + 1) % self.block_size, copy_from


WRONG_ALLOCATORS = [
    (FreeWhileShared, ["freed while shared"]),
    (NoCopyOnWrite, ["shared block without a copy"]),
    (NewBlockAtLastSlot, ["off-by-one at a block boundary", "last slot"]),
    (NoNewBlockAtFirstSlot, ["off-by-one at a block boundary", "new block"]),
    (LeakOnFree, ["leaked"]),
    (LeakOnCopy, ["refcount"]),
    (AllocateFloor, ["round up"]),
    (AllocateExtra, ["one block too many"]),
    (ForkSharesList, ["own copy of the list"]),
    (ForkNoRefcount, ["refcount"]),
    (CopyAlways, ["no other sequence holds", "no copy"]),
    (CopyAtBoundary, ["nothing to copy at a block boundary"]),
    (NoErrorWhenFull, ["must raise"]),
    (NotAtomic, ["before taking any"]),
    (WrongOffset, ["offset"]),
    (AliasedTable, ["own list", "changed from [", "without changing the allocator's own record"]),
    (AliasedAllocate, ["own list", "without changing the allocator's own record"]),
    (DropsRefBeforeCopy, ["raised (good)", "refcount"]),
    (BumpsLengthFirst, ["offset"]),
    (FreeBlockRefcountNonzero, ["free block"]),
]


@pytest.mark.parametrize("impl,needles", WRONG_ALLOCATORS, ids=[c.__name__ for c, _ in WRONG_ALLOCATORS])
def test_wrong_allocators_rejected(impl, needles):
    message = expect_rejected(check_block_allocator, impl, *needles)
    assert not hands_over_code(message), message        # the mistake and the rule, not the fixing line


def test_allocator_exceptions_are_wrapped():
    class Broken(BlockAllocator):
        def fork(self, parent_id, child_id):
            raise KeyError("oops")
    expect_rejected(check_block_allocator, Broken, "fork(", "raised KeyError")


# ---------------------------------------------------------------------------------------------------
# Wrong gathers


def _ref(pool, table, n):
    return pool[list(table)].permute(1, 0, 2, 3).flatten(1, 2)[:, :n]


def _inplace(pool, table, n):
    pool.mul_(1)
    pool[0, 0, 0, 0] += 1
    return _ref(pool, table, n)


WRONG_GATHERS = [
    (lambda p, t, n: _ref(p, sorted(t), n), ["allocation order"]),
    (lambda p, t, n: _ref(p, range(len(t)), n), ["first blocks of the pool"]),
    (lambda p, t, n: p[list(t)].reshape(p.shape[1], -1, p.shape[3])[:, :n], ["heads and blocks are mixed"]),
    (lambda p, t, n: _ref(p, t, 10 ** 6), ["every slot of the blocks"]),
    (lambda p, t, n: _ref(p, t, n + 1), ["off by one"]),
    (lambda p, t, n: _ref(p, t, n - 1) if n > 1 else _ref(p, t, n)[:, :0], ["off by one"]),
    (lambda p, t, n: _ref(p, t, n).float(), ["dtype"]),
    (lambda p, t, n: _ref(p, list(t)[::-1], n), ["reverse"]),
    (lambda p, t, n: _ref(p, t, n)[0], ["[heads, seq_len, head_dim]"]),
    (_inplace, ["modified the pool"]),
    (lambda p, t, n: torch.cat([p[b] for b in t], 1)[:, 1:n + 1], ["wrong values"]),
]


@pytest.mark.parametrize("impl,needles", WRONG_GATHERS, ids=[f"gather{i}" for i in range(len(WRONG_GATHERS))])
def test_wrong_gathers_rejected(impl, needles):
    message = expect_rejected(check_paged_gather, impl, *needles)
    assert not hands_over_code(message), message


def _tuple_indexing(pool, block_table, seq_len):
    """Right for a list; pool[tuple] indexes several dimensions (raises for (4, 2, 0))."""
    blocks = pool[block_table]
    nb, H, bs, D = blocks.shape
    return blocks.permute(1, 0, 2, 3).reshape(H, nb * bs, D)[:, :seq_len]


def test_tuple_used_as_an_index_is_named():
    message = expect_rejected(check_paged_gather, _tuple_indexing, "as a tuple", "one dimension per element")
    assert not hands_over_code(message), message


def test_gather_exceptions_are_wrapped():
    def broken(pool, table, n):
        return pool[torch.tensor(table)]   # a tuple table is fine, but this ignores seq_len... and shape
    expect_rejected(check_paged_gather, broken, "[heads, seq_len, head_dim]")


# ---------------------------------------------------------------------------------------------------
# End to end: the grader says which piece is wrong


def test_paged_generate_blames_the_allocator(tiny):
    expect_rejected(lambda a: check_paged_generate(a, paged_gather), NoCopyOnWrite, "your BlockAllocator")


class OneBlockTooMany(BlockAllocator):
    """The walkthrough's first mistake: n // block_size + 1 blocks for a prompt (one too many at every
    multiple of the block size)."""
    def allocate(self, seq_id, num_tokens):
        if seq_id in self._tables:
            raise ValueError("already allocated")
        self._tables[seq_id] = self._take(num_tokens // self.block_size + 1)
        self._lengths[seq_id] = num_tokens
        return list(self._tables[seq_id])


def test_paged_generate_sends_a_failing_piece_to_its_own_check(tiny):
    """Issue 34 walkthrough: the engine said 'out of blocks: 2 needed, 0 free', naming the exception and
    not the allocator; now the piece that fails its own check is named, with that check's message."""
    msg = expect_rejected(lambda a: check_paged_generate(a, paged_gather), OneBlockTooMany,
                          "your BlockAllocator does not pass check_block_allocator", "pass check_block_allocator first")
    assert "out of blocks" not in msg
    own = expect_rejected(check_block_allocator, OneBlockTooMany)
    assert own.split(" FAILED: ", 1)[1][:80] in msg                    # the unit check's own words


def test_paged_generate_blames_the_gather(tiny):
    def sorted_gather(pool, table, n):
        return _ref(pool, sorted(table), n)
    expect_rejected(lambda g: check_paged_generate(BlockAllocator, g), sorted_gather, "paged_gather")


def test_paged_generate_catches_leaks(tiny):
    msg = expect_rejected(lambda a: check_paged_generate(a, paged_gather), LeakOnFree, "leaked")
    assert "_Verdict" not in msg


def test_a_leak_on_copy_is_sent_to_the_allocator_check(tiny):
    # the walkthrough's learner: copy-on-write keeps the old block's reference; allocate-then-free is fine,
    # and the allocator's own check names the count that stays too high
    msg = expect_rejected(lambda a: check_paged_generate(a, paged_gather), LeakOnCopy,
                          "does not pass check_block_allocator", "copy-on-write", "refcount")
    assert "pass check_block_allocator first" in msg


def test_paged_generate_wraps_exceptions(tiny):
    def broken(pool, table, n):
        raise IndexError("boom")
    expect_rejected(lambda g: check_paged_generate(BlockAllocator, g), broken, "raised IndexError")


def test_a_diagnosis_is_named_only_when_a_second_table_confirms_it():
    def sorted_if_short(pool, table, n):                    # right on 4-block tables, sorted on shorter ones
        return _ref(pool, sorted(table) if len(table) <= 3 else table, n)
    msg = expect_rejected(check_paged_gather, sorted_if_short, "wrong values")
    assert "allocation order" not in msg


def _gather_into_default_device(pool, table, n):      # the output made without the pool's device
    H, bs, D = pool.shape[1], pool.shape[2], pool.shape[3]
    out = torch.zeros(H, len(table) * bs, D, dtype=pool.dtype)
    for i, b in enumerate(table):
        out[:, i * bs:(i + 1) * bs] = pool[b].to(out.device)
    return out[:, :n]


def _gather_by_cat(pool, table, n):                    # unusual but correct: one block at a time, concatenated
    return torch.cat([pool[b] for b in table], dim=1)[:, :n]


def test_paged_gather_follows_the_pool_device():
    """Issue 34: check_paged_gather had no device case. A gather that builds its output on the default
    device is named; one that concatenates blocks (any device) passes."""
    expect_rejected(check_paged_gather, _gather_into_default_device, "device='meta'", "pool's device")
    check_paged_gather(_gather_by_cat)
