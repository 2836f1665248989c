// detail::stream_copy and detail::stream_scaled (the streamed writes of rank_order_mean and
// topk_a2a's copy out) against plain loops, bit for bit, on every host instruction-set path
// this CPU offers (the 64-byte stores of the AVX-512 path from stream_lines_min_bytes, the
// 16-byte ones below it and on the other paths): lengths 0, 1, small, odd, on both sides of
// stream_lines_min_bytes and beyond 2^20, destinations at every element offset from a 64-byte
// boundary, and values that are not Gaussian (zeros of both signs, subnormals, infinities,
// NaN, the largest finite values, which a scale of 2 overflows). Nothing outside the range is
// written.
#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <gradcomp/detail/host_dispatch.hpp>
#include <gradcomp/detail/stream_store.hpp>

namespace {

using gradcomp::detail::host_isa;

template <class T>
T odd_value(std::mt19937_64& rng) {
  using lim = std::numeric_limits<T>;
  switch (rng() % 10) {
    case 0: return T(0);
    case 1: return -T(0);
    case 2: return lim::denorm_min() * static_cast<T>(rng() % 100 + 1);
    case 3: return (rng() % 2 ? T(1) : T(-1)) * lim::infinity();
    case 4: return lim::quiet_NaN();
    case 5: return (rng() % 2 ? T(1) : T(-1)) * lim::max();
    default: {
      const int e = static_cast<int>(rng() % 80) - 40;
      return std::ldexp(static_cast<T>(rng() % 100000 + 1) * (rng() % 2 ? T(1) : T(-1)), e);
    }
  }
}

template <class T>
bool same_bits(const T* a, const T* b, std::size_t n) {
  return n == 0 || std::memcmp(a, b, n * sizeof(T)) == 0;
}

// Restores the process-wide ceiling when it goes out of scope.
struct isa_ceiling {
  host_isa before;
  explicit isa_ceiling(host_isa isa) : before(gradcomp::detail::limit_host_isa(isa)) {}
  ~isa_ceiling() { gradcomp::detail::limit_host_isa(before); }
  isa_ceiling(const isa_ceiling&) = delete;
  isa_ceiling& operator=(const isa_ceiling&) = delete;
};

}  // namespace

TEST_CASE_TEMPLATE("stream_copy, stream_scaled: a plain loop's bits on every path", T, float, double) {
  constexpr std::size_t line = 64 / sizeof(T);
  constexpr std::size_t wide = gradcomp::detail::stream_lines_min_bytes / sizeof(T);
  std::mt19937_64 rng(7);
  const std::size_t biggest = (std::size_t{1} << 20) + 3;
  std::vector<T> src(biggest + line);
  for (T& x : src) x = odd_value<T>(rng);
  const T sentinel = T(-12.25);

  if (gradcomp::detail::detected_host_isa() != host_isa::avx512) {
    MESSAGE("this CPU has no AVX-512: the 64-byte streaming stores are not tested here");
  }
  for (const host_isa isa : {host_isa::portable, host_isa::baseline, host_isa::avx2, host_isa::avx512}) {
    if (static_cast<int>(isa) > static_cast<int>(gradcomp::detail::detected_host_isa())) continue;
    const isa_ceiling ceiling(isa);
    CAPTURE(gradcomp::detail::host_isa_name(isa));
    for (const std::size_t len : {std::size_t{0}, std::size_t{1}, std::size_t{3}, line - 1, line, line + 1,
                                  std::size_t{37}, wide - 1, wide, wide + 1, 3 * wide + line + 5, biggest}) {
      // The 64-byte stores take exactly the ranges of 4 KiB or more, on the AVX-512 path
      // (where the build has streaming stores at all).
      if (GRADCOMP_STREAM_STORES && GRADCOMP_HOST_DISPATCH) {
        CHECK(gradcomp::detail::stream_lines_used<T>(len) == (isa == host_isa::avx512 && len >= wide));
      } else {
        CHECK_FALSE(gradcomp::detail::stream_lines_used<T>(len));
      }
      // Every offset from a 64-byte boundary for the short lengths, a few for the long ones.
      const std::size_t offsets = len <= 4 * wide ? line : 3;
      for (std::size_t off = 0; off < offsets; ++off) {
        CAPTURE(len);
        CAPTURE(off);
        // A 64-byte-aligned start (an over-allocated vector, rounded up), then off elements in.
        std::vector<T> storage(len + 3 * line, sentinel);
        const auto base = reinterpret_cast<std::uintptr_t>(storage.data());
        const std::size_t lead = ((64 - base % 64) % 64) / sizeof(T) + off;
        REQUIRE(lead + len + 1 <= storage.size());
        T* dst = storage.data() + lead;
        const T* from = src.data() + off;  // the source off the boundary too

        gradcomp::detail::stream_copy(dst, from, len);
        gradcomp::detail::stream_fence();
        CHECK(same_bits(dst, from, len));

        const T scale = len % 2 == 0 ? T(0.25) : T(2);  // 2 overflows the largest values
        gradcomp::detail::stream_scaled(dst, from, len, scale);
        gradcomp::detail::stream_fence();
        std::vector<T> want(len);
        for (std::size_t i = 0; i < len; ++i) want[i] = from[i] * scale;
        CHECK(same_bits(dst, want.data(), len));

        bool untouched = true;
        for (std::size_t i = 0; i < lead; ++i) untouched = untouched && storage[i] == sentinel;
        for (std::size_t i = lead + len; i < storage.size(); ++i) untouched = untouched && storage[i] == sentinel;
        CHECK(untouched);
      }
    }
  }
}
