#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "bounds.h"
#include "simd.h"

// Prompt-chunk (prefill) attention on CPU, reading K/V from the paged cache, flash-attention style.
// q, out: [T, Hq, D] (the step's flattened tokens; only the spans' rows of out are written; q's heads
// contiguous, its tokens at any stride);
// k_cache, v_cache: [num_blocks, block_size, Hkv, D]; tables: [P, max_blocks] int64 block ids;
// spans: [P, 3] int64 (q_start, q_len, ctx_len). Query i of a span sits at position
// ctx_len - q_len + i and attends to keys 0..that position: causal, offset by the cached prefix.
// q and out are float32 or bfloat16 (alike), the cache either: all arithmetic is float32, bf16
// queries, keys and values widened as they are copied into a task's tiles, outputs rounded on store.
//
// The lanes of a vector register hold W query rows (tokens of one span times the G query heads that
// share one kv head), so each K or V element is broadcast to every lane, and the online softmax's
// max, sum and rescaling run across keys lane by lane, with no horizontal reductions: per key a
// task does 2 * D vector multiply-adds for its W rows. 115-156 GFLOP/s on one core here (head dim
// 64), where torch's CPU flash SDPA reached 37-73: its GEMM is MKL's, which does not use AVX-512 on
// this AMD CPU. In bfloat16 on an Intel CPU with AMX, torch's SDPA runs its products on AMX and is
// faster (the engine sends such prompt chunks there); AVX512-BF16 pair products (_mm512_dpbf16_ps)
// in place of the float32 multiply-adds measured slower on that CPU (10.5 against 8.2 ms, 8 prompts of
// 256 tokens, P and V packed into bf16 pairs per tile), so bf16 rows are widened to float32 instead.

namespace {

using namespace ecoserve_simd;

#ifdef ECOSERVE_SIMD
struct Span {
  int64_t q_start, q_len, ctx_len;
  const int64_t* table;
};

// One task: W query rows (row r of a span and kv head: token r / G, query head h * G + r % G).
struct Task {
  int64_t span, head, first_row;
};

struct Shape {
  int64_t Hq, Hkv, G, bs;
  int64_t q_row;  // floats between consecutive tokens of q (q may be a view into the fused qkv output)
  float scale;
};

// Kv head h's row of key j in the paged cache.
template <typename C>
inline const C* row_at(const C* cache, const Span& s, const Shape& sh, int64_t h, int64_t j, int64_t D) {
  return cache + ((s.table[j / sh.bs] * sh.bs + j % sh.bs) * sh.Hkv + h) * D;
}

// Copies W key rows of kv head h, starting at key j0, into a contiguous float32 tile (the score loop
// reads all W at each dim); rows past the last key repeat it (their scores are masked out).
template <int DT, typename C>
inline void load_tile(float* tile, const C* cache, const Span& s, const Shape& sh, int64_t h, int64_t j0,
                      int64_t nk, int64_t d_rt) {
  const int64_t D = DT ? DT : d_rt;
  for (int c = 0; c < W; ++c) {
    const C* row = row_at(cache, s, sh, h, j0 + std::min<int64_t>(c, nk - 1), D);
    if constexpr (std::is_same_v<C, float>) {
      std::memcpy(tile + c * D, row, D * sizeof(float));
    } else {
      int64_t d = 0;
      for (; d + W <= D; d += W) vstore(tile + c * D + d, vload(row + d));
      for (; d < D; ++d) tile[c * D + d] = to_float(row[d]);
    }
  }
}

// sc[c] = the W rows' scores against key c of the tile: D broadcast multiply-adds per key, the W
// accumulators in registers (restrict: the tiles are not the accumulators).
template <int DT>
inline void scores(vec* __restrict sc, const float* __restrict qt, const float* __restrict kt, int64_t d_rt) {
  const int64_t D = DT ? DT : d_rt;
  vec acc[W];
  for (int c = 0; c < W; ++c) acc[c] = vset1(0.f);
  for (int64_t d = 0; d < D; ++d) {
    const vec qd = vload(qt + d * W);
    for (int c = 0; c < W; ++c) acc[c] = vfma(qd, vset1(kt[c * D + d]), acc[c]);
  }
  for (int c = 0; c < W; ++c) sc[c] = acc[c];
}

// DT: the head dim when known at compile time (the loops unroll), 0 for any other (d_rt). Q: q's and
// out's element type, C: the cache's. vt: a float32 tile of V rows, used where the cache is bf16 (a
// float32 V is read in place).
template <int DT, typename Q, typename C>
void run_task(const Task& t, const std::vector<Span>& spans, const Shape& sh, const Q* q, const C* kc,
              const C* vc, Q* out, float* qt, float* ot, float* kt, float* vt, int64_t d_rt) {
  const int64_t D = DT ? DT : d_rt;
  const Span& s = spans[t.span];
  const int64_t past = s.ctx_len - s.q_len, rows = s.q_len * sh.G;
  alignas(64) float pos[W];
  const Q* qrow[W];
  Q* orow[W];
  // lanes past the last row repeat it and are not stored
  for (int lane = 0; lane < W; ++lane) {
    const int64_t r = std::min<int64_t>(t.first_row + lane, rows - 1);
    const int64_t tok = r / sh.G, head = t.head * sh.G + r % sh.G;
    qrow[lane] = q + (s.q_start + tok) * sh.q_row + head * D;
    orow[lane] = out + ((s.q_start + tok) * sh.Hq + head) * D;
    pos[lane] = static_cast<float>(past + tok);
  }
  // the rows' queries, transposed (qt[d * W + lane]) and pre-scaled, W x W blocks in registers
  const vec scale = vset1(sh.scale);
  int64_t d0 = 0;
  for (; d0 + W <= D; d0 += W) {
    vec blk[W];
    for (int lane = 0; lane < W; ++lane) blk[lane] = vmul(vload(qrow[lane] + d0), scale);
    transpose_block(blk);
    for (int j = 0; j < W; ++j) vstore(qt + (d0 + j) * W, blk[j]);
  }
  for (; d0 < D; ++d0)
    for (int lane = 0; lane < W; ++lane) qt[d0 * W + lane] = to_float(qrow[lane][d0]) * sh.scale;
  const vec posv = vload(pos);
  const int64_t first_pos = past + t.first_row / sh.G;  // the lanes' positions only grow
  const int64_t last_row = std::min<int64_t>(t.first_row + W, rows) - 1;
  const int64_t kv_end = past + last_row / sh.G + 1;
  const vec neg_inf = vset1(-INFINITY);
  std::fill(ot, ot + D * W, 0.f);
  vec m = neg_inf, l = vset1(0.f);
  for (int64_t j0 = 0; j0 < kv_end; j0 += W) {
    const int64_t nk = std::min<int64_t>(W, kv_end - j0);
    load_tile<DT>(kt, kc, s, sh, t.head, j0, nk, D);
    const float* vrow[W];  // a key's V row at a time: in place, or widened into the V tile
    if constexpr (std::is_same_v<C, float>) {
      for (int c = 0; c < W; ++c) vrow[c] = row_at(vc, s, sh, t.head, j0 + std::min<int64_t>(c, nk - 1), D);
    } else {
      load_tile<DT>(vt, vc, s, sh, t.head, j0, nk, D);
      for (int c = 0; c < W; ++c) vrow[c] = vt + c * D;
    }
    vec sc[W];
    scores<DT>(sc, qt, kt, D);
    vec tile_max = neg_inf;
    if (nk == W && j0 + W - 1 <= first_pos) {  // every lane sees every key of the tile
      for (int c = 0; c < W; ++c) tile_max = vmax(tile_max, sc[c]);
    } else {
      for (int c = 0; c < W; ++c) {
        // key j0 + c is seen by the lanes at or after its position; keys past the chunk by none
        const float key = c < nk ? static_cast<float>(j0 + c) : INFINITY;
        sc[c] = vselect(vle(vset1(key), posv), sc[c], neg_inf);
        tile_max = vmax(tile_max, sc[c]);
      }
    }
    const vec m_new = vmax(m, tile_max);
    const vec corr = vexp_nonpositive(vsub(m, m_new));
    m = m_new;
    l = vmul(l, corr);
    for (int c = 0; c < W; ++c) {
      sc[c] = vexp_nonpositive(vsub(sc[c], m_new));
      l = vadd(l, sc[c]);
    }
    constexpr int CH = W / 2;  // output dims per pass, their accumulators in registers (W measured slower)
    int64_t d0 = 0;
    for (; d0 + CH <= D; d0 += CH) {
      vec o[CH];
      for (int i = 0; i < CH; ++i) o[i] = vmul(vload(ot + (d0 + i) * W), corr);
      for (int c = 0; c < W; ++c) {
        const float* vr = vrow[c] + d0;
        for (int i = 0; i < CH; ++i) o[i] = vfma(sc[c], vset1(vr[i]), o[i]);
      }
      for (int i = 0; i < CH; ++i) vstore(ot + (d0 + i) * W, o[i]);
    }
    for (; d0 < D; ++d0) {
      vec o = vmul(vload(ot + d0 * W), corr);
      for (int c = 0; c < W; ++c) o = vfma(sc[c], vset1(vrow[c][d0]), o);
      vstore(ot + d0 * W, o);
    }
  }
  // normalize, transpose back and store the real rows
  const vec inv = vdiv(vset1(1.f), l);
  const int real = static_cast<int>(last_row - t.first_row + 1);
  for (d0 = 0; d0 + W <= D; d0 += W) {
    vec blk[W];
    for (int j = 0; j < W; ++j) blk[j] = vmul(vload(ot + (d0 + j) * W), inv);
    transpose_block(blk);
    for (int lane = 0; lane < real; ++lane) vstore(orow[lane] + d0, blk[lane]);
  }
  alignas(64) float invs[W];
  vstore(invs, inv);
  for (; d0 < D; ++d0)
    for (int lane = 0; lane < real; ++lane) orow[lane][d0] = from_float<Q>(ot[d0 * W + lane] * invs[lane]);
}

template <typename Q, typename C>
using TaskFn = void (*)(const Task&, const std::vector<Span>&, const Shape&, const Q*, const C*, const C*, Q*,
                        float*, float*, float*, float*, int64_t);

template <typename Q, typename C>
TaskFn<Q, C> pick(int64_t D) {
  switch (D) {
    case 32: return run_task<32, Q, C>;
    case 64: return run_task<64, Q, C>;
    case 80: return run_task<80, Q, C>;
    case 96: return run_task<96, Q, C>;
    case 128: return run_task<128, Q, C>;
    default: return run_task<0, Q, C>;
  }
}

template <typename Q, typename C>
void run_tasks(const std::vector<Task>& tasks, const std::vector<Span>& list, const Shape& sh, int64_t D,
               const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
               torch::Tensor& out) {
  const TaskFn<Q, C> fn = pick<Q, C>(D);
  const Q* qp = q.data_ptr<Q>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  Q* op = out.data_ptr<Q>();
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(tasks.size());
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> buf(4 * D * W);  // transposed queries, output accumulators, a K tile, a V tile
    float* b = buf.data();
    for (int64_t i = next++; i < n; i = next++)
      fn(tasks[i], list, sh, qp, kp, vp, op, b, b + D * W, b + 2 * D * W, b + 3 * D * W, D);
  });
}
#endif

}  // namespace

bool has_simd() {
#ifdef ECOSERVE_SIMD
  return true;
#else
  return false;
#endif
}

void paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor out,
                   torch::Tensor tables, torch::Tensor spans, double scale) {
  TORCH_CHECK(has_simd(), "paged_prefill: built without AVX2/AVX-512; use torch SDPA");
  const auto is_supported = [](const torch::Tensor& x) {
    return x.dtype() == torch::kFloat32 || x.dtype() == torch::kBFloat16;
  };
  TORCH_CHECK(is_supported(q) && out.dtype() == q.dtype() && is_supported(k_cache) &&
              v_cache.dtype() == k_cache.dtype(), "paged_prefill: q and out must be float32 or bfloat16 alike, "
              "the cache float32 or bfloat16 (K and V alike), got ", q.dtype(), ", ", out.dtype(), ", ",
              k_cache.dtype(), " and ", v_cache.dtype());
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "paged_prefill: q must be [T, Hq, D] "
              "with contiguous heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous() && tables.is_contiguous() &&
              spans.is_contiguous(), "paged_prefill: contiguous tensors only");
  TORCH_CHECK(tables.dtype() == torch::kInt64 && spans.dtype() == torch::kInt64, "paged_prefill: int64 tables/spans");
  TORCH_CHECK(spans.dim() == 2 && spans.size(1) == 3 && tables.dim() == 2 && tables.size(0) == spans.size(0),
              "paged_prefill: spans [P, 3] and tables [P, max_blocks], got ", spans.sizes(), " and ", tables.sizes());
  TORCH_CHECK(out.sizes() == q.sizes(), "paged_prefill: out must have q's shape ", q.sizes(), ", got ", out.sizes());
  ecoserve_bounds::check_cache("paged_prefill", k_cache, v_cache, q.size(1), q.size(2));
  {
    const int64_t P = spans.size(0), nblk = tables.size(1), bs = k_cache.size(1);
    const int64_t* sp = spans.data_ptr<int64_t>();
    const int64_t* tp = tables.data_ptr<int64_t>();
    for (int64_t p = 0; p < P; ++p) {
      const int64_t q_start = sp[3 * p], q_len = sp[3 * p + 1], ctx_len = sp[3 * p + 2];
      TORCH_CHECK(q_start >= 0 && q_len > 0 && q_len <= ctx_len && q_start + q_len <= q.size(0), "paged_prefill: span ",
                  p, " (q_start ", q_start, ", q_len ", q_len, ", ctx_len ", ctx_len, ") is outside the ", q.size(0),
                  " query rows or attends fewer tokens than it computes");
      ecoserve_bounds::check_table_row("paged_prefill", tp + p * nblk, nblk, p, ctx_len, bs, k_cache.size(0));
    }
  }
#ifdef ECOSERVE_SIMD
  const int64_t Hq = q.size(1), D = q.size(2), bs = k_cache.size(1), Hkv = k_cache.size(2);
  const Shape sh{Hq, Hkv, Hq / Hkv, bs, q.stride(0), static_cast<float>(scale)};
  const int64_t P = spans.size(0), nblk = tables.size(1);
  const int64_t* sp = spans.data_ptr<int64_t>();
  std::vector<Span> list;
  std::vector<Task> tasks;
  for (int64_t p = 0; p < P; ++p) {
    const Span s{sp[3 * p], sp[3 * p + 1], sp[3 * p + 2], tables.data_ptr<int64_t>() + p * nblk};
    list.push_back(s);
    const int64_t rows = s.q_len * sh.G;
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t r = 0; r < rows; r += W)
        tasks.push_back({p, h, r});
  }
  // A thread takes the next task when it is free. The tasks of one span and kv head run one after
  // another, so that its K and V rows stay in the core's cache (ordered by cost alone, 8 prompts of
  // 256 ran at 80 instead of 120 GFLOP/s), and the costliest spans go first, so that no thread
  // waits long on another's tail.
  std::stable_sort(tasks.begin(), tasks.end(), [&](const Task& a, const Task& b) {
    return list[a.span].q_len * list[a.span].ctx_len > list[b.span].q_len * list[b.span].ctx_len;
  });
  using bf16 = c10::BFloat16;
  const bool q_bf16 = q.dtype() == torch::kBFloat16, cache_bf16 = k_cache.dtype() == torch::kBFloat16;
  if (!q_bf16 && !cache_bf16) run_tasks<float, float>(tasks, list, sh, D, q, k_cache, v_cache, out);
  else if (!q_bf16) run_tasks<float, bf16>(tasks, list, sh, D, q, k_cache, v_cache, out);
  else if (!cache_bf16) run_tasks<bf16, float>(tasks, list, sh, D, q, k_cache, v_cache, out);
  else run_tasks<bf16, bf16>(tasks, list, sh, D, q, k_cache, v_cache, out);
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_prefill", &paged_prefill);
  m.def("has_simd", &has_simd);
}
