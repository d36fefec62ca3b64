"""kvlab: the small library behind the book "The KV cache, built and measured".

One module per job, on four floors; a test (``tests/test_layout.py``) keeps the arrows pointing down.

The domain: what the book builds. It computes and never prints, plots, times or grades, and imports
only the domain.

* the model and its caches: ``gpt2`` (the hand-built GPT-2 and its ONE forward pass), ``forwardcheck``
  (what that forward checks at its entry), ``weights`` (chapter 8's bf16 and int8 weights), ``matvec`` (batch 1's products as reductions), ``cache`` (the
  cache interface, its one mask rule and chapter 3's caches), ``pastlen`` (lab 3's cache contract in
  that interface), ``quant`` (the maths of quantization) and ``quant_cache`` (chapter 5's caches),
  ``static`` (chapter 8's static cache and compiled decode step), ``paged`` (chapter 9's allocator and
  gathers), ``paged_cache`` (the pool of blocks in the cache interface), ``ragged`` (attention over a
  ragged step, sequence by sequence), ``pagedkernel`` (the C++ loop that reads a decode row's keys
  where they lie in the pool), ``serving`` (sequence, block
  manager, scheduler, runner, engine, and the reference every request is checked against);
* speculative decoding (chapter 10): ``speculative`` (draft, verify in one forward, accept, rewind every
  cache; speculative sampling), ``drafts`` (prompt lookup, a small draft model, the target's own first
  layers sharing its cache) and ``specbatch`` (batched speculation, each row rewound on its own blocks);
* chapter 11's designs that shrink the cache: ``gqa`` (grouped-query heads converted from a trained
  model), ``window`` (a sink + window cache), ``latent`` (an MLA-style latent);
* the arithmetic: ``memory`` (chapter 4's formula), ``roofline`` (chapter 7's floor of a step),
  ``flops`` (positions and FLOPs of chapter 1), ``batching`` (chapter 6's left-padded batches),
  ``designs`` (chapter 11: the published designs' cache bytes);
* the inputs: ``configs`` (a model's shape and dtypes from any config), ``catalogue`` (the models the
  book prices), ``validate`` (every input check, one place per rule), ``paths`` (where the repository's
  files are), ``loading`` (models and devices), ``reference`` (transformers' own generators, the
  references), ``quality`` (held-out loss, the perplexity protocol).

Measurement: ``timing`` (honest timing), ``probes`` (the machine's bandwidth and arithmetic rate),
``harness`` (same tokens before timing, the decode-then-rewind timer), ``generators`` (the roster of
the book's generators, one name each), ``footprint`` (the bytes tensors really hold),
``compilecount`` (what torch counts of a compiled function), per chapter ``quantbench`` (5),
``rooflinebench`` (7), ``staticbench`` and ``weightbench`` (8), ``servingbench`` and ``servingcost`` (9), ``specbench`` (10), ``shrinkbench`` (11); the commands ``bench`` (the headline
ratios), ``report`` (a device's measurements as JSON: ``report_sections``, ``machine``) and ``cli``
(their argument checks).

Presentation: ``notebook`` (a notebook's setup in one call: threads, seed, device, model, banner),
``tables`` (tables that fit the page), ``plots`` (figures), ``draw`` and ``draw_engine``
(diagrams drawn from the objects the code builds), ``progress`` (progress bars only where someone
watches), ``verdicts`` (sentences computed from measurements), ``provenance`` (what produced a
number: banner and stamps), ``calculator`` (chapter 4's calculator), ``rooflineview``, ``weightview`` and
``staticview`` (chapters 7 and 8's tables, figures and sentences), ``specreport`` (chapter 10's),
``results`` (recorded runs read back).

The course, apart (``kvlab.course``; the book imports none of it): ``checks`` (the lab graders),
``labs`` (solutions -> labs, never over a learner's cells), ``grade`` (a learner's scorecard),
``release`` (an nbgrader / GitHub Classroom release), ``install`` (the library in a bare Jupyter).
"""

__version__ = "0.1.0"
