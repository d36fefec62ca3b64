"""A CPU kernel for decode attention that reads every key where it lies in the paged pool (chapter 9).

A decode row's keys are scattered over the blocks its table names. The batched gather copies them out
into one buffer first, so a step reads the cache, writes it again and reads it a third time; inductor
compiles :func:`kvlab.ragged.paged_decode` into a loop that reads them in place, but its loop is
several times slower than the fused attention of a contiguous cache (chapter 9 measures both). This
is the loop written by hand, the CPU counterpart of vLLM's paged-attention kernel: one task per
(row, head), each key found through the table (``block = table[pos // block_size]``, slot
``pos % block_size``), scored, softmaxed and summed against its value, with no copy and no mask (every
key of a decode row is visible).

It is C++ built by ``torch.utils.cpp_extension.load_inline`` the first time it is asked for (about
half a minute; torch keeps the build on disk and later processes load it in a second). It handles
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
  at::parallel_for(0, b * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> score(length);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / H, head = task % H;
      const int64_t* table = T + row * width;
      const float* qv = Q + task * D;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t pos = 0; pos < length; ++pos) {            // scores, each key read in its block
        const float* kv = K + ((table[pos / bs] * H + head) * bs + pos % bs) * D;
        float dot = 0.f;
        #pragma omp simd reduction(+:dot)
        for (int64_t d = 0; d < D; ++d) dot += qv[d] * kv[d];
        score[pos] = dot * scale;
        top = score[pos] > top ? score[pos] : top;
      }
      float total = 0.f;
      for (int64_t pos = 0; pos < length; ++pos) { score[pos] = std::exp(score[pos] - top); total += score[pos]; }
      float* o = O + task * D;
      for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
      for (int64_t pos = 0; pos < length; ++pos) {            // the weighted sum of the values
        const float* vv = V + ((table[pos / bs] * H + head) * bs + pos % bs) * D;
        const float p = score[pos] / total;
        #pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] += p * vv[d];
      }
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
        _BUILT["module"] = load_inline("kvlab_paged_decode" + ("_avx2" if vector else ""), cpp_sources=_SOURCE,
                                       functions=["paged_decode"], extra_cflags=["-O3", "-fopenmp", *vector],
                                       extra_ldflags=["-fopenmp"], verbose=False)
    return _BUILT["module"]


def paged_decode(q, pool_k, pool_v, tables, length: int):
    """:func:`kvlab.ragged.paged_decode`'s contract (``q`` ``[b, H, 1, D]``, one layer's pools
    ``[blocks, H, block_size, D]``, ``tables`` ``[b, width]``, ``length`` keys per row, every one
    visible): ``[b, H, 1, D]``, read in place. None if the kernel could not be built here (warned
    once); the caller then takes another way."""
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
