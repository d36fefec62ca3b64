"""The lab graders. Each ``check_*`` runs a learner's function on fresh inputs against an
independent reference (transformers itself, or float64 arithmetic), raises ``AssertionError``
with a message that points at the mistake, and prints one line when it passes.

One submodule per lab; everything is re-exported here so a notebook writes
``from kvlab.course.checks import check_naive_generate``. Every check is exported through
:func:`._common.grader` with its line of ``_RULES``: it refuses the library's code run on the
learner's behalf (the exercise is to write it) and fails with the message and the learner's own
frames, not the grader's source.
"""

from ._common import grader

from .lab01 import check_naive_generate, check_sample_generate
from .lab02 import check_cached_generate, check_generate_until
from .lab03 import (check_attention, check_cache_bytes_prediction, check_generate_with_cache,
                    check_kv_cache)
from .lab04 import check_kv_cache_bytes, check_max_batch_size, check_max_seq_len
from .lab05 import check_quantize, check_quantize_int
from .lab06 import check_batched_generate, check_batched_generate_until, check_make_batch
from .lab07 import (check_bound_and_critical, check_decode_step_bytes, check_overhead_fit,
                    check_step_time_floor, check_sweep_plan)
from .lab08 import (check_hidden_nan, check_no_recompile, check_static_attention, check_static_cache,
                    check_static_generate)
from .lab09 import check_block_allocator, check_paged_gather, check_paged_generate
from .lab09_serving import check_prefix_cache, check_scheduler
from .lab10 import check_speculative_step, check_speedup_prediction
from .lab11 import check_gqa_conversion, check_sink_window_cache, check_window_prediction

__all__ = [
    "check_naive_generate",
    "check_sample_generate",
    "check_cached_generate",
    "check_generate_until",
    "check_kv_cache",
    "check_attention",
    "check_generate_with_cache",
    "check_cache_bytes_prediction",
    "check_kv_cache_bytes",
    "check_max_batch_size",
    "check_max_seq_len",
    "check_quantize",
    "check_quantize_int",
    "check_make_batch",
    "check_batched_generate",
    "check_batched_generate_until",
    "check_decode_step_bytes",
    "check_step_time_floor",
    "check_bound_and_critical",
    "check_sweep_plan",
    "check_overhead_fit",
    "check_static_cache",
    "check_static_attention",
    "check_no_recompile",
    "check_static_generate",
    "check_hidden_nan",
    "check_block_allocator",
    "check_paged_gather",
    "check_paged_generate",
    "check_scheduler",
    "check_prefix_cache",
    "check_speculative_step",
    "check_speedup_prediction",
    "check_sink_window_cache",
    "check_gqa_conversion",
    "check_window_prediction",
]

# Every lab enforces THE RULE by what runs (``_common.LibraryWatch``: see its docstring): per check,
# what of kvlab the exercise hands over (``given``: nothing, for most) and, where the exercise is to
# extend a library class, the methods the learner must write (``graded``). Every check has its line.
from kvlab import cache as _cache, gpt2 as _gpt2, roofline as _roofline, serving as _serving  # noqa: E402
from kvlab import static as _static  # noqa: E402

_RULES = {
    # lab 1-2: the transformers model is the grader's, every loop is the learner's
    "check_naive_generate": dict(given=()),
    "check_sample_generate": dict(given=()),
    "check_cached_generate": dict(given=()),
    "check_generate_until": dict(given=()),
    # lab 3: the grader plugs the learner's pieces into kvlab.gpt2.GPT2; their code runs nothing of kvlab
    "check_kv_cache": dict(given=()),
    "check_attention": dict(given=()),
    "check_generate_with_cache": dict(given=()),
    "check_cache_bytes_prediction": dict(given=()),
    # labs 4-6
    "check_kv_cache_bytes": dict(given=()),
    "check_max_batch_size": dict(given=()),
    "check_max_seq_len": dict(given=()),
    "check_quantize": dict(given=()),
    "check_quantize_int": dict(given=()),
    "check_make_batch": dict(given=()),
    "check_batched_generate": dict(given=()),
    "check_batched_generate_until": dict(given=()),
    # lab 7
    "check_decode_step_bytes": dict(given=(_roofline.decode_step_flops,)),
    "check_step_time_floor": dict(given=(_roofline.decode_step_flops,)),
    "check_bound_and_critical": dict(given=(_roofline.decode_step_flops,)),
    "check_sweep_plan": dict(given=(_roofline.decode_step_flops,)),
    "check_overhead_fit": dict(given=()),
    # lab 8
    "check_static_cache": dict(given=()),
    "check_static_attention": dict(given=()),
    "check_no_recompile": dict(given=()),
    "check_static_generate": dict(given=(_gpt2.GPT2, _static.StaticKVCache)),
    "check_hidden_nan": dict(given=()),
    # lab 9
    "check_block_allocator": dict(given=()),
    "check_paged_gather": dict(given=()),
    "check_paged_generate": dict(given=()),
    "check_scheduler": dict(given=(_serving.Sequence, _serving.Batch, _serving.BlockManager,
                                   # the two halves of the library's own schedule are the answer too
                                   (_serving.Scheduler, ("schedule", "_schedule_running", "_schedule_waiting"))),
                            graded={_serving.Scheduler: ("schedule",)}),
    "check_prefix_cache": dict(given=(_serving.Sequence, (_serving.BlockManager, ("lookup", "evict"))),
                               graded={_serving.BlockManager: ("lookup", "evict")}),
    # lab 10: the step is handed the target (the book's GPT2) and its cache (rewind, seq_len); the
    # draft is the grader's own
    "check_speculative_step": dict(given=(_gpt2.GPT2, _cache.PreallocatedCache)),
    "check_speedup_prediction": dict(given=()),
    # lab 11: the window cache takes kvlab.cache.Cache as its base (always allowed)
    "check_sink_window_cache": dict(given=()),
    "check_gqa_conversion": dict(given=()),
    "check_window_prediction": dict(given=()),
}
for _name in __all__:
    _check = globals()[_name]
    _check.__name__ = _name                   # the name a learner calls, in every message
    globals()[_name] = grader(_check, **_RULES[_name])
del _name, _check
