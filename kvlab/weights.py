"""Smaller weights for the hand-built GPT-2 (chapter 8): bf16, and int8 weight-only quantization.

A batch-1 decode step is bound by reading the weights (chapter 7), so the floor moves only if the
step reads fewer bytes. Two ways, both applied to a copy of a :class:`kvlab.gpt2.GPT2`:

* ``"bf16"``: every tensor in bfloat16 (2 bytes a weight), the model computes and caches in it too;
* ``"int8"``: weight-only quantization as gpt-fast does it: every weight matrix (the four of each
  block and the tied token embedding / LM head) stored as int8 with one scale per output channel
  (``w ~ q x scale``, ``q`` in -127..127, ``scale = max |w| of the row / 127``); biases, layer norms
  and the position table stay in the compute dtype (fp32), and so do the activations and the cache.
  The int8 matrix is what the kernel reads: it is never expanded back to fp32 in memory.

    small = weights.convert(model, "int8")       # a new model; ``model`` is not changed
    weights.describe(small)                      # "int8 weights (per-channel scales), fp32 activations"

How the int8 product runs depends on the device (:func:`int8_matmul`): on a CPU, torch's
weight-only kernel ``aten._weight_int8pack_mm``, which reads the int8 matrix and multiplies in bf16
(its fp32 path is not vectorised: measured about 14x slower than fp32 ``F.linear`` on a small CPU,
so the activations enter it as bf16 and leave as fp32); elsewhere gpt-fast's form
``F.linear(x, q.to(x.dtype)) * scale``, whose conversion inductor fuses into the product's kernel
when the step is compiled (eagerly it would materialise the fp32 matrix: compile it).
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from .gpt2 import GPT2

FORMATS = ("fp32", "bf16", "int8")


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of ``w [out, in]``: ``(q int8 [out, in], scale [out])`` with ``w ~ q x
    scale``. A row of zeros gets scale 1 (any scale represents it exactly)."""
    w = w.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


@torch.library.custom_op("kvlab::int8_mm_cpu", mutates_args=())
def _int8_mm_cpu(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """torch's CPU weight-only int8 kernel, ``x [N, in]`` bf16. Wrapped as an opaque op so that
    ``torch.compile`` calls the kernel as it is (inductor's own lowering of it refuses a fused input)."""
    return torch.ops.aten._weight_int8pack_mm(x, q, scale)


@_int8_mm_cpu.register_fake
def _(x, q, scale):
    return x.new_empty(x.shape[0], q.shape[0])


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x @ (q x scale).T`` for ``x [..., in]``, ``q`` int8 ``[out, in]``, ``scale [out]``, in
    ``x``'s dtype, reading the int8 matrix itself (see the module's docstring for the two paths)."""
    if x.device.type == "cpu":
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
        y = _int8_mm_cpu(flat, q, scale.to(torch.bfloat16))
        return y.to(x.dtype).view(*x.shape[:-1], q.shape[0])
    return _int8_matmul_generic(x, q, scale)


def _int8_matmul_generic(x, q, scale):
    """gpt-fast's form: inductor fuses the int8 -> ``x.dtype`` conversion into the product's kernel."""
    return F.linear(x, q.to(x.dtype)) * scale.to(x.dtype)


class Int8Linear(nn.Module):
    """An ``nn.Linear`` with its weight stored as int8 and one scale per output channel."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        q, scale = quantize_rows(linear.weight)
        dtype = linear.weight.dtype
        # Parameters (frozen), not buffers, so that chapter 7's byte count sees them at their own size.
        self.weight = nn.Parameter(q.to(linear.weight.device), requires_grad=False)
        self.scale = nn.Parameter(scale.to(linear.weight.device, dtype), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x):
        y = int8_matmul(x, self.weight, self.scale)
        return y if self.bias is None else y + self.bias


class Int8TokenEmbedding(nn.Module):
    """The tied token embedding / LM head in int8 with one scale per token (row): the input looks up
    ``B`` rows and rescales them; the head multiplies by the whole int8 table, the step's largest
    matrix (``vocab x n_embd``)."""

    def __init__(self, emb: nn.Embedding):
        super().__init__()
        q, scale = quantize_rows(emb.weight)
        self.weight = nn.Parameter(q.to(emb.weight.device), requires_grad=False)
        self.scale = nn.Parameter(scale.to(emb.weight.device, emb.weight.dtype), requires_grad=False)

    def forward(self, ids):
        return self.weight[ids].to(self.scale.dtype) * self.scale[ids, None]

    def head(self, h):
        return int8_matmul(h, self.weight, self.scale)


def convert(model, fmt: str):
    """A copy of the hand-built GPT-2 ``model`` (fp32) with its weights in ``fmt`` (one of
    :data:`FORMATS`); ``model`` itself is not changed."""
    if not isinstance(model, GPT2):
        raise ValueError(f"convert takes the hand-built kvlab.gpt2.GPT2 (GPT2.from_hf(hf)), got "
                         f"{type(model).__name__}")
    if fmt not in FORMATS:
        raise ValueError(f"weight format must be one of {FORMATS}, got {fmt!r}")
    if model.dtype != torch.float32 or weight_format(model) != "fp32":
        raise ValueError(f"convert starts from an fp32 model (this one is {describe(model)}): convert the "
                         "original, not a converted copy")
    small = copy.deepcopy(model)
    if fmt == "bf16":
        small = small.to(torch.bfloat16)
    elif fmt == "int8":
        for block in small.h:
            for parent in (block.attn, block.mlp):
                for name in ("c_attn", "c_fc", "c_proj"):
                    if isinstance(getattr(parent, name, None), nn.Linear):
                        setattr(parent, name, Int8Linear(getattr(parent, name)))
        small.wte = Int8TokenEmbedding(small.wte)
    small.kvlab_weights = fmt
    return small.eval()


def weight_format(model) -> str:
    """``"fp32"``, ``"bf16"`` or ``"int8"``: how the model's weight matrices are stored."""
    if isinstance(getattr(model, "wte", None), Int8TokenEmbedding):
        return "int8"
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype).removeprefix("torch."))


def describe(model) -> str:
    """One line: the weights' format and the dtype the model computes (and caches) in."""
    fmt = weight_format(model)
    act = str(model.dtype).removeprefix("torch.").replace("float32", "fp32").replace("bfloat16", "bf16")
    scales = " (per-channel scales)" if fmt == "int8" else ""
    return f"{fmt} weights{scales}, {act} activations and cache"
