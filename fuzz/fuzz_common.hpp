// Shared by the libFuzzer targets: a failed property aborts (libFuzzer then saves the input),
// a selector for compressors that only decompress, and the quantizer a payload names.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include <gradcomp/gradcomp.hpp>

namespace gradcomp::fuzz {

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "gradcomp fuzz property violated: %s\n", what);
  std::fflush(stderr);
  std::abort();
}

inline void require(bool ok, const char* what) {
  if (!ok) fail(what);
}

// Bitwise, so that NaN outputs compare too.
template <class T>
bool same_bytes(std::span<const T> a, std::span<const T> b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size_bytes()) == 0);
}

// A recognisable fill that no decoder writes by accident.
inline constexpr float sentinel = -12345.625f;

// Decompression never calls the selector; compressor<> still wants one.
struct no_selection {
  template <gradient_value T>
  selection_stats select(std::span<const T>, const select_context&, std::vector<std::uint32_t>& idx) {
    idx.clear();
    return {};
  }
};

// Calls f(q) with the quantizer that decodes payloads of (id, params); params are valid.
template <class F>
void with_quantizer(quantizer_id id, quantizer_params params, F&& f) {
  switch (id) {
    case quantizer_id::identity: f(identity{}); return;
    case quantizer_id::fp16: f(fp16{}); return;
    case quantizer_id::bf16: f(bf16{}); return;
    case quantizer_id::qsgd: f(qsgd(params.levels, params.bucket_size)); return;
    case quantizer_id::terngrad: f(terngrad(params.bucket_size)); return;
    case quantizer_id::scaled_sign: f(scaled_sign(params.bucket_size)); return;
  }
  fail("with_quantizer: a validated payload names an unknown quantizer");
}

// Little-endian reads that stop at the end of the input (missing bytes read as zero).
struct reader {
  const std::uint8_t* data;
  std::size_t size;
  std::size_t at = 0;

  std::uint8_t u8() { return at < size ? data[at++] : 0; }
  std::uint16_t u16() {
    const unsigned lo = u8();
    return static_cast<std::uint16_t>(lo | (static_cast<unsigned>(u8()) << 8));
  }
  std::uint32_t u32() {
    const std::uint32_t lo = u16();
    return lo | (static_cast<std::uint32_t>(u16()) << 16);
  }
  std::size_t left() const { return at < size ? size - at : 0; }
};

}  // namespace gradcomp::fuzz
