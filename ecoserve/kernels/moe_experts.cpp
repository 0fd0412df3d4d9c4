#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "simd.h"
#include "stream_rows.h"

// The routed experts of one mixture-of-experts layer in one call: out[t] = sum_j w[t, j] *
// down_e(silu(gate_e(x[t])) * up_e(x[t])), e = ids[t, j]. The (token, expert) pairs are sorted by expert
// (counting sort); a first parallel pass over (expert, block of its rows, block of intermediate columns)
// tiles gathers the tile's rows of x, runs its gate and up GEMMs and SiLU-and-mul; a second over
// (expert, row block, block of hidden columns) runs the down GEMM straight from the first pass's rows
// (already grouped by expert) and writes each pair's row times its routing weight to its own place;
// a last pass sums each token's pairs. No atomics: the result does not depend on the thread count.
//
// The GEMMs are PyTorch's `at::native::cpublas::brgemm` (oneDNN's batch-reduce micro-kernels: AMX
// tiles for bfloat16, AVX-512/AVX2 for float32) on weights packed once by `pack_experts` into blocks of
// BN output columns: bfloat16 blocks in the VNNI layout `cpublas::pack` writes ([K/2][BN][2], K
// padded to even), float32 blocks as plain [K][BN]. Rounding follows the per-expert torch path
// (model/moe.py's `fused_experts`) and so transformers: in bfloat16 the gate and up outputs, SiLU, its
// product, the down output and its product with the routing weight are each rounded to bf16, and a
// token's rows are summed in float32 in ascending expert order and rounded once, as its index_add_ does.
//
// A tile of at most stream_max_rows rows (decode steps: one row per active expert at batch 1) is a
// stream of its weight blocks rather than a GEMM: it goes through stream_rows.h's loop, the dense decode
// linears' (the packed blocks here have its layout, [Kp / V][BN][V]).

namespace {

using namespace ecoserve_simd;

constexpr int64_t BN = 64;  // output columns per packed block: two AMX tiles of bf16 side by side
constexpr int64_t BM = 64;  // rows of one expert per tile

int64_t blocks(int64_t n) { return (n + BN - 1) / BN; }

// K as packed: bf16 VNNI pairs rows of K, so an odd K gets a zero row
int64_t packed_k(int64_t k, bool bf16) { return bf16 ? k + (k & 1) : k; }

template <typename T>
constexpr bool is_bf16() { return std::is_same_v<T, c10::BFloat16>; }

// out[i] = silu(g[i]) * u[i] from the two GEMMs' float32 tiles, rounded as torch's ops in T round
template <typename T>
void silu_mul_row(const float* g, const float* u, T* out, int64_t n) {
  int64_t i = 0;
#ifdef ECOSERVE_SIMD
  if constexpr (is_bf16<T>()) {
    for (; i + W <= n; i += W) {
      const vec gv = vround_bf16(vload(g + i)), uv = vround_bf16(vload(u + i));
      vstore(out + i, vmul(vround_bf16(vsilu(gv)), uv));
    }
  }
#endif
#pragma omp simd
  for (int64_t j = i; j < n; ++j) {
    const float gj = round_to<T>(g[j]), uj = round_to<T>(u[j]);
    out[j] = from_float<T>(round_to<T>(silu(gj)) * uj);
  }
}

// out[i] = round(c[i]) * w: the down GEMM's row in T, times the routing weight, rounded to T
template <typename T>
void scale_row(const float* c, float w, T* out, int64_t n) {
  int64_t i = 0;
#ifdef ECOSERVE_SIMD
  if constexpr (is_bf16<T>()) {
    const vec wv = vset1(w);
    for (; i + W <= n; i += W) vstore(out + i, vmul(vround_bf16(vload(c + i)), wv));
  }
#endif
#pragma omp simd
  for (int64_t j = i; j < n; ++j) out[j] = from_float<T>(round_to<T>(c[j]) * w);
}

// acc[i] += y[i] in float32
template <typename T>
void add_row(float* acc, const T* y, int64_t n) {
  int64_t i = 0;
#ifdef ECOSERVE_SIMD
  if constexpr (is_bf16<T>())
    for (; i + W <= n; i += W) vstore(acc + i, vadd(vload(acc + i), vload(y + i)));
#endif
#pragma omp simd
  for (int64_t j = i; j < n; ++j) acc[j] += to_float(y[j]);
}

// Whether a tile of m rows is streamed (stream_rows.h) rather than run through brgemm.
template <typename T>
bool streamed(int64_t m) {
#ifdef ECOSERVE_SIMD
  return m <= stream_max_rows<T>();
#else
  return false;
#endif
}

// c [m, BN] = a [m, K] (float32 rows of lda, zero in the padding) times one packed block of BN columns
template <typename T>
void stream_tile_rows(const T* block, const float* a, int64_t lda, int64_t kp, int64_t m, float* c) {
#ifdef ECOSERVE_SIMD
  stream_block<T, is_bf16<T>() ? 2 : 1, BN / W>(block, a, lda, kp, m, c, BN);
#endif
}

// The (token, expert) pairs grouped by local expert, in token order within each (a stable counting
// sort); pairs routed to experts outside [first, first + E) (another rank's) are left out.
struct Routing {
  std::vector<int64_t> offsets;  // [E + 1]: expert e's pairs are sorted[offsets[e], offsets[e + 1])
  std::vector<int64_t> sorted;   // pair indices t * k + j
  std::vector<int64_t> tiles;    // (expert, first row) of each BM-row block, packed as expert * 2^32 + row
};

Routing sort_pairs(const int64_t* ids, int64_t pairs, int64_t first, int64_t E) {
  Routing r;
  r.offsets.assign(E + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t e = ids[p] - first;
    if (e >= 0 && e < E) ++r.offsets[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) r.offsets[e + 1] += r.offsets[e];
  r.sorted.resize(r.offsets[E]);
  std::vector<int64_t> next(r.offsets.begin(), r.offsets.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t e = ids[p] - first;
    if (e >= 0 && e < E) r.sorted[next[e]++] = p;
  }
  for (int64_t e = 0; e < E; ++e)
    for (int64_t row = r.offsets[e]; row < r.offsets[e + 1]; row += BM) r.tiles.push_back((e << 32) | row);
  return r;
}

template <typename T>
void run_experts(const torch::Tensor& x, const torch::Tensor& ids, const torch::Tensor& weights,
                 const torch::Tensor& gate_up, const torch::Tensor& down, int64_t inter, int64_t first,
                 torch::Tensor& out) {
  constexpr bool vnni = is_bf16<T>();
  const int64_t T_ = x.size(0), H = x.size(1), k = ids.size(1), E = gate_up.size(0);
  const int64_t Hp = packed_k(H, vnni), Ip = packed_k(inter, vnni), NI = blocks(inter), NH = blocks(H);
  const Routing routing = sort_pairs(ids.data_ptr<int64_t>(), T_ * k, first, E);
  const int64_t rows = static_cast<int64_t>(routing.sorted.size()), tiles = routing.tiles.size();
  auto hidden = torch::empty({std::max<int64_t>(rows, 1), Ip}, x.options());  // silu(gate) * up, grouped
  auto y = torch::empty({T_ * k, H}, x.options());                             // each pair's weighted row
  const T* xp = x.data_ptr<T>();
  const float* wp = weights.data_ptr<float>();
  const T *gup = gate_up.data_ptr<T>(), *dp = down.data_ptr<T>();
  T *hp = hidden.data_ptr<T>(), *yp = y.data_ptr<T>();
  const int64_t* sorted = routing.sorted.data();
  const int64_t* tile = routing.tiles.data();
  const int64_t* offsets = routing.offsets.data();
  auto tile_rows = [&](int64_t i, int64_t& e, int64_t& row) {
    e = tile[i] >> 32;
    row = tile[i] & 0xFFFFFFFF;
    return std::min(BM, offsets[e + 1] - row);
  };

  // pass 1: gate and up blocks of each tile, SiLU-and-mul into hidden's rows
  at::parallel_for(0, tiles * NI, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> a(BM * Hp, T(0.f));
    std::vector<float> af(BM * Hp, 0.f);  // a small tile's rows widened, for the streaming loop
    std::vector<float> cg(BM * BN), cu(BM * BN);
    int64_t gathered = -1;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / NI, nb = i % NI;
      int64_t e, row;
      const int64_t m = tile_rows(t, e, row);
      if (gathered != t) {  // the tile's rows of x, once for all its column blocks
        for (int64_t r = 0; r < m; ++r) {
          const T* src = xp + (sorted[row + r] / k) * H;
          if (streamed<T>(m))
            convert_row(&af[r * Hp], src, H);
          else
            std::memcpy(&a[r * Hp], src, H * sizeof(T));
        }
        gathered = t;
      }
      const T* b = gup + (e * 2 * NI + nb) * Hp * BN;
      if (streamed<T>(m)) {
        stream_tile_rows<T>(b, af.data(), Hp, Hp, m, cg.data());
        stream_tile_rows<T>(b + NI * Hp * BN, af.data(), Hp, Hp, m, cu.data());
      } else {
        at::native::cpublas::brgemm(m, BN, Hp, Hp, BN, BN, false, a.data(), b, cg.data(), vnni);
        at::native::cpublas::brgemm(m, BN, Hp, Hp, BN, BN, false, a.data(), b + NI * Hp * BN, cu.data(), vnni);
      }
      const int64_t n = std::min(BN, inter - nb * BN);
      for (int64_t r = 0; r < m; ++r) silu_mul_row<T>(&cg[r * BN], &cu[r * BN], hp + (row + r) * Ip + nb * BN, n);
    }
    at::native::cpublas::brgemm_release(vnni);
  });
  if (Ip != inter)  // the zero column of an odd intermediate size, read by the down GEMM's padded K
    for (int64_t r = 0; r < rows; ++r) hp[r * Ip + inter] = T(0.f);

  // pass 2: down blocks straight from hidden (rows already grouped by expert), scaled into each pair's row
  at::parallel_for(0, tiles * NH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> c(BM * BN), hf;
    int64_t widened = -1;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / NH, nb = i % NH;
      int64_t e, row;
      const int64_t m = tile_rows(t, e, row);
      const T* b = dp + (e * NH + nb) * Ip * BN;
      if (streamed<T>(m)) {
        if (widened != t) {  // hidden's rows of the tile (their padding column is zero), once per tile
          hf.resize(m * Ip);
          convert_row(hf.data(), hp + row * Ip, m * Ip);
          widened = t;
        }
        stream_tile_rows<T>(b, hf.data(), Ip, Ip, m, c.data());
      } else {
        at::native::cpublas::brgemm(m, BN, Ip, Ip, BN, BN, false, hp + row * Ip, b, c.data(), vnni);
      }
      const int64_t n = std::min(BN, H - nb * BN);
      for (int64_t r = 0; r < m; ++r) {
        const int64_t pair = sorted[row + r];
        scale_row<T>(&c[r * BN], wp[pair], yp + pair * H + nb * BN, n);
      }
    }
    at::native::cpublas::brgemm_release(vnni);
  });

  // pass 3: each token's local pairs, summed in ascending expert order
  const int64_t* idp = ids.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, T_, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> order(k);
    std::vector<float> acc(H);
    for (int64_t t = begin; t < end; ++t) {
      int64_t n = 0;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t e = idp[t * k + j] - first;
        if (e >= 0 && e < E) order[n++] = j;
      }
      std::sort(order.begin(), order.begin() + n, [&](int64_t a, int64_t b) { return idp[t * k + a] < idp[t * k + b]; });
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t i = 0; i < n; ++i) add_row<T>(acc.data(), yp + (t * k + order[i]) * H, H);
      convert_row(op + t * H, acc.data(), H);
    }
  });
}

void check_packed(const torch::Tensor& w, const torch::Tensor& x, const char* what) {
  TORCH_CHECK(w.dtype() == x.dtype() && w.is_contiguous() && w.dim() == 3, "moe_experts: ", what,
              " must be a contiguous [E, blocks, K * ", BN, "] tensor from pack_experts in x's dtype, got ",
              w.dtype(), " ", w.sizes());
}

}  // namespace

// Whether this CPU runs the kernel in `dtype` through oneDNN's micro-kernels: bfloat16 needs
// `cpublas::could_pack` (AMX); float32 needs no packing, and brgemm falls back to a plain GEMM
// where oneDNN has no micro-kernel.
bool supports(c10::ScalarType dtype) {
  if (dtype == at::kBFloat16) return at::native::cpublas::could_pack(at::kBFloat16);
  return dtype == at::kFloat;
}

// w [E, N, K] (each expert's x W^T weight, N outputs) -> [E, ceil(N / BN), Kp * BN]: each block of BN
// output columns as brgemm's B [Kp, BN], zero beyond N (and in the padded row of an odd bf16 K).
torch::Tensor pack_experts(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 3 && (w.dtype() == at::kFloat || w.dtype() == at::kBFloat16),
              "pack_experts: a float32 or bfloat16 [E, N, K] tensor, got ", w.dtype(), " ", w.sizes());
  TORCH_CHECK(supports(w.scalar_type()), "pack_experts: this CPU cannot pack ", w.dtype(), " for brgemm");
  const bool bf16 = w.dtype() == at::kBFloat16;
  const int64_t E = w.size(0), N = w.size(1), K = w.size(2), NB = blocks(N), Kp = packed_k(K, bf16);
  // B = W^T, padded: [E, Kp, NB * BN]
  auto plain = torch::zeros({E, Kp, NB * BN}, w.options());
  plain.narrow(1, 0, K).narrow(2, 0, N).copy_(w.transpose(1, 2));
  if (!bf16) return plain.view({E, Kp, NB, BN}).permute({0, 2, 1, 3}).contiguous().view({E, NB, Kp * BN});
  auto packed = torch::zeros({E, NB, Kp * BN}, w.options());
  const auto* in = static_cast<const c10::BFloat16*>(plain.data_ptr());
  auto* out = static_cast<c10::BFloat16*>(packed.data_ptr());
  at::parallel_for(0, E * NB, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e = i / NB, nb = i % NB;
      at::native::cpublas::pack(Kp, BN, NB * BN, BN, at::kBFloat16, at::kBFloat16, in + e * Kp * NB * BN + nb * BN,
                                out + i * Kp * BN);
    }
  });
  return packed;
}

// pack_experts' inverse: the [E, N, K] weights back, bit for bit.
torch::Tensor unpack_experts(torch::Tensor packed, int64_t N, int64_t K) {
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous(), "unpack_experts: a tensor from pack_experts");
  const bool bf16 = packed.dtype() == at::kBFloat16;
  const int64_t E = packed.size(0), NB = blocks(N), Kp = packed_k(K, bf16);
  TORCH_CHECK(packed.size(1) == NB && packed.size(2) == Kp * BN, "unpack_experts: ", packed.sizes(),
              " was not packed from [E, ", N, ", ", K, "]");
  // the block's element (k, n): [Kp][BN] plain in float32, [Kp / 2][BN][2] VNNI pairs in bfloat16
  auto blocked = bf16 ? packed.view({E, NB, Kp / 2, BN, 2}).permute({0, 1, 3, 2, 4}).reshape({E, NB, BN, Kp})
                      : packed.view({E, NB, Kp, BN}).transpose(2, 3);
  return blocked.reshape({E, NB * BN, Kp}).narrow(1, 0, N).narrow(2, 0, K).contiguous();
}

// x [T, H] float32 or bfloat16, ids [T, k] int64 (global expert ids), weights [T, k], gate_up and down
// from pack_experts (gate_up: the gate's blocks, then the up's, of experts [first, first + E)), inter the
// experts' intermediate size -> [T, H] in x's dtype.
torch::Tensor moe_experts(torch::Tensor x, torch::Tensor ids, torch::Tensor weights, torch::Tensor gate_up,
                          torch::Tensor down, int64_t inter, int64_t first) {
  TORCH_CHECK(x.dim() == 2 && (x.dtype() == at::kFloat || x.dtype() == at::kBFloat16),
              "moe_experts: x must be float32 or bfloat16 [T, H], got ", x.dtype(), " ", x.sizes());
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == at::kLong,
              "moe_experts: ids must be int64 [T, k] with x's T, got ", ids.dtype(), " ", ids.sizes());
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.is_floating_point(),
              "moe_experts: weights must be floating [T, k] like ids, got ", weights.dtype(), " ", weights.sizes());
  check_packed(gate_up, x, "gate_up");
  check_packed(down, x, "down");
  // after the checks of the inputs: a bad call is told so on every CPU, whatever it can run
  TORCH_CHECK(supports(x.scalar_type()), "moe_experts: this CPU has no brgemm micro-kernel for ", x.dtype());
  const bool bf16 = x.dtype() == at::kBFloat16;
  const int64_t H = x.size(1), E = gate_up.size(0);
  TORCH_CHECK(inter > 0 && gate_up.size(1) == 2 * blocks(inter) && gate_up.size(2) == packed_k(H, bf16) * BN,
              "moe_experts: gate_up ", gate_up.sizes(), " is not [E, 2I, H] = [E, ", 2 * inter, ", ", H, "] packed");
  TORCH_CHECK(down.size(0) == E && down.size(1) == blocks(H) && down.size(2) == packed_k(inter, bf16) * BN,
              "moe_experts: down ", down.sizes(), " is not [E, H, I] = [", E, ", ", H, ", ", inter, "] packed");
  TORCH_CHECK(E < (int64_t{1} << 31) && x.size(0) * ids.size(1) < (int64_t{1} << 32), "moe_experts: too large");
  x = x.contiguous();
  ids = ids.contiguous();
  weights = weights.to(at::kFloat).contiguous();
  auto out = torch::empty_like(x);
  if (bf16) run_experts<c10::BFloat16>(x, ids, weights, gate_up, down, inter, first, out);
  else run_experts<float>(x, ids, weights, gate_up, down, inter, first, out);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supports", &supports);
  m.def("pack_experts", &pack_experts);
  m.def("unpack_experts", &unpack_experts);
  m.def("moe_experts", &moe_experts);
}
