// gradcomp/cuda/dispatch/sgd.cuh: the SGD update on the device (lr, momentum, Nesterov, weight
// decay: step_impl::sgd_kernel, detail::sgd_update's operations one for one), for the device
// drivers (cuda/sparsified_sgd.cuh, cuda/periodic_averaging.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include <gradcomp/cuda/dispatch/launch.cuh>
#include <gradcomp/cuda/kernels/step_kernels.cuh>
#include <gradcomp/sgd.hpp>

namespace gradcomp::cuda {

// params -= lr * update of g, on `stream`; velocity: n floats where opt.momentum > 0 (else
// unused). Nothing is launched for n = 0. skip: device memory; where *skip != 0 when the kernel
// runs, nothing is written (graph_step: the verdict of every rank).
inline void launch_sgd_update(float* params, const float* g, float* velocity, std::size_t n,
                              const sgd_options& opt, cudaStream_t stream,
                              const std::uint32_t* skip = nullptr) {
  if (!n) return;
  constexpr unsigned threads = 256;
  const auto lr = static_cast<float>(opt.lr);
  const auto wd = static_cast<float>(opt.weight_decay);
  const auto m = static_cast<float>(opt.momentum);
  const unsigned grid = grid_for(n, threads, 4096);
  using step_impl::sgd_kind;
  if (opt.momentum == 0.0) {
    step_impl::sgd_kernel<sgd_kind::plain>
        <<<grid, threads, 0, stream>>>(params, g, nullptr, n, lr, wd, m, skip);
  } else if (opt.nesterov) {
    step_impl::sgd_kernel<sgd_kind::nesterov>
        <<<grid, threads, 0, stream>>>(params, g, velocity, n, lr, wd, m, skip);
  } else {
    step_impl::sgd_kernel<sgd_kind::momentum>
        <<<grid, threads, 0, stream>>>(params, g, velocity, n, lr, wd, m, skip);
  }
  check_launch("sgd_kernel");
}

}  // namespace gradcomp::cuda
