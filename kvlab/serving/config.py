"""The engine's settings, checked once, when the engine is built (chapter 9)."""

from __future__ import annotations

from dataclasses import dataclass

from ..validate import check_int

ADMISSIONS = ("on-demand", "reserve", "contiguous")
BATCHINGS = ("continuous", "static")
ORDERS = ("decode-first", "arrival")


@dataclass(frozen=True)
class EngineConfig:
    """What every piece of the engine reads: the pool (``num_blocks`` of ``block_size`` slots), the
    per-step budgets (vLLM's ``max_num_batched_tokens`` and ``max_num_seqs``) and the policies (see
    :class:`~kvlab.serving.scheduler.Scheduler`). ``max_len`` is the contiguous reservation per
    sequence (``admission="contiguous"`` only). ``exact_attention``: a prompt chunk scores its visible
    pairs only (:func:`kvlab.ragged.causal_chunk`), not its whole rectangle in one masked call.
    ``paged_attention``: True, decode rows read their keys in place from the blocks (on a CPU,
    :mod:`kvlab.pagedkernel`'s C++ loop; elsewhere the compiled :func:`kvlab.ragged.paged_decode`,
    where torch.compile can run); False copies them out of the blocks first (the gather) and runs the
    model's attention on the copy; None (the default) reads them in place where the C++ loop runs
    (a CPU, float32 pools, a C++ compiler) and gathers them everywhere else."""

    num_blocks: int
    block_size: int = 16
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 16
    max_len: int | None = None
    chunked_prefill: bool = True
    prefix_caching: bool = True
    admission: str = "on-demand"
    batching: str = "continuous"
    running_order: str = "decode-first"
    exact_attention: bool = False
    paged_attention: bool | None = None

    def __post_init__(self):
        check_int(self.num_blocks, "num_blocks (blocks in the pool)", 1)
        check_int(self.block_size, "block_size (token slots per block)", 1)
        check_int(self.max_num_batched_tokens, "max_num_batched_tokens (tokens per step)", 1)
        check_int(self.max_num_seqs, "max_num_seqs (sequences per step)", 1)
        for name, value, allowed in (("admission", self.admission, ADMISSIONS), ("batching", self.batching, BATCHINGS),
                                     ("running_order", self.running_order, ORDERS)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        if self.admission == "contiguous" or self.max_len is not None:
            check_int(self.max_len, "max_len (the contiguous reservation per sequence)", 1)
        for name in ("chunked_prefill", "prefix_caching", "exact_attention"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.paged_attention is not None and not isinstance(self.paged_attention, bool):
            raise ValueError(f"paged_attention must be True, False or None (in place where the C++ kernel runs), "
                             f"got {self.paged_attention!r}")
