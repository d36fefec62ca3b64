"""kvlab: the small library behind the book "The KV cache, built and measured".

One module per idea. The domain (what the book builds; these compute and never print, plot or tabulate):

* ``models`` (load every model the book uses), ``generate`` (reference generators, chapters 1-2);
* ``gpt2`` (the hand-built GPT-2 and its ONE forward pass) and ``cache`` (the cache interface, its one
  mask rule and chapter 3's caches): the model never changes, only the cache does;
* ``memory`` (the arithmetic of chapter 4), ``quant`` (quantized caches, chapter 5), ``batching``
  (left-padded batches, chapter 6), ``roofline`` (the floor of a decode step, chapter 7), ``static``
  (the static cache and a compiled decode step, chapter 8), ``paged`` and ``serving`` (paged memory and
  the serving engine: sequence, block manager, scheduler, runner, engine; chapter 9); chapter 11's
  designs that shrink the cache: ``gqa`` (grouped-query heads converted from a trained model),
  ``window`` (a sink + window cache), ``latent`` (an MLA-style latent), ``designs`` (their bytes).

The measurement layer (checks, timings, tables, plots and computed sentences):

* ``harness`` (one same-tokens check, one rewind-and-time step, one table printer), ``timing`` (honest
  timing), ``progress`` (progress bars only where someone watches), ``probes`` (the machine's bandwidth
  and arithmetic rate, measured), ``measure`` (what tensors really hold), ``calculator`` (chapter 4's
  calculator), ``verdicts`` (sentences computed from measurements), ``tables`` (tables that fit the
  page), ``plots`` (figures with provenance), ``draw`` (diagrams drawn from the objects the code builds),
  ``compilecount`` (what torch counts of a compiled function);
* per chapter: ``floorbench`` (7), ``staticbench`` (8), ``servingbench`` (9), ``shrinkbench`` (11); across the book: ``bench``
  (the headline ratios), ``report`` (a device's measurements as JSON) and ``results`` (reading them back).

Tooling: ``checks`` (the lab graders), ``labs`` (solutions -> labs, never over a learner's cells),
``grade`` (``make grade``: a learner's scorecard), ``release`` (an nbgrader / GitHub Classroom release),
``cli`` (the commands' argument checks), ``install`` (the library in a bare Jupyter).
"""

__version__ = "0.1.0"
