#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <vector>

#include "bf16.h"
#include "simd.h"
#include "stream_rows.h"

// y = x W^T (+ b) for a few rows of x (decode steps), reading W where oneDNN's prepacked linear
// (model/packed.py's `pack_weight`) keeps it, so one copy of the weight serves both paths.
//
// Why: at decode sizes a linear is a stream of its weight. oneDNN's GEMM on these shapes streamed 19-21
// GB/s of weight at one to four rows on a 2-vCPU Xeon (AMX); stream_rows.h's loop reads the same bytes at
// 23-28 GB/s (scripts/bench_skinny_linear.py).
//
// The layout is oneDNN's, recognised rather than assumed: `fit` tries the blocked layouts oneDNN uses
// for a linear's weight (blocks of NB output columns, each [Kp/V][NB][V]: K padded to Kp, V = 1 for
// float32 and 2 for bfloat16's VNNI pairs, blocks one after another) and accepts one only if every
// element of the packed buffer at its computed place equals the weight's (bit for bit) and the padding
// is zero. A layout that passes computes exactly W's products whatever oneDNN meant by it; none passing
// means the caller keeps oneDNN for that layer.
//
// Each thread takes whole column blocks, each block read by stream_rows.h's `stream_block`. The output is
// rounded to x's dtype once, after the bias.

namespace at::native {
TORCH_API void* data_ptr_from_mkldnn(const at::Tensor& mkldnn_tensor);
TORCH_API int64_t nbytes_from_mkldnn(const at::Tensor& mkldnn_tensor);
}  // namespace at::native

namespace {

using namespace ecoserve_simd;

struct Layout {
  int64_t nb = 0, v = 0, kp = 0;  // columns per block, K values per pair, padded K
};

// Every element of W at its place in the layout, bit for bit, and zero in the padding.
template <typename Bits>
bool layout_holds(const Bits* packed, const Bits* w, int64_t n_out, int64_t k_in, const Layout& l) {
  const int64_t blocks = (n_out + l.nb - 1) / l.nb, block_size = l.kp * l.nb;
  for (int64_t b = 0; b < blocks; ++b) {
    const Bits* p = packed + b * block_size;
    for (int64_t kk = 0; kk < l.kp; kk += l.v)
      for (int64_t c = 0; c < l.nb; ++c)
        for (int64_t j = 0; j < l.v; ++j) {
          const int64_t n = b * l.nb + c, k = kk + j;
          const Bits expect = n < n_out && k < k_in ? w[n * k_in + k] : Bits{0};
          if (p[(kk / l.v * l.nb + c) * l.v + j] != expect) return false;
        }
  }
  return true;
}

#ifdef ECOSERVE_SIMD
template <typename T, int V, int NBV>
void skinny(const T* w, const float* xs, const float* bias, T* y, int64_t rows, int64_t n_out, int64_t kp) {
  constexpr int NB = NBV * W;
  const int64_t blocks = (n_out + NB - 1) / NB;
  // serial below ~256 KB of weight: waking the other thread costs more than it saves
  const int64_t grain = std::max<int64_t>(1, (int64_t{256} << 10) / (kp * NB * int64_t(sizeof(T))));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    std::vector<float> acc(rows * NB);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NB, cols = std::min<int64_t>(NB, n_out - n0);
      stream_block<T, V, NBV>(w + b * kp * NB, xs, kp, kp, rows, acc.data(), NB);
      for (int64_t m = 0; m < rows; ++m) {
        T* out = y + m * n_out + n0;
        const float* a = acc.data() + m * NB;
        for (int64_t c = 0; c < cols; ++c) out[c] = from_float<T>(bias ? a[c] + bias[n0 + c] : a[c]);
      }
    }
  });
}

template <typename T, int V>
bool dispatch_nbv(const T* w, const float* xs, const float* bias, T* y, int64_t rows, int64_t n_out, int64_t kp,
                  int64_t nb) {
  switch (nb / W) {
    case 1: skinny<T, V, 1>(w, xs, bias, y, rows, n_out, kp); return true;
    case 2: skinny<T, V, 2>(w, xs, bias, y, rows, n_out, kp); return true;
    case 4: skinny<T, V, 4>(w, xs, bias, y, rows, n_out, kp); return true;
    case 8: skinny<T, V, 8>(w, xs, bias, y, rows, n_out, kp); return true;
    default: return false;
  }
}
#endif

// which block widths the compiled loop runs for V
bool runs(int64_t nb, int64_t v) {
#ifdef ECOSERVE_SIMD
  const int64_t nbv = nb / W;
  return (v == 1 || v == 2) && nb % W == 0 && (nbv == 1 || nbv == 2 || nbv == 4 || nbv == 8);
#else
  return false;
#endif
}

}  // namespace

// The layout of `packed` (oneDNN's prepacked `weight` [N, K]) as (NB, V, Kp), or (0, 0, 0) if none
// the loop runs reproduces `weight` exactly.
std::tuple<int64_t, int64_t, int64_t> fit(const at::Tensor& packed, const at::Tensor& weight) {
  TORCH_CHECK(packed.is_mkldnn(), "fit: expected oneDNN's prepacked weight");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == packed.scalar_type(),
              "fit: expected the contiguous 2-D weight the packed one was made from");
  const auto dtype = weight.scalar_type();
  if (dtype != at::kFloat && dtype != at::kBFloat16) return {0, 0, 0};
  const int64_t n_out = weight.size(0), k_in = weight.size(1), size = weight.element_size();
  const int64_t elements = at::native::nbytes_from_mkldnn(packed) / size;
  const void* raw = at::native::data_ptr_from_mkldnn(packed);
  for (int64_t v : {int64_t{1}, int64_t{2}})
    for (int64_t nb : {int64_t{64}, int64_t{32}, int64_t{16}, int64_t{128}}) {
      const int64_t blocks = (n_out + nb - 1) / nb;
      if (!runs(nb, v) || elements % (blocks * nb)) continue;
      const Layout l{nb, v, elements / (blocks * nb)};
      if (l.kp < k_in || l.kp % v) continue;
      const bool holds = dtype == at::kFloat
          ? layout_holds(static_cast<const uint32_t*>(raw), static_cast<const uint32_t*>(weight.data_ptr()), n_out,
                         k_in, l)
          : layout_holds(static_cast<const uint16_t*>(raw), static_cast<const uint16_t*>(weight.data_ptr()), n_out,
                         k_in, l);
      if (holds) return {l.nb, l.v, l.kp};
    }
  return {0, 0, 0};
}

// x [M, K] (float32 or bfloat16, the packed weight's dtype) times the packed W [N, K] laid out as `fit` found.
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t n_out, int64_t nb, int64_t v, int64_t kp) {
  TORCH_CHECK(packed.is_mkldnn() && x.dim() == 2 && x.is_contiguous() && x.scalar_type() == packed.scalar_type(),
              "skinny_linear: expected contiguous 2-D rows of the packed weight's dtype");
  TORCH_CHECK(runs(nb, v) && kp >= x.size(1) && kp % v == 0, "skinny_linear: layout (", nb, ", ", v, ", ", kp,
              ") is not one `fit` returns here");
  const int64_t blocks = (n_out + nb - 1) / nb;
  TORCH_CHECK(at::native::nbytes_from_mkldnn(packed) == blocks * nb * kp * int64_t(packed.element_size()),
              "skinny_linear: the packed weight's size does not match its layout");
  const int64_t rows = x.size(0), k_in = x.size(1);
  at::Tensor b32;
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n_out, "skinny_linear: bias of ", n_out, " expected");
    b32 = bias->to(at::kFloat).contiguous();
  }
  // the rows widened once to float32 and zero-padded to Kp (the padded weights are zero, x's must be finite)
  at::Tensor xs = at::zeros({rows, kp}, x.options().dtype(at::kFloat));
  xs.narrow(1, 0, k_in).copy_(x);
  at::Tensor y = at::empty({rows, n_out}, x.options());
  if (rows == 0 || n_out == 0) return y;
  bool done = false;
#ifdef ECOSERVE_SIMD
  const void* w = at::native::data_ptr_from_mkldnn(packed);
  const float* bp = bias ? b32.data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat)
    done = v == 1 && dispatch_nbv<float, 1>(static_cast<const float*>(w), xs.data_ptr<float>(), bp,
                                            y.data_ptr<float>(), rows, n_out, kp, nb);
  else if (v == 2)
    done = dispatch_nbv<c10::BFloat16, 2>(static_cast<const c10::BFloat16*>(w), xs.data_ptr<float>(), bp,
                                          y.data_ptr<c10::BFloat16>(), rows, n_out, kp, nb);
  else
    done = dispatch_nbv<c10::BFloat16, 1>(static_cast<const c10::BFloat16*>(w), xs.data_ptr<float>(), bp,
                                          y.data_ptr<c10::BFloat16>(), rows, n_out, kp, nb);
#endif
  TORCH_CHECK(done, "skinny_linear: no compiled loop for this layout");
  return y;
}

// The most rows the streaming loop takes in `dtype` before a GEMM's blocking wins (stream_rows.h).
int64_t max_rows(c10::ScalarType dtype) {
  return dtype == at::kBFloat16 ? stream_max_rows<c10::BFloat16>() : stream_max_rows<float>();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("max_rows", &max_rows, "the most rows of x the loop is meant for, in dtype");
  m.def("fit", &fit, "the packed weight's layout as (NB, V, Kp), or (0, 0, 0)");
  m.def("skinny_linear", &skinny_linear, "x W^T (+ b) for a few rows, on oneDNN's packed W");
}
