// Device selection and fused error feedback, timed with CUDA events (UseManualTime), against
// sort-based top-k, a copy and a bare e += g in the same binary. Bytes processed: the 4n bytes
// of g read once, for every family, so that the rates compare.
//   cuda/select/topk              topk: sample, bracket, one filter read, finish, sort of k
//   cuda/select/topk_stream       the same call launched directly (no graph): adds the host's
//                                 launch cost of its ~25 operations
//   cuda/select/radix_select      topk with topk_method::radix
//   cuda/select/gaussiank         gaussiank
//   cuda/select/threshold         threshold at the normal quantile of density ppm
//   cuda/step/topk_residual       topk::select_accumulate (e += g fused) + gather_and_clear
//   cuda/baseline/radix_sort_topk keys of |g| with indices, cub::DeviceRadixSort::
//                                 SortPairsDescending, the first k indices copied out
//   cuda/baseline/thrust_sort_topk  the same with thrust::sort_by_key
//   cuda/baseline/copy            cudaMemcpyAsync device to device of the 4n bytes
//   cuda/baseline/axpy            e += g
// Arguments n:<n>/ppm:<ppm> (the baselines copy and axpy: n:<n> only). The gradcomp families
// (but topk_stream) capture their call once into a CUDA graph on a stream of their own and time
// graph launches, as a training step under CUDA graphs runs them: the calls never wait for
// the host, so they capture as they are, and the events then time the device work rather than
// the host's launch rate. Targets at n = 25557032, ppm 1000: topk >= 10x faster than
// radix_sort_topk and within 3x of copy; topk_residual within 1.5x of axpy. Inputs: normal
// values from a counter-based hash, generated on the device once per size.
#include <benchmark/benchmark.h>
#include <cub/device/device_radix_sort.cuh>
#include <cuda_runtime.h>
#include <thrust/device_ptr.h>
#include <thrust/execution_policy.h>
#include <thrust/functional.h>
#include <thrust/sort.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include <gradcomp/cuda/feedback.cuh>
#include <gradcomp/cuda/memory.cuh>
#include <gradcomp/cuda/select.cuh>
#include <gradcomp/detail/normal.hpp>
#include <gradcomp/feedback/residual.hpp>
#include <gradcomp/select/gaussiank.hpp>
#include <gradcomp/select/threshold.hpp>
#include <gradcomp/select/topk.hpp>

#include "normal_input.cuh"
#include "timing.cuh"

namespace {

using gradcomp::detail::cuda_check;

__global__ void axpy_bench_kernel(float* e, const float* g, std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    e[i] += g[i];
  }
}

__global__ void key_index_kernel(const float* g, std::size_t n, std::uint32_t* keys,
                                 std::uint32_t* idx) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    keys[i] = gradcomp::detail::abs_key(g[i]);
    idx[i] = static_cast<std::uint32_t>(i);
  }
}

using gradcomp_bench::grid_blocks;

const float* input(std::size_t n) { return gradcomp_bench::normal_input(n); }

// Times body() with events on `stream` per iteration; GB/s of the n-float gradient.
template <class Body>
void timed(benchmark::State& state, std::size_t n, cudaStream_t stream, Body body) {
  gradcomp_bench::timed_events(state, stream, body);
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(n * sizeof(float)));
}

std::size_t k_of(std::size_t n, std::int64_t ppm) {
  return gradcomp::k_for_density(n, static_cast<double>(ppm) * 1e-6);
}

// Times body(stream) as a captured graph (gradcomp_bench::timed_graph_events); GB/s of g.
template <class Body>
void timed_graph(benchmark::State& state, std::size_t n, Body body) {
  gradcomp_bench::timed_graph_events(state, body);
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(n * sizeof(float)));
}

// A selector's device call with its scratch allocated once; graph-timed unless `direct`.
template <class Sel>
void bench_selector(benchmark::State& state, Sel sel, bool direct = false) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const std::size_t k = k_of(n, state.range(1));
  const float* g = input(n);
  const gradcomp::device_span<const float> gs{g, n};
  gradcomp::device_buffer<std::uint32_t> idx(n);
  gradcomp::device_buffer<gradcomp::selection_stats> st(1);
  const gradcomp::select_context ctx{k, static_cast<double>(k) / static_cast<double>(n), {}};
  gradcomp::temp_storage tmp;
  gradcomp::on_device(sel).select(tmp, gs, ctx, idx.span(), st.data(), nullptr);
  gradcomp::device_buffer<char> scratch(tmp.bytes);
  tmp.ptr = scratch.data();
  auto call = [&](cudaStream_t s) {
    gradcomp::on_device(sel).select(tmp, gs, ctx, idx.span(), st.data(), s);
  };
  if (direct) {
    timed(state, n, nullptr, [&] { call(nullptr); });
  } else {
    timed_graph(state, n, call);
  }
  state.counters["k"] = static_cast<double>(k);
}

void bm_topk(benchmark::State& state) { bench_selector(state, gradcomp::topk{}); }

void bm_topk_stream(benchmark::State& state) { bench_selector(state, gradcomp::topk{}, true); }

void bm_radix_select(benchmark::State& state) {
  gradcomp::topk sel;
  sel.method = gradcomp::topk_method::radix;
  bench_selector(state, sel);
}

void bm_gaussiank(benchmark::State& state) { bench_selector(state, gradcomp::gaussiank{}); }

void bm_threshold(benchmark::State& state) {
  const double rho = static_cast<double>(state.range(1)) * 1e-6;
  bench_selector(state, gradcomp::threshold{gradcomp::detail::inverse_normal_upper(rho / 2.0)});
}

void bm_topk_residual(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const std::size_t k = k_of(n, state.range(1));
  const float* g = input(n);
  gradcomp::device_buffer<float> e(n);
  cuda_check(cudaMemset(e.data(), 0, n * sizeof(float)), "cudaMemset");
  // The memset runs on the legacy default stream, which the non-blocking stream of
  // timed_graph does not wait for.
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  gradcomp::device_buffer<std::uint32_t> idx(k);
  gradcomp::device_buffer<float> values(k);
  gradcomp::device_buffer<gradcomp::selection_stats> st(1);
  gradcomp::topk sel;
  const gradcomp::residual fb;
  const gradcomp::select_context ctx{k, static_cast<double>(k) / static_cast<double>(n), {}};
  const gradcomp::device_span<const float> gs{g, n};
  gradcomp::temp_storage tmp;
  gradcomp::on_device(sel).select_accumulate(tmp, e.span(), gs, ctx, idx.span(), st.data(),
                                             nullptr);
  gradcomp::device_buffer<char> scratch(tmp.bytes);
  tmp.ptr = scratch.data();
  timed_graph(state, n, [&](cudaStream_t s) {
    gradcomp::on_device(sel).select_accumulate(tmp, e.span(), gs, ctx, idx.span(), st.data(), s);
    // trusted: the selector just made the indices, and a graph may not wait for the stream.
    gradcomp::on_device(fb).gather_and_clear(
        tmp, e.span(), gradcomp::device_span<const std::uint32_t>{idx.data(), k}, st.data(),
        values.span(), s, gradcomp::device_validation::trusted);
  });
  state.counters["k"] = static_cast<double>(k);
}

void bm_radix_sort_topk(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const std::size_t k = k_of(n, state.range(1));
  const float* g = input(n);
  gradcomp::device_buffer<std::uint32_t> keys(n), keys_out(n), idx(n), idx_out(n), top(k);
  std::size_t bytes = 0;
  cuda_check(cub::DeviceRadixSort::SortPairsDescending(nullptr, bytes, keys.data(), keys_out.data(),
                                                       idx.data(), idx_out.data(),
                                                       static_cast<std::int64_t>(n)),
             "SortPairsDescending (size)");
  gradcomp::device_buffer<char> scratch(bytes);
  timed(state, n, nullptr, [&] {
    key_index_kernel<<<grid_blocks, 256>>>(g, n, keys.data(), idx.data());
    cuda_check(cudaGetLastError(), "key_index_kernel");
    cuda_check(cub::DeviceRadixSort::SortPairsDescending(
                   scratch.data(), bytes, keys.data(), keys_out.data(), idx.data(), idx_out.data(),
                   static_cast<std::int64_t>(n)),
               "SortPairsDescending");
    cuda_check(cudaMemcpyAsync(top.data(), idx_out.data(), k * sizeof(std::uint32_t),
                               cudaMemcpyDeviceToDevice),
               "cudaMemcpyAsync");
  });
}

void bm_thrust_sort_topk(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const std::size_t k = k_of(n, state.range(1));
  const float* g = input(n);
  gradcomp::device_buffer<std::uint32_t> keys(n), idx(n), top(k);
  timed(state, n, nullptr, [&] {
    key_index_kernel<<<grid_blocks, 256>>>(g, n, keys.data(), idx.data());
    cuda_check(cudaGetLastError(), "key_index_kernel");
    thrust::device_ptr<std::uint32_t> kp(keys.data());
    thrust::device_ptr<std::uint32_t> ip(idx.data());
    thrust::sort_by_key(thrust::device, kp, kp + static_cast<std::ptrdiff_t>(n), ip,
                        thrust::greater<std::uint32_t>());
    cuda_check(cudaMemcpyAsync(top.data(), idx.data(), k * sizeof(std::uint32_t),
                               cudaMemcpyDeviceToDevice),
               "cudaMemcpyAsync");
  });
}

void bm_copy(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const float* g = input(n);
  gradcomp::device_buffer<float> out(n);
  timed(state, n, nullptr, [&] {
    cuda_check(cudaMemcpyAsync(out.data(), g, n * sizeof(float), cudaMemcpyDeviceToDevice),
               "cudaMemcpyAsync");
  });
}

void bm_axpy(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const float* g = input(n);
  gradcomp::device_buffer<float> e(n);
  cuda_check(cudaMemset(e.data(), 0, n * sizeof(float)), "cudaMemset");
  timed(state, n, nullptr, [&] {
    axpy_bench_kernel<<<grid_blocks, 256>>>(e.data(), g, n);
    cuda_check(cudaGetLastError(), "axpy_bench_kernel");
  });
}

using gradcomp_bench::sizes_only;
using gradcomp_bench::sizes_ppm;

BENCHMARK(bm_topk)->Name("cuda/select/topk")->Apply(sizes_ppm);
BENCHMARK(bm_topk_stream)->Name("cuda/select/topk_stream")->Apply(sizes_ppm);
BENCHMARK(bm_radix_select)->Name("cuda/select/radix_select")->Apply(sizes_ppm);
BENCHMARK(bm_gaussiank)->Name("cuda/select/gaussiank")->Apply(sizes_ppm);
BENCHMARK(bm_threshold)->Name("cuda/select/threshold")->Apply(sizes_ppm);
BENCHMARK(bm_topk_residual)->Name("cuda/step/topk_residual")->Apply(sizes_ppm);
BENCHMARK(bm_radix_sort_topk)->Name("cuda/baseline/radix_sort_topk")->Apply(sizes_ppm);
BENCHMARK(bm_thrust_sort_topk)->Name("cuda/baseline/thrust_sort_topk")->Apply(sizes_ppm);
BENCHMARK(bm_copy)->Name("cuda/baseline/copy")->Apply(sizes_only);
BENCHMARK(bm_axpy)->Name("cuda/baseline/axpy")->Apply(sizes_only);

}  // namespace
