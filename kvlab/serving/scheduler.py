"""The scheduler: which sequences run in the next step, and how many of their tokens (chapter 9).

Each step has a budget of ``max_num_batched_tokens`` tokens (vLLM's name) and at most
``max_num_seqs`` sequences. The scheduler fills it in two passes:

1. **running** sequences. ``running_order="decode-first"`` (the default) takes the decoding ones
   first (1 token each), then prompts still being prefilled get the next chunk of theirs from what
   is left (chunked prefill: a long prompt runs over several steps while the others keep decoding).
   That is vLLM V0's chunked-prefill policy; vLLM V1 walks its running list in admission order
   (``running_order="arrival"`` here), and the two are compared in chapter 9. Blocks are taken on
   demand; when the pool is empty, the **newest** running sequence is preempted by recompute: its
   blocks are freed and it goes back to the front of the queue with every token it has, to be
   recomputed later (its generated tokens are kept, so it resumes with them; the recompute is
   chunked by the budget even when chunked prefill is off, or a long one could never come back).
2. **waiting** sequences, first come first served (no overtaking: a request that does not fit blocks
   the ones behind it, so none starves), unless this step had to preempt (memory just ran out): each
   is admitted with its prefix-cache hits and as much of its prompt as the budget leaves.

``admission`` says what a sequence must be promised before it is admitted:

* ``"on-demand"``: nothing; blocks are taken as it grows, and preemption makes room (vLLM's way);
* ``"reserve"``: its worst case, ``blocks_for(prompt + max_new_tokens)``; never preempts;
* ``"contiguous"``: ``blocks_for(max_len)`` whatever its length: what a contiguous cache per sequence
  (chapters 3-6's) reserves, counted on the same pool so the memory is equal.

``batching="static"`` admits a new batch only when every sequence of the previous one has finished;
the batch is every waiting request that memory (its admission promise) and ``max_num_seqs`` allow,
admitted over as many steps as the token budget needs to prefill them.
The scheduler keeps no length of its own: it reads ``seq.num_computed`` and ``seq.num_tokens``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..paged import blocks_for
from .sequence import Sequence, Status

from .config import ADMISSIONS, BATCHINGS, ORDERS


@dataclass
class Batch:
    """One step's work: ``(sequence, tokens to run)`` pairs and the ``(src, dst)`` block copies first."""

    work: list[tuple[Sequence, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    decode_tokens: int = 0     # tokens of sequences that were decoding (the rest are prompt or recompute)
    context: int = 0           # keys already cached for the step's sequences, before the step
    pairs: int = 0             # (query, visible key) pairs the step's attention scores

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.work)


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be an int >= 1 (one token, one sequence at least), got {v!r}")
    return v


class Scheduler:
    def __init__(self, blocks, max_num_batched_tokens: int = 256, max_num_seqs: int = 16,
                 chunked_prefill: bool = True, admission: str = "on-demand", batching: str = "continuous",
                 max_len: int | None = None, running_order: str = "decode-first"):
        self.max_tokens = _positive_int("max_num_batched_tokens", max_num_batched_tokens)
        self.max_seqs = _positive_int("max_num_seqs", max_num_seqs)
        if admission not in ADMISSIONS or batching not in BATCHINGS:
            raise ValueError(f"admission must be one of {ADMISSIONS} and batching one of {BATCHINGS}, got "
                             f"{admission!r}, {batching!r}")
        if running_order not in ORDERS:
            raise ValueError(f"running_order must be one of {ORDERS}, got {running_order!r}")
        if admission == "contiguous":
            _positive_int("max_len (the contiguous reservation per sequence)", max_len)
        self.blocks, self.chunked, self.admission, self.batching = blocks, chunked_prefill, admission, batching
        self.max_len, self.running_order = max_len, running_order
        self.forming = True                      # static batching: the current batch still takes requests
        self.capacity = blocks.num_blocks        # blocks the sequences may share (less any pinned prefix)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []        # in admission order: the last is the first victim
        self.reserved = 0                        # blocks promised to running sequences (reserving policies)
        self.preemptions = 0

    # -- what a request may ask for --------------------------------------------------------------
    def reservation(self, seq: Sequence) -> int:
        if self.admission == "contiguous":
            return blocks_for(self.max_len, self.blocks.block_size)
        return blocks_for(seq.max_tokens, self.blocks.block_size) if self.admission == "reserve" else 0

    def never_fits(self, seq: Sequence, shared: int = 0) -> str | None:
        """Why ``seq`` could never be served here, or None (checked once, at submit). ``shared``: the
        tokens it takes from a pinned prefix (whole blocks of them are not counted against the pool)."""
        need = blocks_for(seq.max_tokens, self.blocks.block_size) - shared // self.blocks.block_size
        if max(need, self.reservation(seq)) > self.capacity:
            return (f"it may hold {seq.max_tokens} tokens = {need} blocks of {self.blocks.block_size} (reserving "
                    f"{self.reservation(seq)}), but the pool can give at most {self.capacity}: add blocks, "
                    "or ask for fewer tokens")
        if self.admission == "contiguous" and seq.max_tokens > self.max_len:
            return f"it may hold {seq.max_tokens} tokens, more than the contiguous max_len={self.max_len}"
        if not self.chunked and len(seq.prompt) - shared > self.max_tokens:
            return (f"its {len(seq.prompt) - shared} prompt tokens to compute exceed max_num_batched_tokens={self.max_tokens} and "
                    "chunked prefill is off: raise the budget or turn chunked_prefill on")
        return None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    # -- one step -------------------------------------------------------------------------------
    def next_batch(self) -> Batch:
        """The next step's work (:meth:`schedule`), with what the trace needs counted before it runs."""
        batch = self.schedule()
        batch.decode_tokens = sum(n for s, n in batch.work if s.output and s.to_compute == 1)
        batch.context = sum(s.num_computed for s, _ in batch.work)
        batch.pairs = sum((2 * s.num_computed + n + 1) * n // 2 for s, n in batch.work)   # sum of p + 1
        return batch

    def schedule(self) -> Batch:
        """The next step's work, with every block it needs already taken (see the module's docstring)."""
        batch = Batch()
        self._schedule_running(batch)
        self._schedule_waiting(batch)
        return batch

    # -- the two moves a schedule is made of ----------------------------------------------------
    def cached_tokens(self, seq: Sequence) -> int:
        """Tokens of ``seq`` whose keys it already has or will get from the prefix cache on admission."""
        return seq.num_computed if seq.block_table else len(self.blocks.lookup(seq.tokens)) * self.blocks.block_size

    def grant(self, batch: Batch, seq: Sequence, n: int) -> None:
        """Run ``n`` more tokens of ``seq`` in this step: take its blocks (a waiting sequence first takes
        its prefix-cache hits and becomes running) and add it to the batch. Raises OutOfBlocks, changing
        nothing, when the pool cannot hold them."""
        if seq.status is Status.WAITING:
            batch.copies += self.blocks.allocate(seq, self.cached_tokens(seq) + n)
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            self.reserved += self.reservation(seq)
        else:
            batch.copies += self.blocks.grow(seq, seq.num_computed + n)
        batch.work.append((seq, n))

    def _schedule_running(self, batch: Batch) -> None:
        # decode-first: a long prompt never holds back the others' next token (only the budget left
        # after them goes to its chunk); arrival: the running list as it is (vLLM V1)
        order = (sorted(self.running, key=lambda s: s.to_compute > 1) if self.running_order == "decode-first"
                 else list(self.running))
        for seq in order:
            if seq not in self.running:            # preempted earlier in this pass
                continue
            n = min(seq.to_compute, self.max_tokens - batch.num_tokens)
            if n < 1 or len(batch.work) >= self.max_seqs:
                return
            scheduled = {id(s) for s, _ in batch.work}
            while not self.blocks.can_hold(seq, seq.num_computed + n):
                victim = next(s for s in reversed(self.running) if id(s) not in scheduled)  # the newest
                self.preempt(victim, batch)
                if victim is seq:
                    break
            else:
                self.grant(batch, seq, n)

    def _schedule_waiting(self, batch: Batch) -> None:
        if self.batching == "static" and not self.running:
            self.forming = True                    # the previous batch is done: a new one forms
        if batch.preempted or (self.batching == "static" and not self.forming):
            return                                 # memory just ran out, or the batch is closed
        while self.waiting and len(self.running) < self.max_seqs:
            seq = self.waiting[0]
            start = self.cached_tokens(seq)
            n = min(seq.num_tokens - start, self.max_tokens - batch.num_tokens)
            if n < 1:
                return                             # the budget is spent: the batch goes on forming next step
            if self.reserved + self.reservation(seq) > self.capacity or not self.blocks.can_hold(seq, start + n):
                break                              # wait: no overtaking
            if n < seq.num_tokens - start and not self.chunked and not seq.output:
                return                             # a whole prompt or nothing (a recompute is chunked)
            self.grant(batch, seq, n)
        self.forming = False                       # memory or max_num_seqs is reached: the batch is closed

    def preempt(self, seq: Sequence, batch: Batch | None = None) -> None:
        """Recompute preemption: free its blocks, put it first in the queue with all its tokens."""
        self._release(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.preemptions += 1
        if batch is not None:
            batch.preempted.append(seq)

    def retire(self, seq: Sequence, status: Status, error: str | None = None) -> None:
        """A sequence leaves for good (finished or failed): its blocks are freed at once."""
        if seq.block_table or seq in self.running:
            self._release(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.status, seq.error = status, error

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        if seq in self.running:
            self.running.remove(seq)
            self.reserved -= self.reservation(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
