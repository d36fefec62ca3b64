"""Lab 9's scheduler and prefix-cache graders: wrong implementations of every kind the issue lists are
rejected with a message naming the mistake; correct ones written differently pass; the library's own
handed in is told to write its own."""

import pytest

from kvlab.course.checks import check_prefix_cache, check_scheduler
from kvlab.paged import OutOfBlocks
from kvlab.serving import Batch, BlockManager, Scheduler, Status

from utils import expect_rejected, hands_over_code, own_copy


# ---------------------------------------------------------------------------------------------------
# Schedulers


class IndexScheduler(Scheduler):
    """Correct, written otherwise: indices, an explicit admission order, grant's OutOfBlocks caught."""

    def schedule(self):
        batch, left = Batch(), self.max_tokens
        decoding = [s for s in self.running if s.to_compute == 1]
        order = decoding + [s for s in self.running if s.to_compute > 1]
        for seq in order:
            if seq.status is not Status.RUNNING or left == 0 or len(batch.work) == self.max_seqs:
                continue
            n = min(seq.to_compute, left)
            while True:
                try:
                    self.grant(batch, seq, n)
                    left -= n
                    break
                except OutOfBlocks:
                    done = {id(s) for s, _ in batch.work}
                    idx = max(i for i, s in enumerate(self.running) if id(s) not in done)
                    victim = self.running[idx]
                    self.preempt(victim, batch)
                    if victim is seq:
                        break
        while self.waiting and left and len(self.running) < self.max_seqs and not batch.preempted:
            seq = self.waiting[0]
            start = self.cached_tokens(seq)
            n = min(seq.num_tokens - start, left)
            if not self.blocks.can_hold(seq, start + n):
                break
            self.grant(batch, seq, n)
            left -= n
        return batch


def _typed_in_schedule():
    """The library's algorithm typed in by the learner (its source run outside kvlab), returning the
    engine's Batch as the contract says."""
    schedule = own_copy(Scheduler).schedule
    schedule.__globals__["Batch"] = Batch
    return schedule


class Copied(Scheduler):
    # correct: the library's algorithm typed in whole (schedule and the two halves it calls: the
    # halves are the answer too, so a copy of schedule alone would still run the library's)
    schedule = _typed_in_schedule()
    _schedule_running = own_copy(Scheduler)._schedule_running
    _schedule_waiting = own_copy(Scheduler)._schedule_waiting


def test_correct_schedulers_pass(tiny):
    check_scheduler(IndexScheduler)
    check_scheduler(Copied)


def test_the_library_handed_in_is_refused():
    expect_rejected(check_scheduler, Scheduler, "does not define schedule itself", "write it yourself")
    expect_rejected(check_scheduler, int, "subclasses kvlab.serving.Scheduler")


class Bound(Scheduler):
    schedule = Scheduler.schedule          # the library's function bound in, not written


class CallsSuper(Scheduler):
    def schedule(self):                    # a trivial override: the library's decision runs
        return super().schedule()


class Forwards(Scheduler):
    def schedule(self, _impl=Scheduler.schedule):      # the library's, as a default argument
        return _impl(self)


class Halves(Scheduler):
    def schedule(self):                    # the library's two halves of schedule, called in order
        batch = Batch()
        self._schedule_running(batch)
        self._schedule_waiting(batch)
        return batch


def test_the_library_halves_of_schedule_are_refused():
    """The walkthrough of issue 34: the library's own _schedule_running / _schedule_waiting are the
    answer, not tools: refused, naming what ran."""
    expect_rejected(check_scheduler, Halves, "ran kvlab.serving.scheduler.Scheduler._schedule_running",
                    "write it yourself")


def test_the_library_one_step_removed_is_refused_by_what_runs():
    """Issue 34, kind 1: a bound copy, a super() call, a default argument: refused, naming what ran."""
    expect_rejected(check_scheduler, Bound, "does not define schedule itself")
    for cls in (CallsSuper, Forwards):
        expect_rejected(check_scheduler, cls, "ran kvlab.serving.scheduler.Scheduler.schedule", "write it yourself")


def _variant(**changes):
    """IndexScheduler with one decision changed."""

    class Wrong(IndexScheduler):
        def schedule(self):
            batch, left = Batch(), self.max_tokens
            order = sorted(self.running, key=lambda s: s.to_compute > 1)
            if changes.get("chunks_first"):
                order = sorted(self.running, key=lambda s: s.to_compute == 1)
            if changes.get("skip_prefilling"):
                order = [s for s in order if s.to_compute == 1]
            for seq in order:
                if seq.status is not Status.RUNNING or left == 0 or len(batch.work) == self.max_seqs:
                    continue
                n = min(seq.to_compute, left)
                while not changes.get("run_unasked") and not self.blocks.can_hold(seq, seq.num_computed + n):
                    done = {id(s) for s, _ in batch.work}
                    pool = [s for s in self.running if id(s) not in done]
                    victim = pool[0] if changes.get("oldest_victim") else pool[-1]
                    if changes.get("largest_victim"):          # "free the most memory": by blocks held
                        victim = max(pool, key=lambda s: len(s.block_table))
                    self.preempt(victim, batch)
                    if changes.get("lose_tokens"):
                        victim.output.clear()
                    if victim is seq:
                        break
                else:
                    self.grant(batch, seq, n)
                    left -= n
            queue = sorted(self.waiting, key=lambda s: s.num_tokens) if changes.get("shortest_first") \
                else list(self.waiting)
            if batch.preempted and not changes.get("admit_after_preempt"):
                queue = []
            for seq in queue:
                if not left or len(self.running) >= self.max_seqs:
                    break
                start = self.cached_tokens(seq)
                n = seq.num_tokens - start if changes.get("past_budget") else min(seq.num_tokens - start, left)
                if changes.get("cached_counted_twice"):
                    n = min(seq.num_tokens, left)          # the cached tokens counted in n too
                if changes.get("no_chunks") and n < seq.num_tokens - start:
                    break
                if not changes.get("grant_unasked") and not self.blocks.can_hold(seq, start + n):
                    break
                self.grant(batch, seq, n)
                left -= n
            return batch
    return Wrong


WRONG = [
    (_variant(past_budget=True), ["admit past the budget"]),
    (_variant(oldest_victim=True), ["preempt the newest"]),
    # issue 34 walkthrough: the victim chosen by size was told only the rule, not what it did
    (_variant(largest_victim=True), ["preempt the newest", "held the most blocks", "not by size"]),
    (_variant(lose_tokens=True), ["preempted", "lost tokens"]),
    (_variant(skip_prefilling=True), ["starve a running request"]),
    # issue 34, kind 7: prompt chunks before decodes, seen also when the step has no room left
    (_variant(chunks_first=True), ["is decoding and got no token", "decoding come first"]),
    # a raw OutOfBlocks from the learner's grant becomes a named failure
    (_variant(grant_unasked=True), ["OutOfBlocks", "without first asking whether the pool can hold them",
                                    "was waiting", "the queue stops at the first", "rule 3"]),
    # the same OutOfBlocks, three rules: each named from the grant that failed
    (_variant(run_unasked=True), ["OutOfBlocks", "was running", "preempt the newest", "rule 2"]),
    (_variant(grant_unasked=True, admit_after_preempt=True), ["just preempted", "admit no one"]),
    (_variant(shortest_first=True), ["first come, first served"]),
    (_variant(no_chunks=True), ["left waiting", "chunks"]),
    (_variant(cached_counted_twice=True), ["left waiting", "from the prefix cache", "room it does not need"]),
]


@pytest.mark.parametrize("impl,needles", WRONG, ids=["past-budget", "oldest-victim", "largest-victim", "lost-tokens", "starves", "chunks-first", "grant-unasked",
                                                      "run-unasked", "admit-after-preempt",
                                                      "overtakes", "no-chunks", "cached-twice"])
def test_wrong_schedulers_rejected(impl, needles):
    message = expect_rejected(check_scheduler, impl, *needles)
    assert not hands_over_code(message), message        # the mistake and the rule, not the fixing line


class NeverPreempts(Scheduler):
    """A first attempt: a running sequence the pool cannot hold is skipped, nobody is preempted."""

    def schedule(self):
        batch = Batch()
        for seq in list(self.running):
            n = min(seq.to_compute, self.max_tokens - batch.num_tokens)
            if n and len(batch.work) < self.max_seqs and self.blocks.can_hold(seq, seq.num_computed + n):
                self.grant(batch, seq, n)
        while self.waiting and batch.num_tokens < self.max_tokens and len(self.running) < self.max_seqs:
            seq, start = self.waiting[0], self.cached_tokens(self.waiting[0])
            n = min(seq.num_tokens - start, self.max_tokens - batch.num_tokens)
            if not self.blocks.can_hold(seq, start + n):
                break
            self.grant(batch, seq, n)
        return batch


class AdmitsWhilePreempting(IndexScheduler):
    def schedule(self):
        batch = super().schedule()
        left = self.max_tokens - batch.num_tokens
        if batch.preempted and self.waiting and left and len(self.running) < self.max_seqs:
            seq = self.waiting[0]
            n = min(seq.num_tokens - self.cached_tokens(seq), left)
            if self.blocks.can_hold(seq, self.cached_tokens(seq) + n):
                self.grant(batch, seq, n)
        return batch


def test_first_attempts_get_the_fix_named():
    for wrong, needles in ((NeverPreempts, ("could not hold it", "preempt the newest")),
                           (AdmitsWhilePreempting, ("had to preempt", "admit no one"))):
        message = expect_rejected(check_scheduler, wrong, *needles)
        assert not hands_over_code(message), message


def test_a_raising_scheduler_is_named():
    class Broken(Scheduler):
        def schedule(self):
            raise KeyError("oops")
    expect_rejected(check_scheduler, Broken, "your schedule() raised KeyError")


def test_an_empty_step_is_named():
    class Idle(Scheduler):
        def schedule(self):
            return Batch()
    expect_rejected(check_scheduler, Idle, "left waiting")


# ---------------------------------------------------------------------------------------------------
# Prefix caches


class WalkCache(BlockManager):
    """Correct, written otherwise: an index loop, eviction through next(iter(...))."""

    def lookup(self, tokens):
        tokens, out = list(tokens), []
        keys = self._keys(tokens[:-1])
        i = 0
        while i < len(keys) and self.block_of.get(keys[i]) is not None:
            out.append(self.block_of[keys[i]])
            i += 1
        return out

    def evict(self):
        b = next(iter(self.cached))
        del self.cached[b]
        key, self.key_of[b] = self.key_of[b], None
        self.block_of.pop(key)
        self.evictions += 1
        return b


class EvictKeepsKeyOf(WalkCache):
    def evict(self):                     # forgets the key in block_of, not in key_of: a stale entry
        b = next(iter(self.cached))
        del self.cached[b]
        self.block_of.pop(self.key_of[b])
        self.evictions += 1
        return b


class EvictKeepsBlockOfAfterReuse(WalkCache):
    def evict(self):                     # forgets the block in block_of, keeps its old key in key_of
        b = next(iter(self.cached))
        del self.cached[b]
        self.block_of = {k: v for k, v in self.block_of.items() if v != b}
        self.evictions += 1
        return b                         # key_of[b] still names the old key: b can never be registered again


class LookupCountsHits(WalkCache):
    def lookup(self, tokens):            # right blocks, but a lookup that moves a counter
        found = super().lookup(tokens)
        self.hits += bool(found)
        return found


def test_prefix_cache_policies():
    """Issue 34, kind 7: an eviction that leaves a stale entry (the prefix never found again) and a
    lookup that changes a counter are rejected, each named."""
    expect_rejected(check_prefix_cache, EvictKeepsKeyOf, "in your evict", "of the two maps between keys and blocks")
    expect_rejected(check_prefix_cache, EvictKeepsBlockOfAfterReuse, "found again", "no key at all")
    expect_rejected(check_prefix_cache, LookupCountsHits, "lookup changed the cache", "hits")


def test_correct_prefix_caches_pass():
    check_prefix_cache(WalkCache)

    mine = own_copy(BlockManager)

    class Copied(BlockManager):
        lookup, evict = mine.lookup, mine.evict      # typed in by the learner: correct
    check_prefix_cache(Copied)


def test_the_library_block_manager_is_refused():
    expect_rejected(check_prefix_cache, BlockManager, "does not define lookup, evict itself", "write it yourself")

    class LookupForwards(BlockManager):
        def lookup(self, tokens):
            return BlockManager.lookup(self, tokens)

        evict = own_copy(BlockManager).evict
    expect_rejected(check_prefix_cache, LookupForwards, "ran kvlab.serving.block_manager.BlockManager.lookup")


class KeepsOldKey(WalkCache):
    def evict(self):
        b, _ = self.cached.popitem(last=False)
        self.evictions += 1
        return b                                            # its key still points at it


class MostRecent(WalkCache):
    def evict(self):
        b, _ = self.cached.popitem(last=True)
        del self.block_of[self.key_of[b]]
        self.key_of[b] = None
        self.evictions += 1
        return b


class WholePrompt(WalkCache):
    def lookup(self, tokens):
        return super().lookup(list(tokens) + [0])          # the last token too


class TokensOnly(BlockManager):
    """Keys by the block's tokens alone (no parent): a block found after another prefix."""

    def _keys(self, tokens):
        bs = self.block_size
        return [tuple(tokens[i * bs:(i + 1) * bs]) for i in range(len(tokens) // bs)]

    def lookup(self, tokens):
        out = []
        for key in self._keys(list(tokens)[:-1]):
            if key in self.block_of:
                out.append(self.block_of[key])
        return out

    evict = WalkCache.evict


class TouchesOnLookup(WalkCache):
    def lookup(self, tokens):
        out = super().lookup(tokens)
        for b in out:
            if b in self.cached:
                self.cached.move_to_end(b)
        return out


WRONG_CACHES = [
    (KeepsOldKey, ["old key", "left that key behind"]),
    (MostRecent, ["least recently used"]),
    (WholePrompt, ["last token"]),
    (TokensOnly, ["parent", "whole prefix"]),
    (TouchesOnLookup, ["lookup changed the cache"]),
]


@pytest.mark.parametrize("impl,needles", WRONG_CACHES, ids=[c.__name__ for c, _ in WRONG_CACHES])
def test_wrong_prefix_caches_rejected(impl, needles):
    message = expect_rejected(check_prefix_cache, impl, *needles)
    assert not hands_over_code(message), message
