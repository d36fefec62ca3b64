"""The paged KV cache: allocator invariants, gathers, copy-on-write, chapter 3's generate on paged memory."""

import random

import pytest
import torch

from kvlab.gpt2 import generate
from kvlab.paged import BlockAllocator, OutOfBlocks, batched_gather, paged_gather
from kvlab.paged_cache import PagedCache, PagedPool


def _invariants(a: BlockAllocator, live: dict):
    """Every refcount equals the number of live tables that hold the block; free + used = all."""
    used = {}
    for s in live:
        for b in a.block_table(s):
            used[b] = used.get(b, 0) + 1
    for b in range(a.num_blocks):
        assert a.refcount(b) == used.get(b, 0), (b, a.refcount(b), used.get(b, 0))
    assert a.num_free == a.num_blocks - len(used)


def test_random_operations_keep_invariants_and_leak_nothing():
    rng = random.Random(0)
    a, live, next_id = BlockAllocator(24, 3), {}, 0
    for _ in range(600):
        op = rng.choice(["alloc", "fork", "append", "append", "append", "free"])
        try:
            if op == "alloc":
                n = rng.randint(0, 8)
                assert len(a.allocate(next_id, n)) == -(-n // 3)
                live[next_id], next_id = n, next_id + 1
            elif op == "fork" and live:
                p = rng.choice(list(live))
                a.fork(p, next_id)
                live[next_id], next_id = live[p], next_id + 1
            elif op == "append" and live:
                s = rng.choice(list(live))
                before = a.block_table(s)
                block, offset, copy_from = a.append_slot(s)
                assert offset == live[s] % 3 and a.block_table(s)[-1] == block
                assert copy_from is None or (copy_from == before[-1] and block != copy_from)
                live[s] += 1
            elif op == "free" and live:
                s = rng.choice(list(live))
                a.free(s)
                del live[s]
        except OutOfBlocks:
            pass
        _invariants(a, live)
    for s in list(live):
        a.free(s)
    assert a.num_free == 24


def test_failed_allocation_changes_nothing():
    a = BlockAllocator(3, 4)
    a.allocate("x", 5)
    with pytest.raises(OutOfBlocks, match="only 1 of 3"):
        a.allocate("y", 9)
    assert a.num_free == 1
    with pytest.raises(KeyError):
        a.block_table("y")
    with pytest.raises(ValueError):
        a.allocate("x", 1)


def test_gathers_follow_the_table_not_the_ids():
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(10, 2, 4, 3, generator=g)
    tables, lens = [[7, 2, 9], [0], [5, 3]], [11, 2, 8]
    for t, n in zip(tables, lens):
        want = torch.stack([pool[t[p // 4], :, p % 4] for p in range(n)], dim=1)
        assert torch.equal(paged_gather(pool, t, n), want)
    x, valid = batched_gather(pool, tables, lens)
    for i, (t, n) in enumerate(zip(tables, lens)):
        assert torch.equal(x[i, :, :n], paged_gather(pool, t, n)) and valid[i].sum() == n
    with pytest.raises(ValueError, match="needs 3 blocks"):
        paged_gather(pool, [1, 2], 9)


def test_copy_on_write_copies_the_shared_block():
    c = PagedPool(n_layer=2, n_head=1, head_dim=2, num_blocks=6, block_size=4)
    slots = c.reserve("p", 6)
    for layer in range(2):
        blocks, offs = torch.tensor(slots).T
        c.write(layer, blocks, offs, torch.arange(12.).view(6, 1, 2), -torch.arange(12.).view(6, 1, 2))
    c.fork("p", "q")
    (block, off), = c.reserve("q", 1)
    shared = c.allocator.block_table("p")[-1]
    assert c.copies == 1 and block != shared and off == 2
    assert torch.equal(c.keys[:, block, :, :2], c.keys[:, shared, :, :2])
    c.free("p"), c.free("q")
    assert c.blocks_used == 0


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_chapter3_generate_on_paged_memory(tiny, ours, block_size):
    tok, model = tiny[1], ours
    ids = torch.stack([tok("And God said, Let there be light", return_tensors="pt").input_ids[0, :6],
                       tok("The LORD is my shepherd; I shall", return_tensors="pt").input_ids[0, :6]])
    want = generate(model, ids, 15, cache=model.new_cache(2, 21))
    cache = PagedCache(4, 2, 4, 64, 21, block_size=block_size)
    assert torch.equal(generate(model, ids, 15, cache=cache), want)
    assert cache.nbytes <= cache.paged.nbytes
    cache.reset()
    assert cache.paged.blocks_used == 0 and cache.seq_len == 0
