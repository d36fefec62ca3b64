"""The lab graders. Each ``check_*`` runs a learner's function on fresh inputs against an independent
reference (transformers itself, or float64 arithmetic), raises ``AssertionError`` with a message that
points at the mistake, and prints one line when it passes.

One submodule per lab; everything is re-exported here so a notebook writes
``from kvlab.checks import check_naive_generate``.
"""

from .lab01 import check_naive_generate

__all__ = ["check_naive_generate"]
