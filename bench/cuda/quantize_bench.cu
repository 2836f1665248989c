// Device quantizers and sparse gather/scatter, timed with CUDA events (UseManualTime), against
// a device-to-device copy of the same input bytes in the same binary:
//   cuda/quantize/<q>/n:<n>          encode of n floats (bytes processed: the 4n input bytes)
//   cuda/dequantize/<q>/n:<n>        decode of the same encoding (bytes: the 4n output bytes)
//   cuda/baseline/copy_quant/n:<n>   cudaMemcpyAsync of the 4n input bytes
//   cuda/sparse/gather/n:<n>/ppm:<p>              k = n * p / 1e6 values by sorted index
//   cuda/sparse/scatter_add_atomic/n:<n>/ppm:<p>  8 payloads of k entries (overlapping
//   cuda/sparse/scatter_add_sorted/n:<n>/ppm:<p>  indices) added into a dense buffer
// Quantizers as in the host bench: identity, fp16, bf16, qsgd4 (4 bits, buckets of 512),
// terngrad and scaled_sign (one bucket each: the statistics' tree at its deepest). The sparse
// calls run with device_validation::trusted (indices from the host wire decoder): no host
// round trip is timed. Bytes for the sparse calls: indices and values read, values written.
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <gradcomp/cuda/memory.cuh>
#include <gradcomp/cuda/quantize.cuh>
#include <gradcomp/cuda/sparse.cuh>
#include <gradcomp/detail/random.hpp>
#include <gradcomp/quantize.hpp>

#include "timing.cuh"

namespace {

using gradcomp::device_buffer;
using gradcomp::device_span;
using gradcomp::detail::cuda_check;

// Normal values from the counter-based generator (Box-Muller), written on the device so that
// 2^27 inputs cost no host time.
__global__ void fill_normal(float* v, std::size_t n, std::uint64_t key) {
  const gradcomp::detail::counter_rng rng{key};
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const float u1 = 1.0f - rng.uniform(2 * i);  // (0, 1]
    const float u2 = rng.uniform(2 * i + 1);
    v[i] = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
  }
}

device_buffer<float> normal_input(std::size_t n, std::uint64_t seed) {
  device_buffer<float> v(n);
  fill_normal<<<1024, 256>>>(v.data(), n, seed);
  cuda_check(cudaGetLastError(), "fill_normal");
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  return v;
}

using gradcomp_bench::timed_events;

struct stream_holder {
  cudaStream_t s = nullptr;
  stream_holder() { cuda_check(cudaStreamCreate(&s), "cudaStreamCreate"); }
  ~stream_holder() { cudaStreamDestroy(s); }
  stream_holder(const stream_holder&) = delete;
  stream_holder& operator=(const stream_holder&) = delete;
};

// The encoding of n values by q, with its buffers and scratch.
template <class Q>
struct encoded_buffers {
  gradcomp::encoded_size size;
  device_buffer<std::byte> packed;
  device_buffer<float> side;
  gradcomp::device_encoded view() const {
    return {{packed.data(), size.packed_bytes}, {side.data(), size.side_count}};
  }
  encoded_buffers(const Q& q, std::size_t n)
      : size(gradcomp::device_encoded_size(q, n)),
        packed(std::max<std::size_t>(size.packed_bytes, 1)),
        side(std::max<std::size_t>(size.side_count, 1)) {}
};

template <class Q>
void bench_encode(benchmark::State& state, Q q) {
  const auto n = static_cast<std::size_t>(state.range(0));
  stream_holder stream;
  const auto input = normal_input(n, 1);
  encoded_buffers<Q> enc(q, n);
  const device_span<const float> values{input.data(), n};
  const gradcomp::call_id call{1, 2, 3};
  gradcomp::temp_storage tmp;
  gradcomp::on_device(q).encode(tmp, values, call, enc.view(), stream.s);
  device_buffer<std::byte> scratch(tmp.bytes);
  tmp.ptr = scratch.data();
  timed_events(state, stream.s,
               [&] { gradcomp::on_device(q).encode(tmp, values, call, enc.view(), stream.s); });
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(n * sizeof(float)));
  state.counters["packed_bytes"] = static_cast<double>(enc.size.packed_bytes);
}

template <class Q>
void bench_decode(benchmark::State& state, Q q) {
  const auto n = static_cast<std::size_t>(state.range(0));
  stream_holder stream;
  const auto input = normal_input(n, 2);
  encoded_buffers<Q> enc(q, n);
  const gradcomp::call_id call{1, 2, 3};
  gradcomp::temp_storage tmp;
  gradcomp::on_device(q).encode(tmp, device_span<const float>{input.data(), n}, call, enc.view(),
                                stream.s);
  device_buffer<std::byte> scratch(tmp.bytes);
  tmp.ptr = scratch.data();
  gradcomp::on_device(q).encode(tmp, device_span<const float>{input.data(), n}, call, enc.view(),
                                stream.s);
  device_buffer<float> out(n);
  gradcomp::temp_storage dtmp;
  const device_span<float> decoded{out.data(), n};
  // Trusted: the bytes come from the device encoder; no host round trip in the timing.
  gradcomp::on_device(q).decode(dtmp, enc.view(), decoded, stream.s,
                                gradcomp::device_validation::trusted);
  device_buffer<std::byte> dscratch(dtmp.bytes);
  dtmp.ptr = dscratch.data();
  timed_events(state, stream.s, [&] {
    gradcomp::on_device(q).decode(dtmp, enc.view(), decoded, stream.s,
                                  gradcomp::device_validation::trusted);
  });
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(n * sizeof(float)));
}

void bench_copy(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  stream_holder stream;
  const auto input = normal_input(n, 3);
  device_buffer<float> out(n);
  timed_events(state, stream.s, [&] {
    cuda_check(cudaMemcpyAsync(out.data(), input.data(), n * sizeof(float),
                               cudaMemcpyDeviceToDevice, stream.s),
               "cudaMemcpyAsync");
  });
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(n * sizeof(float)));
}

// `payloads` sorted index lists of k distinct indices below n, concatenated (overlapping
// across payloads, as ranks' selections do).
std::vector<std::uint32_t> payload_indices(std::size_t n, std::size_t k, std::size_t payloads) {
  std::vector<std::uint32_t> all;
  all.reserve(k * payloads);
  for (std::size_t p = 0; p < payloads; ++p) {
    const gradcomp::detail::counter_rng rng{0x5eed + p};
    std::vector<std::uint32_t> idx(k);
    // Stratified: one index per stratum of n / k, so they are distinct and sorted.
    for (std::size_t j = 0; j < k; ++j) {
      const std::size_t lo = j * n / k;
      const std::size_t hi = (j + 1) * n / k;
      idx[j] = static_cast<std::uint32_t>(lo + rng.below(j, hi - lo));
    }
    all.insert(all.end(), idx.begin(), idx.end());
  }
  return all;
}

std::size_t k_of(std::size_t n, std::size_t ppm) {
  return std::max<std::size_t>(1, n * ppm / 1'000'000);
}

void bench_gather(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const std::size_t k = k_of(n, static_cast<std::size_t>(state.range(1)));
  stream_holder stream;
  const auto g = normal_input(n, 4);
  const auto h_idx = payload_indices(n, k, 1);
  device_buffer<std::uint32_t> idx(k);
  cuda_check(
      cudaMemcpy(idx.data(), h_idx.data(), k * sizeof(std::uint32_t), cudaMemcpyHostToDevice),
      "cudaMemcpy");
  device_buffer<float> values(k);
  gradcomp::temp_storage tmp;
  const device_span<const float> gs{g.data(), n};
  const device_span<const std::uint32_t> is{idx.data(), k};
  const device_span<float> vs{values.data(), k};
  const auto trusted = gradcomp::device_validation::trusted;
  gradcomp::cuda::gather(tmp, gs, is, vs, stream.s, trusted);
  device_buffer<std::byte> scratch(tmp.bytes);
  tmp.ptr = scratch.data();
  timed_events(state, stream.s, [&] { gradcomp::cuda::gather(tmp, gs, is, vs, stream.s, trusted); });
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(k * 12));
}

template <bool Sorted>
void bench_scatter(benchmark::State& state) {
  constexpr std::size_t payloads = 8;
  const auto n = static_cast<std::size_t>(state.range(0));
  const std::size_t k = k_of(n, static_cast<std::size_t>(state.range(1)));
  const std::size_t m = k * payloads;
  stream_holder stream;
  const auto h_idx = payload_indices(n, k, payloads);
  device_buffer<std::uint32_t> idx(m);
  cuda_check(
      cudaMemcpy(idx.data(), h_idx.data(), m * sizeof(std::uint32_t), cudaMemcpyHostToDevice),
      "cudaMemcpy");
  const auto values = normal_input(m, 5);
  device_buffer<float> dense(n);
  cuda_check(cudaMemset(dense.data(), 0, n * sizeof(float)), "cudaMemset");
  const device_span<const std::uint32_t> is{idx.data(), m};
  const device_span<const float> vs{values.data(), m};
  const device_span<float> ds{dense.data(), n};
  const auto trusted = gradcomp::device_validation::trusted;
  const auto call = [&](gradcomp::temp_storage& t) {
    if constexpr (Sorted) {
      gradcomp::cuda::scatter_add_sorted(t, is, vs, ds, stream.s, trusted);
    } else {
      gradcomp::cuda::scatter_add_atomic(t, is, vs, ds, stream.s, trusted);
    }
  };
  gradcomp::temp_storage tmp;
  call(tmp);
  device_buffer<std::byte> scratch(tmp.bytes);
  tmp.ptr = scratch.data();
  timed_events(state, stream.s, [&] { call(tmp); });
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(m * 8));
  state.counters["entries"] = static_cast<double>(m);
}

constexpr std::int64_t sizes[] = {std::int64_t{1} << 20, 25557032, std::int64_t{1} << 27};
constexpr std::int64_t densities_ppm[] = {100, 1000, 10000};

template <class Q>
void add_quantizer(const std::string& name, Q q) {
  for (const std::int64_t n : sizes) {
    benchmark::RegisterBenchmark(("cuda/quantize/" + name).c_str(),
                                 [q](benchmark::State& s) { bench_encode(s, q); })
        ->ArgNames({"n"})
        ->Arg(n)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("cuda/dequantize/" + name).c_str(),
                                 [q](benchmark::State& s) { bench_decode(s, q); })
        ->ArgNames({"n"})
        ->Arg(n)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
}

[[maybe_unused]] const bool registered = [] {
  add_quantizer("identity", gradcomp::identity{});
  add_quantizer("fp16", gradcomp::fp16{});
  add_quantizer("bf16", gradcomp::bf16{});
  add_quantizer("qsgd4", gradcomp::qsgd::with_bits(4));
  add_quantizer("terngrad", gradcomp::terngrad{});
  add_quantizer("scaled_sign", gradcomp::scaled_sign{});
  for (const std::int64_t n : sizes) {
    benchmark::RegisterBenchmark("cuda/baseline/copy_quant", bench_copy)
        ->ArgNames({"n"})
        ->Arg(n)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
    for (const std::int64_t ppm : densities_ppm) {
      benchmark::RegisterBenchmark("cuda/sparse/gather", bench_gather)
          ->ArgNames({"n", "ppm"})
          ->Args({n, ppm})
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
      benchmark::RegisterBenchmark("cuda/sparse/scatter_add_atomic", bench_scatter<false>)
          ->ArgNames({"n", "ppm"})
          ->Args({n, ppm})
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
      benchmark::RegisterBenchmark("cuda/sparse/scatter_add_sorted", bench_scatter<true>)
          ->ArgNames({"n", "ppm"})
          ->Args({n, ppm})
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
  return true;
}();

}  // namespace
