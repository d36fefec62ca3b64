"""Lab 9 graders for the engine's decisions: a scheduler's ``schedule()`` and a prefix cache's ``lookup``
and ``evict``.

``check_scheduler`` serves workloads the learner has not seen (pools that bind, tiny token budgets,
few sequences per step, a shared prefix) through chapter 9's engine with the learner's scheduler,
checks every step it plans against the rules (budget, victims, first come first served, no request
left out while there is room, blocks for every token) and every request's tokens against its prompt
generated alone. Each rule is checked on a fake model whose next token depends on every token it
sees (milliseconds), then once on the hand-built GPT-2.

``check_prefix_cache`` replays operations on the learner's block manager (prompts registered, freed,
looked up, evicted by other prompts) and then serves a prefix-heavy stream through it.
"""

from __future__ import annotations

import random

from ._common import fail, passed
from ._fake import FakeLM, fake_reference
from .lab09 import library_copy
from kvlab.gpt2 import GPT2
from kvlab.paged import OutOfBlocks
from kvlab.serving import Batch, Engine, Sequence, Status
from kvlab.serving import BlockManager as LibraryBlockManager
from kvlab.serving import Scheduler as LibraryScheduler
from kvlab.serving.reference import References

from ._common import grading_model

NAME_SCHED, NAME_PREFIX = "check_scheduler", "check_prefix_cache"
V = 97

# (what the case exercises, engine settings, requests, prompt lengths, new tokens, shared prefix length, seed)
_CASES = [
    ("a token budget smaller than the prompts (chunks)", dict(num_blocks=40, block_size=4,
     max_num_batched_tokens=7, max_num_seqs=4), 7, (5, 30), (2, 8), 0, 32),
    ("a pool that binds (preemption)", dict(num_blocks=10, block_size=4, max_num_batched_tokens=16, max_num_seqs=6),
     9, (1, 14), (3, 14), 0, 31),
    ("long prompts in chunks on a pool that binds", dict(num_blocks=12, block_size=4, max_num_batched_tokens=8,
     max_num_seqs=4), 10, (3, 24), (4, 12), 0, 36),
    ("two sequences per step, many waiting", dict(num_blocks=30, block_size=2, max_num_batched_tokens=32,
     max_num_seqs=2), 6, (1, 9), (1, 9), 0, 33),
    ("a shared prefix found in the prefix cache, a tight pool", dict(num_blocks=12, block_size=4,
     max_num_batched_tokens=12, max_num_seqs=5), 8, (1, 8), (2, 12), 9, 34),
]


class _Ticks:
    """A clock that moves one unit per step (the grader's), so arrivals interleave with steps exactly."""

    def __init__(self):
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def skip_to(self, t: float) -> None:
        self.t = max(self.t, t)


def _workload(n, prompt_len, new, prefix_len, seed):
    rng = random.Random(seed)
    prefix = [rng.randrange(1, V) for _ in range(prefix_len)]
    out = []
    for i in range(n):
        p = prefix + [rng.randrange(1, V) for _ in range(rng.randint(*prompt_len))]
        out.append((p, rng.randint(*new), float(i // 3)))      # three requests arrive per step
    return out


# ---------------------------------------------------------------------------------------------------
# The rules of one step


def _snapshot(sch) -> dict:
    need = sum(sch.blocks.blocks_needed(s, s.num_computed + min(s.to_compute, sch.max_tokens)) for s in sch.running)
    return dict(running=list(sch.running), waiting=list(sch.waiting), free=sch.blocks.num_free, need=need,
                held={id(s): len(s.block_table) for s in sch.running})


def _verify_step(sch, snap, batch, where) -> None:

    if not isinstance(batch, Batch):
        raise fail(NAME_SCHED, f"{where}: schedule() must return a kvlab.serving.Batch, got {type(batch).__name__}")
    seqs = [s for s, _ in batch.work]
    if len(set(map(id, seqs))) != len(seqs):
        raise fail(NAME_SCHED, f"{where}: a sequence appears twice in one step's work")
    total = sum(n for _, n in batch.work)
    if total > sch.max_tokens:
        raise fail(NAME_SCHED, f"{where}: the step holds {total} tokens but max_num_batched_tokens is {sch.max_tokens}: "
                               "you admit past the budget; no sequence gets more tokens than the budget has left (rule 1)")
    if len(seqs) > sch.max_seqs:
        raise fail(NAME_SCHED, f"{where}: {len(seqs)} sequences in one step, max_num_seqs is {sch.max_seqs}")
    for s, n in batch.work:
        if not isinstance(n, int) or n < 1 or n > s.to_compute:
            raise fail(NAME_SCHED, f"{where}: request {s.rid} got {n!r} tokens but has {s.to_compute} to run "
                                   "(num_tokens - num_computed): give it between 1 and that many")
        if any(v is s and id(s) in ran for v, ran, _ in getattr(sch, "preempt_log", ())):
            raise fail(NAME_SCHED, f"{where}: you preempted request {s.rid} after giving it tokens in this step: pick "
                                   "the victim among the running sequences that have not run yet in this step")
        if s.status is not Status.RUNNING or s.num_computed + n > len(s.block_table) * sch.blocks.block_size:
            raise fail(NAME_SCHED, f"{where}: request {s.rid} is scheduled without blocks for its tokens (or is not "
                                   "running): a sequence's tokens in a step come with their blocks, through the scheduler's grant (which "
                                   "also admits a waiting one)")
    _verify_victims(sch, snap, batch, where)
    _verify_fairness(sch, snap, batch, where, total)


def _verify_victims(sch, snap, batch, where) -> None:

    victims = [s for s in snap["running"] if s.status is Status.WAITING]
    logged = {id(v) for v, _, _ in sch.preempt_log}
    for v in victims:
        if id(v) not in logged or v not in sch.waiting:
            raise fail(NAME_SCHED, f"{where}: request {v.rid} lost its blocks but did not go through self.preempt "
                                   "(which frees them and puts it first in the queue to be recomputed)")
    for (v, scheduled, running), sizes in zip(sch.preempt_log, sch.preempt_sizes):
        newer = [s for s in running[running.index(v) + 1:] if id(s) not in scheduled]
        if newer:
            # the candidates the rule chooses among; a victim that held the most blocks of them (ties
            # included, sizes not all equal) was likely picked by size (a misreading: "free the most memory")
            held = {id(s): sizes.get(id(s), 0) for s in running if id(s) not in scheduled}
            mine = held.get(id(v), 0)
            by_size = mine >= max(held.values()) > min(held.values())     # the largest (ties too), sizes differing
            ties = [s.rid for s in running if s is not v and held.get(id(s)) == mine]
            size = (f" Request {v.rid} held the most blocks of those that had not run ({mine}"
                    + (f", as many as request {ties[0]}" if ties else "") + "): the rule chooses by admission "
                    "order, not by size" if by_size else "")
            raise fail(NAME_SCHED, f"{where}: you preempted request {v.rid} while request {newer[-1].rid}, admitted "
                                   f"after it, held blocks and had not run in this step: preempt the newest running "
                                   "sequence not yet scheduled (the last admitted), so the oldest are never starved."
                                   + size)
    if victims and snap["need"] <= snap["free"]:
        raise fail(NAME_SCHED, f"{where}: you preempted {[v.rid for v in victims]} although the {snap['free']} free "
                               f"blocks could hold every running sequence's next tokens ({snap['need']} blocks): "
                               "preempt only while the pool cannot hold a running sequence's next tokens (rule 2)")


def _verify_fairness(sch, snap, batch, where, total) -> None:

    scheduled = {id(s) for s, _ in batch.work}
    room = total < sch.max_tokens and len(batch.work) < sch.max_seqs
    left_out = [s for s in snap["running"] if s.status is Status.RUNNING and id(s) not in scheduled]
    if left_out and room and not sch.blocks.can_hold(left_out[0], left_out[0].num_computed + 1):
        raise fail(NAME_SCHED, f"{where}: request {left_out[0].rid} was running and got no token because the pool could "
                               "not hold it, and nothing was preempted: rule 2, when the pool cannot hold a running sequence, "
                               "preempt the newest running sequence that has not run in this step, then try again")
    ran = {id(s) for s, _ in batch.work}
    chunk = next((s for s, _ in batch.work if s.to_compute > 1 and any(s is r for r in snap["running"])), None)
    decode = next((s for s in left_out if s.to_compute == 1), None)
    if chunk is not None and decode is not None and id(decode) not in ran:
        raise fail(NAME_SCHED, f"{where}: request {decode.rid} is decoding and got no token while request {chunk.rid}'s "
                               "prompt ran a chunk: running sequences that are decoding come first (one token each), "
                               "those still in their prompt share what is left of the budget")
    if left_out and room:
        raise fail(NAME_SCHED, f"{where}: request {left_out[0].rid} was running and got no token although the step had "
                               f"room for {sch.max_tokens - total} more tokens: you starve a running request; every "
                               "running sequence (decoding first) gets its share while the budget lasts")
    admitted = [s for s in snap["waiting"] if s.status is Status.RUNNING]
    readmitted = [v for v in batch.preempted if v.status is Status.RUNNING]
    if (admitted or readmitted) and batch.preempted:
        raise fail(NAME_SCHED, f"{where}: you admitted request {(admitted or readmitted)[0].rid} in a step that had to preempt "
                               f"{batch.preempted[0].rid}: memory just ran out, so admit no one in that step")
    if admitted != snap["waiting"][:len(admitted)]:
        first = next(s for s in snap["waiting"] if s not in admitted)
        raise fail(NAME_SCHED, f"{where}: you admitted request {admitted[-1].rid} before request {first.rid}, which "
                               "waited longer: first come, first served (the head of the queue first; stop at the first that cannot run)")
    if sch.waiting and not batch.preempted and room and len(sch.running) < sch.max_seqs:
        w = sch.waiting[0]
        n = min(w.num_tokens - sch.cached_tokens(w), sch.max_tokens - total)
        c = sch.cached_tokens(w)
        if w in snap["waiting"] and sch.blocks.can_hold(w, c + n):
            whole = min(w.num_tokens, sch.max_tokens - total)          # n with the cached tokens counted again
            if c and whole > n and not sch.blocks.can_hold(w, c + whole):
                raise fail(NAME_SCHED, f"{where}: request {w.rid} was left waiting although {n} of its tokens fit the "
                                       f"step and the pool: {c} of its tokens come from the prefix cache (a preempted "
                                       "request finds its own blocks there): those are not run again and need no new "
                                       "room; counting them among the tokens to run asks the pool for room it does not need")
            raise fail(NAME_SCHED, f"{where}: request {w.rid} was left waiting although {n} of its tokens fit the step "
                                   "and the pool: admit it (a prompt longer than the budget runs in chunks), or it may "
                                   "wait forever")


# ---------------------------------------------------------------------------------------------------
# check_scheduler


def _unasked(refused) -> str:
    """Which rule a grant the pool could not hold broke, from the grant itself."""
    if refused is None:
        return ("the blocks were taken outside the scheduler's grant: take them only through it, after asking "
                "the pool whether it can hold them")
    seq, n, waiting, preempted = refused
    if waiting and preempted:
        return (f"request {seq.rid} was waiting, and you admitted it with {n} token(s) in a step that had just "
                f"preempted request {preempted[0].rid}: memory ran out in this step, so admit no one (rule 3)")
    if waiting:
        return (f"request {seq.rid} was waiting, and you admitted it with {n} token(s) the pool could not hold: "
                "the queue stops at the first request the pool cannot hold; it waits until blocks are freed (rule 3)")
    return (f"request {seq.rid} was running, and you gave it {n} token(s) the pool could not hold: when the pool "
            "cannot hold a running sequence's tokens, preempt the newest running sequence that has not run in "
            "this step, then try again (rule 2)")


def _graded_class(Scheduler, title):
    class Graded(Scheduler):
        step = 0

        def preempt(self, seq, batch=None):
            """Logged: who was preempted, which sequences had run in this step by then, who was running."""
            done = {id(s) for s, _ in batch.work} if batch is not None else set()
            self.preempt_log.append((seq, done, list(self.running)))
            self.preempt_sizes.append({id(s): len(s.block_table) for s in self.running})   # blocks held then
            return super().preempt(seq, batch)

        def grant(self, batch, seq, n):
            """Logged when the pool cannot hold it: which sequence, running or waiting, after a preemption or not
            (a scheduler may catch the OutOfBlocks and preempt; only one that escapes is judged)."""
            waiting = seq.status is Status.WAITING
            try:
                return super().grant(batch, seq, n)
            except OutOfBlocks:
                self.refused_grant = (seq, n, waiting, list(batch.preempted))
                raise

        def schedule(self):
            Graded.step += 1
            self.preempt_log, self.preempt_sizes, self.refused_grant = [], [], None
            snap = _snapshot(self)
            try:
                batch = Scheduler.schedule(self)
            except (AssertionError, NotImplementedError):
                raise
            except OutOfBlocks as e:
                raise fail(NAME_SCHED, f"case '{title}', step {Graded.step}: your schedule() granted blocks the "
                                       f"pool did not have (OutOfBlocks: {e}): you granted without first asking "
                                       "whether the pool can hold them: " + _unasked(self.refused_grant)) from None
            except Exception as e:  # noqa: BLE001
                raise fail(NAME_SCHED, f"case '{title}', step {Graded.step}: your schedule() raised "
                                       f"{type(e).__name__}: {e}") from e
            _verify_step(self, snap, batch, f"case '{title}', step {Graded.step}")
            return batch
    return Graded


def _run_case(Scheduler, model, case, reference):

    title, kw, n, plen, new, pre, seed = case
    eng = Engine(model, scheduler_cls=_graded_class(Scheduler, title), clock=_Ticks(), **kw)
    seqs = [eng.submit(p, m, arrival=t) for p, m, t in _workload(n, plen, new, pre, seed)]
    budget = 40 * sum(s.max_tokens for s in seqs)
    try:
        while eng.step():
            eng.clock.t += 1
            if len(eng.trace.steps) > budget:
                raise fail(NAME_SCHED, f"case '{title}': {budget} steps and requests are still unfinished: no progress")
    except RuntimeError as e:
        raise fail(NAME_SCHED, f"case '{title}': your schedule() returned an empty step while requests wait ({e})") from None
    for s in seqs:
        want = reference(s)
        if s.status is not Status.FINISHED:
            raise fail(NAME_SCHED, f"case '{title}': request {s.rid} ended {s.status.value} ({s.error}): a request was lost")
        if s.output != want:
            i = next((j for j, (a, b) in enumerate(zip(s.output, want)) if a != b), min(len(s.output), len(want)))
            how = (f"it was preempted {s.preemptions} time(s) and resumed with lost or changed tokens: a preempted "
                   "request keeps every token it has and recomputes them all"
                   if s.preemptions else "check which tokens you run (seq.num_computed onwards)")
            raise fail(NAME_SCHED, f"case '{title}': request {s.rid}'s new token #{i + 1} differs from its prompt "
                                   f"generated alone: {how}")
        if len(eng.trace.token_times[s.rid]) != len(s.output):
            why = (f"it was preempted {s.preemptions} time(s) and resumed with lost tokens, then generated them "
                   "again (a client would receive them twice): a preempted request keeps seq.output"
                   if s.preemptions else "check that each step appends one token per finished chunk")
            raise fail(NAME_SCHED, f"case '{title}': request {s.rid} emitted {len(eng.trace.token_times[s.rid])} tokens "
                                   f"for an output of {len(s.output)}: {why}")
    return eng


def check_scheduler(Scheduler) -> None:
    """Grade a ``kvlab.serving.Scheduler`` subclass whose ``schedule()`` is the learner's."""

    if not (isinstance(Scheduler, type) and issubclass(Scheduler, LibraryScheduler)):
        raise fail(NAME_SCHED, "hand in a class that subclasses kvlab.serving.Scheduler and writes schedule()")
    if library_copy(Scheduler, LibraryScheduler, ("schedule",)):
        raise fail(NAME_SCHED, "your class does not write schedule(): it is kvlab.serving.Scheduler's own; write "
                               "your own in the lab's cell")
    model, preempted = FakeLM(vocab=V, n_positions=256), 0
    for case in _CASES:
        eng = _run_case(Scheduler, model, case, lambda s: fake_reference(s.prompt, s.max_new_tokens, V))
        preempted += eng.scheduler.preemptions
    _confirm_on_gpt2(Scheduler)
    passed(NAME_SCHED, f"{len(_CASES)} unseen workloads ({preempted} preemptions) and one on GPT-2: every step within "
                       "the budget, the newest preempted first, first come first served, no request starved or lost, "
                       "every request equal to its prompt alone")


def _confirm_on_gpt2(Scheduler) -> None:

    model = GPT2.from_hf(grading_model()[0])
    _run_case(Scheduler, model, ("the hand-built GPT-2, a pool that binds", dict(num_blocks=8, block_size=4,
              max_num_batched_tokens=10, max_num_seqs=4), 5, (2, 9), (3, 8), 0, 35), References(model))


# ---------------------------------------------------------------------------------------------------
# check_prefix_cache


def _fill(bm, rid, tokens):
    """A sequence that computed ``tokens`` and finished: its full blocks registered, then freed."""

    s = Sequence(rid, tuple(tokens), 1)
    bm.allocate(s, len(tokens))
    s.num_computed = len(tokens)
    bm.commit(s)
    return s


def _state(bm) -> tuple:
    """Everything a lookup must leave as it was: the cache's order, keys, counts, and every counter
    (hits, hit tokens, evictions: any number the block manager keeps)."""
    counters = {k: v for k, v in vars(bm).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return (list(bm.cached), list(bm.key_of), dict(bm.block_of), [bm.refcount(b) for b in range(bm.num_blocks)],
            counters)


def _lookup(bm, tokens, where):
    before = _state(bm)
    try:
        got = bm.lookup(tuple(tokens))
    except (AssertionError, NotImplementedError):
        raise
    except Exception as e:  # noqa: BLE001
        raise fail(NAME_PREFIX, f"{where}: lookup raised {type(e).__name__}: {e}") from e
    if _state(bm) != before:
        raise fail(NAME_PREFIX, f"{where}: lookup changed the cache (its order, keys, reference counts or a counter such as "
                                "hits or evictions): a lookup only reads; "
                                "the block manager forks the hits itself when it admits the sequence")
    if not isinstance(got, (list, tuple)):
        raise fail(NAME_PREFIX, f"{where}: lookup must return a list of block ids, got {got!r}")
    return [int(b) for b in got]


def _prefix_scenarios(BlockManager):
    """Yield (what, got, want) for each probe; the learner's lookup/evict run on every one."""
    rng = random.Random(77)
    A = [rng.randrange(1, V) for _ in range(13)]        # 3 full blocks of 4 + 1 token
    C = [rng.randrange(1, V) for _ in range(13)]
    bm = BlockManager(6, 4)
    a = _fill(bm, "A", A)
    blocks_a = list(a.block_table)
    bm.free(a)
    yield "a prompt that starts with a cached one", _lookup(bm, A + [5], "lookup(A + one token)"), blocks_a[:3]
    yield "a prompt that is exactly 3 cached blocks (its last token must still run)",         _lookup(bm, A[:12], "lookup(A's first 12 tokens)"), blocks_a[:2]
    yield "a block whose tokens match but whose prefix does not",         _lookup(bm, C[:4] + A[4:8] + [1], "lookup(other tokens + A's second block)"), []
    c = _fill(bm, "C", C)                                # 4 blocks: the free list's 3, then 1 eviction
    blocks_c = list(c.block_table)
    bm.free(c)
    yield "an evicted block, reused for other tokens, never found by its old key", \
        [b for b in _lookup(bm, A + [5], "lookup(A + one token) after one of its blocks was reused") if b in blocks_c], []
    yield "the least recently used block evicted first (A's tail)", _lookup(bm, A + [5], "lookup(A + one token)"),         blocks_a[:2]
    yield "the most recently used prompt kept", _lookup(bm, C + [3], "lookup(C + one token)"), blocks_c[:3]
    D = [rng.randrange(1, V) for _ in range(12)]
    d = _fill(bm, "D", D)                                # evicts more of A and reuses its blocks for D's tokens
    yield "an evicted block, reused for other tokens, never found by its old key",         [b for b in _lookup(bm, A + [5], "lookup(A + one token) after its blocks were reused") if b in d.block_table], []
    yield "a block held by a running sequence is never evicted", sorted(set(d.block_table) & set(bm.cached)), []
    blocks_d = list(d.block_table)
    bm.free(d)
    yield "a prompt registered in blocks that were evicted is found again", \
        _lookup(bm, D + [1], "lookup(D + one token), D's blocks reused from evicted ones"), blocks_d[:3]


def _raised_in(e) -> str:
    """Which of the learner's methods raised, and, for a KeyError in evict, the mistake it shows."""
    tb, where = e.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_name in ("lookup", "evict"):
            where = tb.tb_frame.f_code.co_name
        tb = tb.tb_next
    if where == "evict" and isinstance(e, KeyError):
        return (": in your evict, a key no longer in self.block_of. An earlier eviction forgot a block's key in one "
                "of the two maps between keys and blocks, not in both")
    return f": in your {where}" if where else ""


def check_prefix_cache(BlockManager) -> None:
    """Grade a ``kvlab.serving.BlockManager`` subclass whose ``lookup`` and ``evict`` are the learner's."""

    if not (isinstance(BlockManager, type) and issubclass(BlockManager, LibraryBlockManager)):
        raise fail(NAME_PREFIX, "hand in a class that subclasses kvlab.serving.BlockManager and writes lookup and evict")
    if library_copy(BlockManager, LibraryBlockManager, ("lookup", "evict")):
        raise fail(NAME_PREFIX, "your class writes neither lookup nor evict: it is kvlab's own; write your own")
    n = 0
    try:
        for what, got, want in _prefix_scenarios(BlockManager):
            n += 1
            if got != want:
                raise fail(NAME_PREFIX, f"{what}: got {got}, expected {want}. " + _PREFIX_HINTS[what])
    except (AssertionError, NotImplementedError):
        raise
    except Exception as e:  # noqa: BLE001
        raise fail(NAME_PREFIX, f"your block manager raised {type(e).__name__}: {e} (after {n} probe(s))"
                                + _raised_in(e)) from e
    eng = _serve_prefixes(BlockManager)
    passed(NAME_PREFIX, f"{n} probes of lookup and eviction, then a prefix-heavy stream ({eng.blocks.hits} hits, "
                        f"{eng.blocks.evictions} evictions): every request equal to its prompt alone")


_PREFIX_HINTS = {
    "a prompt that starts with a cached one": "A prompt that starts with cached blocks hits each of "
        "its full blocks, in order, up to the first miss; your lookup returned other blocks.",
    "a prompt that is exactly 3 cached blocks (its last token must still run)": "A full-block match "
        "must leave the prompt's last token out: its logits are the first output, so at least that token must run.",
    "a block whose tokens match but whose prefix does not": "A key must name the whole prefix (tokens and the "
        "parent's key), not the block's tokens alone; and stop at the first miss.",
    "the least recently used block evicted first (A's tail)": "evict() takes the least recently used unreferenced "
        "block; yours evicted another one.",
    "the most recently used prompt kept": "evict() takes the least recently used unreferenced block.",
    "an evicted block, reused for other tokens, never found by its old key": "Your lookup found an evicted block by "
        "its old key: the eviction left that key behind, so the block's new tokens are served as the old ones.",
    "a block held by a running sequence is never evicted": "You evicted a block a running sequence still holds: "
        "only blocks no sequence references may be evicted.",
    "a prompt registered in blocks that were evicted is found again": "An evicted block kept a trace of its old "
        "key (in self.key_of or self.block_of), so it could not be registered under its new tokens: evict() must "
        "leave the block with no key at all.",
}


def _serve_prefixes(BlockManager):

    rng = random.Random(78)
    system = [rng.randrange(1, V) for _ in range(10)]
    eng = Engine(FakeLM(vocab=V, n_positions=256), num_blocks=14, block_size=3, max_num_batched_tokens=16,
                 block_manager_cls=BlockManager, clock=_Ticks())
    seqs = [eng.submit(system[:rng.randint(4, 10)] + [rng.randrange(1, V) for _ in range(rng.randint(1, 6))],
                       rng.randint(2, 9), arrival=float(i)) for i in range(12)]
    while eng.step():
        eng.clock.t += 1
    for s in seqs:
        if s.status is not Status.FINISHED or s.output != fake_reference(s.prompt, s.max_new_tokens, V):
            raise fail(NAME_PREFIX, f"serving 12 requests that share a system prompt through your block manager: "
                                    f"request {s.rid} differs from its prompt alone: a hit returned a block that does "
                                    "not hold that prefix's keys")
    if not eng.blocks.hits or not eng.blocks.evictions:
        raise fail(NAME_PREFIX, f"a stream that shares a system prompt on a full pool got {eng.blocks.hits} hits and "
                                f"{eng.blocks.evictions} evictions: lookup finds nothing, or evict is never used")
    return eng
