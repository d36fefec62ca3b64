"""A request as the engine sees it: its tokens, its block table, its status (chapter 9).

A :class:`Sequence` is the one owner of the facts about one request: the prompt and the tokens
generated so far, the blocks that hold its keys and values (``block_table``, in token order), and
``num_computed``, the number of its tokens whose keys and values are in those blocks (the one length
the engine keeps for it). Everything else (the block manager, the scheduler, the runner) reads or
changes these fields; no other object keeps a second copy of them.

A sequence with ``n`` tokens has ``num_computed <= n - 1`` while it is served: the newest token's keys
are computed by the step that reads its logits. One step computes ``tokens[num_computed : num_computed
+ chunk]``; when the chunk reaches the end, that step's logits give the next token. Prefill, a chunk of
a long prompt, a decode step and the recompute of a preempted sequence are all this one rule.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Status(enum.Enum):
    WAITING = "waiting"      # queued (new, or preempted and waiting to be recomputed)
    RUNNING = "running"      # holds blocks; is scheduled every step until it finishes
    FINISHED = "finished"    # max_new_tokens reached or end-of-text produced; blocks freed
    FAILED = "failed"        # a step could not serve it; ``error`` says why; blocks freed


@dataclass(eq=False)
class Sequence:
    rid: object
    prompt: tuple[int, ...]
    max_new_tokens: int
    eos_token_id: int | None = None
    arrival: float = 0.0                              # seconds on the engine's clock
    output: list[int] = field(default_factory=list)   # the new tokens, in order
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0                             # tokens whose keys/values are in the blocks
    status: Status = Status.WAITING
    error: str | None = None
    preemptions: int = 0                              # times its blocks were taken back (recompute)
    cached_tokens: int = 0                            # prompt tokens found in the prefix cache, all admissions
    sampling: object = None                           # SamplingParams, or None: greedy
    generator: object = None                          # its own torch.Generator when it samples
    children: list = field(default_factory=list)      # samples of the same prompt, forked after its prefill
    block_keys: list = field(default_factory=list)    # prefix-cache keys of its full blocks, each hashed once
    committed: int = 0                                # full blocks already offered to the prefix cache

    @property
    def tokens(self) -> list[int]:
        return list(self.prompt) + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def to_compute(self) -> int:
        """Tokens still to run before the next token can be read off the logits."""
        return self.num_tokens - self.num_computed

    @property
    def max_tokens(self) -> int:
        """The most tokens it can ever hold: prompt + max_new_tokens - 1 (the last one is never fed back)."""
        return len(self.prompt) + self.max_new_tokens - 1

    @property
    def done(self) -> bool:
        if len(self.output) >= self.max_new_tokens:
            return True
        last = self.output[-1] if self.output else None
        return last is not None and (last == self.eos_token_id or (self.sampling is not None and last in self.sampling.stop))

    def append(self, token: int) -> None:
        self.output.append(int(token))

    def reset_for_recompute(self) -> None:
        """Preempted by recompute: its blocks were freed; every token it has will be computed again."""
        self.block_table = []
        self.num_computed = 0
        self.committed = 0                 # its new blocks must be offered again (its keys stay valid)
        self.status = Status.WAITING
        self.preemptions += 1
