// The device drivers of tests/torch/module_sgd_cuda.cpp (see module_sgd_cuda_drivers.hpp).
#include "module_sgd_cuda_drivers.hpp"

#include <memory>

#include <gradcomp/compressor.hpp>
#include <gradcomp/cuda/device_driver.cuh>
#include <gradcomp/cuda/staged_comm.cuh>
#include <gradcomp/exchange/dense_allreduce.hpp>
#include <gradcomp/exchange/sparse_allgather.hpp>
#include <gradcomp/feedback/residual.hpp>
#include <gradcomp/quantize.hpp>
#include <gradcomp/select/dense.hpp>
#include <gradcomp/select/topk.hpp>

namespace gradcomp_test {

using namespace gradcomp;
using staged = gradcomp::cuda::staged_comm<in_process_comm>;

gradcomp::cuda::device_driver_factory topk_driver(in_process_comm& comm, cudaStream_t stream,
                                        sgd_options opt, double density, bool graph) {
  using C = compressor<topk, identity, residual>;
  if (graph) {
    return gradcomp::cuda::device_graph_sgd_factory<staged>(std::make_shared<staged>(comm, stream),
                                                            topk{}, opt,
                                                            density_schedule::constant(density));
  }
  return gradcomp::cuda::device_sgd_factory<C, sparse_allgather>(std::make_shared<staged>(comm, stream),
                                                       C{}, sparse_allgather{}, opt,
                                                       density_schedule::constant(density));
}

gradcomp::cuda::device_driver_factory dense_driver(in_process_comm& comm, cudaStream_t stream,
                                         sgd_options opt) {
  using C = compressor<dense, identity, residual>;
  return gradcomp::cuda::device_sgd_factory<C, dense_allreduce>(std::make_shared<staged>(comm, stream),
                                                      C{}, dense_allreduce{}, opt,
                                                      density_schedule::constant(1.0));
}

gradcomp::cuda::averaging_driver_factory averaging_driver(in_process_comm& comm,
                                                          cudaStream_t stream, sgd_options opt,
                                                          averaging_options avg) {
  return gradcomp::cuda::device_averaging_factory<qsgd, sparse_allgather>(
      std::make_shared<staged>(comm, stream), qsgd{}, sparse_allgather{}, opt, avg);
}

gradcomp::cuda::layerwise_driver_factory lags_driver(in_process_comm& comm, cudaStream_t stream,
                                                     sgd_options opt) {
  using C = compressor<topk, identity, residual>;
  return gradcomp::cuda::device_layerwise_factory<C, sparse_allgather>(
      std::make_shared<staged>(comm, stream), C{}, sparse_allgather{}, opt);
}

}  // namespace gradcomp_test
