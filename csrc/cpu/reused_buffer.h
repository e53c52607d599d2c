// A one-block cache for the out-of-place log-prob gradient on CPU: the CPU analogue, for one buffer, of PyTorch's
// CUDA caching allocator.
//
// A fresh [N, V_local] gradient is larger than glibc's mmap threshold (32 MiB at most), so every backward gets new
// pages from the kernel and pays one fault and one zeroed page per 4 KiB before any math: on a 2-core Zen 5 VM,
// 46 ms for the 250 MiB gradient of 2048 x 32000 fp32, four times the whole in-place backward (12 ms). Asking for
// huge pages (memory_hints.h) makes that cheap when the kernel has them free and far worse when it must compact
// memory first (300 ms to 2.4 s measured there). So the gradient's storage comes from this allocator instead: when
// the tensor is freed (autograd drops it once the step is done with it), its block is kept, and the next backward
// of about the same size (the block holds between n and 5n/4 bytes) writes into pages that are already mapped.
//
// Retained memory: at most one block, the most recently freed one, between steps; a request it cannot serve frees
// it first. torch.ops.rollout_corr.cpu_grad_cache_bytes(release=True) (rollout_corr_ext.empty_cpu_cache()) gives
// it back; ROLLOUT_CORR_CPU_GRAD_CACHE=0 turns the cache off. The kernels write every element of the gradient, so a
// reused block never shows its previous contents.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <cstdlib>
#include <cstring>
#include <mutex>

namespace rollout_corr {
namespace cpu {

class ReusedBlockAllocator final : public c10::Allocator {
 public:
  // Never destroyed: tensors holding its blocks may outlive static destruction.
  static ReusedBlockAllocator& get() {
    static ReusedBlockAllocator* instance = new ReusedBlockAllocator();
    return *instance;
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
        stale = cached_;  // freed below: never more than one block retained beside the live ones
      }
      cached_ = nullptr;
    }
    free_block(stale);
    if (block == nullptr) block = new Block{c10::alloc_cpu(n), n};
    return {block->data, block, &release_block, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // Bytes held by the cache (not by any tensor); with release, the block is freed first and the bytes it held are
  // returned.
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

 private:
  struct Block {
    void* data;
    size_t bytes;
  };

  ReusedBlockAllocator() {
    const char* v = std::getenv("ROLLOUT_CORR_CPU_GRAD_CACHE");
    enabled_ = v == nullptr || std::strcmp(v, "0") != 0;
  }

  static void free_block(Block* block) {
    if (block == nullptr) return;
    c10::free_cpu(block->data);
    delete block;
  }

  // The deleter of every DataPtr this allocator hands out: keep the block (replacing an older one) or free it.
  static void release_block(void* ctx) {
    Block* block = static_cast<Block*>(ctx);
    if (block == nullptr) return;
    ReusedBlockAllocator& self = get();
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
  bool enabled_ = true;
};

}  // namespace cpu
}  // namespace rollout_corr
