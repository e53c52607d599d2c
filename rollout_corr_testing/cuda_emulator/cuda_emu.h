// A CUDA thread-model emulator for the CPU (test infrastructure, docs/cuda_kernels.md).
//
// Include this header *before* any csrc/cuda/*_kernels.cuh file and compile with g++: the kernels build
// unchanged and `emu::launch(kernel, grid, block, dynamic_smem_bytes, args...)` runs them thread by thread.
//
// Thread model:
//   * Blocks run one after another. The threads of a block are fibers (ucontext) on one OS thread, run by a
//     turnstile: each thread runs alone until it reaches a synchronisation point (__syncthreads, a warp
//     shuffle, __syncwarp) or exits, then the next thread runs. The order (emu::set_schedule) is ascending or
//     descending thread id, or warp-major (one warp at a time runs, shuffles included, until all its threads wait
//     at a __syncthreads or exited, then the next warp: the last warp first, or the first), so a missing barrier
//     lets one thread read shared memory that others have not written yet, or one warp run a row ahead of the
//     others -- deterministically, not by luck.
//   * __syncthreads is a real barrier: it releases once every thread of the block has arrived. A thread that
//     exits while others wait at a barrier, a barrier reached by only part of the block, or threads waiting at
//     different __syncthreads statements, is reported as an error (synccheck: undefined behaviour on a GPU).
//   * Warp shuffles are warp-wide rendezvous over 32-lane warps: every lane of the warp must arrive (full
//     mask), then each lane reads the value its source lane posted. Partial participation is an error.
//   * Shared memory declared with RC_SHARED_ARRAY / RC_DYNAMIC_SHARED comes from a per-block arena that is
//     poisoned (all bytes 0xFF: NaN for floats, -1 for integers) before every block, so reading a slot
//     nobody wrote in this block gives a visibly wrong value. Plain `__shared__` maps to `static` (one copy
//     per kernel instantiation, not poisoned).
//   * Atomics are plain read-modify-writes: fibers only switch at synchronisation points, so they are atomic.
//
// Instruments (what the tests read back through torch.ops.rollout_corr_emu.launch_records):
//   * Global-memory traffic. RC_LDG / RC_STG (csrc/include/rc_macros.h), through which every global access of the
//     device code goes, are defined here first: while recording (emu::recorder().on) each access is logged with
//     its site (file:line of the macro), address, size and its warp-level request. A request is what one
//     instruction does for the lanes of a warp: the instruction is the inlined copy of the macro (its program
//     counter: a helper called from two places is two instructions, as on the GPU), and lane k's n-th execution of
//     it since the warp last synchronised (shuffle, __syncwarp, __syncthreads) is grouped with every other lane's
//     n-th -- fibers run one at a time, so a per-lane dynamic count stands in for the lock step, re-aligned wherever
//     the warp is known to be converged. (Lanes that leave a loop early and enter it again before the warp next
//     synchronises would be grouped with the wrong iteration: the elementwise kernels' grid-stride loops over rows
//     do that only with several rows per block, which their launchers never use.)
//     The records give per launch, per site and per buffer the bytes read and written and, per request, the
//     distinct 32-byte sectors touched against Nsight Compute's ideal ceil(distinct bytes / 32) and against the
//     alignment-aware minimum (the sectors a gapless byte range spans, e.g. 5 for 128 bytes that start mid-sector).
//   * racecheck (like compute-sanitizer's): between two barriers of a block, a shared-memory byte written by one
//     thread and read or written by another, or accessed by a plain access and an atomic of another thread, is a
//     hazard, reported with the kernel, the shared array and element, the two threads and the two source lines.
//     Every load and store of the emulated code reaches the checker, pointers into the arena passed to helper
//     functions included: the emulator is compiled with GCC's kernel-address-sanitizer instrumentation in its
//     outline form (a call to __asan_{load,store}N_noabort(addr) before each access), and those callbacks are
//     defined below (RC_EMU_RACECHECK; loader.py sets it; unavailable in the AddressSanitizer build, which owns
//     those symbols). Threads of one warp are ordered by __syncwarp only (as in CUDA's memory model).
//   * synccheck: see __syncthreads above; per launch, how often each __syncthreads statement released the block.
#pragma once

#define RC_CUDA_EMULATOR 1

#include <cxxabi.h>
#include <dlfcn.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
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

#define RC_EMU_NOINSTR __attribute__((no_sanitize_address))
#define RC_EMU_ALWAYS_INLINE inline __attribute__((always_inline))

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace emu {

constexpr int kWarp = 32;
constexpr int kSectorBytes = 32;

enum class Schedule : int { kAscending = 0, kDescending = 1, kWarpMajorDescending = 2, kWarpMajorAscending = 3 };

class EmulatorError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class State { kReady, kBarrier, kWarpSync, kDone };

// ---- access sites --------------------------------------------------------------------------------------------------

// A source location the instruments name: an RC_LDG / RC_STG expansion, or the call of an atomic.
struct SiteInfo {
  const char* file;
  int line;
  bool store;
};

inline std::mutex& site_mutex() {
  static std::mutex m;
  return m;
}
inline std::vector<SiteInfo>& site_table() {
  static std::vector<SiteInfo> t;
  return t;
}
inline int register_site(const char* file, int line, bool store) {
  std::lock_guard<std::mutex> g(site_mutex());
  site_table().push_back({file, line, store});
  return static_cast<int>(site_table().size()) - 1;
}
inline SiteInfo site_info(int id) {
  std::lock_guard<std::mutex> g(site_mutex());
  return site_table()[static_cast<size_t>(id)];
}
// The same (file, line) always gets the same id (for call sites seen at run time: atomics).
inline int intern_site(const char* file, int line) {
  static std::map<std::pair<std::string, int>, int> ids;
  static std::mutex m;
  std::lock_guard<std::mutex> g(m);
  auto key = std::make_pair(std::string(file), line);
  auto it = ids.find(key);
  if (it != ids.end()) return it->second;
  const int id = register_site(file, line, true);
  ids.emplace(key, id);
  return id;
}
inline std::string base_name(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}
inline std::string site_name(int id) {
  const SiteInfo s = site_info(id);
  return base_name(s.file) + ":" + std::to_string(s.line);
}

// ---- what a launch records --------------------------------------------------------------------------------------

struct GlobalAccess {
  uintptr_t addr;
  uint32_t size;
  uint32_t request;  // index into LaunchRecord::request_site
};

struct LaunchRecord {
  std::string kernel;
  dim3 grid, block;
  std::vector<GlobalAccess> log;       // every global access, in execution order
  std::vector<int> request_site;       // per warp-level request: its site (whose `store` says load or store)
  std::map<std::string, uint64_t> barriers;  // "file:line" of a __syncthreads -> how often it released the block
  std::vector<std::string> hazards;    // distinct racecheck hazards (the first occurrence of each)
  uint64_t hazard_count = 0;           // every occurrence
};

// Launch records are kept between record_start() and the next record_start() while `on`.
struct Recorder {
  bool on = false;
  std::vector<LaunchRecord> launches;
};
inline Recorder& recorder() {
  static Recorder r;
  return r;
}
inline bool g_traffic_on = false;  // recorder().on, read on every RC_LDG / RC_STG

inline void record_start() {
  recorder().launches.clear();
  recorder().on = g_traffic_on = true;
}
inline void record_stop() { recorder().on = g_traffic_on = false; }

// racecheck: 0 off, 1 record hazards in the launch record, 2 record and fail the launch (the default).
constexpr bool racecheck_available() {
#ifdef RC_EMU_RACECHECK
  return true;
#else
  return false;
#endif
}
inline int& racecheck_mode() {
  static int mode = [] {
    const char* env = std::getenv("ROLLOUT_CORR_EMU_RACECHECK");
    return env ? std::atoi(env) : 2;
  }();
  return mode;
}

// ---- fibers, launches --------------------------------------------------------------------------------------------

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
  bool syncwarp = false;  // the posted warp op is a __syncwarp (orders memory between the lanes)
  // The __syncthreads statement this thread waits at.
  const char* barrier_file = nullptr;
  int barrier_line = 0;
  // Per global-access instruction: how many times this thread executed it since its warp last synchronised.
  std::unordered_map<uintptr_t, uint32_t> pc_count;
  uint64_t count_epoch = ~uint64_t(0);  // the warp's synchronisation count pc_count belongs to
};

// A warp-level request: (instruction, warp, the warp's synchronisation count, per-lane execution count).
struct RequestKey {
  uintptr_t pc;
  uint64_t warp, epoch, n;
  bool operator==(const RequestKey& o) const { return pc == o.pc && warp == o.warp && epoch == o.epoch && n == o.n; }
};
struct RequestKeyHash {
  size_t operator()(const RequestKey& k) const {
    uint64_t h = (k.pc ^ (k.warp << 56)) * 0x9E3779B97F4A7C15ull;
    h ^= (k.epoch + 0x632BE59BD9B4E019ull + (h << 6) + (h >> 2));
    h ^= (k.n + 0x85EBCA77C2B2AE63ull + (h << 6) + (h >> 2));
    return static_cast<size_t>(h);
  }
};

// One racecheck shadow entry per shared-memory byte: the accesses of the current barrier interval (an epoch).
struct ShadowAccess {
  int32_t tid = -1;
  uint32_t warp_syncs = 0;  // __syncwarp releases of the thread's warp before the access
  uintptr_t where = 0;      // the instruction (pc) or, with the top bit set, an interned atomic site
};
struct ShadowByte {
  uint64_t write_epoch = 0;
  ShadowAccess write;  // the last plain write
  uint64_t read_epoch = 0;
  ShadowAccess read[2];  // up to two distinct plain readers
  uint64_t atomic_epoch = 0;
  ShadowAccess atomic[2];  // up to two distinct atomic accessors
};

// A named shared array of the running block (RC_SHARED_ARRAY / RC_DYNAMIC_SHARED), for hazard reports.
struct SharedRegion {
  size_t offset, bytes, elem;
  const char* name;
};

struct Launch {
  dim3 grid, block;
  uint3 block_idx;
  const void* kernel = nullptr;
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
  std::vector<SharedRegion> regions;
  std::string error;
  uint64_t sync_points = 0;
  // Instruments.
  LaunchRecord* rec = nullptr;  // traffic, barriers, hazards (nullptr: nothing to record)
  std::unordered_map<RequestKey, uint32_t, RequestKeyHash> requests;  // -> request index, for the running block
  std::vector<uint64_t> warp_epochs;  // synchronisations (warp ops and barriers) of each warp in this block
  std::vector<uint32_t> warp_syncs;   // __syncwarp releases per warp in this block
  int barrier_interval = 0;          // barriers released in this block so far
  std::string last_barrier;          // "file:line" of the last one
  std::map<std::string, size_t> hazard_index;
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
inline T* block_shared(size_t count, const void* key, const char* name = "shared") {
  Launch& l = L();
  auto it = l.static_slots.find(key);
  if (it != l.static_slots.end()) return reinterpret_cast<T*>(it->second);
  unsigned char* p = arena_alloc(sizeof(T) * count);
  l.static_slots[key] = p;
  l.regions.push_back({static_cast<size_t>(p - l.arena.data()), sizeof(T) * count, sizeof(T), name});
  return reinterpret_cast<T*>(p);
}

template <typename T>
inline T* dynamic_shared() {
  Launch& l = L();
  for (auto& r : l.regions)
    if (l.dynamic_base != nullptr && r.offset == static_cast<size_t>(l.dynamic_base - l.arena.data())) r.elem = sizeof(T);
  return reinterpret_cast<T*>(l.dynamic_base);
}

inline uint3 thread_idx() { return L().current->tid; }

// ---- global-memory traffic (RC_LDG / RC_STG) ------------------------------------------------------------------------

// The program counter of the inlined copy this is expanded in: which instruction an RC_LDG / RC_STG is.
RC_EMU_ALWAYS_INLINE uintptr_t this_instruction() {
  uintptr_t pc = 0;
#if defined(__x86_64__)
  asm volatile("lea 0(%%rip), %0" : "=r"(pc));
#elif defined(__aarch64__)
  asm volatile("adr %0, ." : "=r"(pc));
#endif
  return pc;
}

inline void record_global(const void* p, uint32_t size, int site, uintptr_t pc) {
  Launch* l = current_launch();
  if (l == nullptr || l->current == nullptr || l->rec == nullptr) return;  // host code, or not recording
  Fiber& f = *l->current;
  const size_t warp = static_cast<size_t>(f.linear / kWarp);
  const uint64_t epoch = l->warp_epochs[warp];
  if (f.count_epoch != epoch) {  // the warp synchronised since this lane's last access: the counts re-align
    f.pc_count.clear();
    f.count_epoch = epoch;
  }
  if (pc == 0) pc = static_cast<uintptr_t>(site) + 1;  // no program counter on this target: the source site
  const uint64_t n = f.pc_count[pc]++;
  const RequestKey key{pc, warp, epoch, n};
  auto it = l->requests.find(key);
  if (it == l->requests.end()) {
    it = l->requests.emplace(key, static_cast<uint32_t>(l->rec->request_site.size())).first;
    l->rec->request_site.push_back(site);
  }
  l->rec->log.push_back({reinterpret_cast<uintptr_t>(p), size, it->second});
}

// Sectors of one warp-level request (its lanes' byte ranges): distinct 32-byte sectors touched, Nsight Compute's ideal
// ceil(distinct bytes / 32), and the alignment-aware minimum (the sectors a gapless range spans, else the ideal).
struct RequestSectors {
  uint64_t sectors = 0, ideal = 0, minimum = 0, bytes = 0, unique_bytes = 0, lanes = 0;
};
inline RequestSectors request_sectors(std::vector<std::pair<uintptr_t, uint32_t>>& lanes) {
  RequestSectors r;
  if (lanes.empty()) return r;
  std::sort(lanes.begin(), lanes.end());
  uintptr_t covered_to = lanes.front().first;  // end of the union of the byte ranges so far
  bool gapless = true;
  std::vector<uintptr_t> sectors;
  for (const auto& a : lanes) {
    r.bytes += a.second;
    r.lanes += 1;
    const uintptr_t end = a.first + a.second;
    if (a.first > covered_to) gapless = false;
    const uintptr_t begin = std::max(a.first, covered_to);
    if (end > begin) r.unique_bytes += end - begin;
    covered_to = std::max(covered_to, end);
    for (uintptr_t s = a.first / kSectorBytes; s <= (end - 1) / kSectorBytes; ++s) sectors.push_back(s);
  }
  std::sort(sectors.begin(), sectors.end());
  r.sectors = static_cast<uint64_t>(std::unique(sectors.begin(), sectors.end()) - sectors.begin());
  r.ideal = (r.unique_bytes + kSectorBytes - 1) / kSectorBytes;
  r.minimum = gapless ? (covered_to - 1) / kSectorBytes - lanes.front().first / kSectorBytes + 1 : r.ideal;
  return r;
}

inline void flush_requests(Launch& l) { l.requests.clear(); }

template <typename T, typename SiteFn>
RC_EMU_ALWAYS_INLINE std::remove_cv_t<T> ldg(T* p, SiteFn site) {
  if (g_traffic_on) record_global(p, sizeof(T), site(), this_instruction());
  return *p;
}
template <typename T, typename V, typename SiteFn>
RC_EMU_ALWAYS_INLINE void stg(T* p, V&& value, SiteFn site) {
  if (g_traffic_on) record_global(p, sizeof(T), site(), this_instruction());
  *p = std::forward<V>(value);
}

// ---- racecheck ----------------------------------------------------------------------------------------------------

// The arena of the running block while racecheck watches it (plain globals: read by every instrumented access).
inline uintptr_t g_race_lo = 0;
inline uintptr_t g_race_len = 0;
inline uint64_t g_epoch = 0;           // barrier interval, unique across blocks and launches
inline int g_atomic_depth = 0;         // inside an emulated atomic
inline uintptr_t g_atomic_where = 0;   // its interned call site (top bit set)
constexpr uintptr_t kAtomicTag = uintptr_t(1) << 63;

inline std::vector<ShadowByte>& shadow() {
  static std::vector<ShadowByte> s;
  return s;
}

inline std::string thread_name(const Launch& l, int linear) {
  const unsigned x = linear % l.block.x, y = (linear / l.block.x) % l.block.y, z = linear / (l.block.x * l.block.y);
  std::string s = "thread " + std::to_string(x);
  if (l.block.y > 1 || l.block.z > 1) s += "," + std::to_string(y) + "," + std::to_string(z);
  return s + " (warp " + std::to_string(linear / kWarp) + ")";
}

struct PendingHazard {
  const char* kind;
  ShadowAccess first;
  bool first_write, first_atomic;
};

// `where` -> "file:line": atomics carry their call site; plain accesses their pc, resolved with addr2line (the
// emulator is built with line tables) to the innermost source line that is not the emulator's.
inline std::string describe_where(uintptr_t where) {
  if (where & kAtomicTag) return site_name(static_cast<int>(where & ~kAtomicTag));
  static std::map<uintptr_t, std::string> cache;
  auto it = cache.find(where);
  if (it != cache.end()) return it->second;
  std::string out;
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(where), &info) != 0 && info.dli_fname != nullptr) {
    const uintptr_t offset = where - 1 - reinterpret_cast<uintptr_t>(info.dli_fbase);
    char cmd[4096];
    std::snprintf(cmd, sizeof(cmd), "addr2line -i -e '%s' 0x%llx 2>/dev/null", info.dli_fname,
                  static_cast<unsigned long long>(offset));
    if (FILE* pipe = popen(cmd, "r")) {
      char line[4096];
      while (std::fgets(line, sizeof(line), pipe) != nullptr) {
        std::string s(line);
        while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
        const size_t disc = s.find(" (discriminator");
        if (disc != std::string::npos) s.resize(disc);
        if (s.empty() || s[0] == '?' || s.find("cuda_emu.h") != std::string::npos) continue;
        out = base_name(s);
        break;
      }
      pclose(pipe);
    }
    if (out.empty() && info.dli_sname != nullptr) out = std::string(info.dli_sname) + "+?";
  }
  if (out.empty()) {
    std::ostringstream os;
    os << "pc " << reinterpret_cast<void*>(where);
    out = os.str();
  }
  cache.emplace(where, out);
  return out;
}

inline std::string kernel_name(const void* kernel) {
  Dl_info info;
  std::string name;
  if (kernel != nullptr && dladdr(kernel, &info) != 0 && info.dli_sname != nullptr) {
    int status = 0;
    char* d = abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status);
    name = (status == 0 && d != nullptr) ? d : info.dli_sname;
    std::free(d);
    if (name.rfind("void ", 0) == 0) name = name.substr(5);
    // Drop the parameter list: the template arguments say which instantiation ran.
    int depth = 0;
    for (size_t i = 0; i < name.size(); ++i) {
      if (name[i] == '<') ++depth;
      if (name[i] == '>') --depth;
      if (name[i] == '(' && depth == 0) {
        name.resize(i);
        break;
      }
    }
    const std::string ns = "rollout_corr::";
    for (size_t pos; (pos = name.find(ns)) != std::string::npos;) name.erase(pos, ns.size());
  } else {
    std::ostringstream os;
    os << "kernel@" << kernel;
    name = os.str();
  }
  return name;
}

inline void report_hazard(Launch& l, const PendingHazard& h, int tid, uintptr_t where, bool write, bool atomic,
                          size_t offset) {
  if (l.rec == nullptr) return;
  l.rec->hazard_count += 1;
  const SharedRegion* region = nullptr;
  for (const auto& r : l.regions)
    if (offset >= r.offset && offset < r.offset + r.bytes) region = &r;
  auto access = [](bool w, bool a) { return a ? "atomic" : (w ? "write" : "read"); };
  const std::string a_site = describe_where(h.first.where), b_site = describe_where(where);
  const std::string key = std::string(h.kind) + "|" + a_site + "|" + b_site + "|" + (region ? region->name : "?");
  if (l.hazard_index.count(key) != 0 || l.rec->hazards.size() >= 64) return;
  l.hazard_index[key] = l.rec->hazards.size();
  std::ostringstream os;
  os << "racecheck: " << h.kind << " hazard in " << kernel_name(l.kernel) << ", block (" << l.block_idx.x << ","
     << l.block_idx.y << "," << l.block_idx.z << "), shared ";
  if (region != nullptr)
    os << region->name << "[" << (offset - region->offset) / region->elem << "]";
  else
    os << "byte +" << offset;
  os << ": " << access(h.first_write, h.first_atomic) << " by " << thread_name(l, h.first.tid) << " at " << a_site
     << ", then " << access(write, atomic) << " by " << thread_name(l, tid) << " at " << b_site
     << ", with no __syncthreads between them (barrier interval " << l.barrier_interval;
  if (!l.last_barrier.empty()) os << ", after the __syncthreads at " << l.last_barrier;
  os << ")";
  l.rec->hazards.push_back(os.str());
}

// One access by the running thread to [addr, addr + n) inside the watched arena.
inline void race_slow(uintptr_t addr, size_t n, bool write, uintptr_t where) {
  Launch* lp = current_launch();
  if (lp == nullptr || lp->current == nullptr) return;
  Launch& l = *lp;
  const uintptr_t saved_len = g_race_len;
  g_race_len = 0;  // the checker's own accesses are not the kernel's
  const bool atomic = g_atomic_depth > 0;
  if (atomic) where = g_atomic_where;
  const size_t offset = addr - g_race_lo;
  std::vector<ShadowByte>& sh = shadow();
  if (sh.size() < offset + n) sh.resize(std::max(offset + n, std::min(l.arena.size(), sh.size() * 2 + 4096)));
  const int tid = l.current->linear;
  const int warp = tid / kWarp;
  const uint32_t syncs = l.warp_syncs[static_cast<size_t>(warp)];
  const uint64_t e = g_epoch;
  const ShadowAccess me{tid, syncs, where};
  // An earlier access of this barrier interval that this one is not ordered after.
  auto unordered = [&](const ShadowAccess& o) {
    return o.tid >= 0 && o.tid != tid && !(o.tid / kWarp == warp && o.warp_syncs < syncs);
  };
  bool reported = false;
  for (size_t b = offset; b < offset + n; ++b) {
    ShadowByte& s = sh[b];
    if (!reported) {
      // The earlier access of this interval by another thread that this one conflicts with, if any.
      PendingHazard h{nullptr, {}, false, false};
      if (s.write_epoch == e && unordered(s.write))
        h = {atomic ? "atomic-after-write" : (write ? "write-after-write" : "read-after-write"), s.write, true, false};
      if (h.kind == nullptr && (write || atomic) && s.read_epoch == e) {
        for (const auto& r : s.read)
          if (h.kind == nullptr && unordered(r))
            h = {atomic ? "atomic-after-read" : "write-after-read", r, false, false};
      }
      if (h.kind == nullptr && !atomic && s.atomic_epoch == e) {
        for (const auto& a : s.atomic)
          if (h.kind == nullptr && unordered(a)) h = {write ? "write-after-atomic" : "read-after-atomic", a, true, true};
      }
      if (h.kind != nullptr) {
        report_hazard(l, h, tid, where, write, atomic, b);
        reported = true;
      }
    }
    if (atomic) {
      if (s.atomic_epoch != e) {
        s.atomic_epoch = e;
        s.atomic[0] = me;
        s.atomic[1] = ShadowAccess{};
      } else if (s.atomic[0].tid == tid) {
        s.atomic[0] = me;
      } else if (s.atomic[1].tid < 0 || s.atomic[1].tid == tid) {
        s.atomic[1] = me;
      }
    } else if (write) {
      s.write_epoch = e;
      s.write = me;
    } else {
      if (s.read_epoch != e) {
        s.read_epoch = e;
        s.read[0] = me;
        s.read[1] = ShadowAccess{};
      } else if (s.read[0].tid == tid) {
        s.read[0] = me;
      } else if (s.read[1].tid < 0 || s.read[1].tid == tid) {
        s.read[1] = me;
      }
    }
  }
  g_race_len = saved_len;
}

RC_EMU_NOINSTR RC_EMU_ALWAYS_INLINE void race_access(uintptr_t addr, size_t n, bool write, void* pc) {
  if (addr - g_race_lo < g_race_len) race_slow(addr, n, write, reinterpret_cast<uintptr_t>(pc));
}

// Atomics mark their accesses (atomic vs atomic is no race) and name their call site.
struct AtomicScope {
  RC_EMU_NOINSTR AtomicScope(const char* file, int line) {
    if (g_race_len != 0) g_atomic_where = kAtomicTag | static_cast<uintptr_t>(intern_site(file, line));
    ++g_atomic_depth;
  }
  RC_EMU_NOINSTR ~AtomicScope() { --g_atomic_depth; }
};

// ---- synchronisation -------------------------------------------------------------------------------------------

// A __syncthreads statement that runs as if it were not in the source ("file.cuh:line", the file's base name; empty:
// none): the barrier-necessity test disables each barrier in turn in one build instead of rebuilding a copy of the
// kernels without it.
inline std::string& skipped_barrier() {
  static std::string site;
  return site;
}
inline bool is_skipped_barrier(const char* file, int line) {
  const std::string& site = skipped_barrier();
  if (site.empty()) return false;
  const std::string path(file);
  const std::string here = path.substr(path.find_last_of('/') + 1) + ":" + std::to_string(line);
  return here == site;
}

inline void syncthreads(const char* file, int line) {
  if (is_skipped_barrier(file, line)) return;
  Launch& l = L();
  l.current->state = State::kBarrier;
  l.current->barrier_file = file;
  l.current->barrier_line = line;
  ++l.sync_points;
  yield_to_scheduler();
}

template <typename T>
inline T warp_exchange(T value, int src_lane, unsigned mask, bool syncwarp = false) {
  static_assert(sizeof(T) <= sizeof(uint64_t), "shuffle of a type wider than 8 bytes");
  Launch& l = L();
  Fiber* f = l.current;
  f->shfl_value = 0;
  std::memcpy(&f->shfl_value, &value, sizeof(T));
  f->shfl_src = src_lane;
  f->warp_mask = mask;
  f->syncwarp = syncwarp;
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
  bool syncwarp = false;
  for (int i = first; i < last; ++i) {
    if ((l.fibers[i].warp_mask & expected) != expected) {
      fail("warp-synchronous op with a mask that leaves out lanes of warp " + std::to_string(warp));
    }
    syncwarp |= l.fibers[i].syncwarp;
  }
  for (int i = first; i < last; ++i) {
    const int src = l.fibers[i].shfl_src;
    const int src_idx = (src >= 0 && src < last - first) ? first + src : i;
    l.fibers[i].shfl_result = l.fibers[src_idx].shfl_value;
    l.fibers[i].state = State::kReady;
  }
  if (syncwarp) l.warp_syncs[static_cast<size_t>(warp)] += 1;
  l.warp_epochs[static_cast<size_t>(warp)] += 1;
  return true;
}

// ---- the launch ----------------------------------------------------------------------------------------------------

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

// "0-15, 32, 40-63"
inline std::string thread_ranges(const std::vector<int>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size();) {
    size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
    if (!s.empty()) s += ", ";
    s += std::to_string(ids[i]);
    if (j > i) s += "-" + std::to_string(ids[j]);
    i = j + 1;
  }
  return s;
}

inline std::string block_name(const Launch& l) {
  return kernel_name(l.kernel) + " block (" + std::to_string(l.block_idx.x) + "," + std::to_string(l.block_idx.y) +
         "," + std::to_string(l.block_idx.z) + ")";
}

// Every thread waits at a __syncthreads: release the block, unless they wait at different statements.
inline void release_barrier(Launch& l, int n) {
  std::map<std::pair<std::string, int>, std::vector<int>> by_site;
  for (int i = 0; i < n; ++i)
    by_site[{l.fibers[i].barrier_file ? l.fibers[i].barrier_file : "?", l.fibers[i].barrier_line}].push_back(i);
  if (by_site.size() > 1) {
    std::string msg = "deadlock or divergent synchronisation (synccheck: divergent __syncthreads) in " + block_name(l) +
                      ": the threads wait at different __syncthreads statements:";
    for (const auto& kv : by_site)
      msg += " threads " + thread_ranges(kv.second) + " at " + base_name(kv.first.first) + ":" +
             std::to_string(kv.first.second) + ";";
    fail(msg);
    return;
  }
  const auto& site = by_site.begin()->first;
  l.last_barrier = base_name(site.first) + ":" + std::to_string(site.second);
  if (l.rec != nullptr) l.rec->barriers[l.last_barrier] += 1;
  l.barrier_interval += 1;
  ++g_epoch;
  for (auto& e : l.warp_epochs) e += 1;
  for (int i = 0; i < n; ++i) l.fibers[i].state = State::kReady;
}

inline void report_stuck_block(Launch& l, int n) {
  std::vector<int> done, barrier, warp_sync;
  for (int i = 0; i < n; ++i) {
    const State s = l.fibers[i].state;
    (s == State::kDone ? done : (s == State::kBarrier ? barrier : warp_sync)).push_back(i);
  }
  std::string msg = "deadlock or divergent synchronisation in " + block_name(l) + ": " + std::to_string(done.size()) +
                    " threads exited, " + std::to_string(barrier.size()) + " at __syncthreads, " +
                    std::to_string(warp_sync.size()) + " at a warp-synchronous op whose warp is incomplete";
  if (!barrier.empty()) {
    const Fiber& f = l.fibers[barrier.front()];
    msg += " (synccheck: __syncthreads at " + base_name(f.barrier_file ? f.barrier_file : "?") + ":" +
           std::to_string(f.barrier_line) + " reached by threads " + thread_ranges(barrier) + " only";
    if (!done.empty()) msg += "; threads " + thread_ranges(done) + " exited";
    if (!warp_sync.empty()) msg += "; threads " + thread_ranges(warp_sync) + " wait at a warp op";
    msg += ")";
  }
  fail(msg);
}

inline void run_block(Launch& l) {
  const int n = static_cast<int>(l.block.x * l.block.y * l.block.z);
  std::fill(l.arena.begin(), l.arena.end(), static_cast<unsigned char>(0xFF));
  l.arena_used = 0;
  l.static_slots.clear();
  l.regions.clear();
  l.dynamic_base = l.dynamic_bytes ? arena_alloc(l.dynamic_bytes) : nullptr;
  if (l.dynamic_base != nullptr) l.regions.push_back({0, l.dynamic_bytes, 1, "dynamic shared memory"});
  l.barrier_interval = 0;
  l.last_barrier.clear();
  const int warps = (n + kWarp - 1) / kWarp;
  l.warp_syncs.assign(static_cast<size_t>(warps), 0);
  l.warp_epochs.assign(static_cast<size_t>(warps), 0);
  for (int i = 0; i < n; ++i) {
    Fiber& f = l.fibers[i];
    f.linear = i;
    f.tid = {static_cast<unsigned>(i % l.block.x), static_cast<unsigned>((i / l.block.x) % l.block.y),
             static_cast<unsigned>(i / (l.block.x * l.block.y))};
    f.state = State::kReady;
    f.barrier_file = nullptr;
    f.barrier_line = 0;
    f.pc_count.clear();
    f.count_epoch = ~uint64_t(0);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = l.stacks[i].get();
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_entry, 0);
  }
  ++g_epoch;
  const bool watch = racecheck_available() && racecheck_mode() != 0;
  if (watch) {
    g_race_lo = reinterpret_cast<uintptr_t>(l.arena.data());
    g_race_len = l.arena.size();
  }
  const Schedule sched = schedule();
  const bool descending = sched == Schedule::kDescending;
  const bool warp_major = sched == Schedule::kWarpMajorDescending || sched == Schedule::kWarpMajorAscending;
  auto run = [&](int i) {
    l.current = &l.fibers[i];
    swapcontext(&l.scheduler_ctx, &l.fibers[i].ctx);
    l.current = nullptr;
  };
  while (l.error.empty()) {
    bool progress = false;
    if (warp_major) {
      // One warp at a time, shuffles included, until all its threads wait at a __syncthreads or exited.
      for (int k = 0; k < warps && l.error.empty(); ++k) {
        const int w = sched == Schedule::kWarpMajorDescending ? warps - 1 - k : k;
        const int first = w * kWarp, last = std::min(n, first + kWarp);
        while (l.error.empty()) {
          bool ran = false;
          for (int i = first; i < last && l.error.empty(); ++i) {
            if (l.fibers[i].state != State::kReady) continue;
            run(i);
            ran = true;
          }
          const bool released = l.error.empty() && try_release_warp(l, w, n);
          if (!ran && !released) break;
          progress = true;
        }
      }
    } else {
      for (int k = 0; k < n && l.error.empty(); ++k) {
        const int i = descending ? n - 1 - k : k;
        if (l.fibers[i].state != State::kReady) continue;
        run(i);
        progress = true;
      }
      for (int w = 0; w < warps && l.error.empty(); ++w) progress |= try_release_warp(l, w, n);
    }
    if (!l.error.empty() || progress) continue;
    int done = 0, barrier = 0;
    for (int i = 0; i < n; ++i) {
      done += l.fibers[i].state == State::kDone;
      barrier += l.fibers[i].state == State::kBarrier;
    }
    if (done == n) break;
    if (barrier == n) {
      release_barrier(l, n);
      continue;
    }
    report_stuck_block(l, n);
  }
  g_race_len = 0;
  flush_requests(l);
}

template <typename Kernel, typename... Args>
void launch(Kernel kernel, dim3 grid, dim3 block, size_t dynamic_smem_bytes, Args... args) {
  const int n = static_cast<int>(block.x * block.y * block.z);
  if (n <= 0 || n > 1024) throw EmulatorError("block size must be in [1, 1024], got " + std::to_string(n));
  Launch l;
  l.grid = grid;
  l.block = block;
  l.kernel = reinterpret_cast<const void*>(kernel);
  l.dynamic_bytes = dynamic_smem_bytes;
  l.arena.resize(kArenaBytes);
  l.fibers.resize(n);
  l.stacks.resize(n);
  for (auto& stack : l.stacks) stack.reset(new char[kStackBytes]);
  l.body = [&]() { kernel(args...); };
  // Hazards are recorded even when the traffic is not (racecheck fails the launch on them).
  LaunchRecord record;
  const bool racecheck = racecheck_available() && racecheck_mode() != 0;
  if (recorder().on || racecheck) {
    record.grid = grid;
    record.block = block;
    l.rec = &record;
  }
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
    g_race_len = 0;
    current_launch() = previous;
    throw;
  }
  current_launch() = previous;
  const bool hazards = racecheck && racecheck_mode() == 2 && record.hazard_count > 0;
  if (recorder().on) {
    record.kernel = kernel_name(l.kernel);
    recorder().launches.push_back(std::move(record));
  }
  if (!l.error.empty()) throw EmulatorError(l.error);
  if (hazards) {
    const LaunchRecord& r = recorder().on ? recorder().launches.back() : record;
    std::string msg = std::to_string(r.hazard_count) + " racecheck hazard(s) in " + kernel_name(l.kernel) + ", " +
                      std::to_string(r.hazards.size()) + " distinct:";
    for (size_t i = 0; i < r.hazards.size() && i < 6; ++i) msg += "\n  " + r.hazards[i];
    if (r.hazards.size() > 6) msg += "\n  ...";
    throw EmulatorError(msg);
  }
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
  T* const name = ::emu::block_shared<T>((count), &name##_emu_key, #name)
#define RC_DYNAMIC_SHARED(T, name) T* const name = ::emu::dynamic_shared<T>()

// A call GCC cannot see into (defined in emu_stats.cpp, another translation unit): it may free memory, so the
// AddressSanitizer pass keeps the check of a store to an address the same code loaded just before, which it would
// otherwise drop as redundant -- and racecheck would never see that store (device_utils.cuh).
extern "C" void rc_emu_opaque_call();
#define RC_SHARED_STORE_AFTER_LOAD() rc_emu_opaque_call()

// Global-memory accesses of the device code (csrc/include/rc_macros.h): counted while recording. Each expansion
// registers its site once (a static in a lambda unique to the expansion and the template instantiation).
#define RC_LDG(ptr)                                                                                      \
  (::emu::ldg((ptr), [] {                                                                                \
    static const int rc_emu_site_ = ::emu::register_site(__FILE__, __LINE__, false);                    \
    return rc_emu_site_;                                                                                 \
  }))
#define RC_STG(ptr, value)                                                                               \
  (::emu::stg((ptr), (value), [] {                                                                       \
    static const int rc_emu_site_ = ::emu::register_site(__FILE__, __LINE__, true);                     \
    return rc_emu_site_;                                                                                 \
  }))

inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::emu::syncthreads(file, line);
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ::emu::warp_exchange<int>(0, ::emu::lane_id(), mask, /*syncwarp=*/true);
}

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

// Atomics: the call site comes from default arguments (racecheck names it; atomics of different threads on the
// same address are no hazard, an atomic and a plain access are).
template <typename T>
RC_EMU_ALWAYS_INLINE T atomicAdd(T* address, T val, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::emu::AtomicScope scope(file, line);
  const T old = *address;
  *address = old + val;
  return old;
}
template <typename T>
RC_EMU_ALWAYS_INLINE T atomicMax(T* address, T val, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::emu::AtomicScope scope(file, line);
  const T old = *address;
  *address = old > val ? old : val;
  return old;
}
template <typename T>
RC_EMU_ALWAYS_INLINE T atomicMin(T* address, T val, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::emu::AtomicScope scope(file, line);
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

// --- racecheck's view of every memory access ------------------------------------------------------------------
// Built with -fsanitize=kernel-address --param=asan-instrumentation-with-call-threshold=0 (loader.py), GCC calls
// these before each load and store of the compiled code; only accesses inside the running block's shared-memory
// arena reach the checker. Weak: every emulated family's translation unit defines them, the link keeps one.
#ifdef RC_EMU_RACECHECK
extern "C" {
#define RC_EMU_ASAN_CALLBACKS(n)                                                                                   \
  __attribute__((weak, used)) RC_EMU_NOINSTR void __asan_load##n##_noabort(uintptr_t a) {                         \
    ::emu::race_access(a, n, false, __builtin_return_address(0));                                                  \
  }                                                                                                                \
  __attribute__((weak, used)) RC_EMU_NOINSTR void __asan_store##n##_noabort(uintptr_t a) {                        \
    ::emu::race_access(a, n, true, __builtin_return_address(0));                                                   \
  }
RC_EMU_ASAN_CALLBACKS(1)
RC_EMU_ASAN_CALLBACKS(2)
RC_EMU_ASAN_CALLBACKS(4)
RC_EMU_ASAN_CALLBACKS(8)
RC_EMU_ASAN_CALLBACKS(16)
#undef RC_EMU_ASAN_CALLBACKS
__attribute__((weak, used)) RC_EMU_NOINSTR void __asan_loadN_noabort(uintptr_t a, size_t n) {
  ::emu::race_access(a, n, false, __builtin_return_address(0));
}
__attribute__((weak, used)) RC_EMU_NOINSTR void __asan_storeN_noabort(uintptr_t a, size_t n) {
  ::emu::race_access(a, n, true, __builtin_return_address(0));
}
__attribute__((weak, used)) RC_EMU_NOINSTR void __asan_handle_no_return() {}
__attribute__((weak, used)) RC_EMU_NOINSTR void __asan_before_dynamic_init(const char*) {}
__attribute__((weak, used)) RC_EMU_NOINSTR void __asan_after_dynamic_init() {}
}
#endif
