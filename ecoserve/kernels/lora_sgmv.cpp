#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "bf16.h"

// Batched heterogeneous LoRA for one wrapped linear, every adapter segment of the step in one call
// (Punica's SGMV on CPU): y[rows of segment s] += (x[rows] @ A_s^T) @ B_s^T. oneDNN's GEMM costs
// 20-60 us of fixed overhead per call whatever its size, and a step makes two such calls per module
// and segment, so the LoRA of a 135M model's 120 modules cost more than a quarter of a decode step;
// the micro-kernels that torch's own CPU GEMM templates use (at::native::cpublas::brgemm: AMX or
// AVX512-BF16 tiles in bfloat16, AVX-512/AVX2 in float32) take 1-6 us on these shapes.
//
// Work items are (segment, block of up to 32 rows, block of output columns): each gathers its rows,
// runs the shrink [rows, in] x [in, K] (K = the slot's slices x rank) into float32, rounds it to the
// element type (as torch's bf16 mm does), runs the expand into float32 for its columns, and adds that
// into y, rounded once (as addmm_ does). Items write disjoint parts of y: no atomics, deterministic.
//
// Weights are packed per slot as the micro-kernel reads B, with v = 2 for bfloat16 (VNNI pairs along the
// reduced dimension) and 1 for float32: A^T as [in / v, K, v] at the front of the slot ([in / v, W, v],
// W the padded width; K <= W the adapter's own width, its rank x slices rounded up to v, so the shrink
// reads it without stride) and B^T as [W / v, out, v], whose first K / v rows a segment reads (zero past
// its adapter's rows).

namespace {

using namespace ecoserve_simd;

constexpr int64_t kBlockRows = 32;
constexpr int64_t kBlockCols = 256;
// A call that updates at most this many elements of y (a decode step's rows) runs on the calling thread:
// in the engine, waking the other threads for it measured more than the work (about 100 against 50 us).
constexpr int64_t kSerialWork = 64 * 3072;

// y[j] += c[j] for j < n, rounded once to T (bf16 rows take explicit vector loops: the compiler's
// do not vectorize c10::BFloat16)
template <typename T>
inline void add_row(T* __restrict y, const float* __restrict c, int64_t n) {
  int64_t j = 0;
#ifdef ECOSERVE_SIMD
  for (; j + W <= n; j += W) vstore(y + j, vadd(vload(y + j), vload(c + j)));
#endif
  for (; j < n; ++j) y[j] = from_float<T>(to_float(y[j]) + c[j]);
}

// A thread's scratch buffer of at least n elements, kept between calls (value-initialising a fresh
// vector of bf16 on every call measured a third of the kernel's time).
inline float* scratch(int64_t floats) {
  static thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < floats) buffer.resize(floats);
  return buffer.data();
}

template <typename T>
void sgmv(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const at::Tensor& rows,
          const at::Tensor& bounds, const at::Tensor& slots, const at::Tensor& widths) {
  constexpr int64_t v = std::is_same_v<T, float> ? 1 : 2;
  constexpr bool vnni = v == 2;
  const int64_t in = x.size(1), out = y.size(1);
  const int64_t W = a.size(2);  // a: [slots, in / v, W, v]
  const int64_t num_segments = slots.size(0);
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* bound = bounds.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* width = widths.data_ptr<int64_t>();
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = b.data_ptr<T>();
  const int64_t a_slot = a.stride(0), b_slot = b.stride(0);

  // items: (segment, first row in the segment's list), times column blocks
  std::vector<std::pair<int64_t, int64_t>> row_blocks;
  for (int64_t s = 0; s < num_segments; ++s)
    for (int64_t r = bound[s]; r < bound[s + 1]; r += kBlockRows) row_blocks.emplace_back(s, r);
  const int64_t col_blocks = (out + kBlockCols - 1) / kBlockCols;
  const int64_t items = static_cast<int64_t>(row_blocks.size()) * col_blocks;

  const int64_t grain = rows.size(0) * out <= kSerialWork ? items : 1;
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    // the shrink and expand results in float32, then gathered rows and the rounded shrink in T
    float* h = scratch(kBlockRows * (W + kBlockCols + in + W));
    float* c = h + kBlockRows * W;
    T* xs = reinterpret_cast<T*>(c + kBlockRows * kBlockCols);
    T* hs = xs + kBlockRows * in;
    int64_t done_block = -1;  // the row block whose shrink `hs` holds
    for (int64_t item = begin; item < end; ++item) {
      const int64_t block = item / col_blocks, col0 = (item % col_blocks) * kBlockCols;
      const auto [s, first] = row_blocks[block];
      const int64_t m = std::min(kBlockRows, bound[s + 1] - first);
      const int64_t k = width[s];
      const int64_t n = std::min(kBlockCols, out - col0);
      const int64_t* r = row + first;
      const bool contiguous = r[m - 1] - r[0] == m - 1 && std::is_sorted(r, r + m);
      if (block != done_block) {
        const T* xa = xp + r[0] * in;  // a run of rows is read in place, others are gathered
        if (!contiguous) {
          for (int64_t i = 0; i < m; ++i) std::copy_n(xp + r[i] * in, in, xs + i * in);
          xa = xs;
        }
        at::native::cpublas::brgemm(m, k, in, in, k, k, false, xa, ap + slot[s] * a_slot, h, vnni);
        convert_row(hs, h, m * k);
        done_block = block;
      }
      at::native::cpublas::brgemm(m, n, k, k, out, n, false, hs, bp + slot[s] * b_slot + col0 * v, c,
                                  vnni);
      for (int64_t i = 0; i < m; ++i) add_row(yp + r[i] * out + col0, c + i * n, n);
    }
    if (vnni) at::native::cpublas::brgemm_release(true);
  });
}

}  // namespace

// y [T, out] += per segment s: (x[rows_s] @ A_slot(s)^T) @ B_slot(s)^T[:K_s], in place.
// rows: int64 row indices of all segments one after another; bounds [S + 1] their offsets; slots [S];
// widths [S] each segment's K (a multiple of v, at most W).
void lora_sgmv_(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                const at::Tensor& rows, const at::Tensor& bounds, const at::Tensor& slots,
                const at::Tensor& widths) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "x [T, in] and y [T, out] expected");
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && a.is_contiguous() && b.is_contiguous(),
              "contiguous tensors expected");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == x.scalar_type() &&
              b.scalar_type() == x.scalar_type(), "x, y and the weights must share a dtype");
  const int64_t v = x.scalar_type() == at::kBFloat16 ? 2 : 1;
  TORCH_CHECK(a.dim() == 4 && b.dim() == 4 && a.size(1) * v == x.size(1) && a.size(3) == v && b.size(3) == v &&
              b.size(2) == y.size(1) && b.size(1) * v == a.size(2) && a.size(0) == b.size(0),
              "weights packed as A^T [slots, in / v, W, v] and B^T [slots, W / v, out, v] expected");
  TORCH_CHECK(rows.scalar_type() == at::kLong && bounds.scalar_type() == at::kLong &&
              slots.scalar_type() == at::kLong && widths.scalar_type() == at::kLong, "int64 indices expected");
  const int64_t S = slots.size(0);
  TORCH_CHECK(bounds.size(0) == S + 1 && widths.size(0) == S, "bounds [S + 1] and widths [S] expected");
  const int64_t* bound = bounds.data_ptr<int64_t>();
  TORCH_CHECK(bound[0] == 0 && bound[S] == rows.size(0), "bounds must cover rows");
  for (int64_t s = 0; s < S; ++s) {
    const int64_t slot = slots.data_ptr<int64_t>()[s], k = widths.data_ptr<int64_t>()[s];
    TORCH_CHECK(bound[s] <= bound[s + 1], "bounds must not decrease");
    TORCH_CHECK(0 <= slot && slot < a.size(0), "segment ", s, ": slot ", slot, " out of range");
    TORCH_CHECK(0 < k && k <= a.size(2) && k % v == 0, "segment ", s, ": width ", k, " invalid");
  }
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i)
    TORCH_CHECK(0 <= row[i] && row[i] < x.size(0), "row index ", row[i], " out of range");
  if (x.scalar_type() == at::kBFloat16)
    sgmv<c10::BFloat16>(y, x, a, b, rows, bounds, slots, widths);
  else if (x.scalar_type() == at::kFloat)
    sgmv<float>(y, x, a, b, rows, bounds, slots, widths);
  else
    TORCH_CHECK(false, "float32 or bfloat16 expected");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lora_sgmv_", &lora_sgmv_, "batched multi-adapter LoRA, added into y in place");
}
