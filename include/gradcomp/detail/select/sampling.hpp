// gradcomp/detail/select/sampling.hpp: the strided sample from which selectors estimate their
// thresholds.
#pragma once

#include <cstddef>

#include <gradcomp/detail/select/keys.hpp>

namespace gradcomp::detail {

// Calls f(j, value) for the values at the positions floor(j n / s), j < s (1 <= s <= n). The
// positions advance by quotient and remainder (no division per sample); the loads are
// independent, so the out-of-order core overlaps their cache misses.
template <class Source, class F>
void for_each_strided(const Source& src, std::size_t s, F&& f) {
  const std::size_t n = src.size();
  const std::size_t q = n / s;
  const std::size_t r = n % s;
  std::size_t pos = 0;
  std::size_t rem = 0;
  for (std::size_t j = 0; j < s; ++j) {
    f(j, src.at(pos));
    pos += q;
    rem += r;
    if (rem >= s) {
      rem -= s;
      ++pos;
    }
  }
}

// The keys at those positions, into keys[0..s).
template <class T, class Source>
void strided_sample_keys(const Source& src, std::size_t s, abs_key_t<T>* keys) {
  for_each_strided(src, s, [keys](std::size_t j, T x) { keys[j] = abs_key(x); });
}

}  // namespace gradcomp::detail
