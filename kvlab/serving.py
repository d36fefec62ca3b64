"""Serving many sequences at once on a paged cache (chapter 9): a queue, a scheduler, batched steps.

Requests arrive with their own prompt and ``max_new_tokens`` (and an optional end-of-text id). The
:class:`Engine` keeps a queue and a set of running requests; each :meth:`Engine.step`:

1. admits queued requests while the pool can hold them (``continuous``: at every step; ``static``:
   only when the whole previous batch has finished, the baseline);
2. runs the model's one forward pass over a ragged step (:func:`kvlab.paged.ragged_forward`): the
   requests already running decode one token each, the ones admitted now prefill their prompt (their
   first token), all in one row of tokens; each token reads its own sequence's blocks through its
   block table, and the paged cache's key positions hide every other sequence's;
3. retires the finished rows and frees their blocks.

Every request's tokens equal what the hand-built GPT-2 generates for that prompt alone
(:func:`reference_tokens`), whatever it was batched with and whenever it joined.

A request whose prompt starts with a registered prefix (:meth:`Engine.add_prefix`, a shared system
prompt) forks the prefix's blocks instead of recomputing them, and prefills only the rest.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .paged import BlockAllocator, PagedKVCache, blocks_for, ragged_forward


@dataclass(eq=False)
class Request:
    prompt: list[int]
    max_new_tokens: int
    eos_token_id: int | None = None
    rid: int = -1
    tokens: list[int] = field(default_factory=list)   # the new tokens generated so far
    prefix: tuple | None = None                        # the registered prefix it shares, if any
    submitted: float = 0.0
    first_token: float = float("nan")
    finished: float = float("nan")
    finished_step: int = -1

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.max_new_tokens or (
            self.eos_token_id is not None and bool(self.tokens) and self.tokens[-1] == self.eos_token_id)

    @property
    def latency(self) -> float:
        return self.finished - self.submitted


class Engine:
    """A queue of requests served on a paged cache, ``continuous`` or ``static`` batching.

    No preemption: a request is admitted only when the worst case of every admitted request (its
    prompt plus ``max_new_tokens``, minus the full blocks it shares) fits in the pool, so a running
    request never waits for a block. ``max_batch`` caps the rows of one step.
    """

    def __init__(self, model, num_blocks: int, block_size: int, max_batch: int = 8,
                 policy: str = "continuous", allocator_cls=BlockAllocator, gather=None,
                 prefix_sharing: bool = True):
        if policy not in ("continuous", "static"):
            raise ValueError(f"policy must be 'continuous' or 'static', got {policy!r}")
        self.model, self.policy, self.max_batch = model, policy, max_batch
        self.block_size, self.prefix_sharing = block_size, prefix_sharing
        self.cache = PagedKVCache.for_model(model, num_blocks, block_size, allocator_cls=allocator_cls,
                                            gather=gather)
        self.queue: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.prefixes: dict[tuple, str] = {}    # prefix tokens -> the pinned sequence that holds them
        self.committed = 0                      # worst-case blocks promised to admitted requests + prefixes
        self.pinned = 0                         # blocks the registered prefixes hold for good
        self.trace: list[dict] = []
        self.steps, self.t0, self._next = 0, None, 0

    # -- requests -------------------------------------------------------------------------------
    def add_prefix(self, tokens) -> None:
        """Prefill ``tokens`` once and keep their blocks: later prompts that start with them share them."""
        tokens = tuple(int(t) for t in tokens)
        if not self.prefix_sharing or tokens in self.prefixes:
            return
        sid = f"prefix{len(self.prefixes)}"
        self.committed += blocks_for(len(tokens), self.block_size)
        self.pinned += blocks_for(len(tokens), self.block_size)
        ragged_forward(self.model, self.cache, [sid], [list(tokens)])
        self.prefixes[tokens] = sid

    def _prefix_of(self, prompt) -> tuple | None:
        """The longest registered prefix strictly shorter than ``prompt`` that starts it (the last
        prompt token is always recomputed: its logits give the first new token)."""
        best = None
        for p in self.prefixes:
            if len(p) < len(prompt) and tuple(prompt[:len(p)]) == p and (best is None or len(p) > len(best)):
                best = p
        return best

    def _need(self, r: Request) -> int:
        shared = len(r.prefix) // self.block_size if r.prefix else 0   # full shared blocks are never copied
        return blocks_for(len(r.prompt) + r.max_new_tokens, self.block_size) - shared

    def submit(self, prompt, max_new_tokens: int, eos_token_id=None) -> Request:
        prompt = [int(t) for t in prompt]
        if not prompt or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError("a request needs a non-empty prompt and max_new_tokens >= 1")
        r = Request(prompt, max_new_tokens, eos_token_id, rid=self._next)
        r.prefix = self._prefix_of(prompt)
        if self._need(r) > self.cache.num_blocks - self.pinned:
            raise ValueError(f"request {r.rid} needs up to {self._need(r)} blocks; the pool can never give "
                             f"it more than {self.cache.num_blocks - self.pinned}: add blocks")
        self._next += 1
        r.submitted = self._now()
        self.queue.append(r)
        return r

    # -- the scheduler --------------------------------------------------------------------------
    def _now(self) -> float:
        """Seconds since the first request (on a GPU, after the queued kernels have finished)."""
        if self.cache.keys.device.type == "cuda":
            torch.cuda.synchronize(self.cache.keys.device)
        if self.t0 is None:
            self.t0 = time.perf_counter()
        return time.perf_counter() - self.t0

    def _admit(self) -> list[Request]:
        if self.policy == "static" and self.running:
            return []            # static batching: the next batch waits for the whole current one
        admitted = []
        while (self.queue and len(self.running) + len(admitted) < self.max_batch
               and self.committed + self._need(self.queue[0]) <= self.cache.num_blocks):
            r = self.queue.popleft()   # first come, first served: no overtaking, no starvation
            self.committed += self._need(r)
            admitted.append(r)
        return admitted

    def _emit(self, reqs: list[Request], logits: torch.Tensor) -> None:
        now = None
        for r, t in zip(reqs, logits.argmax(-1).tolist()):
            r.tokens.append(t)
            if len(r.tokens) == 1:
                now = now if now is not None else self._now()
                r.first_token = now

    def step(self) -> bool:
        """One scheduler step, one forward pass; False when there is nothing left to do.

        The pass holds every running row (its last token: one decode step) and every request
        admitted now (its prompt after any shared prefix: the prefill, which yields its first token).
        """
        if not self.queue and not self.running:
            return False
        decoding = list(self.running)
        admitted = self._admit()
        if not admitted and not decoding:
            raise RuntimeError(f"request {self.queue[0].rid} can never be admitted")
        for r in admitted:
            if r.prefix:
                self.cache.fork(self.prefixes[r.prefix], r.rid)
        todo = [r.prompt[len(r.prefix):] if r.prefix else r.prompt for r in admitted]
        ctx = sum(self.cache.lengths[r.rid] for r in decoding)
        rows = decoding + admitted
        logits = ragged_forward(self.model, self.cache, [r.rid for r in rows],
                               [[r.tokens[-1]] for r in decoding] + todo)
        self._emit(rows, logits)
        self.running += admitted
        now, self.steps = self._now(), self.steps + 1
        self.trace.append(dict(step=self.steps, time=now, rows=len(rows), decode_rows=len(decoding),
                               prefill_rows=len(admitted), prefill_tokens=sum(map(len, todo)), context=ctx,
                               blocks_used=self.cache.blocks_used, queued=len(self.queue)))
        for r in [r for r in self.running if r.done]:   # retire: free the blocks right away
            self.running.remove(r)
            self.cache.free(r.rid)
            self.committed -= self._need(r)
            r.finished, r.finished_step = now, self.steps
            self.finished.append(r)
        return True

    def run(self, progress: bool = False) -> list[Request]:
        """Step until every submitted request has finished; returns them in submission order."""
        from tqdm.auto import tqdm

        bar = tqdm(total=len(self.queue) + len(self.running), desc=self.policy, leave=False, disable=not progress)
        while self.step():
            bar.n = len(self.finished)
            bar.refresh()
        bar.close()
        return sorted(self.finished, key=lambda r: r.rid)

    def close(self) -> None:
        """Drop the registered prefixes (the pool is empty afterwards if nothing leaked)."""
        for tokens, sid in self.prefixes.items():
            self.cache.free(sid)
            self.committed -= blocks_for(len(tokens), self.block_size)
        self.pinned = 0
        self.prefixes.clear()


# ---------------------------------------------------------------------------------------------------
# The reference and the measurements


@torch.no_grad()
def reference_tokens(model, prompt, max_new_tokens: int, eos_token_id=None) -> list[int]:
    """What the hand-built GPT-2 generates for this prompt alone (chapter 3's cached greedy loop)."""
    from .gpt2 import generate

    ids = torch.tensor([list(prompt)], device=model.wte.weight.device)
    new = generate(model, ids, max_new_tokens)[0, len(prompt):].tolist()
    if eos_token_id is not None and eos_token_id in new:
        new = new[:new.index(eos_token_id) + 1]
    return new


def random_workload(n: int, vocab_size: int, prompt_len=(4, 48), new_tokens=(4, 64), seed: int = 0,
                    prefix: list[int] | None = None) -> list[tuple[list[int], int]]:
    """``n`` requests ``(prompt, max_new_tokens)`` with lengths drawn uniformly from the ranges
    (token ids drawn at random; greedy decoding makes the output deterministic anyway)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        P = int(torch.randint(prompt_len[0], prompt_len[1] + 1, (1,), generator=g))
        M = int(torch.randint(new_tokens[0], new_tokens[1] + 1, (1,), generator=g))
        prompt = torch.randint(1, vocab_size, (P,), generator=g).tolist()
        out.append(((prefix or []) + prompt, M))
    return out


def serve(model, workload, num_blocks: int, block_size: int, policy: str = "continuous", max_batch: int = 8,
          prefix=None, prefix_sharing: bool = True, eos_token_id=None, **kwargs) -> Engine:
    """Run a whole workload through a fresh :class:`Engine`; returns the engine (requests, trace)."""
    eng = Engine(model, num_blocks, block_size, max_batch, policy, prefix_sharing=prefix_sharing, **kwargs)
    if prefix:
        eng.add_prefix(prefix)
    for prompt, m in workload:
        eng.submit(prompt, m, eos_token_id)
    eng.run()
    return eng


def summary(eng: Engine) -> dict:
    """Throughput, latency (mean, p90, max), steps and mean decode occupancy of a finished run."""
    reqs = eng.finished
    lat = torch.tensor([r.latency for r in reqs])
    total = eng.trace[-1]["time"]
    rows = [t["rows"] for t in eng.trace]
    return dict(policy=eng.policy, requests=len(reqs), tokens=sum(len(r.tokens) for r in reqs), seconds=total,
                tokens_per_s=sum(len(r.tokens) for r in reqs) / total, steps=eng.steps,
                mean_latency=float(lat.mean()), p90_latency=float(lat.quantile(0.9)), max_latency=float(lat.max()),
                mean_occupancy=sum(rows) / (len(rows) * eng.max_batch) if rows else 0.0,
                peak_blocks=max(t["blocks_used"] for t in eng.trace))


def reserved_vs_used(lengths: list[int], max_len: int, batch_size: int, block_sizes) -> list[dict]:
    """Token slots reserved vs used to hold sequences of the given final ``lengths``, per scheme.

    * reserve ``max_len`` per sequence (chapter 3's cache, transformers' ``StaticCache``);
    * a growing cache shared by a static batch of ``batch_size`` (``DynamicCache``): every row is as
      long as the batch's longest;
    * paged blocks of each size in ``block_sizes``: counted by running a real :class:`BlockAllocator`.
    """
    used = sum(lengths)
    rows = [dict(scheme=f"reserve max_len={max_len} per sequence", reserved=len(lengths) * max_len)]
    padded = sum(len(lengths[i:i + batch_size]) * max(lengths[i:i + batch_size])
                 for i in range(0, len(lengths), batch_size))
    rows.append(dict(scheme=f"growing cache, static batches of {batch_size}", reserved=padded))
    for bs in block_sizes:
        alloc = BlockAllocator(sum(blocks_for(n, bs) for n in lengths), bs)
        for i, n in enumerate(lengths):
            alloc.allocate(i, 1)
            for _ in range(n - 1):      # grow one token at a time, as decoding does
                alloc.append_slot(i)
        rows.append(dict(scheme=f"paged, block_size={bs}", reserved=(alloc.num_blocks - alloc.num_free) * bs))
    for r in rows:
        r["used"], r["waste"] = used, 1 - used / r["reserved"]
    return rows


def run_floor(eng: Engine, bandwidth: float, flops: float) -> float:
    """Chapter 7's floor for a finished run: the least time its steps could take on a machine that
    moves ``bandwidth`` bytes/s and computes ``flops`` FLOP/s.

    Each step is one pass over its decode rows and the prompt tokens it prefills, priced by
    :func:`kvlab.roofline.step_time_floor` as that many rows reading the decode rows' cache: every
    weight read once, two FLOPs per weight per token (a lower bound: the prefill's attention is left out).
    """
    from .roofline import step_time_floor

    total = 0.0
    for t in eng.trace:   # one pass per step: its decode rows and its prefill tokens read the weights once
        tokens = t["decode_rows"] + t["prefill_tokens"]
        total += step_time_floor(eng.model, tokens, t["context"] // tokens, bandwidth, flops)
    return total
