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
    gradcomp::on_device(fb).update(
        tmp, gradcomp::device_span<T>{de.data(), n},
        gradcomp::device_span<const std::uint32_t>{di.data(), idx.size()},
        gradcomp::device_span<const float>{dd.data(), dec.size()});
    fb.update(st, std::span<const std::uint32_t>(idx), std::span<const float>(dec));
    check_cuda(cudaDeviceSynchronize());
    CHECK(bitwise_equal(download(de.data(), n), st.e));
    gradcomp::on_device(fb).restore(
        tmp, gradcomp::device_span<T>{de.data(), n},
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
                          tmp, gradcomp::device_span<T>{de.data(), n},
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
    scratch.resize(tmp.bytes);
    tmp.ptr = scratch.data();
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
