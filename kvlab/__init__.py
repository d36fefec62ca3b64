"""kvlab: the small library behind the book "The KV cache, built and measured".

One module per idea: ``models`` (load every model the book uses), ``generate`` (reference
generators), ``timing`` (honest timing), ``checks`` (the lab graders), ``labs`` (solutions -> labs).
Later chapters add ``cache``, ``memory``, ``quant`` and ``batching``.
"""

__version__ = "0.1.0"
