// Small kernels whose behaviour is known in advance, to test the emulator itself (tests/test_cuda_emulator*.py):
// access patterns with a known number of sectors per request, planted shared-memory races next to their correct
// versions, divergent barriers, and the device API (dynamic shared memory, shuffles, __syncwarp, atomics, 2-D
// blocks). Exposed as torch.ops.rollout_corr_emu.selftest_*; built with the kernel families (one compile).
#include "cuda_emu.h"  // must come first: it defines the device API the kernels use

#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

#include "device_utils.cuh"

namespace rollout_corr {
namespace selftest {

// ---- access patterns: y[i] = x[offset + i * stride] ---------------------------------------------------------------

struct GatherParams {
  const float* x;
  float* y;
  int64_t n;
  int64_t stride;
  int64_t offset;
};

__global__ void gather_kernel(GatherParams p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < p.n) RC_STG(p.y + i, RC_LDG(p.x + p.offset + i * p.stride));
}

// Every thread reads x[0].
__global__ void broadcast_kernel(GatherParams p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < p.n) RC_STG(p.y + i, RC_LDG(p.x));
}

// 16-byte vectors: y[4i..4i+3] = x[4i..4i+3].
__global__ void vector_kernel(GatherParams p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const auto* xv = reinterpret_cast<const AlignedVector<float, 4>*>(p.x);
  auto* yv = reinterpret_cast<AlignedVector<float, 4>*>(p.y);
  if (i < p.n / 4) RC_STG(yv + i, RC_LDG(xv + i));
}

void traffic(std::string pattern, const at::Tensor& x, const at::Tensor& y, int64_t stride, int64_t offset,
             int64_t threads) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat && x.is_contiguous() && y.is_contiguous());
  GatherParams p{x.const_data_ptr<float>(), y.mutable_data_ptr<float>(), y.numel(), stride, offset};
  const unsigned blocks = static_cast<unsigned>((y.numel() + threads - 1) / threads);
  const dim3 block(static_cast<unsigned>(threads));
  if (pattern == "gather") {
    TORCH_CHECK(offset + (y.numel() - 1) * stride < x.numel(), "gather out of bounds");
    emu::launch(gather_kernel, dim3(blocks), block, 0, p);
  } else if (pattern == "broadcast") {
    emu::launch(broadcast_kernel, dim3(blocks), block, 0, p);
  } else if (pattern == "vector") {
    emu::launch(vector_kernel, dim3(std::max(1u, blocks / 4)), block, 0, p);
  } else {
    TORCH_CHECK(false, "unknown pattern ", pattern);
  }
}

// ---- shared-memory races, each with its correct version (`fixed` = 1) -----------------------------------------------

// Lane 0 of each warp writes its warp's slot; thread 0 sums the slots after the barrier (or without it).
__global__ void warp_slots_kernel(int* out, int fixed) {
  RC_SHARED_ARRAY(int, slots, kWarpSize);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  if (lane == 0) slots[warp] = warp + 1;
  if (fixed) __syncthreads();
  if (threadIdx.x == 0) {
    int s = 0;
    for (int w = 0; w < static_cast<int>(blockDim.x / kWarpSize); ++w) s += slots[w];
    out[0] = s;
  }
}

// A shared histogram: bins zeroed, a barrier, then atomics from every thread (atomics of different threads on one
// bin are no race; without the first barrier the zeroing races with them).
__global__ void histogram_kernel(int* out, int fixed) {
  RC_SHARED_ARRAY(unsigned, bins, 8);
  if (threadIdx.x < 8) bins[threadIdx.x] = 0u;
  if (fixed) __syncthreads();
  atomicAdd(&bins[threadIdx.x % 8], 1u);
  __syncthreads();
  if (threadIdx.x < 8) out[threadIdx.x] = static_cast<int>(bins[threadIdx.x]);
}

// Lane 0 writes, lane 1 of the same warp reads: ordered only by __syncwarp (a shuffle is no memory fence).
__global__ void intra_warp_kernel(int* out, int fixed) {
  RC_SHARED_ARRAY(int, slot, 1);
  if (threadIdx.x == 0) slot[0] = 7;
  if (fixed) __syncwarp();
  (void)__shfl_sync(kFullWarpMask, 0, 0);
  if (threadIdx.x == 1) out[0] = slot[0];
}

// The shared array reaches out-of-line helpers as a raw pointer (as block_reduce_sum_max gets `red`): still watched.
__attribute__((noinline)) void store_through(int* p, int i, int v) { p[i] = v; }
__attribute__((noinline)) int load_through(const int* p, int i) { return p[i]; }
__global__ void raw_pointer_kernel(int* out, int fixed) {
  RC_SHARED_ARRAY(int, slots, kWarpSize);
  if (threadIdx.x % kWarpSize == 0) store_through(slots, threadIdx.x / kWarpSize, 1 + threadIdx.x / kWarpSize);
  if (fixed) __syncthreads();
  if (threadIdx.x == 0) out[0] = load_through(slots, 1);
}

// Several rows per block, the warps' slots rewritten for each row: without the trailing barrier a warp that runs
// ahead writes row r+1's slot while thread 0 still reads row r's (the shape of the log-prob and policy-loss
// kernels: a warp reduction by shuffles, then lane 0 writes the warp's slot). out[r] = sum over warps of (100 r + w).
__global__ void rows_kernel(int* out, int fixed) {
  RC_SHARED_ARRAY(int, slots, kWarpSize);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  for (int r = 0; r < 4; ++r) {
    const int v = warp_sum(lane == 0 ? 100 * r + warp : 0);
    if (lane == 0) slots[warp] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
      int s = 0;
      for (int w = 0; w < static_cast<int>(blockDim.x / kWarpSize); ++w) s += slots[w];
      out[r] = s;
    }
    if (fixed) __syncthreads();
  }
}

// (outputs, the launch's error message or "") under the given schedule and the current racecheck mode.
std::tuple<at::Tensor, std::string> race(std::string kernel, int64_t fixed, int64_t schedule, int64_t threads) {
  TORCH_CHECK(schedule >= 0 && schedule <= 3, "schedule must be in [0, 3]");
  emu::set_schedule(static_cast<emu::Schedule>(schedule));
  auto out = at::full({8}, -1, at::TensorOptions().dtype(at::kInt));
  int* o = out.mutable_data_ptr<int>();
  const int f = static_cast<int>(fixed);
  const dim3 block(static_cast<unsigned>(threads));
  std::string error;
  try {
    if (kernel == "warp_slots") emu::launch(warp_slots_kernel, dim3(1), block, 0, o, f);
    else if (kernel == "histogram") emu::launch(histogram_kernel, dim3(1), block, 0, o, f);
    else if (kernel == "intra_warp") emu::launch(intra_warp_kernel, dim3(1), block, 0, o, f);
    else if (kernel == "raw_pointer") emu::launch(raw_pointer_kernel, dim3(1), block, 0, o, f);
    else if (kernel == "rows") emu::launch(rows_kernel, dim3(1), block, 0, o, f);
    else TORCH_CHECK(false, "unknown kernel ", kernel);
  } catch (const emu::EmulatorError& e) {
    error = e.what();
  }
  emu::set_schedule(emu::Schedule::kAscending);
  return {out, error};
}

// ---- synccheck ----------------------------------------------------------------------------------------------------

__global__ void half_block_barrier_kernel(int* out) {
  if (threadIdx.x < 16) __syncthreads();
  out[threadIdx.x] = 1;
}
__global__ void partial_shuffle_kernel(int* out) {
  if (threadIdx.x < 8) out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, static_cast<int>(threadIdx.x), 1);
}
__global__ void split_barriers_kernel(int* out) {
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1;
}

std::string divergence(int64_t which) {
  std::vector<int> out(64, 0);
  try {
    if (which == 0) emu::launch(half_block_barrier_kernel, dim3(1), dim3(64), 0, out.data());
    else if (which == 1) emu::launch(partial_shuffle_kernel, dim3(1), dim3(32), 0, out.data());
    else emu::launch(split_barriers_kernel, dim3(1), dim3(64), 0, out.data());
  } catch (const emu::EmulatorError& e) {
    return e.what();
  }
  return "";
}

// ---- the device API -----------------------------------------------------------------------------------------------

// Block sum through dynamic shared memory + a shfl_down tree; one atomicAdd per block into a global total.
__global__ void block_sum_kernel(const float* x, int n, float* total, int* blocks_done) {
  RC_DYNAMIC_SHARED(float, partial);
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  const int nthreads = blockDim.x * blockDim.y;
  float v = 0.f;
  for (int i = blockIdx.x * nthreads + tid; i < n; i += gridDim.x * nthreads) v += x[i];
  for (int off = 16; off > 0; off /= 2) v += __shfl_down_sync(0xffffffffu, v, off);
  if (tid % 32 == 0) partial[tid / 32] = v;
  __syncthreads();
  if (tid == 0) {
    float s = 0.f;
    for (int w = 0; w < nthreads / 32; ++w) s += partial[w];
    atomicAdd(total, s);
    atomicAdd(blocks_done, 1);
  }
}

// Lane permutations: broadcast from lane 3, shift up by 1; and __syncwarp as a pure rendezvous.
__global__ void lanes_kernel(int* out) {
  const int lane = threadIdx.x % 32;
  __syncwarp();
  const int b = __shfl_sync(0xffffffffu, lane * 10, 3);
  const int u = __shfl_up_sync(0xffffffffu, lane, 1);
  out[threadIdx.x] = b * 1000 + u;
}

std::vector<double> device_api() {
  std::vector<float> x(1000);
  double want = 0;
  for (int i = 0; i < 1000; ++i) {
    x[i] = 0.5f * (i % 7) - 1.f;
    want += x[i];
  }
  float total = 0.f;
  int done = 0;
  emu::launch(block_sum_kernel, dim3(3), dim3(32, 4), 4 * sizeof(float), x.data(), 1000, &total, &done);
  std::vector<int> out(64);
  emu::launch(lanes_kernel, dim3(1), dim3(64), 0, out.data());
  std::vector<double> r = {want, static_cast<double>(total), static_cast<double>(done)};
  for (int v : out) r.push_back(v);
  return r;
}

}  // namespace selftest

TORCH_LIBRARY_FRAGMENT(rollout_corr_emu, m) {
  m.def("selftest_traffic(str pattern, Tensor x, Tensor(a!) y, int stride=1, int offset=0, int threads=128) -> ()",
        &selftest::traffic);
  m.def("selftest_race(str kernel, int fixed, int schedule=0, int threads=128) -> (Tensor, str)", &selftest::race);
  m.def("selftest_divergence(int which) -> str", &selftest::divergence);
  m.def("selftest_device_api() -> float[]", &selftest::device_api);
}

}  // namespace rollout_corr
