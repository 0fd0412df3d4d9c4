#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "bounds.h"
#include "simd.h"

// Paged decode attention on CPU: one query token per sequence, reading K/V straight from the
// paged cache (no gather copy). q: [B, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D];
// tables: [B, max_blocks] int64 block ids; lens: [B] int64 context lengths. q and the cache are each
// float32 or bfloat16 (the out rows take q's dtype); scores, softmax and the weighted V sum are float32,
// bf16 cache rows widened to float32 in registers as they are read, a bf16 q converted once per task.
// A task is a sequence (or, with few sequences, a run of its kv heads): scores of its query heads
// against each cached row, softmax, then the weighted sum of V, streaming each K and V row once.
// The task is memory-bound (a row is Hkv * D elements, a block sits anywhere in the cache), so the
// next block is prefetched while one is read (the K pass's last block requests V's first, the V
// pass's last the first K block of the thread's next task; 3-4% on a bf16 cache): 8.3 ->
// 1.5 ms for 64 sequences of 330 tokens, 12 heads over 4 kv heads of 64 (one core, float32 cache).
// Where the head dim is a multiple of the SIMD width W (AVX-512 or AVX2) the arithmetic per (token,
// query head) is kept small: a K row is widened once for its G = Hq / Hkv query heads, each leaving a
// partial vector, and the W partials of a query head's W tokens are summed by one transpose-and-add
// rather than one horizontal reduction each; V rows are summed per block and kv head with its query
// heads' accumulators in registers, stored once a block rather than once a token. The exponentials
// are vectorized; other head dims take plain loops. On a shared Intel Xeon core (best of 3 runs,
// other jobs running): with the K/V in L2 (2 sequences) 0.035-0.038 against 0.043-0.046 ms before
// these changes; with 64 sequences (22 MB bf16, 43 MB float32, out of the L2) the core's outstanding
// misses bound it (the prefetches wait for line fill buffers) and it gains 5-13%: bf16 cache 1.68-1.69
// against 1.86-1.94 ms, float32 2.59-2.61 against 2.73-2.79 ms; the offline bf16 benchmark's 3144 calls
// 5.4 against 5.7 s.
// A prefetch two blocks ahead, or to L2 a block further, measured no faster.

namespace {

using namespace ecoserve_simd;

// C: the cache's element type (float or c10::BFloat16).
template <typename C>
struct Task {
  const float* q;        // nh * G query rows of D floats
  const C* k;            // the cache, offset to this task's first kv head
  const C* v;
  const int64_t* table;  // this sequence's block ids
  int64_t L, G, D, bs, row;  // row: elements between consecutive tokens of a block
  int64_t nh;            // kv heads of this task (consecutive); its query rows are nh * G
  int64_t ls;            // floats between consecutive query rows' scores (at least L)
  float scale;
  const C* next_k;       // the first K block (offset to its first kv head) of the task that follows on
  int64_t next_n;        // this thread, and its rows; nullptr and 0 for the last
};

// The blocks of a sequence lie anywhere in the cache, so the hardware prefetcher cannot see the next
// one coming: while a block is read, each row of the next block is requested ahead, a cache line at a time.
// On x86 the instruction is written out: GCC's vectorizer deletes __builtin_prefetch from a loop it
// vectorizes, and the loops over a block's rows below are vectorized once fn is inlined into them.
inline void prefetch_line(const char* p) {
#if defined(__x86_64__) || defined(_M_X64)
  asm volatile("prefetcht0 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 3);
#endif
}
inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) prefetch_line(static_cast<const char*>(p) + b);
}

// Calls fn(row, t) for each cached row t < L of this task's sequence (row: its kv heads' D elements),
// block by block, requesting the next block's rows while this one is read.
template <typename C, typename Fn>
inline void for_each_row(const Task<C>& t, const C* cache, Fn&& fn) {
  for (int64_t t0 = 0; t0 < t.L; t0 += t.bs) {
    const int64_t n = std::min(t.bs, t.L - t0);
    const C* rows = cache + t.table[t0 / t.bs] * t.bs * t.row;
    const C* next = t0 + t.bs < t.L ? cache + t.table[t0 / t.bs + 1] * t.bs * t.row : nullptr;
    for (int64_t i = 0; i < n; ++i) {
      if (next) prefetch_row(next + i * t.row, t.nh * t.D * static_cast<int64_t>(sizeof(C)));
      fn(rows + i * t.row, t0 + i);
    }
  }
}

// scores: G rows of L, ls floats apart
void softmax_rows(float* scores, int64_t G, int64_t L, int64_t ls) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * ls;
    float m = -INFINITY;
    for (int64_t t = 0; t < L; ++t) m = std::max(m, sg[t]);
    float z = 0.f;
#pragma omp simd reduction(+:z)
    for (int64_t t = 0; t < L; ++t) {
      sg[t] = exp_nonpositive(sg[t] - m);
      z += sg[t];
    }
    const float inv = 1.f / z;
#pragma omp simd
    for (int64_t t = 0; t < L; ++t) sg[t] *= inv;
  }
}

// acc: the task's nh * G output rows, float32.
template <typename C>
void attend_scalar(const Task<C>& t, float* scores, float* acc) {
  for_each_row(t, t.k, [&](const C* kt, int64_t tok) {
    for (int64_t g = 0; g < t.nh * t.G; ++g) {
      const float* qg = t.q + g * t.D;
      const C* kh = kt + (g / t.G) * t.D;
      float s = 0.f;
#pragma omp simd reduction(+:s)
      for (int64_t d = 0; d < t.D; ++d) s += qg[d] * to_float(kh[d]);
      scores[g * t.ls + tok] = s * t.scale;
    }
  });
  softmax_rows(scores, t.nh * t.G, t.L, t.ls);
  std::fill(acc, acc + t.nh * t.G * t.D, 0.f);
  for_each_row(t, t.v, [&](const C* vt, int64_t tok) {
    for (int64_t g = 0; g < t.nh * t.G; ++g) {
      const float p = scores[g * t.ls + tok];
      const C* vh = vt + (g / t.G) * t.D;
      float* ag = acc + g * t.D;
#pragma omp simd
      for (int64_t d = 0; d < t.D; ++d) ag[d] += p * to_float(vh[d]);
    }
  });
}


#ifdef ECOSERVE_SIMD
// A block ahead of the one being read. Its rows are requested one at a time, spread over the work on
// the current block: requested all at once they would fill the core's line fill buffers and stall it.
template <typename C>
struct NextBlock {
  const C* rows;  // nullptr past the last block
  int64_t n, row, bytes;  // rows, elements between rows, bytes of a row (the task's kv heads)
  void prefetch(int64_t i) const {
    if (rows && i < n) prefetch_row(rows + i * row, bytes);
  }
};

// Blocks are requested this many blocks ahead of the one being read: two measured no faster (a float32
// block is 16 KB, so two ahead and the one being read fill the 48 KB L1).
constexpr int64_t kAhead = 1;

// Calls fn(rows, t0, n, ahead) for each block of this task's sequence in `cache`: its n rows from token t0
// on, a row every t.row elements, and the block kAhead further for fn to prefetch; past the last block
// that is `after`, the first block read next (V's after K's, the next task's K after V's).
template <typename C, typename Fn>
inline void for_each_block(const Task<C>& t, const C* cache, const NextBlock<C>& after, Fn&& fn) {
  const int64_t bytes = t.nh * t.D * static_cast<int64_t>(sizeof(C));
  const int64_t blocks = (t.L + t.bs - 1) / t.bs;
  const auto block = [&](int64_t b) -> NextBlock<C> {
    if (b >= blocks) return b == blocks ? after : NextBlock<C>{nullptr, 0, t.row, bytes};
    return {cache + t.table[b] * t.bs * t.row, std::min(t.bs, t.L - b * t.bs), t.row, bytes};
  };
  for (int64_t b = 0; b < blocks; ++b) fn(block(b).rows, b * t.bs, block(b).n, block(b + kAhead));
}

// Vector registers of this build (AVX-512: 32, AVX2: 16).
constexpr int kRegisters = W == 16 ? 32 : 16;

// part[(g * W + i) * W ...] = the lane-wise products of query row g with row i's head (NV vectors summed into one),
// for m <= W rows of k, a row every `row` elements, each row read once for all its kv heads' query rows
// (in cache order, as the prefetch of the next block expects). Rows from m on leave zeros.
template <typename C, int NV>
__attribute__((always_inline)) inline void partial_scores(const Task<C>& t, const C* k, int64_t m, float* part,
                                                          const NextBlock<C>& next, int64_t i0) {
  for (int64_t i = 0; i < W; ++i) {
    if (i >= m) {
      for (int64_t g = 0; g < t.nh * t.G; ++g) vstore(part + (g * W + i) * W, vset1(0.f));
      continue;
    }
    next.prefetch(i0 + i);
    const C* kr = k + i * t.row;
    for (int64_t h = 0; h < t.nh; ++h) {
      vec kv[NV];
      for (int j = 0; j < NV; ++j) kv[j] = vload(kr + h * t.D + j * W);
      for (int64_t g = h * t.G; g < (h + 1) * t.G; ++g) {
        const float* qg = t.q + g * t.D;
        vec s = vmul(vload(qg), kv[0]);
        for (int j = 1; j < NV; ++j) s = vfma(vload(qg + j * W), kv[j], s);
        vstore(part + (g * W + i) * W, s);
      }
    }
  }
}

// Query rows that share a V row in registers: GN rows' NV accumulators and the V row's NV vectors must
// fit in the register file (AVX-512, D = 64: up to 4 rows; AVX2, D = 64: one).
template <int NV>
constexpr int group_rows() {
  const int fit = (kRegisters - 1 - NV) / NV;
  return fit < 1 ? 1 : (fit > 4 ? 4 : fit);
}

// acc[r] += sum_i p[r * ls + i] * v row i, for GN query rows r over n rows of v: the accumulators stay in
// registers across the rows, each V row is widened once for all GN query rows. ahead (or nullptr): the
// same head's rows in the next block, requested a row at a time.
template <typename C, int NV, int GN>
__attribute__((always_inline)) inline void accumulate_rows(const float* p, int64_t ls, const C* v, int64_t row,
                                                           int64_t n, float* acc, const C* ahead) {
  vec a[GN][NV];
  for (int r = 0; r < GN; ++r)
    for (int j = 0; j < NV; ++j) a[r][j] = vload(acc + r * NV * W + j * W);
  for (int64_t i = 0; i < n; ++i) {
    if (ahead) prefetch_row(ahead + i * row, NV * W * static_cast<int64_t>(sizeof(C)));
    vec vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = vload(v + i * row + j * W);
    for (int r = 0; r < GN; ++r) {
      const vec pr = vset1(p[r * ls + i]);
      for (int j = 0; j < NV; ++j) a[r][j] = vfma(pr, vv[j], a[r][j]);
    }
  }
  for (int r = 0; r < GN; ++r)
    for (int j = 0; j < NV; ++j) vstore(acc + r * NV * W + j * W, a[r][j]);
}

// accumulate_rows for a run-time count gn <= group_rows<NV>() of query rows
template <typename C, int NV, int GN = group_rows<NV>()>
inline void accumulate_group(int gn, const float* p, int64_t ls, const C* v, int64_t row, int64_t n, float* acc,
                             const C* ahead) {
  if constexpr (GN > 1) {
    if (gn < GN) return accumulate_group<C, NV, GN - 1>(gn, p, ls, v, row, n, acc, ahead);
  }
  accumulate_rows<C, NV, GN>(p, ls, v, row, n, acc, ahead);
}

// NV = D / W vectors per row, a compile-time count so that rows and accumulators stay in registers.
// Scores: W tokens of a block at a time per query row, reduced together (scores rows are t.ls >= L + W
// floats apart, so a chunk's whole vector may be stored). V: per block, each kv head's query rows in
// groups whose accumulators stay in registers while the block's V rows are read.
template <typename C, int NV>
void attend_simd(const Task<C>& t, float* scores, float* acc) {
  const vec scale = vset1(t.scale);
  const int64_t rows_q = t.nh * t.G;
  std::vector<float> part(rows_q * W * W);  // W rows' partial vectors per query row, reduced together
  const int64_t bytes = t.nh * t.D * static_cast<int64_t>(sizeof(C));
  const NextBlock<C> first_v{t.v + t.table[0] * t.bs * t.row, std::min(t.bs, t.L), t.row, bytes};
  const NextBlock<C> next_task{t.next_k, t.next_n, t.row, bytes};
  for_each_block(t, t.k, first_v, [&](const C* rows, int64_t t0, int64_t n, const NextBlock<C>& next) {
    for (int64_t i0 = 0; i0 < n; i0 += W) {
      partial_scores<C, NV>(t, rows + i0 * t.row, std::min<int64_t>(W, n - i0), part.data(), next, i0);
      for (int64_t g = 0; g < rows_q; ++g) {
        vec r[W];
        for (int i = 0; i < W; ++i) r[i] = vload(part.data() + (g * W + i) * W);
        vstore(scores + g * t.ls + t0 + i0, vmul(vsum_rows(r), scale));
      }
    }
  });
  softmax_rows(scores, t.nh * t.G, t.L, t.ls);
  std::fill(acc, acc + t.nh * t.G * t.D, 0.f);
  constexpr int GR = group_rows<NV>();
  for_each_block(t, t.v, next_task, [&](const C* rows, int64_t t0, int64_t n, const NextBlock<C>& next) {
    for (int64_t h = 0; h < t.nh; ++h) {
      for (int64_t g = h * t.G; g < (h + 1) * t.G; g += GR) {
        const int gn = static_cast<int>(std::min<int64_t>(GR, (h + 1) * t.G - g));
        // the next block's rows of this head, requested with the head's first group
        const C* ahead = next.rows && g == h * t.G ? next.rows + h * t.D : nullptr;
        accumulate_group<C, NV>(gn, scores + g * t.ls + t0, t.ls, rows + h * t.D, t.row, n, acc + g * t.D, ahead);
      }
    }
  });
}
#endif

template <typename C>
using AttendFn = void (*)(const Task<C>&, float*, float*);

template <typename C>
AttendFn<C> pick(int64_t D) {
#ifdef ECOSERVE_SIMD
  switch (D % W == 0 ? D / W : 0) {
    case 2: return attend_simd<C, 2>;
    case 4: return attend_simd<C, 4>;
    case 6: return attend_simd<C, 6>;
    case 8: return attend_simd<C, 8>;
    case 16: return attend_simd<C, 16>;
    case 32: return attend_simd<C, 32>;
    default: break;
  }
#endif
  return attend_scalar<C>;
}

// Q: q's and out's element type, C: the cache's.
template <typename Q, typename C>
void run(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache, const int64_t* tp,
         const int64_t* lp, int64_t nblk, float scale, torch::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2), G = Hq / Hkv;
  const Q* qp = q.data_ptr<Q>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  Q* op = out.data_ptr<Q>();
  const AttendFn<C> attend = pick<C>(D);
#ifdef ECOSERVE_SIMD
  const int64_t score_pad = W;
#else
  const int64_t score_pad = 0;
#endif
  // A task takes all kv heads of a sequence, so it streams each cached row (Hkv * D elements) once;
  // with fewer sequences than about two per thread the heads are split between tasks instead.
  const int64_t splits = std::min<int64_t>(Hkv, std::max<int64_t>(1, (2 * at::get_num_threads() + B - 1) / B));
  const int64_t per_task = (Hkv + splits - 1) / splits;
  const int64_t tasks = B * splits;
  // Tasks cost their context length, which varies: each thread gets a run of tasks of about equal
  // total length (parallel_for alone would split the task count evenly, so one thread waits).
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks));
  std::vector<int64_t> bounds(threads + 1, tasks);
  bounds[0] = 0;
  if (threads > 1) {
    int64_t total = 0;
    for (int64_t b = 0; b < B; ++b) total += splits * lp[b];
    int64_t seen = 0, next = 1;
    for (int64_t idx = 0; idx < tasks && next < threads; ++idx) {
      seen += lp[idx / splits];
      if (seen * threads >= total * next) bounds[next++] = idx + 1;
    }
  }
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    // acc: the float32 results; q32: a bf16 task's queries in float32 (a float32 q is read in place)
    std::vector<float> scores, acc(Hq * D), q32(std::is_same_v<Q, float> ? 0 : Hq * D);
    for (int64_t idx = bounds[first]; idx < bounds[last]; ++idx) {
      const int64_t b = idx / splits, h0 = (idx % splits) * per_task, nh = std::min(per_task, Hkv - h0);
      if (nh <= 0) continue;
      const int64_t first_row = (b * Hq + h0 * G) * D, n = nh * G * D;
      const float* qf;
      if constexpr (std::is_same_v<Q, float>) {
        qf = qp + first_row;
      } else {
        convert_row(q32.data(), qp + first_row, n);
        qf = q32.data();
      }
      // the SIMD scores store whole vectors of W tokens: a row's last may reach W - 1 floats past L
      const int64_t ls = lp[b] + score_pad;
      // the next task's first K block, for this one to request while its last V block is read
      const C* next_k = nullptr;
      int64_t next_n = 0;
      const int64_t nb = (idx + 1) / splits, nh0 = ((idx + 1) % splits) * per_task;
      if (idx + 1 < bounds[last] && nh0 < Hkv) {
        next_k = kp + tp[nb * nblk] * bs * Hkv * D + nh0 * D;
        next_n = std::min(bs, lp[nb]);
      }
      const Task<C> task{qf,    kp + h0 * D, vp + h0 * D, tp + b * nblk, lp[b],  G,     D,
                         bs,    Hkv * D,     nh,          ls,            scale, next_k, next_n};
      scores.resize(nh * G * ls);
      attend(task, scores.data(), acc.data());
      convert_row(op + first_row, acc.data(), n);
    }
  });
}

}  // namespace

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                           torch::Tensor lens, double scale) {
  const auto is_supported = [](const torch::Tensor& x) {
    return x.dtype() == torch::kFloat32 || x.dtype() == torch::kBFloat16;
  };
  TORCH_CHECK(is_supported(q) && is_supported(k_cache) && k_cache.dtype() == v_cache.dtype(),
              "paged_decode: q and the cache must each be float32 or bfloat16 (K and V alike), got ", q.dtype(), ", ",
              k_cache.dtype(), " and ", v_cache.dtype());
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && tables.is_contiguous() &&
              lens.is_contiguous(), "paged_decode: contiguous tensors only");
  TORCH_CHECK(tables.dtype() == torch::kInt64 && lens.dtype() == torch::kInt64, "paged_decode: int64 tables/lens");
  TORCH_CHECK(q.dim() == 3, "paged_decode: q must be [B, Hq, D], got ", q.sizes());
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  ecoserve_bounds::check_cache("paged_decode", k_cache, v_cache, Hq, D);
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && lens.dim() == 1 && lens.size(0) == B,
              "paged_decode: tables must be [B, max_blocks] and lens [B] for B = ", B, ", got ", tables.sizes(),
              " and ", lens.sizes());
  const int64_t bs = k_cache.size(1), nblk = tables.size(1);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    ecoserve_bounds::check_table_row("paged_decode", tp + b * nblk, nblk, b, lp[b], bs, k_cache.size(0));
  auto out = torch::empty_like(q);
  const float s = static_cast<float>(scale);
  const bool q_bf16 = q.dtype() == torch::kBFloat16, cache_bf16 = k_cache.dtype() == torch::kBFloat16;
  using bf16 = c10::BFloat16;
  if (!q_bf16 && !cache_bf16) run<float, float>(q, k_cache, v_cache, tp, lp, nblk, s, out);
  else if (!q_bf16) run<float, bf16>(q, k_cache, v_cache, tp, lp, nblk, s, out);
  else if (!cache_bf16) run<bf16, float>(q, k_cache, v_cache, tp, lp, nblk, s, out);
  else run<bf16, bf16>(q, k_cache, v_cache, tp, lp, nblk, s, out);
  return out;
}

// Floats per vector register of this build (16 AVX-512, 8 AVX2, 1 without either): which paths it runs.
int64_t simd_width() {
#ifdef ECOSERVE_SIMD
  return W;
#else
  return 1;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode);
  m.def("simd_width", &simd_width);
}
