// The device drivers tests/torch/module_sgd_cuda.cpp steps, made in
// module_sgd_cuda_drivers.cu by nvcc (the test itself includes LibTorch, which nvcc does not
// compile): each over a cuda::staged_comm on `stream` over the rank's in-process communicator.
#pragma once

#include <cuda_runtime_api.h>

#include <gradcomp/comm/in_process.hpp>
#include <gradcomp/cuda/device_driver.hpp>
#include <gradcomp/schedule/periodic_averaging.hpp>
#include <gradcomp/sgd.hpp>

namespace gradcomp_test {

// compressor<topk, identity, residual> over sparse_allgather at the given density; with
// graph, stepped by graph_step (device_graph_sgd_factory: uncaptured over the staged
// communicator, the same result).
gradcomp::cuda::device_driver_factory topk_driver(gradcomp::in_process_comm& comm,
                                                  cudaStream_t stream, gradcomp::sgd_options opt,
                                                  double density, bool graph = false);
// Dense SGD: compressor<dense, identity, residual> over dense_allreduce.
gradcomp::cuda::device_driver_factory dense_driver(gradcomp::in_process_comm& comm,
                                                   cudaStream_t stream, gradcomp::sgd_options opt);

// PQASGD: device_periodic_averaging<qsgd, sparse_allgather> (stochastic codes, drawn as the
// host's).
gradcomp::cuda::averaging_driver_factory averaging_driver(gradcomp::in_process_comm& comm,
                                                          cudaStream_t stream,
                                                          gradcomp::sgd_options opt,
                                                          gradcomp::averaging_options avg);

// LAGS: device_layerwise_sgd<compressor<topk, identity, residual>, sparse_allgather>.
gradcomp::cuda::layerwise_driver_factory lags_driver(gradcomp::in_process_comm& comm,
                                                     cudaStream_t stream,
                                                     gradcomp::sgd_options opt);

}  // namespace gradcomp_test
