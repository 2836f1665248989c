// gradcomp/cuda.cuh: the device half of gradcomp (compile with nvcc, -std=c++20
// --expt-relaxed-constexpr, or link gradcomp::cuda). It only includes. With it,
// gradcomp::on_device(policy) gives the host policy objects' calls on device spans, with a
// temp_storage (CUB's size query, then one caller-provided scratch buffer) and a stream:
//   - selectors topk (including topk_method::radix), gaussiank, threshold, randomk:
//     cuda/select.cuh;
//   - residual feedback, fused with the selection pass: cuda/feedback.cuh;
//   - every quantizer (identity, fp16, bf16, qsgd, terngrad, scaled_sign): cuda/quantize.cuh;
//   - sparse gather, scatter-add (atomic, or sorted and deterministic) and decompress:
//     cuda/sparse.cuh;
//   - device_buffer and cuda_check: cuda/memory.cuh.
// Included on their own: the device-resident SGD step, device_sparsified_sgd
// (cuda/sparsified_sgd.cuh), PQASGD and LAGS on the device (cuda/periodic_averaging.cuh,
// cuda/layerwise.cuh), the three behind virtual interfaces for LibTorch
// (cuda/device_driver.cuh), and their communicator over any host communicator
// (cuda/staged_comm.cuh); nccl_comm (comm/nccl.hpp) serves them directly.
// Layers, as in CUB: facade (these headers) -> cuda/dispatch/ (argument checks, scratch
// carving, launches) -> cuda/kernels/ -> cuda/block/ primitives; per-element math lives in
// GRADCOMP_HOST_DEVICE functions under gradcomp/detail/, shared with the host code.
#pragma once

#if !defined(__CUDACC__)
#error "gradcomp/cuda.cuh holds device code: compile this file with nvcc"
#endif

#include <gradcomp/gradcomp.hpp>

#include <gradcomp/cuda/feedback.cuh>
#include <gradcomp/cuda/memory.cuh>
#include <gradcomp/cuda/quantize.cuh>
#include <gradcomp/cuda/select.cuh>
#include <gradcomp/cuda/sparse.cuh>
