// What the emulated launchers of every kernel family share: the launch callable the shared host drivers
// (csrc/cuda/*_launch.cuh) take (the CUDA launchers pass current_stream_launch() instead) and the schedule knob.
#pragma once

#include "cuda_emu.h"

#include <c10/util/Exception.h>

#include <cstdint>

namespace rollout_corr {

struct EmuLaunch {
  template <typename Kernel, typename Params>
  void operator()(Kernel kernel, dim3 grid, dim3 block, const Params& p) const {
    emu::launch(kernel, grid, block, 0, p);
  }
};

// The turnstile order of the next launches: 0 ascending thread ids, 1 descending.
inline void apply_schedule(int64_t schedule) {
  TORCH_CHECK(schedule == 0 || schedule == 1, "schedule must be 0 (ascending) or 1 (descending)");
  emu::set_schedule(schedule == 0 ? emu::Schedule::kAscending : emu::Schedule::kDescending);
}

}  // namespace rollout_corr
