// Every environment switch the C++ side reads, read here and nowhere else. The table of all of the package's switches
// (these two and the Python / build ones) is rollout_corr_ext/_env.py, documented in docs/configuration.md.
#pragma once

#include <cstdlib>
#include <cstring>

namespace rollout_corr {
namespace cpu {

// ROLLOUT_CORR_CPU_ISA: "avx512" | "avx2" | "baseline" narrows the SIMD copy of every CPU kernel (cpu_isa(),
// vec_math.h); unset or empty: the widest the CPU runs. Read once per process.
constexpr const char* kCpuIsaSwitch = "ROLLOUT_CORR_CPU_ISA";
// ROLLOUT_CORR_CPU_CACHE: "0" turns off the reused output blocks of the CPU kernels (reused_buffer.h).
constexpr const char* kCpuCacheSwitch = "ROLLOUT_CORR_CPU_CACHE";

// The switch's value, or nullptr when it is unset or empty.
inline const char* switch_value(const char* name) {
  const char* v = std::getenv(name);
  return (v != nullptr && v[0] != '\0') ? v : nullptr;
}

inline bool cpu_cache_enabled() {
  const char* v = switch_value(kCpuCacheSwitch);
  return v == nullptr || std::strcmp(v, "0") != 0;
}

}  // namespace cpu
}  // namespace rollout_corr
