// Helpers of the reliability tests: byte snapshots for "nothing changed" checks (comparing
// object representations catches what operator== would miss: a NaN overwritten by another
// NaN, -0 for +0), and reproducible test gradients of their own, so that these tests do not
// move when other tests' inputs are retuned.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>
#include <vector>

#include <gradcomp/sparse.hpp>

namespace gradcomp::reliability {

enum class dist { normal, laplace };

// Gradient values from a SplitMix64 stream: the same on every platform and library.
template <class T = float>
std::vector<T> gradient(std::size_t n, std::uint64_t seed, dist d = dist::normal) {
  std::uint64_t state = seed * 0x9e3779b97f4a7c15ull + 1;
  auto next = [&state] {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  auto uniform = [&] { return (static_cast<double>(next() >> 11) + 0.5) * 0x1.0p-53; };
  std::vector<T> g(n);
  for (auto& x : g) {
    const double u = uniform();
    const double v = uniform();
    const double r = d == dist::normal
                         ? std::sqrt(-2.0 * std::log(u)) * std::cos(6.283185307179586 * v)
                         : (v < 0.5 ? -1.0 : 1.0) * -std::log(u);
    x = static_cast<T>(r);
  }
  return g;
}

using byte_snapshot = std::vector<unsigned char>;

template <class T>
  requires std::is_trivially_copyable_v<T>
void append_bytes(byte_snapshot& out, std::span<const T> s) {
  // resize + memcpy rather than insert(): GCC 12 reports a false -Wstringop-overflow for
  // vector<unsigned char>::insert at -O2.
  const std::uint64_t n = s.size();  // a size prefix, so that moved bytes cannot cancel out
  const std::size_t at = out.size();
  out.resize(at + sizeof n + s.size_bytes());
  std::memcpy(out.data() + at, &n, sizeof n);
  if (!s.empty()) std::memcpy(out.data() + at + sizeof n, s.data(), s.size_bytes());
}

template <class T>
  requires std::is_trivially_copyable_v<T>
byte_snapshot bytes_of(std::span<const T> s) {
  byte_snapshot out;
  append_bytes(out, s);
  return out;
}

template <class T>
byte_snapshot bytes_of(const std::vector<T>& v) {
  return bytes_of(std::span<const T>(v));
}

// Every field of a payload, raw.
inline byte_snapshot bytes_of(const payload& p) {
  byte_snapshot out;
  const std::uint64_t head[] = {p.dense_size,
                                static_cast<std::uint64_t>(p.layout),
                                static_cast<std::uint64_t>(p.quantizer),
                                p.bits_per_value,
                                p.params.levels,
                                p.params.bucket_size,
                                p.count};
  append_bytes(out, std::span<const std::uint64_t>(head));
  append_bytes(out, std::span<const std::uint32_t>(p.indices));
  append_bytes(out, std::span<const std::byte>(p.values));
  append_bytes(out, std::span<const float>(p.side));
  return out;
}

// Every buffer of a feedback state (buffers() is non-const by the concept), or its size for
// states without buffers.
template <class State>
byte_snapshot state_bytes(State& st) {
  byte_snapshot out;
  for (const auto& b : st.buffers()) {
    append_bytes(out, std::span<const typename std::remove_cvref_t<decltype(b)>::element_type>(
                          b.data(), b.size()));
  }
  if constexpr (requires { st.size; }) {
    const std::uint64_t n = st.size;
    append_bytes(out, std::span<const std::uint64_t>(&n, 1));
  }
  return out;
}

}  // namespace gradcomp::reliability
