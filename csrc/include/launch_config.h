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
