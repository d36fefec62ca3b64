"""A notebook's setup in one call: every chapter and lab opens with ``setup = notebook.start()``.

The same five steps open every notebook of the book, in this order: fix torch's thread count (and say
it), seed torch, pick the device, load the model, show what produced the numbers (the banner).
:func:`start` does them and returns what a chapter reads afterwards; chapter 3's hand-built GPT-2 is
built from the loaded weights on first use (``setup.ours``), so a chapter that never uses it pays
nothing for it.

Presentation: this module sits on top of the others (loading, the model, timing, provenance) and no
library module imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from . import loading, provenance, timing
from .gpt2 import GPT2


@dataclass
class Setup:
    """What a notebook needs from its setup: the device, the transformers model and its tokenizer,
    the banner's text and torch's CPU thread count."""

    device: torch.device
    hf: torch.nn.Module
    tok: object
    banner: str
    threads: int

    @cached_property
    def ours(self) -> GPT2:
        """Chapter 3's hand-built GPT-2 with ``hf``'s weights (same device and dtype), built once, on
        first use. Building it draws from torch's random generator (its layers are initialised before
        the weights are copied in), as ``GPT2.from_hf`` at that point of the notebook would."""
        return GPT2.from_hf(self.hf)


def start(model: str | None = None, seed: int | None = 0, threads: int | None = None, device=None) -> Setup:
    """Set a notebook up and return its :class:`Setup`.

    ``threads``: torch's CPU threads (default: ``KVLAB_THREADS``, else ``OMP_NUM_THREADS``, else every
    core up to 8; see :func:`kvlab.timing.set_threads`). ``seed``: torch's seed (None: leave it).
    ``model``: a name :func:`kvlab.loading.load` knows (chapters 7 and 8 ask for ``"kvlab-tiny"``); by
    default the book's model (:func:`kvlab.loading.load_default`: ``KVLAB_MODEL``, else real ``gpt2``
    when it can be loaded here, else the bundled ``kvlab-tiny``; the banner says why). The device is
    :func:`kvlab.loading.pick_device`'s (``KVLAB_DEVICE`` overrides) unless ``device`` names one. Prints the thread count, shows
    the banner (device, model, versions).
    """
    n = timing.set_threads(threads)
    if seed is not None:
        torch.manual_seed(seed)
    device = loading.pick_device() if device is None else loading.check_device(device)
    hf, tok = loading.load_default(device=device) if model is None else loading.load(model, device=device)
    return Setup(device, hf, tok, provenance.banner(hf, device), n)
