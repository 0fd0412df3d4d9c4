// A few rows of activations times one block of a packed weight, streaming the block from memory: the
// inner loop of the decode-sized linears (skinny_linear.cpp, on oneDNN's packed weights) and of the
// grouped experts' small tiles (moe_experts.cpp, on cpublas-packed blocks). Both layouts are blocks of
// NB = NBV * W output columns, each [Kp / V][NB][V] (V = 1: float32 rows of NB; V = 2: bfloat16 pairs
// (k, k + 1) side by side, the VNNI layout).
//
// Why not a GEMM micro-kernel: at a few rows the block is read once and used a few times, so the time is
// the memory stream. Reading the block as STREAMS sequential runs side by side, each prefetched 4 KiB
// ahead, kept more lines in flight than one run: 28-29 against 22-24 GB/s of float32 weight for the 125M
// model's decode step on the 2-vCPU AMX Xeon, where oneDNN's GEMM streams 20-21 (scripts/bench_skinny_linear.py).
// Rows go in tiles of MT (as many accumulators as the registers hold), so a block is read once from memory
// and again from L2 per further tile. Products and sums are float32; bf16 weights are widened exactly (a
// 16-bit shift), so a CPU without bf16 instructions runs it too.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "bf16.h"
#include "simd.h"

namespace ecoserve_simd {

constexpr int64_t PREFETCH_BYTES = 4096;  // how far ahead in each run of the block to prefetch
constexpr int STREAMS = 4;                // runs of a block read side by side (2: 26.5, 4: 28-29, 8: 27-29 GB/s)

// The most rows worth streaming: above, a GEMM micro-kernel's register blocking wins (measured on the
// 125M model's shapes at 1 and 2 threads against oneDNN: float32 1.12-1.16x at 8 rows and 0.95x at 16,
// bfloat16, whose pairs are widened, 1.07-1.09x at 4 and 0.85x at 8).
template <typename T>
constexpr int64_t stream_max_rows() { return std::is_same_v<T, float> ? 8 : 4; }

#ifdef ECOSERVE_SIMD
constexpr int STREAM_ACC_BUDGET = W == 16 ? 16 : 8;  // accumulators a tile may hold in registers

// Rows [0, mt) (mt <= MT) of xs against one block; see stream_block.
template <typename T, int V, int NBV, int MT>
void stream_tile(const T* wb, const float* xs, int64_t ldx, int64_t kp, int mt, float* acc_out, int64_t acc_stride) {
  vec acc[MT][NBV];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NBV; ++j) acc[m][j] = vset1(0.f);
  constexpr int64_t ROW = NBV * W * V;  // weight elements per step of V values of k
  constexpr int64_t ROW_BYTES = ROW * int64_t(sizeof(T));
  auto step = [&](int64_t r) {
    const T* wr = wb + r * ROW;
    const char* pf = reinterpret_cast<const char*>(wr) + PREFETCH_BYTES;
    for (int64_t line = 0; line < ROW_BYTES; line += 64) _mm_prefetch(pf + line, _MM_HINT_T0);
    const int64_t kk = r * V;
    if constexpr (V == 1) {
      for (int j = 0; j < NBV; ++j) {
        const vec w = vload(wr + j * W);
        for (int m = 0; m < MT; ++m)
          if (m < mt) acc[m][j] = vfma(w, vset1(xs[m * ldx + kk]), acc[m][j]);
      }
    } else {  // bfloat16 pairs: lane c holds (k, c) in its low half and (k + 1, c) in its high half
      for (int j = 0; j < NBV; ++j) {
#if defined(__AVX512F__)
        const __m512i raw = _mm512_loadu_si512(wr + j * W * 2);
        const vec lo = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
        const vec hi = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(int(0xFFFF0000u))));
#else
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + j * W * 2));
        const vec lo = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
        const vec hi = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(int(0xFFFF0000u))));
#endif
        for (int m = 0; m < MT; ++m)
          if (m < mt) {
            acc[m][j] = vfma(lo, vset1(xs[m * ldx + kk]), acc[m][j]);
            acc[m][j] = vfma(hi, vset1(xs[m * ldx + kk + 1]), acc[m][j]);
          }
      }
    }
  };
  const int64_t steps = kp / V, run = steps / STREAMS;
  for (int64_t i = 0; i < run; ++i)
    for (int s = 0; s < STREAMS; ++s) step(s * run + i);
  for (int64_t r = run * STREAMS; r < steps; ++r) step(r);
  for (int m = 0; m < MT; ++m)
    if (m < mt)
      for (int j = 0; j < NBV; ++j) vstore(acc_out + m * acc_stride + j * W, acc[m][j]);
}

// c[m][0:NB] = sum over k of xs[m][k] * B(k, column), for m < rows: xs float32 rows (stride ldx) of at
// least kp values, zero where the block's K is padding; c float32 rows (stride ldc).
template <typename T, int V, int NBV>
void stream_block(const T* wb, const float* xs, int64_t ldx, int64_t kp, int64_t rows, float* c, int64_t ldc) {
  constexpr int MT = std::max(1, STREAM_ACC_BUDGET / NBV);
  for (int64_t m0 = 0; m0 < rows; m0 += MT)
    stream_tile<T, V, NBV, MT>(wb, xs + m0 * ldx, ldx, kp, int(std::min<int64_t>(MT, rows - m0)), c + m0 * ldc, ldc);
}
#endif

}  // namespace ecoserve_simd
