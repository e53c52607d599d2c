// Launch heuristics shared by the CUDA launchers of every kernel family and by the CUDA emulator's bindings:
// host-only and torch-free, so the emulated launches make exactly the launchers' choices.
#pragma once

#include <cstdint>

namespace rollout_corr {

constexpr int kMaxRowThreads = 512;
constexpr int kMergeThreads = 256;

// Elements per 16-byte vector access when the base pointer and row stride allow it, else 1.
template <typename scalar_t>
inline int pick_vec_width(const void* base, int64_t row_stride_elems) {
  constexpr int kWidth = 16 / static_cast<int>(sizeof(scalar_t));
  const bool aligned = reinterpret_cast<uintptr_t>(base) % 16 == 0 && (row_stride_elems * sizeof(scalar_t)) % 16 == 0;
  return aligned ? kWidth : 1;
}

// Threads per row-block: enough to cover the row in one sweep of vectors, a power of two in [32, 512].
inline int row_block_threads(int64_t cols, int vec_width) {
  const int64_t work = (cols + vec_width - 1) / vec_width;
  int threads = 32;
  while (threads < kMaxRowThreads && threads < work) threads *= 2;
  return threads;
}

// Blocks in a 1-D grid: one per row up to the hardware limit of gridDim.x; kernels grid-stride beyond it.
inline int64_t row_grid_blocks(int64_t rows) {
  const int64_t kMaxGridX = 2147483647;
  return rows < 1 ? 1 : (rows < kMaxGridX ? rows : kMaxGridX);
}

}  // namespace rollout_corr

namespace rollout_corr {

// Overrides of the launch heuristics, used only by the CUDA emulator's tests to sweep block sizes, vector widths and
// grids smaller than the row count (0 = the launcher's own choice). The CUDA launchers pass LaunchKnobs{}.
struct LaunchKnobs {
  int64_t threads = 0;
  int64_t vec = 0;
  int64_t max_blocks = 0;
};

inline int64_t capped_grid(int64_t blocks, const LaunchKnobs& k) {
  return k.max_blocks > 0 ? (blocks < k.max_blocks ? blocks : k.max_blocks) : blocks;
}

}  // namespace rollout_corr
