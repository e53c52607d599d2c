// A CUDA thread-model emulator for the CPU (test infrastructure, DESIGN §6).
//
// Include this header *before* any csrc/cuda/*_kernels.cuh file and compile with g++: the kernels build
// unchanged and `emu::launch(kernel, grid, block, dynamic_smem_bytes, args...)` runs them thread by thread.
//
// Thread model:
//   * Blocks run one after another. The threads of a block are fibers (ucontext) on one OS thread, run by a
//     turnstile: each thread runs alone until it reaches a synchronisation point (__syncthreads, a warp
//     shuffle, __syncwarp) or exits, then the next thread runs. The order is ascending or descending thread
//     id (emu::set_schedule), so a missing barrier lets one thread read shared memory that others have not
//     written yet -- deterministically, not by luck.
//   * __syncthreads is a real barrier: it releases once every thread of the block has arrived. A thread that
//     exits while others wait at a barrier, or a barrier reached by only part of the block, is reported as
//     an error (undefined behaviour on a GPU).
//   * Warp shuffles are warp-wide rendezvous over 32-lane warps: every lane of the warp must arrive (full
//     mask), then each lane reads the value its source lane posted. Partial participation is an error.
//   * Shared memory declared with RC_SHARED_ARRAY / RC_DYNAMIC_SHARED comes from a per-block arena that is
//     poisoned (all bytes 0xFF: NaN for floats, -1 for integers) before every block, so reading a slot
//     nobody wrote in this block gives a visibly wrong value. Plain `__shared__` maps to `static` (one copy
//     per kernel instantiation, not poisoned).
//   * Atomics are plain read-modify-writes: fibers only switch at synchronisation points, so they are atomic.
#pragma once

#define RC_CUDA_EMULATOR 1

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__
#define __shared__ static

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace emu {

constexpr int kWarp = 32;

enum class Schedule : int { kAscending = 0, kDescending = 1 };

class EmulatorError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class State { kReady, kBarrier, kWarpSync, kDone };

struct Fiber {
  ucontext_t ctx;
  uint3 tid;
  int linear = 0;
  State state = State::kReady;
  // Posted shuffle: the value's bytes and the source lane this lane wants to read from.
  uint64_t shfl_value = 0;
  int shfl_src = 0;
  uint64_t shfl_result = 0;
  unsigned warp_mask = 0;
};

struct Launch {
  dim3 grid, block;
  uint3 block_idx;
  std::vector<Fiber> fibers;
  // Fiber stacks, left uninitialised: zero-filling 256 KiB per thread on every launch would dominate run time.
  std::vector<std::unique_ptr<char[]>> stacks;
  ucontext_t scheduler_ctx;
  Fiber* current = nullptr;
  std::function<void()> body;
  // Shared-memory arena of the running block.
  std::vector<unsigned char> arena;
  size_t arena_used = 0;
  size_t dynamic_bytes = 0;
  unsigned char* dynamic_base = nullptr;
  std::map<const void*, unsigned char*> static_slots;
  std::string error;
  uint64_t sync_points = 0;
};

inline Launch*& current_launch() {
  static thread_local Launch* launch = nullptr;
  return launch;
}
inline Schedule& schedule() {
  static thread_local Schedule s = Schedule::kAscending;
  return s;
}
inline void set_schedule(Schedule s) { schedule() = s; }

inline Launch& L() {
  Launch* l = current_launch();
  if (l == nullptr) throw EmulatorError("device code called outside emu::launch");
  return *l;
}

constexpr size_t kArenaBytes = 256 * 1024;  // generous: a real SM gives a block at most 227 KiB
constexpr size_t kStackBytes = 256 * 1024;

inline void fail(const std::string& msg) {
  Launch& l = L();
  if (l.error.empty()) l.error = msg;
}

// Hand control back to the scheduler (from inside a fiber).
inline void yield_to_scheduler() {
  Launch& l = L();
  Fiber* f = l.current;
  swapcontext(&f->ctx, &l.scheduler_ctx);
}

inline unsigned char* arena_alloc(size_t bytes) {
  Launch& l = L();
  size_t off = (l.arena_used + 15) & ~size_t(15);
  if (off + bytes > l.arena.size()) throw EmulatorError("shared memory arena exhausted");
  l.arena_used = off + bytes;
  return l.arena.data() + off;
}

template <typename T>
inline T* block_shared(size_t count, const void* key) {
  Launch& l = L();
  auto it = l.static_slots.find(key);
  if (it != l.static_slots.end()) return reinterpret_cast<T*>(it->second);
  unsigned char* p = arena_alloc(sizeof(T) * count);
  l.static_slots[key] = p;
  return reinterpret_cast<T*>(p);
}

template <typename T>
inline T* dynamic_shared() {
  return reinterpret_cast<T*>(L().dynamic_base);
}

inline uint3 thread_idx() { return L().current->tid; }

// --- synchronisation -------------------------------------------------------------------------------------

inline void syncthreads() {
  Launch& l = L();
  l.current->state = State::kBarrier;
  ++l.sync_points;
  yield_to_scheduler();
}

template <typename T>
inline T warp_exchange(T value, int src_lane, unsigned mask) {
  static_assert(sizeof(T) <= sizeof(uint64_t), "shuffle of a type wider than 8 bytes");
  Launch& l = L();
  Fiber* f = l.current;
  f->shfl_value = 0;
  std::memcpy(&f->shfl_value, &value, sizeof(T));
  f->shfl_src = src_lane;
  f->warp_mask = mask;
  f->state = State::kWarpSync;
  ++l.sync_points;
  yield_to_scheduler();
  T out;
  std::memcpy(&out, &f->shfl_result, sizeof(T));
  return out;
}

inline int lane_id() { return L().current->linear % kWarp; }

// Resolve a warp whose lanes all reached a shuffle / __syncwarp. Returns false if the warp is not complete.
inline bool try_release_warp(Launch& l, int warp, int nthreads) {
  const int first = warp * kWarp;
  const int last = std::min(first + kWarp, nthreads);
  bool any_waiting = false, all_waiting = true;
  for (int i = first; i < last; ++i) {
    if (l.fibers[i].state == State::kWarpSync) any_waiting = true;
    else all_waiting = false;
  }
  if (!any_waiting || !all_waiting) return false;
  const unsigned expected = (last - first) == kWarp ? 0xffffffffu : ((1u << (last - first)) - 1u);
  for (int i = first; i < last; ++i) {
    if ((l.fibers[i].warp_mask & expected) != expected) {
      fail("warp-synchronous op with a mask that leaves out lanes of warp " + std::to_string(warp));
    }
  }
  for (int i = first; i < last; ++i) {
    const int src = l.fibers[i].shfl_src;
    const int src_idx = (src >= 0 && src < last - first) ? first + src : i;
    l.fibers[i].shfl_result = l.fibers[src_idx].shfl_value;
    l.fibers[i].state = State::kReady;
  }
  return true;
}

// --- the launch ----------------------------------------------------------------------------------------

inline void fiber_entry() {
  Launch& l = L();
  try {
    l.body();
  } catch (const std::exception& e) {
    fail(std::string("exception in device code: ") + e.what());
  }
  l.current->state = State::kDone;
  swapcontext(&l.current->ctx, &l.scheduler_ctx);
}

inline void run_block(Launch& l) {
  const int n = static_cast<int>(l.block.x * l.block.y * l.block.z);
  std::fill(l.arena.begin(), l.arena.end(), static_cast<unsigned char>(0xFF));
  l.arena_used = 0;
  l.static_slots.clear();
  l.dynamic_base = l.dynamic_bytes ? arena_alloc(l.dynamic_bytes) : nullptr;
  for (int i = 0; i < n; ++i) {
    Fiber& f = l.fibers[i];
    f.linear = i;
    f.tid = {static_cast<unsigned>(i % l.block.x), static_cast<unsigned>((i / l.block.x) % l.block.y),
             static_cast<unsigned>(i / (l.block.x * l.block.y))};
    f.state = State::kReady;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = l.stacks[i].get();
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_entry, 0);
  }
  const bool descending = schedule() == Schedule::kDescending;
  const int warps = (n + kWarp - 1) / kWarp;
  while (true) {
    bool ran = false;
    for (int k = 0; k < n; ++k) {
      const int i = descending ? n - 1 - k : k;
      Fiber& f = l.fibers[i];
      if (f.state != State::kReady) continue;
      l.current = &f;
      swapcontext(&l.scheduler_ctx, &f.ctx);
      l.current = nullptr;
      ran = true;
      if (!l.error.empty()) return;
    }
    bool released = false;
    for (int w = 0; w < warps; ++w) released |= try_release_warp(l, w, n);
    if (!l.error.empty()) return;
    if (ran || released) continue;
    int done = 0, barrier = 0, warp_sync = 0;
    for (const Fiber& f : l.fibers) {
      done += f.state == State::kDone;
      barrier += f.state == State::kBarrier;
      warp_sync += f.state == State::kWarpSync;
    }
    if (done == n) return;
    if (barrier == n) {
      for (int i = 0; i < n; ++i) l.fibers[i].state = State::kReady;
      continue;
    }
    fail("deadlock or divergent synchronisation in block (" + std::to_string(l.block_idx.x) + "," +
         std::to_string(l.block_idx.y) + "," + std::to_string(l.block_idx.z) + "): " + std::to_string(done) +
         " threads exited, " + std::to_string(barrier) + " at __syncthreads, " + std::to_string(warp_sync) +
         " at a warp-synchronous op whose warp is incomplete");
    return;
  }
}

template <typename Kernel, typename... Args>
void launch(Kernel kernel, dim3 grid, dim3 block, size_t dynamic_smem_bytes, Args... args) {
  const int n = static_cast<int>(block.x * block.y * block.z);
  if (n <= 0 || n > 1024) throw EmulatorError("block size must be in [1, 1024], got " + std::to_string(n));
  Launch l;
  l.grid = grid;
  l.block = block;
  l.dynamic_bytes = dynamic_smem_bytes;
  l.arena.resize(kArenaBytes);
  l.fibers.resize(n);
  l.stacks.resize(n);
  for (auto& stack : l.stacks) stack.reset(new char[kStackBytes]);
  l.body = [&]() { kernel(args...); };
  Launch* previous = current_launch();
  current_launch() = &l;
  try {
    for (unsigned z = 0; z < grid.z && l.error.empty(); ++z)
      for (unsigned y = 0; y < grid.y && l.error.empty(); ++y)
        for (unsigned x = 0; x < grid.x && l.error.empty(); ++x) {
          l.block_idx = {x, y, z};
          run_block(l);
        }
  } catch (...) {
    current_launch() = previous;
    throw;
  }
  current_launch() = previous;
  if (!l.error.empty()) throw EmulatorError(l.error);
}

}  // namespace emu

// --- the CUDA device API, as the kernels spell it --------------------------------------------------------

#define threadIdx (::emu::thread_idx())
#define blockIdx (::emu::L().block_idx)
#define blockDim (::emu::L().block)
#define gridDim (::emu::L().grid)
#define warpSize 32

#define RC_SHARED_ARRAY(T, name, count)          \
  static const char name##_emu_key = 0;          \
  T* const name = ::emu::block_shared<T>((count), &name##_emu_key)
#define RC_DYNAMIC_SHARED(T, name) T* const name = ::emu::dynamic_shared<T>()

inline void __syncthreads() { ::emu::syncthreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::emu::warp_exchange<int>(0, ::emu::lane_id(), mask); }

template <typename T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize) {
  const int lane = ::emu::lane_id();
  const int base = lane & ~(width - 1);
  return ::emu::warp_exchange(var, base + (src_lane % width), mask);
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize) {
  const int lane = ::emu::lane_id();
  int src = lane ^ lane_mask;
  if ((src & ~(width - 1)) != (lane & ~(width - 1))) src = lane;
  return ::emu::warp_exchange(var, src, mask);
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  const int lane = ::emu::lane_id();
  const int src = lane + static_cast<int>(delta);
  return ::emu::warp_exchange(var, (src & ~(width - 1)) == (lane & ~(width - 1)) ? src : lane, mask);
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  const int lane = ::emu::lane_id();
  const int src = lane - static_cast<int>(delta);
  return ::emu::warp_exchange(var, (src >= 0 && (src & ~(width - 1)) == (lane & ~(width - 1))) ? src : lane, mask);
}

template <typename T>
inline T atomicAdd(T* address, T val) {
  const T old = *address;
  *address = old + val;
  return old;
}
template <typename T>
inline T atomicMax(T* address, T val) {
  const T old = *address;
  *address = old > val ? old : val;
  return old;
}
template <typename T>
inline T atomicMin(T* address, T val) {
  const T old = *address;
  *address = old < val ? old : val;
  return old;
}
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
using std::exp;
using std::fmaxf;
using std::fminf;
using std::log;
