"""A batch-1 decode step's matrix-vector products written as reductions, for ``torch.compile`` (chapter 8).

At batch 1 every weight matrix meets one vector. PyTorch hands ``F.linear`` to the BLAS library as a
matrix product with one row, and on a CPU that kernel can stream the matrix well below the memory's
bandwidth (chapter 8 measures it beside the read probe). Written as what it is, one dot product per
output row,

    y[n] = sum_k x[k] * W[n, k]          # (x.unsqueeze(-2) * W).sum(-1)

the product is a reduction over contiguous rows, which inductor compiles into one vectorised loop
that reads each weight once. Eagerly the same line would first build the whole ``[N, K]`` product in
memory, so it is only for a compiled step, and only at batch 1: with ``B`` rows the generated loop
reads the matrix ``B`` times, where a matrix product reads it once.

    fast = matvec.as_reductions(model)     # the same Parameters (no copy), products as reductions
"""

from __future__ import annotations

import copy

import torch.nn as nn
import torch.nn.functional as F

from .gpt2 import TokenEmbedding


def row_dot(x, weight):
    """``x @ weight.T`` as one reduction per output row (``x [..., K]``, ``weight [N, K]``)."""
    return (x.unsqueeze(-2) * weight).sum(-1)


class ReductionLinear(nn.Module):
    """An ``nn.Linear`` whose product is :func:`row_dot`; it shares the Linear's own Parameters."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x):
        y = row_dot(x, self.weight)
        return y if self.bias is None else y + self.bias


class ReductionHead(nn.Module):
    """The tied token embedding / LM head (:class:`kvlab.gpt2.TokenEmbedding`) with its head as
    :func:`row_dot`: a look-up at the input, the whole table at the output."""

    def __init__(self, emb: nn.Embedding):
        super().__init__()
        self.weight = emb.weight

    def forward(self, ids):
        return F.embedding(ids, self.weight)

    def head(self, h):
        return row_dot(h, self.weight)


def as_reductions(model):
    """A copy of the hand-built GPT-2 whose ``nn.Linear`` layers and LM head compute as reductions,
    sharing every Parameter with ``model`` (no weight is copied; int8 layers, whose CPU kernel
    already reads the int8 matrix once, are left as they are)."""
    twin = copy.deepcopy(model, memo={id(p): p for p in model.parameters()})
    for block in twin.h:
        for parent in (block.attn, block.mlp):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, ReductionLinear(child))
    if type(twin.wte) is TokenEmbedding:
        twin.wte = ReductionHead(twin.wte)
    return twin
