"""The serving engine's bookkeeping, on a fake model that follows the one-forward contract (fast):
every request equals its prompt generated alone whatever the policy, batching, preemption or prefix
hits; the prefix-cache cases real engines got wrong; no request lost or duplicated; bad input refused
at submit; a request that fails inside a step fails alone."""

import random

import pytest

from kvlab.course.checks._fake import FakeLM, fake_reference
from kvlab.paged import OutOfBlocks
from kvlab.serving import BlockManager, Engine, Sequence, Status

V = 97


def _workload(n, seed, shared=(5, 6, 7, 8, 9, 10, 11, 12, 13), max_prompt=20, max_new=16):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = [rng.randrange(V) for _ in range(rng.randrange(1, max_prompt))]
        out.append((list(shared) + p if i % 3 == 0 else p, rng.randrange(1, max_new)))
    return out


def _serve(wl, **kw):
    kw = dict(num_blocks=12, block_size=4, max_num_batched_tokens=10, max_num_seqs=4) | kw
    eng = Engine(FakeLM(vocab=V), **kw)
    seqs = [eng.submit(p, m, arrival=i * 1e-4) for i, (p, m) in enumerate(wl)]
    eng.run()
    return eng, seqs


def _check(eng, seqs):
    for s in seqs:
        assert s.status is Status.FINISHED, (s.rid, s.status, s.error)
        assert s.output == fake_reference(s.prompt, s.max_new_tokens, V, s.eos_token_id), s.rid
        assert len(eng.trace.token_times[s.rid]) == len(s.output)      # each token emitted once
    assert eng.blocks.num_free == eng.blocks.num_blocks                # nothing leaked
    assert not eng.scheduler.running and not eng.scheduler.waiting and not eng.pending
    assert eng.split_steps == 0                                       # every step ran as ONE forward


POLICIES = [("on-demand", "continuous", True), ("on-demand", "continuous", False), ("on-demand", "static", True),
            ("reserve", "continuous", True), ("reserve", "static", True), ("contiguous", "continuous", True)]


@pytest.mark.parametrize("admission,batching,chunked", POLICIES)
@pytest.mark.parametrize("seed", [1, 2])
def test_every_request_equals_its_prompt_alone(admission, batching, chunked, seed):
    wl = _workload(10, seed)
    eng, seqs = _serve(wl, admission=admission, batching=batching, chunked_prefill=chunked, max_len=40,
                       max_num_batched_tokens=10 if chunked else 40)
    _check(eng, seqs)
    steps = eng.trace.steps
    assert max(t["tokens"] for t in steps) <= eng.scheduler.max_tokens
    assert max(t["seqs"] for t in steps) <= 4
    if admission != "on-demand":
        assert eng.scheduler.preemptions == 0                         # a reservation is never broken


def test_preemption_and_prefix_hits_happen_and_change_nothing():
    eng, seqs = _serve(_workload(12, 3))
    _check(eng, seqs)
    assert eng.scheduler.preemptions > 0 and eng.blocks.hits > 0 and eng.blocks.evictions > 0
    assert eng.blocks.hit_tokens == eng.blocks.hits * 4
    assert max(t["blocks_used"] for t in eng.trace.steps) == 12       # the pool binds
    resumed = [s for s in seqs if s.preemptions]
    assert resumed and all(s.output == fake_reference(s.prompt, s.max_new_tokens, V) for s in resumed)


def test_chunked_prefill_keeps_the_others_decoding():
    eng = Engine(FakeLM(vocab=V, n_positions=256), num_blocks=64, block_size=4, max_num_batched_tokens=6)
    a = eng.submit([1, 2, 3], 30)
    long = eng.submit(list(range(1, 60)), 3, arrival=1e-9)
    for _ in range(3):
        eng.step()
    eng.run()
    _check(eng, [a, long])
    chunks = [t for t in eng.trace.steps if t["prefill_tokens"] and t["decode_tokens"]]
    assert len(chunks) >= 59 // 5                                     # the prompt ran in chunks beside a's decode
    ta = eng.trace.token_times[a.rid]
    steps_with_a = [t for t in eng.trace.steps if t["time"] in ta]
    assert len(steps_with_a) == len(a.output)                         # a got a token at every step it was running


# ---------------------------------------------------------------------------------------------------
# The prefix cache


def test_prompt_entirely_in_the_cache_still_runs_its_last_token():
    m = FakeLM(vocab=V)
    eng = Engine(m, num_blocks=16, block_size=4)
    prompt = list(range(20, 32))                                      # 12 tokens: 3 full blocks
    first = eng.submit(prompt, 2)
    eng.run()
    m.calls.clear()
    again = eng.submit(prompt, 2)
    eng.run()
    assert again.cached_tokens == 8                                   # 2 blocks: the third holds the last token
    assert m.calls[0] == 4                                            # the last block is run (its last token's logits)
    assert again.output == first.output == fake_reference(prompt, 2, V)


def test_an_evicted_block_is_never_found_by_its_old_key():
    bm = BlockManager(num_blocks=2, block_size=2)
    a = Sequence("a", (1, 2, 3, 4), 1)
    bm.allocate(a, 4)
    a.num_computed = 4
    bm.commit(a)
    bm.free(a)                                                        # 2 full blocks cached, unreferenced
    assert len(bm.lookup((1, 2, 3, 4, 9))) == 2
    b = Sequence("b", (7, 8, 9), 1)
    bm.allocate(b, 3)                                                 # needs 2 blocks: evicts both
    assert bm.evictions == 2
    b.num_computed = 3
    bm.commit(b)                                                      # block now holds (7, 8)
    assert bm.lookup((1, 2, 3, 4, 9)) == []                           # the old tokens are not found
    assert len(bm.lookup((7, 8, 1))) == 1


def test_eviction_is_least_recently_used_and_children_go_first():
    bm = BlockManager(num_blocks=4, block_size=1)
    old, new = Sequence("o", (1, 2, 3), 1), Sequence("n", (4, 5, 6), 1)
    for s in (old, new):
        bm.allocate(s, 2)
        s.num_computed = 2
        bm.commit(s)
        bm.free(s)
    x = Sequence("x", (9, 9), 1)
    bm.allocate(x, 2)                                                 # 4 cached blocks, no free list: evict 2
    assert bm.lookup((4, 5, 6)) != [] and bm.lookup((1, 2, 3)) == []  # the older prefix went


def test_preempted_sequence_with_prefix_hits_resumes_exactly():
    shared = list(range(30, 46))                                      # 16 tokens = 4 blocks
    eng = Engine(FakeLM(vocab=V), num_blocks=9, block_size=4, max_num_batched_tokens=24)
    warm = eng.submit(shared + [1], 1)
    eng.run()
    seqs = [eng.submit(shared + [2 + i], 14) for i in range(3)]
    eng.run()
    _check(eng, [warm] + seqs)
    assert eng.scheduler.preemptions > 0
    assert any(s.preemptions and s.cached_tokens >= 16 for s in seqs)


def test_two_identical_prompts_admitted_in_the_same_step():
    eng = Engine(FakeLM(vocab=V), num_blocks=16, block_size=4)
    prompt = list(range(40, 49))
    a, b = eng.submit(prompt, 3), eng.submit(prompt, 3)
    eng.step()
    assert len(eng.trace.steps[0:1]) == 1 and eng.trace.steps[0]["seqs"] == 2
    eng.run()
    _check(eng, [a, b])
    assert a.cached_tokens == b.cached_tokens == 0                    # neither was in the cache yet
    c = eng.submit(prompt, 3)
    eng.run()
    assert c.cached_tokens == 8 and c.output == a.output


def test_explicit_prefix_copy_on_write():
    eng = Engine(FakeLM(vocab=V), num_blocks=20, block_size=4, prefix_caching=False)
    eng.add_prefix([3, 1, 4, 1, 5, 9])                                # 6 tokens: the second block is half full
    seqs = [eng.submit([3, 1, 4, 1, 5, 9, 2 + i], 5) for i in range(3)]
    eng.run()
    for s in seqs:
        assert s.output == fake_reference(s.prompt, 5, V) and s.cached_tokens == 6
    assert eng.blocks.copies == 3                                     # each sharer copies the partly filled block
    eng.close()
    assert eng.blocks.num_free == 20


# ---------------------------------------------------------------------------------------------------
# Block manager: all or nothing


def test_block_manager_failure_leaves_no_trace():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = Sequence("a", (1, 2, 3), 5)
    bm.allocate(a, 3)
    before = (list(a.block_table), bm.num_free, [bm.refcount(i) for i in range(3)])
    with pytest.raises(OutOfBlocks):
        bm.grow(a, 8)
    assert (list(a.block_table), bm.num_free, [bm.refcount(i) for i in range(3)]) == before
    b = Sequence("b", (1, 2, 3, 4, 5, 6, 7), 1)
    with pytest.raises(OutOfBlocks):
        bm.allocate(b, 7)
    assert b.block_table == [] and b.num_computed == 0 and bm.num_free == 1
    with pytest.raises(ValueError, match="block must be"):
        bm.refcount(-1)
    assert bm.refcount(2) == 0                                        # a free block


# ---------------------------------------------------------------------------------------------------
# Bad input and failures


@pytest.mark.parametrize("prompt,m,kw,needle", [
    ([1, 2], 200, {}, "context"),
    ([1, V], 2, {}, "prompt token #1"),
    ([-1, 2], 2, {}, "prompt token #0"),
    ([1.0, 2], 2, {}, "must be an int"),
    ([], 2, {}, "non-empty"),
    ("hello", 2, {}, "non-empty"),
    ([1, 2], True, {}, "max_new_tokens"),
    ([1, 2], 0, {}, "max_new_tokens"),
    ([1, 2], 2, dict(eos_token_id=V), "eos_token_id"),
    ([1, 2], 2, dict(arrival=-1), "arrival"),
    ([1] * 40, 30, {}, "add blocks"),
])
def test_bad_requests_are_refused_at_submit_and_leave_no_trace(prompt, m, kw, needle):
    eng = Engine(FakeLM(vocab=V), num_blocks=16, block_size=4)
    ok = eng.submit([5, 6], 3)
    with pytest.raises(ValueError, match=needle):
        eng.submit(prompt, m, **kw)
    assert list(eng.seqs) == [ok.rid] and eng.pending == [ok]
    eng.run()
    _check(eng, [ok])


def test_duplicate_id_and_bad_engine_settings():
    eng = Engine(FakeLM(vocab=V), num_blocks=16, block_size=4)
    eng.submit([1], 2, rid="x")
    with pytest.raises(ValueError, match="already used"):
        eng.submit([2], 2, rid="x")
    for kw, needle in [(dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
                       (dict(max_num_seqs=0), "max_num_seqs"), (dict(admission="greedy"), "admission"),
                       (dict(admission="contiguous"), "max_len"), (dict(block_size=0), "block_size")]:
        with pytest.raises(ValueError, match=needle):
            Engine(FakeLM(vocab=V), **(dict(num_blocks=16) | kw))
    nochunk = Engine(FakeLM(vocab=V), num_blocks=16, block_size=4, max_num_batched_tokens=4, chunked_prefill=False)
    with pytest.raises(ValueError, match="chunked"):
        nochunk.submit([1] * 5, 2)


def test_a_request_failing_inside_a_step_fails_alone():
    m = FakeLM(vocab=V, poison=66)
    eng = Engine(m, num_blocks=16, block_size=4)
    good = [eng.submit([1 + i, 2, 3], 6) for i in range(3)]
    bad = eng.submit([4, 66, 5], 6)                                   # the model raises on token 66
    eng.run()
    assert bad.status is Status.FAILED and "poisoned" in bad.error and bad.block_table == []
    assert eng.split_steps == 1
    eng.split_steps = 0
    _check(eng, good)


def test_a_failed_add_prefix_leaves_no_trace():
    eng = Engine(FakeLM(vocab=V, poison=66), num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match="add blocks"):
        eng.add_prefix(list(range(1, 40)))                            # 10 blocks: more than the pool
    with pytest.raises(ValueError, match="poisoned"):
        eng.add_prefix([1, 66, 3])                                    # its prefill raises
    assert eng.blocks.num_free == 8 and eng.scheduler.capacity == 8 and not eng.prefixes
    ok = eng.submit([5, 6, 7] * 5, 10)                                # up to 6 blocks
    with pytest.raises(ValueError, match="already submitted"):
        eng.add_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9])                   # 3 pinned: 5 left, too few for it
    eng.run()
    _check(eng, [ok])


def test_numpy_ids_are_accepted_and_lists_as_eos_refused():
    import numpy as np

    eng = Engine(FakeLM(vocab=V), num_blocks=8, block_size=4)
    s = eng.submit(np.array([3, 4, 5]), np.int64(4), eos_token_id=np.int32(V - 1))
    with pytest.raises(ValueError, match="eos_token_id"):
        eng.submit([1, 2], 3, eos_token_id=[0])
    eng.run()
    _check(eng, [s])


@pytest.mark.parametrize("order", ["decode-first", "arrival"])
def test_preempted_recompute_longer_than_the_budget_with_chunking_off(order):
    """The issue's reproduction: 12 blocks of 4, a 16-token budget, chunked prefill off, three requests of
    10 + 30 tokens. A preempted request comes back with up to 39 tokens to recompute, more than one step
    holds: its recompute is chunked (it used to wait forever: 'a bug in the scheduler')."""
    eng = Engine(FakeLM(vocab=V), num_blocks=12, block_size=4, max_num_batched_tokens=16, chunked_prefill=False,
                 running_order=order)
    prompts = [[(7 * i + j) % V for j in range(10)] for i in range(3)]
    seqs = [eng.submit(p, 30) for p in prompts]
    eng.run()
    assert eng.scheduler.preemptions >= 1
    for s, p in zip(seqs, prompts):
        assert s.status is Status.FINISHED and s.output == fake_reference(p, 30, V)
    assert eng.blocks.num_free == 12


def test_a_request_on_a_pinned_prefix_that_fits_is_served():
    """A pinned prefix takes blocks from the pool; a request that forks it needs only the rest, so one
    that fits in what is left is served (it used to be refused as 'can never be served')."""
    eng = Engine(FakeLM(vocab=V), num_blocks=8, block_size=4, max_num_batched_tokens=8, chunked_prefill=False)
    prefix = list(range(1, 17))                                    # 4 full blocks pinned
    eng.add_prefix(prefix)
    seq = eng.submit(prefix + [40, 41, 42], 10)                    # 28 tokens = 7 blocks, 4 of them shared
    eng.run()
    assert seq.output == fake_reference(prefix + [40, 41, 42], 10, V)
    with pytest.raises(ValueError, match="never be served"):
        eng.submit(prefix + [40] * 3, 20)                          # 38 tokens: 10 blocks, 6 beyond the prefix


def test_commit_hashes_each_full_block_once():
    hashed = []

    class Counting(BlockManager):
        committing = False

        def _keys(self, tokens, parent=b""):
            if self.committing:
                hashed.append(len(tokens) // self.block_size)
            return super()._keys(tokens, parent)

        def commit(self, seq):
            self.committing = True
            super().commit(seq)
            self.committing = False

    eng = Engine(FakeLM(vocab=V), num_blocks=16, block_size=4, block_manager_cls=Counting)
    seq = eng.submit(list(range(1, 10)), 30)
    eng.run()
    full = (seq.num_tokens - 1) // 4
    assert sum(hashed) == full and len(seq.block_keys) == full      # every full block hashed once


def test_static_batch_takes_all_that_memory_and_max_num_seqs_allow():
    """Static batching admits a whole batch (all the waiting requests that fit, up to max_num_seqs), over
    as many steps as the token budget needs, and none until the batch has finished."""
    eng = Engine(FakeLM(vocab=V), num_blocks=64, block_size=4, max_num_batched_tokens=12, max_num_seqs=5,
                 admission="reserve", batching="static")
    seqs = [eng.submit([1 + i] * 9, 6) for i in range(12)]
    sizes = []
    while eng.step():
        sizes.append(len(eng.scheduler.running))
    assert max(sizes) == 5 and sizes.count(5) >= 2      # two batches of 5 (then 2); the old rule: 1 or 2
    assert all(s.output == fake_reference([1 + i] * 9, 6, V) for i, s in enumerate(seqs))


def test_sampling_params_are_checked_and_n_samples_fork():
    from kvlab.serving import SamplingParams
    for kw, needle in [(dict(temperature=-1), "temperature"), (dict(top_k=-1), "top_k"), (dict(top_p=0), "top_p"),
                       (dict(n=0), "n "), (dict(seed=1.5), "seed"), (dict(stop=[3]), "stop")]:
        with pytest.raises(ValueError, match=needle):
            SamplingParams(**kw)
    eng = Engine(FakeLM(vocab=V), num_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="SamplingParams"):
        eng.submit([1, 2], 3, sampling="greedy")
    seq = eng.submit([1, 2, 3, 4, 5, 6], 5, sampling=SamplingParams(n=3))   # greedy samples: all equal
    eng.run()
    assert [eng.seqs[r].output for r in (seq.rid, (seq.rid, 1), (seq.rid, 2))] == [fake_reference([1, 2, 3, 4, 5, 6], 5, V)] * 3
    assert eng.blocks.copies >= 2 and eng.blocks.num_free == 16


@pytest.mark.parametrize("seed", [0, 1])
def test_lab9_allocator_and_the_block_manager_agree_on_the_same_scenarios(seed):
    """Lab 9's BlockAllocator (the lab's reference, through the block manager's interface) and the engine's
    block manager (prefix cache off) drive the same workload: the same steps, blocks in use, preemptions,
    copies and tokens."""
    from kvlab.paged import BlockAllocator
    wl = _workload(10, seed)
    runs = []
    for kw in (dict(allocator_cls=BlockAllocator), dict(prefix_caching=False)):
        eng = Engine(FakeLM(vocab=V), num_blocks=12, block_size=4, max_num_batched_tokens=10, max_num_seqs=4, **kw)
        eng.add_prefix([5, 6, 7, 8, 9, 10])                        # copy-on-write on both
        seqs = [eng.submit(p, m) for p, m in wl]                  # all at t=0: no clock in the comparison
        eng.run()
        runs.append(([t["blocks_used"] for t in eng.trace.steps], eng.scheduler.preemptions, eng.blocks.copies,
                     [s.output for s in seqs]))
    assert runs[0] == runs[1]
    assert runs[0][1] > 0 and runs[0][2] > 0
