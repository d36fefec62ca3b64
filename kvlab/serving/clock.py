"""The engine's clock and trace, kept apart from the serving logic (chapter 9).

:class:`Clock` gives seconds since the run started. While nothing can run (no request has arrived
yet and none is left), the engine *skips* to the next arrival instead of sleeping: the skipped time
counts as time, but no CPU waits for it. On a GPU, ``now`` waits for the queued kernels first, so a
step's time is the time its work took, not the time it took to launch it.

:class:`Trace` records what each step did and when each request got each token; every serving metric
(TTFT, TPOT, latency, stalls, throughput, goodput) is computed from it by :mod:`kvlab.servingbench`.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch


class Clock:
    def __init__(self, device="cpu"):
        self.cuda = torch.device(device).type == "cuda"
        self.t0, self.skipped = None, 0.0

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        if self.t0 is None:
            self.t0 = time.perf_counter()
        return time.perf_counter() - self.t0 + self.skipped

    def skip_to(self, t: float) -> None:
        """Idle until ``t``: counted, not slept."""
        self.skipped += max(0.0, t - self.now())


class Trace:
    """Per step: time, tokens by kind, sequences, blocks in use, queue, preemptions, copies.
    Per request: arrival, the time of every token, how it ended."""

    def __init__(self):
        self.steps: list[dict] = []
        self.token_times: dict = defaultdict(list)

    def step(self, start: float, t: float, batch, emitted, blocks, scheduler) -> None:
        decode = batch.decode_tokens
        self.steps.append(dict(
            step=len(self.steps) + 1, start=start, time=t, tokens=batch.num_tokens, seqs=len(batch.work),
            decode_tokens=decode, prefill_tokens=batch.num_tokens - decode, logit_rows=len(emitted),
            context=batch.context, pairs=batch.pairs, blocks_used=blocks.num_blocks - blocks.num_free,
            waiting=len(scheduler.waiting), running=len(scheduler.running), preempted=len(batch.preempted),
            copies=len(batch.copies), copy_pairs=list(batch.copies),
            held=sum(s.num_computed for s in scheduler.running),
            reserved=max(scheduler.reserved, blocks.num_blocks - blocks.num_free)))
        for seq in emitted:
            self.token_times[seq.rid].append(t)
