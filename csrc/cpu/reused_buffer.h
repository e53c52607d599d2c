// One-block caches for the large CPU outputs that a training step frees and asks for again at the same size: the
// log-prob gradient of the out-of-place backward, rollout correction's weights and mask, and the policy loss's
// gradient in the log-probs. The CPU analogue, for
// these few buffers, of PyTorch's CUDA caching allocator.
//
// A buffer of several MiB is new pages from the kernel each time glibc gets it (large blocks are mmapped, or the heap
// top is trimmed after a big free), so it pays one fault and one zeroed page per 4 KiB before any math: on a 2-core
// Zen 5 VM, 46 ms for the 250 MiB gradient of 2048 x 32000 fp32, four times the whole in-place backward (12 ms), and
// about 1.5 ms for the 10 MiB of rollout outputs of a 256 x 8192 batch, as much as one of its passes. Asking for
// huge pages (MADV_HUGEPAGE, what these buffers used to get) makes that cheap when the kernel has them free and far
// worse when it must compact memory first (300 ms to 2.4 s measured there for the gradient). So these outputs come
// from a ReusedBlockAllocator:
// when the tensor is freed, its block is kept, and the next request of about the same size (the block holds between
// n and 5n/4 bytes) writes into pages that are already mapped.
//
// Retained memory: at most one block per use (the most recently freed one); a request the block cannot serve frees
// it first. torch.ops.rollout_corr.cpu_cache_bytes(release=True) (rollout_corr_ext.empty_cpu_cache()) gives them
// back; ROLLOUT_CORR_CPU_CACHE=0 turns the caches off. The kernels write every element of these outputs, so a reused
// block never shows its previous contents.
#pragma once

#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <utility>

#include "policy_loss_params.h"
#include "switches.h"

namespace rollout_corr {
namespace cpu {

// What a cache serves: one block is kept per use. kPolicyLossMat: the policy loss's per-token loss, which most
// callers drop at once. kScratch0 + slot: the policy losses' whole-batch temporaries (clip_cov / kl_cov's
// covariance, its masks and masked sums: rollout_corr_ext/losses.py), which never leave the call.
constexpr int kScratchSlots = static_cast<int>(::rollout_corr::kScratchSlots);  // policy_loss_layout.def
enum class ReusedUse : int {
  kLogprobGrad = 0,
  kRolloutWeights = 1,
  kRolloutMask = 2,
  kPolicyGrad = 3,
  kPolicyLossMat = 4,
  kScratch0 = 5,  // .. kScratch0 + kScratchSlots - 1
};
constexpr int kReusedUses = static_cast<int>(ReusedUse::kScratch0) + kScratchSlots;

class ReusedBlockAllocator final : public c10::Allocator {
 public:
  // Never destroyed: tensors holding their blocks may outlive static destruction.
  static ReusedBlockAllocator& get(ReusedUse use) {
    static ReusedBlockAllocator* caches = new ReusedBlockAllocator[kReusedUses];
    return caches[static_cast<int>(use)];
  }

  // Bytes kept by every cache (not by any tensor); with release, the blocks are freed first and the bytes they held
  // are returned.
  static int64_t retained_bytes_all(bool release) {
    int64_t bytes = 0;
    for (int u = 0; u < kReusedUses; ++u) bytes += get(static_cast<ReusedUse>(u)).retained_bytes(release);
    return bytes;
  }

  c10::DataPtr allocate(size_t n) override {
    if (n == 0) return {nullptr, nullptr, &release_block, c10::Device(c10::DeviceType::CPU)};
    Block* block = nullptr;
    Block* stale = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (cached_ != nullptr && cached_->bytes >= n && cached_->bytes - n <= n / 4) {
        block = cached_;
      } else {
        stale = cached_;  // freed below: never more than one block kept beside the live ones
      }
      cached_ = nullptr;
    }
    free_block(stale);
    if (block == nullptr) block = new Block{c10::alloc_cpu(n), n, this};
    return {block->data, block, &release_block, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  int64_t retained_bytes(bool release) {
    Block* block = nullptr;
    int64_t bytes = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (cached_ != nullptr) bytes = static_cast<int64_t>(cached_->bytes);
      if (release) std::swap(block, cached_);
    }
    free_block(block);
    return bytes;
  }

  ReusedBlockAllocator() : enabled_(cpu_cache_enabled()) {}

 private:
  struct Block {
    void* data;
    size_t bytes;
    ReusedBlockAllocator* owner;
  };

  static void free_block(Block* block) {
    if (block == nullptr) return;
    c10::free_cpu(block->data);
    delete block;
  }

  // The deleter of every DataPtr handed out: keep the block in its cache (replacing an older one) or free it.
  static void release_block(void* ctx) {
    Block* block = static_cast<Block*>(ctx);
    if (block == nullptr) return;
    ReusedBlockAllocator& self = *block->owner;
    if (!self.enabled_) {
      free_block(block);
      return;
    }
    Block* older = nullptr;
    {
      std::lock_guard<std::mutex> lock(self.mu_);
      older = self.cached_;
      self.cached_ = block;
    }
    free_block(older);
  }

  std::mutex mu_;
  Block* cached_ = nullptr;
  bool enabled_;
};

// An uninitialised CPU tensor whose storage comes from the cache of `use` (contiguous; the caller writes all of it).
inline at::Tensor reused_empty(at::IntArrayRef sizes, at::ScalarType dtype, ReusedUse use) {
  return at::detail::empty_generic(sizes, &ReusedBlockAllocator::get(use), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   dtype, c10::nullopt);
}

}  // namespace cpu
}  // namespace rollout_corr
