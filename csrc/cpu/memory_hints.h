// CPU memory hints for the large outputs the kernels write once (the rollout weights and masks; the log-prob
// gradient comes from a reused block instead: reused_buffer.h).
//
// A fresh [B, T] output usually comes straight from the kernel (glibc serves large blocks with mmap, or returns
// the heap to the system after a big free), so its first touch costs one page fault and one zeroed 4 KiB page per
// 4 KiB: about 2 ms for 10 MiB on this machine, as much as a whole pass. Asking for transparent huge pages on the
// block before the kernel writes it (Linux THP in "madvise" mode) turns that into one fault per 2 MiB.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace rollout_corr {
namespace cpu {

// Advise huge pages for the 2 MiB-aligned part of [data, data + bytes). A hint only: nothing changes if THP is
// off, the block is too small, or its pages are already mapped (then they are simply reused).
inline void advise_huge_pages(void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  static const bool enabled = [] {  // ROLLOUT_CORR_HUGE_PAGES=0 turns the hint off (to measure it)
    const char* v = std::getenv("ROLLOUT_CORR_HUGE_PAGES");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  if (!enabled || data == nullptr || bytes < 2 * kHuge) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

}  // namespace cpu
}  // namespace rollout_corr
