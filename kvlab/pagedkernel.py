"""A CPU kernel for decode attention that reads every key where it lies in the paged pool (chapter 9).

A decode row's keys are scattered over the blocks its table names. The batched gather copies them out
into one buffer first, so a step reads the cache, writes it again and reads it a third time; inductor
compiles :func:`kvlab.ragged.paged_decode` into a loop that reads them in place, but its loop is
several times slower than the fused attention of a contiguous cache (chapter 9 measures both). This
is the loop written by hand, the CPU counterpart of vLLM's paged-attention kernel: one task per
(row, head) that walks the row's blocks in table order (position ``p`` is block ``table[p // block_size]``,
slot ``p % block_size``; a head's keys of one block lie side by side, so each block is one stream),
scores every key, softmaxes, and sums the values the same way, with no copy and no mask (every key of
a decode row is visible).

It is C++ built by ``torch.utils.cpp_extension.load_inline`` the first time it is asked for (under
a minute; torch keeps the build on disk and later processes load it in a second). It handles
float32 pools on a CPU; :func:`usable` says False elsewhere (a GPU, half precision, no C++ compiler, a
failed build) and the caller falls back to inductor's loop or the gather.
"""

from __future__ import annotations

import os
import shutil
import sys
import warnings

import torch

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <algorithm>
#include <limits>
#include <vector>

// q [b, H, D]; pools [blocks, H, block_size, D]; tables [b, width] (int64): out [b, H, D], float32.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor pool_k, torch::Tensor pool_v,
                           torch::Tensor tables, int64_t length) {
  const int64_t b = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = pool_k.size(2), width = tables.size(1);
  auto out = torch::empty({b, H, D}, q.options());
  const float* Q = q.data_ptr<float>();
  const float* K = pool_k.data_ptr<float>();
  const float* V = pool_v.data_ptr<float>();
  const int64_t* T = tables.data_ptr<int64_t>();
  float* O = out.data_ptr<float>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int64_t nblocks = (length + bs - 1) / bs;
  at::parallel_for(0, b * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> score(nblocks * bs), acc(D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / H, head = task % H;
      const int64_t* table = T + row * width;
      const float* qv = Q + task * D;
      float top = -std::numeric_limits<float>::infinity();
      // Block by block: a head's keys of one block lie side by side (bs x D floats), so the loop streams
      // through them with no division per key (block and slot come from the loop, not from pos / bs).
      for (int64_t j = 0; j < nblocks; ++j) {
        const float* kb = K + (table[j] * H + head) * bs * D;
        const int64_t n = std::min(bs, length - j * bs);      // the last block may be partly filled
        float* s = score.data() + j * bs;
        for (int64_t t = 0; t < n; ++t) {
          const float* kv = kb + t * D;
          float dot = 0.f;
          #pragma omp simd reduction(+:dot)
          for (int64_t d = 0; d < D; ++d) dot += qv[d] * kv[d];
          s[t] = dot * scale;
          top = s[t] > top ? s[t] : top;
        }
      }
      float total = 0.f;                                      // softmax, shifted by the top score
      for (int64_t pos = 0; pos < length; ++pos) { score[pos] = std::exp(score[pos] - top); total += score[pos]; }
      float* a = acc.data();                                  // the weighted sum of the values, in L1
      for (int64_t d = 0; d < D; ++d) a[d] = 0.f;
      for (int64_t j = 0; j < nblocks; ++j) {
        const float* vb = V + (table[j] * H + head) * bs * D;
        const int64_t n = std::min(bs, length - j * bs);
        const float* s = score.data() + j * bs;
        for (int64_t t = 0; t < n; ++t) {
          const float* vv = vb + t * D;
          const float p = s[t];
          #pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += p * vv[d];
        }
      }
      const float inv = 1.0f / total;                         // normalised once, at the end
      float* o = O + task * D;
      for (int64_t d = 0; d < D; ++d) o[d] = a[d] * inv;
    }
  });
  return out;
}
"""

_BUILT = {"module": None, "failed": None, "compiler": None}


def has_compiler() -> bool:
    """Whether a C++ compiler (``$CXX``, else g++) is on the PATH: looked up once per process, not at
    every layer of every step (this kernel and inductor's CPU backend both need one)."""
    if _BUILT["compiler"] is None:
        _BUILT["compiler"] = shutil.which(os.environ.get("CXX", "g++")) is not None
    return _BUILT["compiler"]


def usable(q, pool_k) -> bool:
    """True where this kernel can run: float32 tensors on a CPU, a C++ compiler present, no failed
    build in this process."""
    return (_BUILT["failed"] is None and q.device.type == "cpu" and pool_k.device.type == "cpu"
            and q.dtype == pool_k.dtype == torch.float32 and has_compiler())


def _vector_flags() -> list[str]:
    """AVX2 and FMA where this CPU has both (the dot products then use 8-wide fused multiply-adds, as
    torch's own kernels do), else none. Named in the build's name too, so a build cached on disk by a
    machine with other instructions is never loaded here."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    return ["-mavx2", "-mfma"] if {"avx2", "fma"} <= set(flags) else []


def _module():
    if _BUILT["module"] is None:
        from torch.utils.cpp_extension import load_inline
        if shutil.which("ninja") is None:      # torch runs `ninja`: the one pip put beside this Python
            os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
        vector = _vector_flags()
        _BUILT["module"] = load_inline("kvlab_paged_decode_v2" + ("_avx2" if vector else ""), cpp_sources=_SOURCE,
                                       functions=["paged_decode"], extra_cflags=["-O3", "-fopenmp", *vector],
                                       extra_ldflags=["-fopenmp"], verbose=False)
    return _BUILT["module"]


def paged_decode(q, pool_k, pool_v, tables, length: int):
    """:func:`kvlab.ragged.paged_decode`'s contract (``q`` ``[b, H, 1, D]``, one layer's pools
    ``[blocks, H, block_size, D]``, ``tables`` ``[b, width]``, ``length`` keys per row, every one
    visible): ``[b, H, 1, D]``, read in place. None if the kernel could not be built here (warned
    once); the caller then takes another way."""
    tensors = (q, pool_k, pool_v)
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        raise ValueError("paged_decode (the C++ kernel) takes float32 tensors on the CPU; got "
                         + ", ".join(f"{n} {t.dtype} on {t.device}" for n, t in zip(("q", "pool_k", "pool_v"), tensors))
                         + ": elsewhere call kvlab.ragged.PagedDecode(), which picks a way that runs there")
    if pool_k.shape != pool_v.shape or q.shape[1] != pool_k.shape[1] or q.shape[3] != pool_k.shape[3]:
        raise ValueError(f"paged_decode: q {list(q.shape)} and the pools {list(pool_k.shape)}, {list(pool_v.shape)} "
                         "must agree: q [b, H, 1, D], pools [blocks, H, block_size, D]")
    if q.shape[2] != 1 or tables.shape[0] != q.shape[0] or length < 1 or length > tables.shape[1] * pool_k.shape[2]:
        raise ValueError(f"paged_decode: q {list(q.shape)} (one query per row), tables {list(tables.shape)}, "
                         f"length {length} (at most width x block_size = {tables.shape[1] * pool_k.shape[2]})")
    try:
        module = _module()
    except Exception as e:  # noqa: BLE001 - a compiler or linker failure: fall back, say so once
        _BUILT["failed"] = e
        warnings.warn(f"the C++ paged decode kernel could not be built ({type(e).__name__}); decode rows use "
                      "another way from now on", stacklevel=2)
        return None
    out = module.paged_decode(q[:, :, 0].contiguous(), pool_k.contiguous(), pool_v.contiguous(),
                              tables.to(torch.long).contiguous(), int(length))
    return out[:, :, None]
