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

// Captures body(stream) into a graph on a non-blocking stream of its own (after one direct
// warm-up call outside the capture) and times the graph's launches with timed_events: what a
// training step under CUDA graphs runs, with the device work rather than the host's launch
// rate in the events.
template <class Body>
void timed_graph_events(benchmark::State& state, Body&& body) {
  using gradcomp::detail::cuda_check;
  cudaStream_t stream = nullptr;
  cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  body(stream);
  cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cuda_check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal),
             "cudaStreamBeginCapture");
  body(stream);
  cuda_check(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
  cuda_check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
  timed_events(state, stream, [&] { cuda_check(cudaGraphLaunch(exec, stream), "cudaGraphLaunch"); });
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace gradcomp_bench
