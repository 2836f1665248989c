// gradcomp/cuda/dispatch/launch.cuh: what every dispatch function does around a kernel launch:
// the grid size for a number of items, and the check that the launch itself succeeded.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include <gradcomp/cuda/memory.cuh>

namespace gradcomp::cuda {

// Blocks of `threads` threads for `items` items, one item per thread, at least 1 block and at
// most max_blocks (the kernels loop over the rest: grid-stride).
inline unsigned grid_for(std::size_t items, unsigned threads, std::size_t max_blocks) {
  const std::size_t blocks = (items + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 1 ? 1 : blocks > max_blocks ? max_blocks : blocks);
}

// Throws communicator-independent gradcomp::error with the CUDA message if the last launch
// failed (bad configuration, no device).
inline void check_launch(const char* what) { detail::cuda_check(cudaGetLastError(), what); }

}  // namespace gradcomp::cuda
