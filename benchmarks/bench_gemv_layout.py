# ruff: noqa: E501  (the C++ source below)
"""The decode step's weight stream: what one token's 121 bf16 linears of SmolLM2-135M (269 MB:
every projection of the 30 blocks and the lm_head, M = 1 row) cost with oneDNN's prepacked
product (what the engine runs) against two AVX512-BF16 GEMV prototypes compiled here with
load_inline (not in the library yet; float32 accumulation, checked against float64):

  * row-streaming: 4 weight rows at a time, dot products of 32 bf16 pairs (vdpbf16ps), one
    horizontal reduction per output;
  * tiled layout: the weight repacked once as [N / 64, K / 2, 64, 2] so that each 64-byte load
    holds 16 outputs x 2 inputs and a broadcast pair of x feeds it: 4 accumulators = 64
    outputs, no horizontal reduction, one pure stream of the weight.

Needs a CPU with AVX512-BF16 and a C++ compiler. Session 9 (a 2-vCPU AMD EPYC without AMX):
oneDNN ~11 GB/s, row-streaming ~9-15, tiled ~22 GB/s against ~29 GB/s of a plain sum over the
same bytes: the linears of a step 2x faster.

    PYTHONPATH=.:python OMP_NUM_THREADS=1 python benchmarks/bench_gemv_layout.py 1 [2,4,8,16]

(the optional second argument: row counts M to time the tiled layout at, row by row per tile)
"""

import statistics
import sys
import time

import torch
from torch.utils.cpp_extension import load_inline

src = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl")))
static void rows(const uint16_t* W, const uint16_t* x, float* y, int64_t n0, int64_t n1, int64_t K) {
  // K % 32 == 0 assumed (576, 1536): 4 output rows at a time, x re-read from L1
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const uint16_t *w0 = W + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    for (int64_t k = 0; k < K; k += 32) {
      __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w0 + k), xv);
      a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w1 + k), xv);
      a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(w2 + k), xv);
      a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(w3 + k), xv);
    }
    y[n] = _mm512_reduce_add_ps(a0); y[n + 1] = _mm512_reduce_add_ps(a1);
    y[n + 2] = _mm512_reduce_add_ps(a2); y[n + 3] = _mm512_reduce_add_ps(a3);
  }
  for (; n < n1; ++n) {
    __m512 a0 = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32)
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(W + n * K + k), (__m512bh)_mm512_loadu_si512(x + k));
    y[n] = _mm512_reduce_add_ps(a0);
  }
}
// W packed as [N / 64][K / 2][64][2] bf16: each 64-byte load holds 16 outputs x 2 k; x pairs
// broadcast; 4 accumulators = 64 outputs, no horizontal reduction
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl")))
static void tiles(const uint16_t* P, const uint16_t* x, float* y, int64_t t0, int64_t t1, int64_t K) {
  const uint32_t* xp = (const uint32_t*)x;
  for (int64_t t = t0; t < t1; ++t) {
    const uint16_t* p = P + t * 64 * K;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t k2 = 0; k2 < K / 2; ++k2) {
      __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[k2]);
      const uint16_t* q = p + k2 * 128;
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(q), xv);
      a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(q + 32), xv);
      a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(q + 64), xv);
      a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(q + 96), xv);
    }
    _mm512_storeu_ps(y + t * 64, a0); _mm512_storeu_ps(y + t * 64 + 16, a1);
    _mm512_storeu_ps(y + t * 64 + 32, a2); _mm512_storeu_ps(y + t * 64 + 48, a3);
  }
}
torch::Tensor pack(torch::Tensor W) {  // [N, K] -> [N/64, K/2, 64, 2] (N % 64 == 0)
  const int64_t N = W.size(0), K = W.size(1);
  return W.view({N / 64, 64, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}
torch::Tensor gemv_packed(torch::Tensor P, torch::Tensor x, int64_t N) {
  const int64_t K = x.size(0);
  auto y = torch::empty({N}, x.options().dtype(torch::kFloat));
  const uint16_t* p = (const uint16_t*)P.data_ptr(); const uint16_t* xp = (const uint16_t*)x.data_ptr();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N / 64, 4, [&](int64_t b, int64_t e) { tiles(p, xp, yp, b, e, K); });
  return y.to(torch::kBFloat16);
}
torch::Tensor linear_packed(torch::Tensor P, torch::Tensor X, int64_t N) {  // X [M, K] -> [M, N]
  const int64_t M = X.size(0), K = X.size(1);
  auto Y = torch::empty({M, N}, X.options().dtype(torch::kFloat));
  const uint16_t* p = (const uint16_t*)P.data_ptr(); const uint16_t* xp = (const uint16_t*)X.data_ptr();
  float* yp = Y.data_ptr<float>();
  // per tile, every row: the tile's weights are re-read from L2 for the rows after the first
  at::parallel_for(0, N / 64, 4, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
      for (int64_t m = 0; m < M; ++m) tiles(p, xp + m * K, yp + m * N, t, t + 1, K);
  });
  return Y.to(torch::kBFloat16);
}
torch::Tensor gemv(torch::Tensor W, torch::Tensor x) {
  const int64_t N = W.size(0), K = W.size(1);
  auto y = torch::empty({N}, x.options().dtype(torch::kFloat));
  const uint16_t* w = (const uint16_t*)W.data_ptr(); const uint16_t* xp = (const uint16_t*)x.data_ptr();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N / 4, 64, [&](int64_t b, int64_t e) { rows(w, xp, yp, b * 4, e * 4 == N / 4 * 4 && e == N / 4 ? N : e * 4, K); });
  return y.to(torch::kBFloat16);
}
"""


def median_s(f, n=9):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def check(y, x, weight):
    """y (bf16 [N]) against float64 x @ weight.T: within bf16 rounding of the largest output."""
    ref = torch.nn.functional.linear(x.double(), weight.double())
    err = (y.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < 2e-2, err


def main():
    from specdec import decode_path
    from specdec.loader import load_model
    from specdec.packed_linear import PackedLinear

    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    torch.set_num_threads(threads)
    mod = load_inline(
        "specdec_gemv_proto",
        cpp_sources=src,
        functions=["gemv", "pack", "gemv_packed", "linear_packed"],
        extra_cflags=["-O3", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
    )
    model, _ = load_model(None, dtype=torch.bfloat16)
    decode_path.configure(model)
    lins = [m for m in model.modules() if isinstance(m, PackedLinear)]
    nbytes = sum(m.weight.numel() * 2 for m in lins)
    xs = {m: torch.randn(m.in_features, dtype=torch.bfloat16) for m in lins}
    with torch.inference_mode():
        packs = {m: mod.pack(m.weight) for m in lins if m.out_features % 64 == 0}
        assert len(packs) == len(lins), "every output size is a multiple of 64 here"
        for m, packed in packs.items():
            check(mod.gemv(m.weight, xs[m]), xs[m], m.weight)
            check(mod.gemv_packed(packed, xs[m], m.out_features), xs[m], m.weight)
        variants = {
            "prepacked oneDNN": lambda: [m(xs[m][None]) for m in lins],
            "row-streaming GEMV": lambda: [mod.gemv(m.weight, xs[m]) for m in lins],
            "tiled-layout GEMV": lambda: [
                mod.gemv_packed(p, xs[m], m.out_features) for m, p in packs.items()
            ],
        }
        times = {name: [] for name in variants}
        for _ in range(3):  # interleaved rounds
            for name, f in variants.items():
                times[name].append(median_s(f))
        print(f"{len(lins)} linears, {nbytes / 1e6:.0f} MB, {threads} thread(s), M = 1:")
        for name, ts in times.items():
            t = statistics.median(ts)
            print(f"  {name:20s} {t * 1e3:6.1f} ms  {nbytes / t / 1e9:5.1f} GB/s")
        for rows in [int(r) for r in (sys.argv[2].split(",") if len(sys.argv) > 2 else [])]:
            xm = {m: torch.randn(rows, m.in_features, dtype=torch.bfloat16) for m in lins}
            for m, packed in packs.items():
                y = mod.linear_packed(packed, xm[m], m.out_features)
                for r in range(rows):
                    check(y[r], xm[m][r], m.weight)
            pair = {
                "prepacked oneDNN": lambda xm=xm: [m(xm[m]) for m in lins],
                "tiled-layout": lambda xm=xm: [
                    mod.linear_packed(p, xm[m], m.out_features) for m, p in packs.items()
                ],
            }
            t_rows = {name: [] for name in pair}
            for _ in range(3):
                for name, f in pair.items():
                    t_rows[name].append(median_s(f))
            print(
                f"  M = {rows}: "
                + ", ".join(f"{n} {statistics.median(t) * 1e3:.1f} ms" for n, t in t_rows.items())
            )
        big = torch.randn(nbytes // 2, dtype=torch.bfloat16)
        t = median_s(big.sum)
        print(f"  {'sum of as many bytes':20s} {t * 1e3:6.1f} ms  {nbytes / t / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
