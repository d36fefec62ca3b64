"""kvlab: the small library behind the book "The KV cache, built and measured".

One module per idea: ``models`` (load every model the book uses), ``generate`` (reference
generators), ``timing`` (honest timing), ``checks`` (the lab graders), ``labs`` (solutions -> labs).
Later chapters add ``gpt2`` and ``cache`` (chapter 3), ``memory`` (the arithmetic), ``measure`` (what
tensors really hold) and ``calculator`` (chapter 4), ``quant`` (chapter 5), ``batching`` (chapter 6), ``static`` and
``staticbench`` (chapter 8), ``paged``, ``serving`` and ``servebench`` (chapter 9).
"""

__version__ = "0.1.0"
