// CUDA kernels of the sampling replay (docs/sampling_replay.md; contracts: csrc/ops.cpp, "§5 sampling replay").
// Device code only: no ATen, no CUDA runtime calls, so the CUDA emulator compiles this very file for the CPU.
// Launch planning and host driver: sampling_launch.cuh (shared with the emulator); launchers: sampling.cu. Keys and
// integer masses: sampling_math.h (shared with the CPU kernels, so a top-p decision is the same on both).
//
// Every kernel runs one block per row (grid-stride over rows). The order statistics (k-th largest, the top-p cut)
// are radix selects over order-preserving integer keys: a round histograms one 8-bit digit of the keys that match
// the digits chosen so far into shared memory (atomics), and warp 0 picks the digit whose bin holds the wanted rank.
// No comparison sort of the row, no global scratch, and every result is independent of the thread schedule.
#pragma once

#include <cmath>
#include <cstdint>

#include "device_utils.cuh"
#include "sampling_math.h"

namespace rollout_corr {

// ---- parameter blocks (raw pointers, sizes, element strides) ---------------------------------------------------

// floor_fill (out = x, -inf under the floor) and floor_zero_ (out = grad, 0 under the floor).
template <typename scalar_t, typename acc_t>
struct FloorParams {
  const scalar_t* x;
  int64_t ldx;
  scalar_t* out;
  int64_t ldo;
  const acc_t* floor;  // [rows]
  acc_t t;
  bool unit_t;  // temperature 1: z = x, no division (as the CPU kernel)
  int64_t rows, cols;
};

template <typename scalar_t, typename acc_t>
struct CountParams {
  const scalar_t* z;
  int64_t ld, rows, cols;
  const acc_t* floor;
  int64_t* counts;  // [rows]
};

template <typename val_t, typename out_t>
struct ScatterParams {
  const val_t* values;   // [rows, width]
  const int64_t* index;  // [rows, width]
  int64_t rows, width, cols;
  out_t* out;            // [rows, cols], zeroed by the launcher
  int32_t* bad_index;    // [1]: set when an index is >= cols (the launcher raises / asserts)
};

template <typename scalar_t, typename acc_t>
struct MassParams {
  const scalar_t* z;
  int64_t ld, rows, cols;
  const acc_t* z_max;
  const acc_t* floor;
  const int64_t* lo;
  const int64_t* hi;
  const int64_t* probes;  // [rows, n_probes], ascending
  int64_t n_probes;
  int64_t* hist;          // [rows, n_probes + 1], zeroed by the launcher
};

template <typename scalar_t, typename acc_t>
struct TopkParams {
  const scalar_t* values;
  int64_t ld, rows, cols, k;
  acc_t* out;  // [rows, k]
};

template <typename scalar_t>
struct CandidateParams {
  const scalar_t* x;
  int64_t ld, rows, cols;  // cols: the valid (non-padding) columns
  const int64_t* k;        // [rows]: the row's top-k; <= 0: an ignored row, never read
  const int64_t* target;   // [rows]: the target's local column, or -1
  float t;
  bool unit_t;
  int64_t width;
  int64_t tile_steps;  // a tile is tile_steps warp-widths of consecutive columns
  float* values;       // [rows, width]
  int64_t* index;      // [rows, width]
  int64_t* count;      // [rows]
  double* stats;       // [rows, 3]
};

template <typename acc_t>
struct DecideParams {
  const acc_t* cand;  // [rows, width], any order, -inf padded
  int64_t rows, width;
  const double* z_max;
  const double* z_t;
  const double* sum_all;
  const int64_t* k;
  const acc_t* floor;
  const double* top_p;
  acc_t* tau;    // [rows]
  double* out;   // [rows, 4]
};

// Shared-memory capacities (the launchers check the arguments against them).
constexpr int kRadixBins = 256;
constexpr int kCandCap = 4096;                     // row_candidates' sort buffer (32 KiB); also its widest width
constexpr int kCandMaxTiles = 2 * kCandCap;        // tile maxima in the same buffer, as fp32
constexpr int kTopkCap = 4096;                     // row_topk's widest k on the device
constexpr int kMassSharedBuckets = 2048;           // mass_histogram's buckets in shared memory (more: global atomics)

// Slots of the per-row state array (unsigned long long) of the selecting kernels.
enum SelectSlot : int {
  kSelPrefix = 0,  // the digits chosen so far
  kSelRank,        // the rank still wanted inside the current bin (count selects) / the budget left (weighted)
  kSelAbove,       // keys above the current bin (count selects)
  kSelEqual,       // keys in the chosen bin of the last round: after the last round, keys equal to the result
  kSelFound,       // 0 when fewer keys than the rank were visited
  kSelCount0,      // row_candidates' first collection counter
  kSelCount1,      // its second (the exact path's)
  kSelSlots
};

// ---- warp and block helpers --------------------------------------------------------------------------------------

__device__ RC_FORCEINLINE int warp_min_int(int v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const int o = __shfl_xor_sync(kFullWarpMask, v, offset);
    v = o < v ? o : v;
  }
  return v;
}

// Inclusive prefix sum over the lanes of a warp (lane 0 first).
template <typename T>
__device__ RC_FORCEINLINE T warp_inclusive_sum(T v) {
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int offset = 1; offset < kWarpSize; offset *= 2) {
    const T o = __shfl_up_sync(kFullWarpMask, v, offset);
    if (lane >= offset) v += o;
  }
  return v;
}

// Sum over the block, returned to every thread: lanes by butterfly, warps through `slots` (kWarpSize entries), each
// thread adding the warps' partials in warp order (the same sum in every thread and every schedule).
template <typename T>
__device__ RC_FORCEINLINE T block_sum(T v, T* slots) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize, num_warps = blockDim.x / kWarpSize;
  v = warp_sum(v);
  if (lane == 0) slots[warp] = v;
  __syncthreads();
  T total = T(0);
  for (int w = 0; w < num_warps; ++w) total += slots[w];
  __syncthreads();  // the slots are rewritten by the next reduction
  return total;
}

// Slots for `flag` lanes of a warp in a shared counter, in lane order: one atomic per warp. Every lane of the warp
// must call it (it shuffles); returns the lane's slot (meaningful where flag is set).
__device__ RC_FORCEINLINE unsigned long long warp_reserve(bool flag, unsigned long long* counter) {
  const int lane = threadIdx.x % kWarpSize;
  const unsigned incl = warp_inclusive_sum(static_cast<unsigned>(flag));
  const unsigned total = __shfl_sync(kFullWarpMask, incl, kWarpSize - 1);
  unsigned long long base = 0;
  if (total == 0) return 0;
  if (lane == 0) base = atomicAdd(counter, static_cast<unsigned long long>(total));
  base = __shfl_sync(kFullWarpMask, base, 0);
  return base + incl - static_cast<unsigned>(flag);
}

// ---- radix selects over integer keys -----------------------------------------------------------------------------

template <typename KeyT>
__device__ RC_FORCEINLINE bool key_matches(KeyT key, KeyT prefix, int shift) {
  // the digits above `shift` equal the prefix's (round 0: no digit chosen yet)
  return shift + 8 >= static_cast<int>(8 * sizeof(KeyT)) || ((key ^ prefix) >> (shift + 8)) == 0;
}

// The rank-th largest key (rank >= 1) of the keys the block's threads visit: `visit(add)` calls add(has, key) for
// each of the thread's elements (add uses atomics only, so visit may be called in any order and from any control
// flow). On return (every thread): st[kSelFound] = 0 when fewer than rank keys were visited; else st[kSelPrefix] =
// the key, st[kSelAbove] = keys above it, st[kSelEqual] = keys equal to it. hist: kRadixBins counters. The state
// travels in registers between rounds and st is written only after a round's counting barrier, so the caller's
// reads of st from before the call need no barrier of their own.
template <typename KeyT, typename Visit>
__device__ void radix_select_largest(Visit&& visit, unsigned long long rank, unsigned* hist,
                                     unsigned long long* st) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  constexpr int kBits = static_cast<int>(8 * sizeof(KeyT));
  KeyT prefix = 0;
  unsigned long long need = rank, above = 0;
  for (int shift = kBits - 8; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < kRadixBins; b += blockDim.x) hist[b] = 0u;
    __syncthreads();  // the zeroed bins before the counting
    visit([&](bool has, KeyT key) {
      if (has && key_matches(key, prefix, shift)) atomicAdd(hist + ((key >> shift) & 0xFF), 1u);
    });
    __syncthreads();  // the counts before warp 0 reads them
    if (warp == 0) {
      // lane l owns bins 255 - 8l down to 248 - 8l: lane order is descending key order
      unsigned own[8];
      unsigned long long lane_sum = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        own[j] = hist[kRadixBins - 1 - 8 * lane - j];
        lane_sum += own[j];
      }
      const unsigned long long incl = warp_inclusive_sum(lane_sum);
      unsigned long long acc = incl - lane_sum;
      const unsigned long long total = __shfl_sync(kFullWarpMask, incl, kWarpSize - 1);
      if (shift == kBits - 8 && lane == 0) st[kSelFound] = total >= need;  // later rounds: the bin holds the rank
      if (acc < need && need <= incl) {  // exactly one lane holds the bin where the rank falls
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (acc + own[j] >= need) {
            const KeyT digit = static_cast<KeyT>(kRadixBins - 1 - 8 * lane - j);
            st[kSelPrefix] = static_cast<unsigned long long>(prefix | (digit << shift));
            st[kSelRank] = need - acc;
            st[kSelAbove] = above + acc;
            st[kSelEqual] = own[j];
            break;
          }
          acc += own[j];
        }
      }
    }
    __syncthreads();  // the chosen digit before every thread reads it (and the bins before they are re-zeroed)
    if (st[kSelFound] == 0) return;
    prefix = static_cast<KeyT>(st[kSelPrefix]);
    need = st[kSelRank];
    above = st[kSelAbove];
  }
}

// The smallest key v with M(<= v) > budget among the visited keys, M the sum of their integer masses: the top-p cut
// (vLLM keeps the values whose mass from below exceeds (1 - p) of the total). visit(add) calls add(has, key, mass).
// On return st[kSelFound] = 0 when no key was visited, else st[kSelPrefix] holds the cut. cnt, mass: kRadixBins bins
// each. State in registers between rounds, as radix_select_largest.
template <typename KeyT, typename Visit>
__device__ void radix_select_mass(Visit&& visit, long long budget, unsigned* cnt, unsigned long long* mass,
                                  unsigned long long* st) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  constexpr int kBits = static_cast<int>(8 * sizeof(KeyT));
  KeyT prefix = 0;
  long long left = budget;  // the budget left below the current bin
  for (int shift = kBits - 8; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < kRadixBins; b += blockDim.x) {
      cnt[b] = 0u;
      mass[b] = 0ull;
    }
    __syncthreads();  // the zeroed bins before the counting
    visit([&](bool has, KeyT key, long long m) {
      if (has && key_matches(key, prefix, shift)) {
        const int b = static_cast<int>((key >> shift) & 0xFF);
        atomicAdd(cnt + b, 1u);
        if (m != 0) atomicAdd(mass + b, static_cast<unsigned long long>(m));
      }
    });
    __syncthreads();  // the bins before warp 0 reads them
    if (warp == 0) {
      // lane l owns bins 8l to 8l + 7: lane order is ascending key order. The cut is the first bin, from below,
      // that holds a key and whose mass brings the mass below it past the budget (when the total exceeds the
      // budget, that bin exists: its count is positive unless the budget is negative, then it is the first bin
      // holding a key).
      long long lane_mass = 0;
      unsigned lane_cnt = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        lane_mass += static_cast<long long>(mass[8 * lane + j]);
        lane_cnt += cnt[8 * lane + j];
      }
      const long long incl = warp_inclusive_sum(lane_mass);
      const bool ok = lane_cnt > 0 && incl > left;
      const int first = warp_min_int(ok ? lane : kWarpSize);
      if (shift == kBits - 8 && lane == 0) st[kSelFound] = first < kWarpSize;
      if (lane == first) {
        long long acc = incl - lane_mass;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int b = 8 * lane + j;
          const long long m = static_cast<long long>(mass[b]);
          if (cnt[b] > 0 && acc + m > left) {
            st[kSelPrefix] = static_cast<unsigned long long>(prefix | (static_cast<KeyT>(b) << shift));
            st[kSelRank] = static_cast<unsigned long long>(left - acc);
            break;
          }
          acc += m;
        }
      }
    }
    __syncthreads();  // the chosen digit before every thread reads it (and the bins before they are re-zeroed)
    if (st[kSelFound] == 0) return;
    prefix = static_cast<KeyT>(st[kSelPrefix]);
    left = static_cast<long long>(st[kSelRank]);
  }
}

// Sorts keys[0, n) descending, n a power of two: a bitonic network in shared memory, one barrier per stage.
__device__ RC_FORCEINLINE void bitonic_sort_descending(unsigned long long* keys, int n) {
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < n / 2; i += blockDim.x) {
        const int lo = 2 * i - (i & (stride - 1));  // the pair (lo, lo + stride), lo's `stride` bit clear
        const int hi = lo + stride;
        const bool descending = (lo & size) == 0;   // the last stage (size = n) sorts all of it descending
        const unsigned long long a = keys[lo], b = keys[hi];
        RC_SHARED_STORE_AFTER_LOAD();
        if ((a < b) == descending) {
          keys[lo] = b;
          keys[hi] = a;
        }
      }
      __syncthreads();  // a stage's swaps before the next stage reads them
    }
  }
}

__device__ RC_FORCEINLINE int pow2_at_least(int n) {
  int p = 1;
  while (p < n) p <<= 1;
  return p;
}

// ---- floor_fill, floor_zero_, count_at_least, scatter_rows -------------------------------------------------------

template <typename scalar_t, typename acc_t>
__device__ RC_FORCEINLINE bool under_floor(scalar_t v, acc_t f, acc_t t, bool unit_t) {
  const acc_t z = static_cast<acc_t>(v);
  return (unit_t ? z : z / t) < f;  // IEEE division, as the CPU kernel and the sampler
}

// out[r, c] = x[r, c], or -inf where x / T is under floor[r]: one read, one write (out may be x: each element is
// read and written by the same thread).
template <typename scalar_t, typename acc_t>
__global__ void floor_fill_kernel(FloorParams<scalar_t, acc_t> p) {
  const scalar_t ninf = static_cast<scalar_t>(-INFINITY);
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const acc_t f = RC_LDG(p.floor + row);
    const scalar_t* x = p.x + row * p.ldx;
    scalar_t* o = p.out + row * p.ldo;
    for (int64_t c = threadIdx.x; c < p.cols; c += blockDim.x) {
      const scalar_t v = RC_LDG(x + c);
      RC_STG(o + c, under_floor(v, f, p.t, p.unit_t) ? ninf : v);
    }
  }
}

// grad[r, c] = 0 where x / T is under floor[r]: one read of x, a write of the zeroed gradient elements only.
template <typename scalar_t, typename acc_t>
__global__ void floor_zero_kernel(FloorParams<scalar_t, acc_t> p) {
  const scalar_t zero = static_cast<scalar_t>(0.0f);
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const acc_t f = RC_LDG(p.floor + row);
    const scalar_t* x = p.x + row * p.ldx;
    scalar_t* g = p.out + row * p.ldo;
    for (int64_t c = threadIdx.x; c < p.cols; c += blockDim.x) {
      if (under_floor(RC_LDG(x + c), f, p.t, p.unit_t)) RC_STG(g + c, zero);
    }
  }
}

// counts[r] = #{c : acc(z[r, c]) >= floor[r]} (NaN never counts).
template <typename scalar_t, typename acc_t>
__global__ void count_at_least_kernel(CountParams<scalar_t, acc_t> p) {
  RC_SHARED_ARRAY(long long, slots, kWarpSize);
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const acc_t f = RC_LDG(p.floor + row);
    const scalar_t* z = p.z + row * p.ld;
    long long n = 0;
    for (int64_t c = threadIdx.x; c < p.cols; c += blockDim.x) n += static_cast<acc_t>(RC_LDG(z + c)) >= f;
    n = block_sum(n, slots);
    if (threadIdx.x == 0) RC_STG(p.counts + row, static_cast<int64_t>(n));
  }
}

// out[r, index[r, w]] = values[r, w] where the index is >= 0, into an output the launcher zeroed (a memset: the
// kernel writes the kept candidates only). Indices of a row are distinct (the candidates' columns).
template <typename val_t, typename out_t>
__global__ void scatter_rows_kernel(ScatterParams<val_t, out_t> p) {
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    for (int64_t w = threadIdx.x; w < p.width; w += blockDim.x) {
      const int64_t c = RC_LDG(p.index + row * p.width + w);
      if (c >= p.cols) {
        RC_STG(p.bad_index, 1);  // every writer stores the same 1
      } else if (c >= 0) {
        RC_STG(p.out + row * p.cols + c, static_cast<out_t>(RC_LDG(p.values + row * p.width + w)));
      }
    }
  }
}

// ---- mass_histogram: one round of the general top-p search -----------------------------------------------------

// #{j : probes[j] < key}, probes ascending.
__device__ RC_FORCEINLINE int64_t probes_below(const long long* probes, int64_t n, long long key) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (probes[mid] < key) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// hist[r, b] = sum of the integer masses round(e^(z - z_max) 2^40) (sampling_math.h) of row r's values z >= floor,
// z > -inf, lo < key(z) <= hi, in bucket b = #{probes < key(z)}. The row's probes and buckets live in shared memory
// (integer atomics: the sums do not depend on the order); with more than kMassSharedBuckets buckets, the probes are
// read from global memory and the masses added there.
template <typename scalar_t, typename acc_t>
__global__ void mass_histogram_kernel(MassParams<scalar_t, acc_t> p) {
  RC_SHARED_ARRAY(long long, probes_s, kMassSharedBuckets);
  RC_SHARED_ARRAY(unsigned long long, hist_s, kMassSharedBuckets);
  const int64_t buckets = p.n_probes + 1;
  const bool shared = buckets <= kMassSharedBuckets;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const long long* probes = reinterpret_cast<const long long*>(p.probes + row * p.n_probes);
    unsigned long long* hist = reinterpret_cast<unsigned long long*>(p.hist + row * buckets);
    if (shared) {
      for (int64_t b = threadIdx.x; b < buckets; b += blockDim.x) {
        if (b < p.n_probes) probes_s[b] = RC_LDG(probes + b);
        hist_s[b] = 0ull;
      }
      __syncthreads();  // the row's probes and zeroed buckets before the counting
      probes = probes_s;
      hist = hist_s;
    }
    const long long l = RC_LDG(p.lo + row), u = RC_LDG(p.hi + row);
    const acc_t f = RC_LDG(p.floor + row);
    const double m = static_cast<double>(RC_LDG(p.z_max + row));
    const scalar_t* z = p.z + row * p.ld;
    for (int64_t c = threadIdx.x; c < p.cols; c += blockDim.x) {
      const acc_t v = static_cast<acc_t>(RC_LDG(z + c));
      const long long key = ordered_key(v);
      if (!(v >= f) || v == acc_t(-INFINITY) || key <= l || key > u) continue;  // NaN: v >= f is false
      const int64_t mass = mass_of(mass_exp(static_cast<double>(v) - m));
      if (mass != 0) atomicAdd(hist + probes_below(probes, p.n_probes, key), static_cast<unsigned long long>(mass));
    }
    if (shared) {
      __syncthreads();  // every mass added before the buckets are written out
      // (no trailing barrier: the next row re-zeroes bucket b in the thread that writes it out here, and its probes
      // are last read before the barrier above)
      for (int64_t b = threadIdx.x; b < buckets; b += blockDim.x) {
        RC_STG(p.hist + row * buckets + b, static_cast<int64_t>(hist_s[b]));
      }
    }
  }
}

// ---- row_topk: the k largest values of each row ---------------------------------------------------------------

template <typename acc_t>
struct KeyOf;
template <>
struct KeyOf<float> {
  using type = uint32_t;
  static __device__ RC_FORCEINLINE uint32_t key(float v) { return ordered_u32(v); }
  static __device__ RC_FORCEINLINE float value(unsigned long long k) {
    return from_ordered_u32(static_cast<uint32_t>(k));
  }
};
template <>
struct KeyOf<double> {
  using type = uint64_t;
  static __device__ RC_FORCEINLINE uint64_t key(double v) { return ordered_u64(v); }
  static __device__ RC_FORCEINLINE double value(unsigned long long k) { return from_ordered_u64(k); }
};

// Per row: kk = min(k, cols); the kk-th largest by a radix select over the keys of the whole row (NaN as -inf: never
// a candidate), the values above it gathered (fewer than kk) and sorted in shared memory, then kk minus that many
// copies of the kk-th largest, then -inf. The row is read once per radix round plus once (k <= kTopkCap).
template <typename scalar_t, typename acc_t>
__global__ void row_topk_kernel(TopkParams<scalar_t, acc_t> p) {
  using K = KeyOf<acc_t>;
  using KeyT = typename K::type;
  RC_SHARED_ARRAY(unsigned long long, keys, kTopkCap);
  RC_SHARED_ARRAY(unsigned, hist, kRadixBins);
  RC_SHARED_ARRAY(unsigned long long, st, kSelSlots);
  const int warp = threadIdx.x / kWarpSize, num_warps = blockDim.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t kk = p.k < p.cols ? p.k : p.cols;
  const acc_t ninf = acc_t(-INFINITY);
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const scalar_t* x = p.values + row * p.ld;
    acc_t* out = p.out + row * p.k;
    if (kk == 0) {
      for (int64_t i = threadIdx.x; i < p.k; i += blockDim.x) RC_STG(out + i, ninf);
      continue;
    }
    auto key_at = [&](int64_t c) -> KeyT {
      const acc_t v = static_cast<acc_t>(RC_LDG(x + c));
      return K::key(v == v ? v : ninf);
    };
    radix_select_largest<KeyT>(
        [&](auto&& add) {
          for (int64_t c = threadIdx.x; c < p.cols; c += blockDim.x) add(true, key_at(c));
        },
        static_cast<unsigned long long>(kk), hist, st);
    const KeyT kth = static_cast<KeyT>(st[kSelPrefix]);
    // < kk <= kTopkCap; the bound only keeps a broken kernel (a planted race) inside shared memory
    const unsigned long long above = st[kSelAbove];
    const int n_above = static_cast<int>(above < static_cast<unsigned long long>(kk) ? above : kk - 1);
    if (threadIdx.x == 0) st[kSelCount0] = 0;
    __syncthreads();  // the counter zeroed before the gathering (and the state read by every thread)
    // gather the keys above the kk-th largest: warp-uniform sweeps, one shared atomic per warp and step
    const int64_t sweep = static_cast<int64_t>(num_warps) * kWarpSize;
    for (int64_t c0 = static_cast<int64_t>(warp) * kWarpSize; c0 < p.cols; c0 += sweep) {
      const int64_t c = c0 + lane;
      const KeyT key = c < p.cols ? key_at(c) : KeyT(0);
      const bool above = c < p.cols && key > kth;
      const unsigned long long slot = warp_reserve(above, st + kSelCount0);
      if (above && slot < static_cast<unsigned long long>(n_above)) keys[slot] = key;
    }
    const int n2 = pow2_at_least(n_above);
    for (int i = n_above + threadIdx.x; i < n2; i += blockDim.x) keys[i] = 0ull;  // below every key
    __syncthreads();  // the gathered keys and the padding before the sort
    bitonic_sort_descending(keys, n2);
    const acc_t kth_value = K::value(kth);
    for (int64_t i = threadIdx.x; i < p.k; i += blockDim.x) {
      const acc_t v = i < n_above ? K::value(keys[i]) : (i < kk ? kth_value : ninf);
      RC_STG(out + i, v);
    }
    // (no trailing barrier: the next row's radix select synchronises before it writes the keys or the state)
  }
}

// ---- row_candidates: the top-k replay's one read ---------------------------------------------------------------

// Running (max, sum e^(z - max)) of the finite values a lane saw: sum in fp64, each term e^(z - max) in fp32.
struct MaxSum {
  float m;
  double s;
};

__device__ RC_FORCEINLINE MaxSum max_sum_merge(MaxSum a, MaxSum b) {
  const float m = a.m > b.m ? a.m : b.m;
  if (m == -INFINITY) return {m, 0.0};
  const double sa = a.m == -INFINITY ? 0.0 : a.s * ::exp(static_cast<double>(a.m) - static_cast<double>(m));
  const double sb = b.m == -INFINITY ? 0.0 : b.s * ::exp(static_cast<double>(b.m) - static_cast<double>(m));
  return {m, sa + sb};
}

// Visits the columns of the tiles marked in `qual` (a bitmask over tiles): warp w takes tiles w, w + warps, ...;
// f(z, col, valid) is called by every lane of the warp for each step (valid: col < cols), so f may shuffle.
template <typename scalar_t, typename F>
__device__ RC_FORCEINLINE void for_each_in_marked_tiles(const CandidateParams<scalar_t>& p, const scalar_t* x,
                                                        const unsigned* qual, int64_t n_tiles, F&& f) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize, num_warps = blockDim.x / kWarpSize;
  const int64_t tile_cols = p.tile_steps * kWarpSize;
  for (int64_t j = warp; j < n_tiles; j += num_warps) {
    if (((qual[j / 32] >> (j % 32)) & 1u) == 0) continue;  // warp-uniform
    for (int64_t i = 0; i < p.tile_steps; ++i) {
      const int64_t c = j * tile_cols + i * kWarpSize + lane;
      const bool valid = c < p.cols;
      float z = -INFINITY;
      if (valid) {
        z = static_cast<float>(RC_LDG(x + c));
        if (!p.unit_t) z = z / p.t;
      }
      f(z, c, valid);
    }
  }
}

// Per row with k >= 1 (one block):
//   1. one read of the row's valid columns, z = x / T in fp32: its max and sum e^(z - max) (fp64 partials), NaN /
//      +inf (a bad row: no candidates), and the max of every tile of tile_steps * 32 consecutive columns (shared);
//   2. B = the k-th largest tile max (a radix select in shared memory): at most the row's k-th largest value (k
//      tiles hold a value that large), so every value >= the k-th largest lies in a tile whose max is >= B;
//   3. the values >= B of those tiles gathered into shared memory (they are few: about k for i.i.d. logits) and
//      sorted by (value descending, column ascending); the k-th of them is the row's k-th largest, and the ones at
//      or above it are the candidates;
//   4. when more than kCandCap values are >= B (long runs of ties), the exact route instead: the k-th largest by a
//      radix select over those tiles, the number of ties, the columns of the ties that fit (a radix select over the
//      columns), then those and the values above the k-th largest gathered and sorted.
// The marked tiles are read again (from L2: a few per cent of the row for i.i.d. logits).
template <typename scalar_t>
__global__ void row_candidates_kernel(CandidateParams<scalar_t> p) {
  RC_SHARED_ARRAY(unsigned long long, buf, kCandCap);  // tile maxima (fp32), then the candidates' sort keys
  RC_SHARED_ARRAY(unsigned, qual, kCandMaxTiles / 32);  // the marked tiles
  RC_SHARED_ARRAY(unsigned, hist, kRadixBins);
  RC_SHARED_ARRAY(unsigned long long, st, kSelSlots);
  RC_SHARED_ARRAY(float, red_m, kWarpSize);
  RC_SHARED_ARRAY(double, red_s, kWarpSize);
  RC_SHARED_ARRAY(int, red_bad, kWarpSize);
  float* const tile_max = reinterpret_cast<float*>(buf);
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize, num_warps = blockDim.x / kWarpSize;
  const int64_t tile_cols = p.tile_steps * kWarpSize;
  const int64_t n_tiles = (p.cols + tile_cols - 1) / tile_cols;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const int64_t k = RC_LDG(p.k + row);
    float* vout = p.values + row * p.width;
    int64_t* iout = p.index + row * p.width;
    double* stats = p.stats + row * 3;
    if (k <= 0 || p.cols == 0) {  // an ignored row: never read
      for (int64_t w = threadIdx.x; w < p.width; w += blockDim.x) {
        RC_STG(vout + w, -INFINITY);
        RC_STG(iout + w, int64_t(-1));
      }
      if (threadIdx.x == 0) {
        RC_STG(p.count + row, int64_t(0));
        RC_STG(stats + 0, -static_cast<double>(INFINITY));
        RC_STG(stats + 1, 0.0);
        RC_STG(stats + 2, -static_cast<double>(INFINITY));
      }
      continue;
    }
    const scalar_t* x = p.x + row * p.ld;

    // 1. the read: per lane, tile maxima, the running max and sum, NaN / +inf
    MaxSum ms{-INFINITY, 0.0};
    int bad = 0;
    for (int64_t j = warp; j < n_tiles; j += num_warps) {
      float tm = -INFINITY;
      for (int64_t i = 0; i < p.tile_steps; ++i) {
        const int64_t c = j * tile_cols + i * kWarpSize + lane;
        if (c >= p.cols) break;
        float z = static_cast<float>(RC_LDG(x + c));
        if (!p.unit_t) z = z / p.t;
        if (!(z < INFINITY)) {  // NaN or +inf
          bad = 1;
        } else if (z > -INFINITY) {
          tm = z > tm ? z : tm;
          if (z > ms.m) {
            ms.s = (ms.m == -INFINITY ? 0.0 : ms.s * ::exp(static_cast<double>(ms.m) - static_cast<double>(z))) + 1.0;
            ms.m = z;
          } else {
            ms.s += static_cast<double>(::expf(z - ms.m));
          }
        }
      }
      tm = warp_max(tm);
      if (lane == 0) tile_max[j] = tm;
    }
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
      MaxSum o;
      o.m = __shfl_xor_sync(kFullWarpMask, ms.m, offset);
      o.s = __shfl_xor_sync(kFullWarpMask, ms.s, offset);
      ms = max_sum_merge(ms, o);
      const int ob = __shfl_xor_sync(kFullWarpMask, bad, offset);
      bad = ob > bad ? ob : bad;
    }
    if (lane == 0) {
      red_m[warp] = ms.m;
      red_s[warp] = ms.s;
      red_bad[warp] = bad;
    }
    if (threadIdx.x == 0) {
      st[kSelCount0] = 0;
      st[kSelCount1] = 0;
    }
    __syncthreads();  // the warps' partials and the tile maxima before every thread reads them
    ms = MaxSum{-INFINITY, 0.0};
    bad = 0;
    for (int w = 0; w < num_warps; ++w) {  // in warp order: the same result in every thread
      ms = max_sum_merge(ms, MaxSum{red_m[w], red_s[w]});
      bad |= red_bad[w];
    }
    if (threadIdx.x == 0) {
      const int64_t tc = RC_LDG(p.target + row);
      double zt = -static_cast<double>(INFINITY);
      if (tc >= 0 && tc < p.cols) {
        float z = static_cast<float>(RC_LDG(x + tc));
        if (!p.unit_t) z = z / p.t;
        zt = z;
      }
      RC_STG(stats + 0, bad ? static_cast<double>(NAN) : static_cast<double>(ms.m));
      RC_STG(stats + 1, bad ? 0.0 : ms.s);
      RC_STG(stats + 2, zt);
    }

    int64_t count = 0;  // the values at or above the k-th largest
    int n_out = 0;      // of which the list holds the first n_out, sorted in buf
    if (!bad && ms.m > -INFINITY) {
      // 2. B: the k-th largest finite tile max (-inf when fewer tiles than k hold a finite value)
      radix_select_largest<uint32_t>(
          [&](auto&& add) {
            for (int64_t j = threadIdx.x; j < n_tiles; j += blockDim.x) {
              const float tm = tile_max[j];
              add(tm > -INFINITY, ordered_u32(tm));
            }
          },
          static_cast<unsigned long long>(k), hist, st);
      const float bound = st[kSelFound] ? from_ordered_u32(static_cast<uint32_t>(st[kSelPrefix])) : -INFINITY;
      for (int64_t w = threadIdx.x; w < (n_tiles + 31) / 32; w += blockDim.x) {
        unsigned bits = 0;
        for (int b = 0; b < 32 && w * 32 + b < n_tiles; ++b) {
          const float tm = tile_max[w * 32 + b];
          bits |= static_cast<unsigned>(tm > -INFINITY && tm >= bound) << b;
        }
        qual[w] = bits;
      }
      __syncthreads();  // the marks before the gathering (and every tile max read before buf is overwritten)

      // 3. the values >= B of the marked tiles, into buf while they fit
      for_each_in_marked_tiles(p, x, qual, n_tiles, [&](float z, int64_t c, bool valid) {
        const bool take = valid && z >= bound && z > -INFINITY;
        const unsigned long long slot = warp_reserve(take, st + kSelCount0);
        if (take && slot < kCandCap) buf[slot] = candidate_key(z, c);
      });
      __syncthreads();  // the gathered keys and their count
      const unsigned long long n_bound = st[kSelCount0];
      bool exact = n_bound > static_cast<unsigned long long>(kCandCap);
      if (!exact) {
        n_out = static_cast<int>(n_bound);
      } else {
        // 4. the exact route: the k-th largest of the marked tiles' values, then the ties' columns that fit
        radix_select_largest<uint32_t>(
            [&](auto&& add) {
              for_each_in_marked_tiles(p, x, qual, n_tiles, [&](float z, int64_t, bool valid) {
                add(valid && z > -INFINITY, ordered_u32(z));
              });
            },
            static_cast<unsigned long long>(k), hist, st);
        const uint32_t kth = static_cast<uint32_t>(st[kSelPrefix]);
        const int64_t n_above = static_cast<int64_t>(st[kSelAbove]);  // < k <= width
        const int64_t n_equal = static_cast<int64_t>(st[kSelEqual]);
        const int64_t room = p.width > n_above ? p.width - n_above : 0;
        const int64_t take_equal = n_equal < room ? n_equal : room;
        uint32_t col_cut = 0;  // ties kept: 0xFFFFFFFF - col >= col_cut (the take_equal smallest columns)
        if (take_equal < n_equal) {
          radix_select_largest<uint32_t>(
              [&](auto&& add) {
                for_each_in_marked_tiles(p, x, qual, n_tiles, [&](float z, int64_t c, bool valid) {
                  add(valid && ordered_u32(z) == kth, static_cast<uint32_t>(0xFFFFFFFFull - static_cast<uint64_t>(c)));
                });
              },
              static_cast<unsigned long long>(take_equal), hist, st);
          col_cut = static_cast<uint32_t>(st[kSelPrefix]);
        }
        for_each_in_marked_tiles(p, x, qual, n_tiles, [&](float z, int64_t c, bool valid) {
          const uint32_t key = ordered_u32(z);
          const bool take = valid && z > -INFINITY &&
                            (key > kth || (key == kth && 0xFFFFFFFFull - static_cast<uint64_t>(c) >= col_cut));
          const unsigned long long slot = warp_reserve(take, st + kSelCount1);
          if (take && slot < kCandCap) buf[slot] = candidate_key(z, c);  // n_above + take_equal <= width <= kCandCap
        });
        count = n_above + n_equal;
        n_out = static_cast<int>(n_above + take_equal < kCandCap ? n_above + take_equal : kCandCap);
      }
      const int n2 = pow2_at_least(n_out);
      for (int i = n_out + threadIdx.x; i < n2; i += blockDim.x) buf[i] = 0ull;  // below every key
      __syncthreads();  // the gathered keys (the exact route's) and the padding before the sort
      bitonic_sort_descending(buf, n2);
      if (!exact) {
        // every value >= B is in buf: the k-th of them is the row's k-th largest; keep the run tied with it
        count = n_out;
        if (n_out >= k) {
          const uint64_t kth_hi = buf[k - 1] >> 32;
          int lo = static_cast<int>(k), hi = n_out;  // the first index past the tied run, by bisection
          while (lo < hi) {
            const int mid = (lo + hi) / 2;
            if ((buf[mid] >> 32) == kth_hi) {
              lo = mid + 1;
            } else {
              hi = mid;
            }
          }
          count = lo;
        }
        n_out = static_cast<int>(count < p.width ? count : p.width);
      }
    }
    for (int64_t w = threadIdx.x; w < p.width; w += blockDim.x) {
      const bool in = w < n_out;
      RC_STG(vout + w, in ? candidate_value(buf[w]) : -INFINITY);
      RC_STG(iout + w, in ? candidate_col(buf[w]) : int64_t(-1));
    }
    if (threadIdx.x == 0) RC_STG(p.count + row, count);
    __syncthreads();  // buf, the partials and the state are rewritten for the next row
  }
}

// ---- candidate_decide: the replay's decision on the gathered candidates -----------------------------------------

// Per row with k >= 1 (one block; the candidates in any order): the k-th largest by a radix select (count), tau =
// max(floor, it); with top-p, the total integer mass of the survivors (>= tau, > -inf), the budget min(floor((1 -
// p) M), M - 1) and the cut by a radix select weighted by mass; then the kept set's sums in fp64 (block sums in a
// fixed order) and thread 0 writes tau and the four outputs. The row is read once per radix round (it is small:
// the shards' candidate lists).
template <typename acc_t>
__global__ void candidate_decide_kernel(DecideParams<acc_t> p) {
  using K = KeyOf<acc_t>;
  using KeyT = typename K::type;
  RC_SHARED_ARRAY(unsigned, hist, kRadixBins);
  RC_SHARED_ARRAY(unsigned long long, hist_mass, kRadixBins);
  RC_SHARED_ARRAY(unsigned long long, st, kSelSlots);
  RC_SHARED_ARRAY(long long, red_i, kWarpSize);
  RC_SHARED_ARRAY(double, red_d, kWarpSize);
  const acc_t ninf = acc_t(-INFINITY);
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const int64_t k = RC_LDG(p.k + row);
    if (k <= 0) {
      if (threadIdx.x == 0) {
        RC_STG(p.tau + row, ninf);
        for (int j = 0; j < 4; ++j) RC_STG(p.out + row * 4 + j, 0.0);
      }
      continue;
    }
    const acc_t* c = p.cand + row * p.width;
    const double m = RC_LDG(p.z_max + row);
    const int64_t kk = k < p.width ? k : p.width;
    radix_select_largest<KeyT>(
        [&](auto&& add) {
          for (int64_t i = threadIdx.x; i < p.width; i += blockDim.x) add(true, K::key(RC_LDG(c + i)));
        },
        static_cast<unsigned long long>(kk), hist, st);
    const acc_t kth = K::value(st[kSelPrefix]);
    const acc_t f = RC_LDG(p.floor + row);
    acc_t tau = kth > f ? kth : f;
    const double top_p = RC_LDG(p.top_p + row);
    if (top_p < 1.0) {
      long long total = 0;
      for (int64_t i = threadIdx.x; i < p.width; i += blockDim.x) {
        const acc_t v = RC_LDG(c + i);
        if (v >= tau && v != ninf) total += mass_of(mass_exp(static_cast<double>(v) - m));
      }
      total = block_sum(total, red_i);
      const long long budget_p = static_cast<long long>(::floor((1.0 - top_p) * static_cast<double>(total)));
      const long long budget = budget_p < total - 1 ? budget_p : total - 1;
      const acc_t tau_k = tau;
      radix_select_mass<KeyT>(
          [&](auto&& add) {
            for (int64_t i = threadIdx.x; i < p.width; i += blockDim.x) {
              const acc_t v = RC_LDG(c + i);
              const bool surv = v >= tau_k && v != ninf;
              add(surv, K::key(v), surv ? mass_of(mass_exp(static_cast<double>(v) - m)) : 0ll);
            }
          },
          budget, hist, hist_mass, st);
      if (st[kSelFound]) {  // no survivor (a floor above every candidate): tau stays, as on the CPU
        const acc_t cut = K::value(st[kSelPrefix]);
        tau = cut > tau ? cut : tau;
      }
    }
    double s = 0.0, s_rel = 0.0;
    for (int64_t i = threadIdx.x; i < p.width; i += blockDim.x) {
      const acc_t v = RC_LDG(c + i);
      if (v >= tau && v != ninf) {
        const double rel = static_cast<double>(v) - m;
        const double e = mass_exp(rel);
        s += e;
        s_rel += e * rel;
      }
    }
    s = block_sum(s, red_d);
    s_rel = block_sum(s_rel, red_d);
    if (threadIdx.x == 0) {
      const double log_kept = ::log(s);
      const double zt = RC_LDG(p.z_t + row);
      const bool in = zt >= static_cast<double>(tau) && zt != -static_cast<double>(INFINITY);
      const double log_s = log_kept - ::log(RC_LDG(p.sum_all + row));
      RC_STG(p.tau + row, tau);
      RC_STG(p.out + row * 4 + 0, in ? (zt - m) - log_kept : -static_cast<double>(INFINITY));
      RC_STG(p.out + row * 4 + 1, log_kept - s_rel / s);  // H = -sum q log q, q = e / s, log q = rel - log s
      RC_STG(p.out + row * 4 + 2, log_s < 0.0 ? log_s : 0.0);
      RC_STG(p.out + row * 4 + 3, log_kept);
    }
  }
}

}  // namespace rollout_corr
