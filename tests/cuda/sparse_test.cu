// Device sparse calls (gradcomp/cuda/sparse.cuh) against host references: gather is exact;
// the sorted scatter-add equals the host's rank-order sum bit for bit and is the same from run
// to run; the atomic scatter-add is within rounding of it; decompress equals the host
// compressor's overwrite; bad indices are refused with the host's exception and nothing is
// written.
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <gradcomp/cuda/memory.cuh>
#include <gradcomp/cuda/sparse.cuh>
#include <gradcomp/feedback/none.hpp>
#include <gradcomp/quantize.hpp>
#include <gradcomp/select/topk.hpp>
#include <gradcomp/step.hpp>

#include "../support/cuda_buffers.hpp"
#include "../support/data.hpp"

namespace {

using gradcomp::device_buffer;
using gradcomp::device_span;
using gradcomp::device_validation;
using gradcomp::detail::cuda_check;

using gradcomp_test::download;
using gradcomp_test::upload;

template <class T>
auto bits_of(const std::vector<T>& v) {
  using U = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
  std::vector<U> b(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) b[i] = std::bit_cast<U>(v[i]);
  return b;
}

// k distinct sorted indices below n.
std::vector<std::uint32_t> random_indices(std::size_t n, std::size_t k, std::mt19937_64& rng) {
  std::vector<std::uint32_t> all;
  if (k * 4 >= n) {
    all.resize(n);
    for (std::size_t i = 0; i < n; ++i) all[i] = static_cast<std::uint32_t>(i);
    std::shuffle(all.begin(), all.end(), rng);
    all.resize(k);
  } else {
    std::vector<char> taken(n, 0);
    while (all.size() < k) {
      const auto x = static_cast<std::uint32_t>(rng() % n);
      if (!taken[x]) {
        taken[x] = 1;
        all.push_back(x);
      }
    }
  }
  std::sort(all.begin(), all.end());
  return all;
}

using gradcomp_test::scratch_buffer;

// P payloads of one tensor, concatenated in rank order.
struct received {
  std::vector<std::uint32_t> indices;
  std::vector<float> values;
  std::vector<std::size_t> counts;
};

received make_payloads(std::size_t n, std::size_t ranks, std::size_t k, gradcomp_test::dist d,
                       std::uint64_t seed, bool same_indices) {
  std::mt19937_64 rng(seed);
  received r;
  const auto shared = random_indices(n, k, rng);
  for (std::size_t p = 0; p < ranks; ++p) {
    const auto idx = same_indices ? shared : random_indices(n, k, rng);
    const auto vals = gradcomp_test::make_input<float>(d, idx.size(), seed * 31 + p);
    r.indices.insert(r.indices.end(), idx.begin(), idx.end());
    r.values.insert(r.values.end(), vals.begin(), vals.end());
    r.counts.push_back(idx.size());
  }
  return r;
}

// The host's sparse_allgather order: payload after payload, dense[x] += T(v).
template <class T>
std::vector<T> host_scatter_add(std::vector<T> dense, const received& r) {
  for (std::size_t j = 0; j < r.indices.size(); ++j) {
    dense[r.indices[j]] += static_cast<T>(r.values[j]);
  }
  return dense;
}

template <class T>
void check_scatter(std::size_t n, std::size_t ranks, std::size_t k, gradcomp_test::dist d,
                   bool same_indices, cudaStream_t stream) {
  CAPTURE(n);
  CAPTURE(ranks);
  CAPTURE(k);
  CAPTURE(gradcomp_test::name(d));
  CAPTURE(same_indices);
  const auto r = make_payloads(n, ranks, k, d, n + k + ranks, same_indices);
  const auto start_f = gradcomp_test::make_input<float>(gradcomp_test::dist::normal, n, 5);
  std::vector<T> start(start_f.begin(), start_f.end());
  const auto expect = host_scatter_add(start, r);

  auto d_idx = upload(r.indices);
  auto d_val = upload(r.values);
  const device_span<const std::uint32_t> idx{d_idx.data(), r.indices.size()};
  const device_span<const float> val{d_val.data(), r.values.size()};

  for (const auto validation : {device_validation::check, device_validation::trusted}) {
    // Sorted: bit-identical to the host, twice.
    std::vector<T> first;
    for (int run = 0; run < 2; ++run) {
      auto d_dense = upload(start);
      const device_span<T> dense{d_dense.data(), n};
      scratch_buffer s;
      gradcomp::cuda::scatter_add_sorted(s.tmp, idx, val, dense, stream, validation);
      s.allocate();
      gradcomp::cuda::scatter_add_sorted(s.tmp, idx, val, dense, stream, validation);
      cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
      const auto got = download(d_dense.data(), n);
      REQUIRE(bits_of(got) == bits_of(expect));
      if (run == 0) first = got;
      REQUIRE(bits_of(got) == bits_of(first));
    }
    // Atomic: within rounding of the host's sum.
    auto d_dense = upload(start);
    const device_span<T> dense{d_dense.data(), n};
    scratch_buffer s;
    gradcomp::cuda::scatter_add_atomic(s.tmp, idx, val, dense, stream, validation);
    s.allocate();
    gradcomp::cuda::scatter_add_atomic(s.tmp, idx, val, dense, stream, validation);
    cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    const auto got = download(d_dense.data(), n);
    std::vector<double> magnitude(n);
    for (std::size_t i = 0; i < n; ++i) magnitude[i] = std::fabs(static_cast<double>(start[i]));
    for (std::size_t j = 0; j < r.indices.size(); ++j) {
      magnitude[r.indices[j]] += std::fabs(static_cast<double>(r.values[j]));
    }
    const double eps = std::numeric_limits<T>::epsilon();
    for (std::size_t i = 0; i < n; ++i) {
      REQUIRE(std::fabs(static_cast<double>(got[i]) - static_cast<double>(expect[i])) <=
              2.0 * static_cast<double>(ranks) * eps * magnitude[i]);
    }
  }
}

}  // namespace

TEST_CASE("cuda sparse: gather is exact") {
  std::mt19937_64 rng(1);
  for (const std::size_t n :
       {std::size_t{1}, std::size_t{7}, std::size_t{1000}, (std::size_t{1} << 20) + 3}) {
    for (const std::size_t k : {std::size_t{0}, std::size_t{1}, n / 3, n}) {
      CAPTURE(n);
      CAPTURE(k);
      const auto g = gradcomp_test::make_input<float>(gradcomp_test::dist::student_t2, n, n);
      const auto idx = random_indices(n, k, rng);
      auto d_g = upload(g);
      auto d_idx = upload(idx);
      device_buffer<float> d_out(k > 0 ? k : 1);
      scratch_buffer s;
      const device_span<const float> gs{d_g.data(), n};
      const device_span<const std::uint32_t> is{d_idx.data(), k};
      gradcomp::cuda::gather(s.tmp, gs, is, device_span<float>{d_out.data(), k});
      s.allocate();
      gradcomp::cuda::gather(s.tmp, gs, is, device_span<float>{d_out.data(), k});
      const auto got = download(d_out.data(), k);
      for (std::size_t j = 0; j < k; ++j) {
        REQUIRE(std::bit_cast<std::uint32_t>(got[j]) == std::bit_cast<std::uint32_t>(g[idx[j]]));
      }
      // From double, as compressor<..., double> gathers.
      std::vector<double> gd(g.begin(), g.end());
      for (auto& x : gd) x *= 1.0000001;
      auto d_gd = upload(gd);
      scratch_buffer s2;
      const device_span<double> gds{d_gd.data(), n};  // non-const span: deduces T = double
      gradcomp::cuda::gather(s2.tmp, gds, is, device_span<float>{d_out.data(), k});
      s2.allocate();
      gradcomp::cuda::gather(s2.tmp, gds, is, device_span<float>{d_out.data(), k});
      const auto got_d = download(d_out.data(), k);
      for (std::size_t j = 0; j < k; ++j) REQUIRE(got_d[j] == static_cast<float>(gd[idx[j]]));
    }
  }
}

TEST_CASE(
    "cuda sparse: scatter-add of payloads: sorted is the host's sum, atomic within rounding") {
  cudaStream_t stream = nullptr;
  cuda_check(cudaStreamCreate(&stream), "cudaStreamCreate");
  for (const auto d : {gradcomp_test::dist::normal, gradcomp_test::dist::student_t2,
                       gradcomp_test::dist::zeros90, gradcomp_test::dist::ties}) {
    check_scatter<float>(1, 1, 1, d, false, stream);
    check_scatter<float>(1, 5, 1, d, true, stream);  // every payload on the one coordinate
    check_scatter<float>(1000, 4, 0, d, false, stream);
    check_scatter<float>(1000, 4, 37, d, false, stream);
    check_scatter<float>(1001, 8, 1001, d, true, stream);  // dense payloads, full overlap
    check_scatter<float>(100'003, 16, 2'000, d, false, stream);
    check_scatter<double>(4099, 3, 500, d, false, stream);
  }
  check_scatter<float>((std::size_t{1} << 20) + 5, 8, 1 << 14, gradcomp_test::dist::normal, false,
                       stream);
  check_scatter<float>((std::size_t{1} << 20) + 5, 4, 1 << 17, gradcomp_test::dist::laplace, true,
                       nullptr);
  cuda_check(cudaStreamDestroy(stream), "cudaStreamDestroy");
}

TEST_CASE("cuda sparse: decompress overwrites like the host compressor") {
  // The host compressor's decompress of an fp32 payload, overwrite mode.
  using comp = gradcomp::compressor<gradcomp::topk, gradcomp::identity, gradcomp::no_feedback>;
  std::mt19937_64 rng(3);
  for (const std::size_t n : {std::size_t{1}, std::size_t{100}, (std::size_t{1} << 20) + 1}) {
    for (const std::size_t k : {std::size_t{0}, std::size_t{1}, n / 10 + 1, n}) {
      CAPTURE(n);
      CAPTURE(k);
      gradcomp::payload p;
      p.dense_size = n;
      p.layout = gradcomp::index_layout::sparse;
      p.indices = random_indices(n, k, rng);
      p.count = static_cast<std::uint32_t>(k);
      auto vals = gradcomp_test::make_input<float>(gradcomp_test::dist::zeros90, k, n + k);
      if (k > 2) {
        vals[0] = -0.0f;
        vals[1] = std::numeric_limits<float>::infinity();
      }
      gradcomp::identity{}.encode(vals, gradcomp::call_id{}, p);
      std::vector<float> expect(n, 123.0f);
      comp{}.decompress(p, expect);

      auto d_idx = upload(p.indices);
      auto d_val = upload(vals);
      device_buffer<float> d_dense(n);
      cuda_check(cudaMemset(d_dense.data(), 0x55, n * sizeof(float)), "cudaMemset");
      const device_span<const std::uint32_t> is{d_idx.data(), k};
      const device_span<const float> vs{d_val.data(), k};
      scratch_buffer s;
      gradcomp::cuda::decompress(s.tmp, is, vs, device_span<float>{d_dense.data(), n});
      s.allocate();
      gradcomp::cuda::decompress(s.tmp, is, vs, device_span<float>{d_dense.data(), n});
      REQUIRE(bits_of(download(d_dense.data(), n)) == bits_of(expect));
    }
  }
}

TEST_CASE("cuda sparse: bad indices are refused with the host's exception, nothing written") {
  const std::size_t n = 1000;
  const std::vector<float> start(n, 2.5f);
  const auto check_untouched = [&](const device_buffer<float>& d) {
    const auto got = download(d.data(), n);
    for (const float x : got) REQUIRE(x == 2.5f);
  };
  // Out of range at position 3 of 6 (two payloads).
  const std::vector<std::uint32_t> bad = {1, 5, 9, 1000, 2, 7};
  const std::vector<float> vals = {1, 2, 3, 4, 5, 6};
  auto d_idx = upload(bad);
  auto d_val = upload(vals);
  const device_span<const std::uint32_t> is{d_idx.data(), bad.size()};
  const device_span<const float> vs{d_val.data(), vals.size()};
  {
    auto d_dense = upload(start);
    scratch_buffer s;
    gradcomp::cuda::scatter_add_sorted(s.tmp, is, vs, device_span<float>{d_dense.data(), n});
    s.allocate();
    CHECK_THROWS_WITH_AS(
        gradcomp::cuda::scatter_add_sorted(s.tmp, is, vs, device_span<float>{d_dense.data(), n}),
        doctest::Contains("indices[3] = 1000; expected < dense_size (1000)"),
        gradcomp::payload_error);
    check_untouched(d_dense);
  }
  {
    auto d_dense = upload(start);
    scratch_buffer s;
    gradcomp::cuda::scatter_add_atomic(s.tmp, is, vs, device_span<float>{d_dense.data(), n});
    s.allocate();
    CHECK_THROWS_AS(
        gradcomp::cuda::scatter_add_atomic(s.tmp, is, vs, device_span<float>{d_dense.data(), n}),
        gradcomp::payload_error);
    check_untouched(d_dense);
  }
  {
    // Trusted: no exception, but the index out of range is skipped, the rest added.
    auto d_dense = upload(start);
    scratch_buffer s;
    const device_span<float> dense{d_dense.data(), n};
    gradcomp::cuda::scatter_add_sorted(s.tmp, is, vs, dense, nullptr, device_validation::trusted);
    s.allocate();
    gradcomp::cuda::scatter_add_sorted(s.tmp, is, vs, dense, nullptr, device_validation::trusted);
    const auto got = download(d_dense.data(), n);
    CHECK(got[1] == 3.5f);
    CHECK(got[9] == 5.5f);
    CHECK(got[999] == 2.5f);
  }
  {
    // Decompress: one payload, so also strictly increasing (the second 9 is refused).
    const std::vector<std::uint32_t> unsorted = {1, 5, 9, 9, 20};
    auto d_u = upload(unsorted);
    auto d_dense = upload(start);
    scratch_buffer s;
    const device_span<const std::uint32_t> us{d_u.data(), unsorted.size()};
    const device_span<const float> v5{d_val.data(), unsorted.size()};
    gradcomp::cuda::decompress(s.tmp, us, v5, device_span<float>{d_dense.data(), n});
    s.allocate();
    CHECK_THROWS_WITH_AS(
        gradcomp::cuda::decompress(s.tmp, us, v5, device_span<float>{d_dense.data(), n}),
        doctest::Contains("indices[3] = 9 after 9; expected strictly increasing"),
        gradcomp::payload_error);
    check_untouched(d_dense);
  }
  {
    // Gather: invalid_argument, values untouched.
    device_buffer<float> d_out(bad.size());
    cuda_check(cudaMemset(d_out.data(), 0, bad.size() * sizeof(float)), "cudaMemset");
    auto d_g = upload(start);
    scratch_buffer s;
    const device_span<const float> gs{d_g.data(), n};
    gradcomp::cuda::gather(s.tmp, gs, is, device_span<float>{d_out.data(), bad.size()});
    s.allocate();
    CHECK_THROWS_AS(
        gradcomp::cuda::gather(s.tmp, gs, is, device_span<float>{d_out.data(), bad.size()}),
        gradcomp::invalid_argument);
    for (const float x : download(d_out.data(), bad.size())) CHECK(x == 0.0f);
  }
  {
    // Size mismatch and too little scratch: invalid_argument before any launch.
    auto d_dense = upload(start);
    gradcomp::temp_storage q;
    CHECK_THROWS_AS(gradcomp::cuda::scatter_add_sorted(q, is, vs.subspan(0, 5),
                                                       device_span<float>{d_dense.data(), n}),
                    gradcomp::invalid_argument);
    scratch_buffer s;
    const std::vector<std::uint32_t> good = {1, 2, 3, 4, 5, 6};
    auto d_good = upload(good);
    const device_span<const std::uint32_t> gs{d_good.data(), good.size()};
    gradcomp::cuda::scatter_add_sorted(s.tmp, gs, vs, device_span<float>{d_dense.data(), n});
    s.allocate();
    gradcomp::temp_storage small{s.tmp.ptr, s.tmp.bytes - 1};
    CHECK_THROWS_AS(
        gradcomp::cuda::scatter_add_sorted(small, gs, vs, device_span<float>{d_dense.data(), n}),
        gradcomp::invalid_argument);
    check_untouched(d_dense);
  }
}
