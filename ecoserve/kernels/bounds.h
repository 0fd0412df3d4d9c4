#pragma once
// Checks the paged kernels make once per call, before any read through a block table: the tables and
// lengths come from Python, and a wrong one would read (or crash on) memory outside the KV cache.
// O(rows x blocks), a few microseconds per call.

#include <torch/extension.h>
#include <cstdint>

namespace ecoserve_bounds {

// The cache is [num_blocks, block_size, Hkv, D], K and V alike; q has Hq heads of D, Hq a multiple of Hkv.
inline void check_cache(const char* kernel, const torch::Tensor& k_cache, const torch::Tensor& v_cache, int64_t Hq,
                        int64_t D) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), kernel,
              ": k_cache and v_cache must both be [num_blocks, block_size, kv_heads, head_dim], got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK(k_cache.size(1) > 0 && k_cache.size(2) > 0 && k_cache.size(3) == D, kernel, ": the cache's head dim ",
              k_cache.size(3), " must be the queries' ", D, " (and its block size and kv heads positive)");
  TORCH_CHECK(Hq % k_cache.size(2) == 0, kernel, ": ", Hq, " query heads are not a multiple of ", k_cache.size(2),
              " kv heads");
}

// Row `row` of a block table attends `ctx_len` tokens: 1 <= ctx_len <= width * block_size, and each block
// it reads (the first ceil(ctx_len / block_size); the padding after them is never read) is in [0, num_blocks).
inline void check_table_row(const char* kernel, const int64_t* table, int64_t width, int64_t row, int64_t ctx_len,
                            int64_t block_size, int64_t num_blocks) {
  TORCH_CHECK(ctx_len >= 1 && ctx_len <= width * block_size, kernel, ": context length ", ctx_len, " of row ", row,
              " is outside [1, ", width * block_size, "] (a table of ", width, " blocks of ", block_size, ")");
  const int64_t used = (ctx_len + block_size - 1) / block_size;
  for (int64_t j = 0; j < used; ++j) {
    const int64_t id = table[j];
    TORCH_CHECK(id >= 0 && id < num_blocks, kernel, ": block id ", id, " in row ", row, ", column ", j,
                " is outside the cache's [0, ", num_blocks, ")");
  }
}

}  // namespace ecoserve_bounds
