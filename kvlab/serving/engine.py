"""The engine: requests in, tokens out, one model call per step (chapter 9).

    eng = Engine(model, num_blocks=64, block_size=16, max_num_batched_tokens=128)
    seq = eng.submit(prompt_ids, max_new_tokens=32, arrival=0.5)
    eng.run()                    # or: while eng.step(): ...
    seq.output, seq.status

The pieces are small and apart, as in nano-vllm: :class:`~kvlab.serving.sequence.Sequence` (a
request's tokens, blocks and status), :class:`~kvlab.serving.block_manager.BlockManager` (blocks,
references, copy-on-write, the prefix cache), :class:`~kvlab.serving.scheduler.Scheduler` (who runs
next and how many tokens), :class:`~kvlab.serving.runner.Runner` (one forward per step),
:class:`~kvlab.serving.clock.Clock` and :class:`~kvlab.serving.clock.Trace` (time and records).

Bad input is refused at :meth:`Engine.submit`, before any work. A request that still fails inside a
step (its forward raises) fails alone: its status says why, its blocks are freed, and the step is
completed for the others.
"""

from __future__ import annotations

import math

from ..paged import blocks_for
from .block_manager import AllocatorBlocks, BlockManager
from .clock import Clock, Trace
from .config import EngineConfig
from .runner import Runner
from .sampling import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence, Status
from ..validate import check_context, check_int, check_prompt


def _int(name: str, v, lo: int, hi: int | None = None) -> int:
    """An int in ``[lo, hi)`` by the one integer rule (``kvlab.validate.check_int``)."""
    return check_int(v, name, lo, None if hi is None else hi - 1)


def check_servable(model):
    """The engine runs ``model(ids, cache=..., positions=..., select=...)`` (kvlab's GPT2 and its fakes):
    refused at construction, not as an error in every request."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (AttributeError, TypeError, ValueError):
        params = {}
    wrapper = any(p.kind is p.VAR_KEYWORD for p in params.values())     # forward(*args, **kwargs): a wrapper
    missing = [] if wrapper else [p for p in ("cache", "select") if p not in params]
    if type(model).__module__.split(".")[0] == "transformers":
        missing = ["select (a transformers model)"]
    cfg = getattr(model, "config", None)
    if missing or not all(hasattr(cfg, f) for f in ("vocab_size", "n_positions")):
        raise ValueError(f"the engine serves kvlab's hand-built model (forward(ids, cache, positions, select)); "
                         f"{type(model).__name__} has no {' or '.join(missing) or 'config.vocab_size/n_positions'}: "
                         "wrap a transformers model with kvlab.gpt2.GPT2.from_hf(model)")
    return model


class Engine:
    """Serves requests on a paged cache; ``admission``/``batching`` pick the policy (see Scheduler)."""

    def __init__(self, model, num_blocks: int | None = None, block_size: int = 16, max_num_batched_tokens: int = 256,
                 max_num_seqs: int = 16, chunked_prefill: bool = True, admission: str = "on-demand",
                 batching: str = "continuous", prefix_caching: bool = True, max_len: int | None = None,
                 allocator_cls=None, gather=None, clock: Clock | None = None, scheduler_cls=Scheduler,
                 block_manager_cls=BlockManager, running_order: str = "decode-first",
                 exact_attention: bool = False, paged_attention: bool | None = None, config: EngineConfig | None = None):
        cfg = config or EngineConfig(num_blocks, block_size, max_num_batched_tokens, max_num_seqs, max_len,
                                     chunked_prefill, prefix_caching, admission, batching, running_order,
                                     exact_attention, paged_attention)
        self.model, self.config, self.engine_config = check_servable(model), model.config, cfg   # checked once
        self.blocks = (block_manager_cls(cfg.num_blocks, cfg.block_size, cfg.prefix_caching) if allocator_cls is None
                       else AllocatorBlocks(allocator_cls, cfg.num_blocks, cfg.block_size))
        order = {} if cfg.running_order == "decode-first" else {"running_order": cfg.running_order}
        self.scheduler = scheduler_cls(self.blocks, cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.chunked_prefill,
                                       cfg.admission, cfg.batching, cfg.max_len, **order)
        self.runner = Runner(model, cfg.num_blocks, cfg.block_size, gather, cfg.exact_attention, cfg.paged_attention)   # owns the pool
        self.clock, self.trace = clock or Clock(self.runner.device), Trace()
        self.pending: list[Sequence] = []      # submitted, not yet arrived (by arrival time)
        self.seqs: dict = {}                    # every request ever submitted, by id
        self.prefixes: list[Sequence] = []      # explicit shared prefixes (add_prefix), pinned
        self.split_steps = 0                    # steps whose one forward raised and were rerun per request

    # -- requests -------------------------------------------------------------------------------
    def submit(self, prompt, max_new_tokens: int, eos_token_id=None, rid=None, arrival: float = 0.0,
               sampling: SamplingParams | None = None) -> Sequence:
        """Queue a request; refused here (ValueError naming the fix) if it could never be served.
        ``sampling`` (:class:`SamplingParams`): greedy when None; with ``n > 1`` the other samples are
        ``seq.children`` (ids ``(rid, 1)``, ...), forked from it once its prompt is computed."""
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        seq = self._new_sequence(prompt, max_new_tokens, eos_token_id, rid, arrival)
        share = self._shared_prefix(seq)
        why = self.scheduler.never_fits(seq, len(share.prompt) if share is not None else 0)
        if why:
            raise ValueError(f"request {seq.rid!r} can never be served: {why}")
        if share is not None:
            self.blocks.fork(share, seq)        # its first write into a partly filled block copies it
            seq.cached_tokens += seq.num_computed
        self._sampled(seq, sampling)
        self.seqs[seq.rid] = seq
        self.pending.append(seq)
        self.pending.sort(key=lambda s: s.arrival)
        return seq

    def _new_sequence(self, prompt, max_new_tokens, eos_token_id, rid, arrival) -> Sequence:
        vocab, ctx = self.config.vocab_size, self.config.n_positions
        ids = tuple(check_prompt(prompt, vocab))     # a list, a tuple or a 1-D LongTensor of ids: never a dict
        m = _int("max_new_tokens", max_new_tokens, 1)
        check_context(len(ids) + m, ctx, f"prompt ({len(ids)} tokens) + max_new_tokens ({m})")
        eos = None if eos_token_id is None else _int("eos_token_id", eos_token_id, 0, vocab)
        used = set(self.seqs) | {p.rid for p in self.prefixes}
        if rid is None:                              # the first free number: never a clash the caller did not make
            rid = next(i for i in range(len(used) + 1) if i not in used)
        elif rid in used:
            raise ValueError(f"request id {rid!r} is already used: give each request its own id (or none: "
                             "the engine numbers it)")
        if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not math.isfinite(arrival) \
                or arrival < 0:
            raise ValueError(f"arrival must be a finite number of seconds >= 0, got {arrival!r}")
        return Sequence(rid, ids, m, eos, float(arrival))

    def _sampled(self, seq: Sequence, sampling: SamplingParams | None) -> None:
        """Give ``seq`` its sampling parameters and generator, and make its ``n - 1`` sibling samples."""
        if sampling is None:
            return
        seq.sampling, seq.generator = sampling, sampling.generator(0)
        for i in range(1, sampling.n):
            child = Sequence((seq.rid, i), seq.prompt, seq.max_new_tokens, seq.eos_token_id, seq.arrival,
                             sampling=sampling, generator=sampling.generator(i))
            if child.rid in self.seqs:
                raise ValueError(f"request id {child.rid!r} is already used: give each request its own id")
            seq.children.append(child)
        for child in seq.children:
            self.seqs[child.rid] = child

    def _fork_children(self, seq: Sequence) -> None:
        """Its prompt is computed: each sibling sample shares its blocks (copy-on-write) and recomputes
        only the prompt's last token, whose logits give that sample its own first token."""
        for child in seq.children:
            self.blocks.fork(seq, child)
            child.num_computed = len(seq.prompt) - 1
            child.status = Status.RUNNING
            self.scheduler.running.append(child)
            self.scheduler.reserved += self.scheduler.reservation(child)
        seq.children = []

    def add_prefix(self, tokens) -> Sequence:
        """Prefill ``tokens`` once and pin their blocks; a later prompt that starts with them (and is
        longer) forks them instead of computing them (explicit sharing, with copy-on-write)."""
        seq = self._new_sequence(tokens, 1, None, ("prefix", len(self.prefixes)), 0.0)
        pin = self.blocks.blocks_needed(seq, seq.num_tokens)
        largest = max((blocks_for(s.max_tokens, self.blocks.block_size) for s in self.seqs.values()
                       if s.status in (Status.WAITING, Status.RUNNING)), default=0)
        if pin >= self.scheduler.capacity or largest > self.scheduler.capacity - pin:
            raise ValueError(f"a {seq.num_tokens}-token prefix would pin {pin} of the {self.scheduler.capacity} blocks "
                             f"left to requests (a request already submitted needs up to {largest}): add blocks or "
                             "shorten it")
        self.runner.copy_blocks(self.blocks.allocate(seq, seq.num_tokens))
        try:
            if seq.to_compute:
                self.runner.run([(seq, seq.to_compute)])
        except Exception:
            self.blocks.free(seq)                 # a failed prefill leaves no trace
            seq.num_computed = 0
            raise
        seq.num_computed = seq.num_tokens
        self.blocks.commit(seq)
        self.scheduler.capacity -= len(seq.block_table)
        self.prefixes.append(seq)
        return seq

    def _shared_prefix(self, seq: Sequence) -> Sequence | None:
        best = None
        for p in self.prefixes:
            n = len(p.prompt)
            if n < len(seq.prompt) and seq.prompt[:n] == p.prompt and (best is None or n > len(best.prompt)):
                best = p
        return best

    # -- serving --------------------------------------------------------------------------------
    def step(self) -> bool:
        """One step: let in the requests that have arrived, schedule, run the model once over the
        step's tokens, append the new tokens, retire the finished. False when nothing is left."""
        start = self.clock.now()
        self._let_in(start)
        batch = self.scheduler.next_batch()
        if not batch.work:
            return self._idle()
        tokens = self._run(batch)                 # one forward; a failing request fails alone
        emitted = self._advance(batch, tokens)
        self.trace.step(start, self.clock.now(), batch, emitted, self.blocks, self.scheduler)
        return True

    def _let_in(self, now: float) -> None:
        while self.pending and self.pending[0].arrival <= now:
            self.scheduler.add(self.pending.pop(0))

    def _idle(self) -> bool:
        if self.scheduler.has_work:
            raise RuntimeError("requests are waiting but none could be scheduled: a bug in the scheduler")
        if not self.pending:
            return False
        self.clock.skip_to(self.pending[0].arrival)
        return True

    def _run(self, batch) -> list:
        self.runner.copy_blocks(batch.copies)
        try:
            return self.runner.run(batch.work)
        except Exception:  # noqa: BLE001 - find who failed: each alone (writes are idempotent)
            self.split_steps += 1
            out = []
            for seq, n in batch.work:
                try:
                    out += self.runner.run([(seq, n)])
                except Exception as e:  # noqa: BLE001
                    self.scheduler.retire(seq, Status.FAILED, f"{type(e).__name__}: {e}")
                    out.append(None)
            return out

    def _advance(self, batch, tokens) -> list[Sequence]:
        emitted = []
        for (seq, n), tok in zip(batch.work, tokens):
            if seq.status is Status.FAILED:
                continue
            seq.num_computed += n
            self.blocks.commit(seq)
            if tok is not None:
                seq.append(tok)
                emitted.append(seq)
                if seq.children:
                    self._fork_children(seq)
                if seq.done:
                    self.scheduler.retire(seq, Status.FINISHED)
        return emitted

    def run(self) -> list[Sequence]:
        """Step until every request has finished or failed; returns them in submission order.
        (The engine prints nothing: a caller that wants progress steps it with ``step()`` itself.)"""
        while self.step():
            pass
        return list(self.seqs.values())

    def close(self) -> None:
        """Release the pinned prefixes (the pool then holds only cached, unreferenced blocks)."""
        for p in self.prefixes:
            self.blocks.free(p)
        self.scheduler.capacity = self.blocks.num_blocks
        self.prefixes.clear()
