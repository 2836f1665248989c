// gradcomp_cuda_step_bench: the device-resident step (device_sparsified_sgd over nccl_comm, one
// rank) against the dense step on the same buffers, in one binary, timed with CUDA events
// around each whole step (the step's host waits included):
//   cuda/step/device_sgd/n:N/ppm:R/tensors:T   top-k at density R ppm with the residual, the
//                                               exchange, the mean and the update (momentum 0.9)
//   cuda/step/device_sgd_qsgd/...               the same with the picks quantized by qsgd
//                                               (4 bits, buckets of 512) and decoded
//   cuda/step/graph_step/...                    the top-k step by graph_step (every check on
//                                               the device, one wait), captured in a CUDA
//                                               graph and replayed
//   cuda/step/graph_step_uncaptured/...         graph_step queued without a capture
//   cuda/baseline/dense_step/n:N/tensors:T      the gradient copied into a bucket, one
//                                               ncclAllReduce, the same update kernel
//   cuda/baseline/copy/n:N                      a device-to-device copy of the gradient
// N parameters split into T equal tensors. NCCL runs at P = 1 (one GPU, one rank): its
// allreduce is a local pass, and the sparse exchange's collectives move only this rank's
// picks. Without a CUDA device it prints why and exits with 77.
#include <benchmark/benchmark.h>

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <vector>

#include <gradcomp/comm/nccl.hpp>
#include <gradcomp/cuda.cuh>
#include <gradcomp/cuda/sparsified_sgd.cuh>

#include "../cuda/normal_input.cuh"
#include "../cuda/timing.cuh"

namespace {

using namespace gradcomp;
using gradcomp::detail::cuda_check;

// One NCCL communicator of one rank on device 0, on a stream of its own, for the whole run.
nccl_comm& communicator() {
  static cudaStream_t stream = [] {
    cudaStream_t s = nullptr;
    cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    return s;
  }();
  // Never destroyed: at exit the CUDA runtime may be gone before a static's destructor runs.
  static nccl_comm* comm = [] {
    ncclUniqueId id{};
    detail::nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    return new nccl_comm(nccl_comm::from_unique_id(id, 1, 0, stream));
  }();
  return *comm;
}

std::vector<std::size_t> layout(std::size_t n, std::size_t tensors) {
  std::vector<std::size_t> sizes(tensors, n / tensors);
  sizes.back() += n % tensors;
  return sizes;
}

sgd_options options() {
  sgd_options opt{};
  opt.lr = 0.01;
  opt.momentum = 0.9;
  return opt;
}

// How bm_device_sgd steps: step(), or graph_step captured in CUDA graphs and replayed, or
// graph_step queued without a capture (unquantized top-k only).
enum class stepping { plain, graph, graph_uncaptured };

template <class Q, stepping How = stepping::plain>
void bm_device_sgd(benchmark::State& state) {
  using C = compressor<topk, Q, residual>;
  using step_t = device_sparsified_sgd<C, sparse_allgather, nccl_comm>;
  const auto n = static_cast<std::size_t>(state.range(0));
  const double rho = static_cast<double>(state.range(1)) * 1e-6;
  const auto tensors = static_cast<std::size_t>(state.range(2));
  nccl_comm& comm = communicator();
  const float* g = gradcomp_bench::normal_input(n);
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  device_buffer<float> params(n);
  cuda_check(cudaMemsetAsync(params.data(), 0, n * sizeof(float), comm.stream()), "cudaMemsetAsync");
  step_t sgd(comm, layout(n, tensors), C{}, sparse_allgather{}, options(),
             density_schedule::constant(rho));
  const auto one_step = [&] {
    if constexpr (How == stepping::plain) {
      sgd.step(params.span(), device_span<const float>(g, n));
    } else {
      sgd.graph_step(params.span(), device_span<const float>(g, n));
    }
  };
  if constexpr (How != stepping::plain) {
    sgd.capture_graphs(How == stepping::graph);
    // Both parities' graphs captured before the timing: each is captured on its second call
    // (the first is a warm-up), and timed_events' own warm-up is the fourth step.
    for (int i = 0; i < 3; ++i) one_step();
  }
  gradcomp_bench::timed_events(state, comm.stream(), one_step);
  state.counters["k"] = static_cast<double>(sgd.last_stats().selected);
  if constexpr (How != stepping::plain) {
    state.counters["graphs"] = static_cast<double>(sgd.graph_captures());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(n * sizeof(float)));
}

void bm_dense_step(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  nccl_comm& comm = communicator();
  const float* g = gradcomp_bench::normal_input(n);
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  device_buffer<float> params(n), bucket(n), velocity(n);
  cuda_check(cudaMemsetAsync(params.data(), 0, n * sizeof(float), comm.stream()), "cudaMemsetAsync");
  cuda_check(cudaMemsetAsync(velocity.data(), 0, n * sizeof(float), comm.stream()), "cudaMemsetAsync");
  const sgd_options opt = options();
  gradcomp_bench::timed_events(state, comm.stream(), [&] {
    cuda_check(cudaMemcpyAsync(bucket.data(), g, n * sizeof(float), cudaMemcpyDeviceToDevice,
                               comm.stream()),
               "cudaMemcpyAsync");
    comm.allreduce(bucket.span(), reduce_op::sum);
    gradcomp::cuda::step_impl::sgd_kernel<gradcomp::cuda::step_impl::sgd_kind::momentum>
        <<<gradcomp::cuda::grid_for(n, 256, 4096), 256, 0, comm.stream()>>>(
            params.data(), bucket.data(), velocity.data(), n, static_cast<float>(opt.lr), 0.0f,
            static_cast<float>(opt.momentum));
    gradcomp::cuda::check_launch("sgd_kernel");
  });
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(n * sizeof(float)));
}

void bm_copy(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  nccl_comm& comm = communicator();
  const float* g = gradcomp_bench::normal_input(n);
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  device_buffer<float> out(n);
  gradcomp_bench::timed_events(state, comm.stream(), [&] {
    cuda_check(cudaMemcpyAsync(out.data(), g, n * sizeof(float), cudaMemcpyDeviceToDevice,
                               comm.stream()),
               "cudaMemcpyAsync");
  });
}

constexpr std::int64_t sizes[] = {std::int64_t{1} << 20, 25557032};

void step_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"n", "ppm", "tensors"});
  for (const std::int64_t n : sizes) {
    for (const std::int64_t ppm : {1000, 10000}) {
      for (const std::int64_t tensors : {1, 64}) b->Args({n, ppm, tensors});
    }
  }
  b->UseManualTime()->Unit(benchmark::kMicrosecond);
}

void dense_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"n", "tensors"});
  for (const std::int64_t n : sizes) b->Args({n, 1});
  b->UseManualTime()->Unit(benchmark::kMicrosecond);
}

void copy_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"n"});
  for (const std::int64_t n : sizes) b->Args({n});
  b->UseManualTime()->Unit(benchmark::kMicrosecond);
}

}  // namespace

BENCHMARK(bm_device_sgd<identity>)->Name("cuda/step/device_sgd")->Apply(step_args);
BENCHMARK(bm_device_sgd<qsgd>)->Name("cuda/step/device_sgd_qsgd")->Apply(step_args);
BENCHMARK(bm_device_sgd<identity, stepping::graph>)->Name("cuda/step/graph_step")->Apply(step_args);
BENCHMARK(bm_device_sgd<identity, stepping::graph_uncaptured>)
    ->Name("cuda/step/graph_step_uncaptured")
    ->Apply(step_args);
BENCHMARK(bm_dense_step)->Name("cuda/baseline/dense_step")->Apply(dense_args);
BENCHMARK(bm_copy)->Name("cuda/baseline/copy")->Apply(copy_args);
