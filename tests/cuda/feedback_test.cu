// Residual error feedback on the device (gradcomp/cuda/feedback.cuh) against the host residual:
// accumulate, update and restore bit for bit, and the fused step (select_accumulate + gather
// and clear) equal to the host's accumulate, select and update with the exact values.
// Skipped (exit 77) without a CUDA device.
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

// The umbrella, so that the build checks it compiles with everything it pulls in.
#include <gradcomp/cuda.cuh>

#include "../support/cuda_buffers.hpp"
#include "../support/data.hpp"

using gradcomp_test::dist;

namespace {

void check_cuda(cudaError_t rc) { REQUIRE_MESSAGE(rc == cudaSuccess, cudaGetErrorString(rc)); }

using gradcomp_test::download;
using gradcomp_test::upload;

template <class T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](T x, T y) {
           return std::bit_cast<gradcomp::detail::abs_key_t<T>>(x) ==
                  std::bit_cast<gradcomp::detail::abs_key_t<T>>(y);
         });
}

}  // namespace

TEST_CASE_TEMPLATE("device residual accumulate/update/restore equal the host's", T, float, double) {
  for (std::size_t n :
       {std::size_t{0}, std::size_t{1}, std::size_t{1000}, (std::size_t{1} << 20) + 5}) {
    CAPTURE(n);
    const gradcomp::residual fb;
    auto st = fb.make_state<T>(n);
    const auto g = gradcomp_test::make_input<T>(dist::normal, n, 3);
    const auto g2 = gradcomp_test::make_input<T>(dist::laplace, n, 4);
    auto de = upload(st.e);
    auto dg = upload(g);
    auto dg2 = upload(g2);
    gradcomp::temp_storage tmp;
    gradcomp::on_device(fb).accumulate(tmp, gradcomp::device_span<T>{de.data(), n},
                                       gradcomp::device_span<const T>{dg.data(), n});
    CHECK(tmp.bytes == 0);
    tmp.ptr = de.data();  // any non-null pointer: nothing is used
    gradcomp::on_device(fb).accumulate(tmp, gradcomp::device_span<T>{de.data(), n},
                                       gradcomp::device_span<const T>{dg.data(), n});
    gradcomp::on_device(fb).accumulate(tmp, gradcomp::device_span<T>{de.data(), n},
                                       gradcomp::device_span<const T>{dg2.data(), n});
    fb.accumulate(st, std::span<const T>(g));
    fb.accumulate(st, std::span<const T>(g2));
    check_cuda(cudaDeviceSynchronize());
    CHECK(bitwise_equal(download(de.data(), n), st.e));

    std::vector<std::uint32_t> idx;
    std::vector<float> dec;
    for (std::size_t i = 0; i < n; i += 7) {
      idx.push_back(static_cast<std::uint32_t>(i));
      dec.push_back(static_cast<float>(st.e[i]) * 0.75f);
    }
    auto di = upload(idx);
    auto dd = upload(dec);
    // update and restore check the indices on the device: a little scratch for that.
    gradcomp::temp_storage stmp;
    gradcomp::on_device(fb).update(
        stmp, gradcomp::device_span<T>{de.data(), n},
        gradcomp::device_span<const std::uint32_t>{di.data(), idx.size()},
        gradcomp::device_span<const float>{dd.data(), dec.size()});
    gradcomp::device_buffer<char> scratch(stmp.bytes);
    stmp.ptr = scratch.data();
    gradcomp::on_device(fb).update(
        stmp, gradcomp::device_span<T>{de.data(), n},
        gradcomp::device_span<const std::uint32_t>{di.data(), idx.size()},
        gradcomp::device_span<const float>{dd.data(), dec.size()});
    fb.update(st, std::span<const std::uint32_t>(idx), std::span<const float>(dec));
    check_cuda(cudaDeviceSynchronize());
    CHECK(bitwise_equal(download(de.data(), n), st.e));
    gradcomp::on_device(fb).restore(
        stmp, gradcomp::device_span<T>{de.data(), n},
        gradcomp::device_span<const std::uint32_t>{di.data(), idx.size()},
        gradcomp::device_span<const float>{dd.data(), dec.size()});
    fb.restore(st, std::span<const std::uint32_t>(idx), std::span<const float>(dec));
    check_cuda(cudaDeviceSynchronize());
    CHECK(bitwise_equal(download(de.data(), n), st.e));

    // Bad sizes throw before anything runs.
    if (n > 0) {
      CHECK_THROWS_AS(
          gradcomp::on_device(fb).accumulate(tmp, gradcomp::device_span<T>{de.data(), n},
                                             gradcomp::device_span<const T>{dg.data(), n - 1}),
          gradcomp::invalid_argument);
      CHECK_THROWS_AS(gradcomp::on_device(fb).update(
                          stmp, gradcomp::device_span<T>{de.data(), n},
                          gradcomp::device_span<const std::uint32_t>{di.data(), idx.size()},
                          gradcomp::device_span<const float>{dd.data(), dec.size() - 1}),
                      gradcomp::invalid_argument);
      check_cuda(cudaDeviceSynchronize());
      CHECK(bitwise_equal(download(de.data(), n), st.e));
    }
  }
}

// The fused step: e += g and the selection in one pass, then the values at the selection are
// gathered and e is zeroed there; the host does the same with select_accumulate and update.
template <class T, class Sel>
void check_fused_step(Sel sel, std::size_t n, std::size_t k, dist d) {
  CAPTURE(n);
  CAPTURE(k);
  const gradcomp::residual fb;
  auto st = fb.make_state<T>(n);
  for (std::size_t i = 0; i < n; ++i) st.e[i] = static_cast<T>(0.01) * static_cast<T>(i % 13);
  auto de = upload(st.e);
  gradcomp::device_buffer<std::uint32_t> di(std::max<std::size_t>(n, 1));
  gradcomp::device_buffer<T> dv(std::max<std::size_t>(n, 1));
  gradcomp::device_buffer<gradcomp::selection_stats> dst(1);
  gradcomp::device_buffer<char> scratch;
  for (int step = 0; step < 3; ++step) {
    const auto g = gradcomp_test::make_input<T>(d, n, 100 + static_cast<std::uint64_t>(step));
    auto dg = upload(g);
    // Host: e += g and select, send the values, e = 0 there (update with the exact values).
    std::vector<std::uint32_t> hidx;
    sel.select_accumulate(fb.in_place_accumulator(st), std::span<const T>(g),
                          gradcomp::select_context{k, 0.0, {}}, hidx);
    std::vector<T> hval(hidx.size());
    std::vector<float> hdec(hidx.size());
    for (std::size_t j = 0; j < hidx.size(); ++j) hval[j] = st.e[hidx[j]];
    for (std::size_t j = 0; j < hidx.size(); ++j) st.e[hidx[j]] = T(0);
    // Device.
    gradcomp::temp_storage tmp;
    const gradcomp::device_span<T> e{de.data(), n};
    const gradcomp::device_span<const T> gs{dg.data(), n};
    const gradcomp::device_span<std::uint32_t> idx{di.data(), n};
    gradcomp::on_device(sel).select_accumulate(tmp, e, gs, gradcomp::select_context{k, 0.0, {}},
                                               idx, dst.data());
    gradcomp::temp_storage gtmp;  // one scratch buffer for both calls: the larger of the two
    gradcomp::on_device(fb).gather_and_clear(
        gtmp, e, gradcomp::device_span<const std::uint32_t>{di.data(), n}, dst.data(),
        gradcomp::device_span<T>{dv.data(), n});
    scratch.resize(std::max(tmp.bytes, gtmp.bytes));
    tmp.ptr = scratch.data();
    tmp.bytes = scratch.size();
    gradcomp::on_device(sel).select_accumulate(tmp, e, gs, gradcomp::select_context{k, 0.0, {}},
                                               idx, dst.data());
    gradcomp::on_device(fb).gather_and_clear(
        tmp, e, gradcomp::device_span<const std::uint32_t>{di.data(), n}, dst.data(),
        gradcomp::device_span<T>{dv.data(), n});
    check_cuda(cudaDeviceSynchronize());
    const auto stats = download(dst.data(), 1)[0];
    if constexpr (std::is_same_v<Sel, gradcomp::topk>) {
      CHECK(download(di.data(), stats.count) == hidx);
      CHECK(bitwise_equal(download(dv.data(), stats.count), hval));
      CHECK(bitwise_equal(download(de.data(), n), st.e));
    } else {
      // Gaussian-k: the device's own threshold; e is zero exactly at its selection, and e + g
      // elsewhere. Both runs start from the host's state for the next step.
      const auto sel_idx = download(di.data(), stats.count);
      const auto dev_e = download(de.data(), n);
      for (const auto i : sel_idx) CHECK(dev_e[i] == T(0));
      st.e = dev_e;
    }
  }
}

TEST_CASE("device fused feedback step equals the host's") {
  for (std::size_t n :
       {std::size_t{1}, std::size_t{5000}, std::size_t{300007}, (std::size_t{1} << 21) + 1}) {
    for (std::size_t k : {std::size_t{0}, std::size_t{1}, n / 1000 + 1, n / 50 + 1, n}) {
      if (k > n) continue;
      check_fused_step<float>(gradcomp::topk{}, n, k, dist::normal);
      check_fused_step<float>(gradcomp::topk{}, n, k, dist::zeros90);
      check_fused_step<double>(gradcomp::topk{}, n, k, dist::student_t2);
      check_fused_step<float>(gradcomp::gaussiank{}, n, k, dist::normal);
    }
  }
}

TEST_CASE_TEMPLATE("device residual feedback keeps the host's promises on bad and repeated indices",
                   T, float, double) {
  const gradcomp::residual fb;
  const std::size_t n = 1000;
  std::vector<T> e0(n);
  for (std::size_t i = 0; i < n; ++i) e0[i] = static_cast<T>(i % 13) - T(6);
  auto de = upload(e0);
  const gradcomp::device_span<T> e{de.data(), n};
  gradcomp::temp_storage tmp;
  gradcomp::device_buffer<char> scratch;
  auto sized = [&](auto&& call) {  // size query, scratch, then the call
    tmp = {};
    call();
    scratch.resize(std::max<std::size_t>(tmp.bytes, 1));
    tmp.ptr = scratch.data();
    call();
  };

  // An index out of range: refused before anything is written (check), or skipped (trusted).
  const std::vector<std::uint32_t> bad = {3, 7, static_cast<std::uint32_t>(n), 9};
  const std::vector<float> ones(bad.size(), 1.0f);
  auto dbad = upload(bad);
  auto dones = upload(ones);
  const gradcomp::device_span<const std::uint32_t> bi{dbad.data(), bad.size()};
  const gradcomp::device_span<const float> bv{dones.data(), ones.size()};
  CHECK_THROWS_AS(sized([&] { gradcomp::on_device(fb).update(tmp, e, bi, bv); }),
                  gradcomp::invalid_argument);
  check_cuda(cudaDeviceSynchronize());
  CHECK(bitwise_equal(download(de.data(), n), e0));
  sized([&] { gradcomp::on_device(fb).restore(tmp, e, bi, bv, nullptr, gradcomp::device_validation::trusted); });
  check_cuda(cudaDeviceSynchronize());
  std::vector<T> want = e0;
  for (const std::uint32_t i : {3u, 7u, 9u}) want[i] += T(1);  // the one out of range: skipped
  CHECK(bitwise_equal(download(de.data(), n), want));

  // A repeated index is added once per entry, as the host's sequential loop does.
  const std::vector<std::uint32_t> twice = {5, 5, 5, 11};
  const std::vector<float> quarter(twice.size(), 0.25f);
  auto dtw = upload(twice);
  auto dq = upload(quarter);
  sized([&] {
    gradcomp::on_device(fb).restore(tmp, e, gradcomp::device_span<const std::uint32_t>{dtw.data(), twice.size()},
                                    gradcomp::device_span<const float>{dq.data(), quarter.size()});
  });
  check_cuda(cudaDeviceSynchronize());
  want[5] += T(0.75);
  want[11] += T(0.25);
  CHECK(bitwise_equal(download(de.data(), n), want));

  // gather_and_clear: a selection that repeats an index is refused (check); trusted, the value
  // goes to one of its entries and 0 to the others, so the sum is kept and nothing is doubled.
  gradcomp::selection_stats st{twice.size(), 0.0, 0, false};
  auto dst = upload(std::vector<gradcomp::selection_stats>{st});
  gradcomp::device_buffer<T> values(twice.size());
  const gradcomp::device_span<const std::uint32_t> ti{dtw.data(), twice.size()};
  CHECK_THROWS_AS(sized([&] {
                    gradcomp::on_device(fb).gather_and_clear(tmp, e, ti, dst.data(),
                                                             gradcomp::device_span<T>{values.data(), twice.size()});
                  }),
                  gradcomp::invalid_argument);
  check_cuda(cudaDeviceSynchronize());
  CHECK(bitwise_equal(download(de.data(), n), want));
  sized([&] {
    gradcomp::on_device(fb).gather_and_clear(tmp, e, ti, dst.data(),
                                             gradcomp::device_span<T>{values.data(), twice.size()},
                                             nullptr, gradcomp::device_validation::trusted);
  });
  check_cuda(cudaDeviceSynchronize());
  const auto got = download(values.data(), twice.size());
  CHECK(got[0] + got[1] + got[2] == want[5]);
  CHECK(got[3] == want[11]);
  want[5] = T(0);
  want[11] = T(0);
  CHECK(bitwise_equal(download(de.data(), n), want));
}
