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

// The turnstile order of the next launches: 0 ascending thread ids, 1 descending, 2 warp-major from the last warp
// (each warp runs on its own to its next __syncthreads: one warp a row ahead of the others), 3 warp-major from the
// first warp.
inline void apply_schedule(int64_t schedule) {
  TORCH_CHECK(schedule >= 0 && schedule <= 3,
              "schedule must be 0 (ascending), 1 (descending), 2 (warp-major, last warp first) or 3 (warp-major, "
              "first warp first), got ", schedule);
  emu::set_schedule(static_cast<emu::Schedule>(schedule));
}

}  // namespace rollout_corr
