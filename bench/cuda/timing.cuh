// Timing of device work for gradcomp_cuda_bench: CUDA events recorded on the work's stream
// around each iteration (Google Benchmark's manual time), after one warm-up call that takes
// allocations and first-launch costs out of the measurement.
#pragma once

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <gradcomp/cuda/memory.cuh>

namespace gradcomp_bench {

// Times work(), which enqueues on `stream`, with events; sets each iteration's time.
template <class Work>
void timed_events(benchmark::State& state, cudaStream_t stream, Work&& work) {
  using gradcomp::detail::cuda_check;
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  cuda_check(cudaEventCreate(&start), "cudaEventCreate");
  cuda_check(cudaEventCreate(&stop), "cudaEventCreate");
  work();
  cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  for (auto _ : state) {
    cuda_check(cudaEventRecord(start, stream), "cudaEventRecord");
    work();
    cuda_check(cudaEventRecord(stop, stream), "cudaEventRecord");
    cuda_check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0.0f;
    cuda_check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    state.SetIterationTime(static_cast<double>(ms) / 1e3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

}  // namespace gradcomp_bench
