"""Serving many requests on a paged cache (chapter 9), in small pieces as nano-vllm has them.

* :mod:`.sequence`: a request's tokens, block table, status (the one length it has);
* :mod:`.block_manager`: blocks, reference counts, copy-on-write, the automatic prefix cache;
* :mod:`.scheduler`: admission under a per-step token budget, chunked prefill, preemption;
* :mod:`.runner`: one scheduled step -> one call of the model's forward over a ragged batch;
* :mod:`.engine`: submit, step, run; :mod:`.clock`: time and the trace.

Measurements (workloads, arrivals, metrics, tables, plots) live in :mod:`kvlab.servingbench`.
"""

from .block_manager import AllocatorBlocks, BlockManager
from .clock import Clock, Trace
from .config import EngineConfig
from .engine import Engine
from .runner import RaggedStep, Runner, allocate_kv_cache, step_inputs
from .sampling import SamplingParams, sample
from .scheduler import Batch, Scheduler
from .sequence import Sequence, Status

__all__ = ["AllocatorBlocks", "Batch", "BlockManager", "Clock", "Engine", "EngineConfig", "RaggedStep", "Runner", "SamplingParams", "Scheduler",
           "Sequence", "Status", "Trace", "allocate_kv_cache",
           "sample", "step_inputs"]
