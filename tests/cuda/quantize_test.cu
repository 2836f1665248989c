// Device quantizers (gradcomp/cuda/quantize.cuh) against the host ones: for every quantizer,
// size and input distribution, the device encoding of a value span has the same packed bytes
// and side values as the host payload given the same call_id; those bytes in a host payload
// decode with the host decoder; the device decode gives the host decoder's floats bit for
// bit; bad arguments and malformed encodings are refused with the host's exception types and
// nothing is written.
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <gradcomp/cuda/memory.cuh>
#include <gradcomp/cuda/quantize.cuh>
#include <gradcomp/quantize.hpp>

#include "../support/cuda_buffers.hpp"
#include "../support/data.hpp"

namespace {

using gradcomp::device_buffer;
using gradcomp::device_span;
using gradcomp::detail::cuda_check;

using gradcomp_test::download;
using gradcomp_test::upload;

std::vector<std::uint32_t> float_bits(const std::vector<float>& v) {
  std::vector<std::uint32_t> b(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) b[i] = std::bit_cast<std::uint32_t>(v[i]);
  return b;
}

using gradcomp_test::scratch_buffer;

// Device encode and decode of v, compared with the host's.
template <class Q>
void check_against_host(const Q& q, const std::vector<float>& v, const gradcomp::call_id& call,
                        cudaStream_t stream) {
  const std::size_t n = v.size();
  gradcomp::payload host;
  host.count = static_cast<std::uint32_t>(n);
  host.dense_size = n;
  host.layout = gradcomp::index_layout::dense;
  q.encode(v, call, host);
  std::vector<float> host_decoded(n);
  q.decode(host, host_decoded);

  const auto size = gradcomp::device_encoded_size(q, n);
  REQUIRE(size.packed_bytes == host.values.size());
  REQUIRE(size.side_count == host.side.size());

  auto d_v = upload(v);
  device_buffer<std::byte> d_packed(size.packed_bytes > 0 ? size.packed_bytes : 1);
  device_buffer<float> d_side(size.side_count > 0 ? size.side_count : 1);
  // Garbage first: the encoder must write every byte, padding included.
  cuda_check(cudaMemset(d_packed.data(), 0xa5, d_packed.size()), "cudaMemset");
  cuda_check(cudaMemset(d_side.data(), 0xa5, d_side.size() * sizeof(float)), "cudaMemset");
  const gradcomp::device_encoded enc{{d_packed.data(), size.packed_bytes},
                                     {d_side.data(), size.side_count}};
  const device_span<const float> values{d_v.data(), n};

  scratch_buffer s;
  gradcomp::on_device(q).encode(s.tmp, values, call, enc, stream);  // size query: no work
  s.allocate();
  gradcomp::on_device(q).encode(s.tmp, values, call, enc, stream);
  cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  const auto packed = download(d_packed.data(), size.packed_bytes);
  const auto side = download(d_side.data(), size.side_count);
  REQUIRE(packed == host.values);
  REQUIRE(float_bits(side) == float_bits(host.side));

  // The device bytes in a host payload: the host decoder accepts them, same values.
  gradcomp::payload copy = host;
  copy.values = packed;
  copy.side = side;
  std::vector<float> copy_decoded(n);
  q.decode(copy, copy_decoded);
  REQUIRE(float_bits(copy_decoded) == float_bits(host_decoded));

  // Device decode, checked and trusted.
  for (const auto validation :
       {gradcomp::device_validation::check, gradcomp::device_validation::trusted}) {
    device_buffer<float> d_out(n > 0 ? n : 1);
    cuda_check(cudaMemset(d_out.data(), 0xff, d_out.size() * sizeof(float)), "cudaMemset");
    scratch_buffer ds;
    gradcomp::on_device(q).decode(ds.tmp, gradcomp::device_encoded_view(enc),
                                  device_span<float>{d_out.data(), n}, stream, validation);
    ds.allocate();
    gradcomp::on_device(q).decode(ds.tmp, gradcomp::device_encoded_view(enc),
                                  device_span<float>{d_out.data(), n}, stream, validation);
    cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    REQUIRE(float_bits(download(d_out.data(), n)) == float_bits(host_decoded));
  }
}

std::vector<std::size_t> sizes() {
  return {0, 1, 2, 3, 7, 8, 9, 63, 511, 512, 513, 1000, 2047, 2048, 2049, 4097, 100'003};
}

std::vector<float> with_specials(std::vector<float> v, std::size_t seed) {
  // NaN, Inf and extremes in some buckets (the host defines what they become).
  if (v.size() > 4) {
    v[seed % v.size()] = std::numeric_limits<float>::quiet_NaN();
    v[(seed * 7 + 1) % v.size()] = -std::numeric_limits<float>::infinity();
    v[(seed * 13 + 2) % v.size()] = std::numeric_limits<float>::max();
    v[(seed * 17 + 3) % v.size()] = -std::numeric_limits<float>::denorm_min();
    v[(seed * 19 + 4) % v.size()] = -0.0f;
  }
  return v;
}

template <class Q>
void sweep(const Q& q, const char* name) {
  cudaStream_t stream = nullptr;
  cuda_check(cudaStreamCreate(&stream), "cudaStreamCreate");
  for (const std::size_t n : sizes()) {
    for (const auto d : gradcomp_test::all_dists) {
      CAPTURE(name);
      CAPTURE(n);
      CAPTURE(gradcomp_test::name(d));
      const auto v = gradcomp_test::make_input<float>(d, n, 1000 + n);
      check_against_host(q, v, gradcomp::call_id{11, n, 3}, stream);
      check_against_host(q, with_specials(v, n), gradcomp::call_id{12, n, 4}, stream);
    }
  }
  // 2^20 + odd, on the default stream as well.
  const std::size_t big = (std::size_t{1} << 20) + 37;
  for (const auto d : {gradcomp_test::dist::normal, gradcomp_test::dist::student_t2,
                       gradcomp_test::dist::zeros90}) {
    CAPTURE(name);
    CAPTURE(gradcomp_test::name(d));
    const auto v = gradcomp_test::make_input<float>(d, big, 77);
    check_against_host(q, v, gradcomp::call_id{5, 6, 7}, nullptr);
  }
  cuda_check(cudaStreamDestroy(stream), "cudaStreamDestroy");
}

}  // namespace

TEST_CASE("cuda quantize: identity, fp16 and bf16 give the host's bytes and values") {
  sweep(gradcomp::identity{}, "identity");
  sweep(gradcomp::fp16{}, "fp16");
  sweep(gradcomp::bf16{}, "bf16");
}

TEST_CASE("cuda quantize: qsgd gives the host's bytes, norms and values") {
  sweep(gradcomp::qsgd{}, "qsgd(7, 512)");
  sweep(gradcomp::qsgd(1, 512), "qsgd(1, 512)");
  sweep(gradcomp::qsgd::with_bits(3, 100), "qsgd 3 bits, bucket 100");
  sweep(gradcomp::qsgd(127, 1), "qsgd(127, 1)");
  sweep(gradcomp::qsgd(32767, 3000), "qsgd(32767, 3000): two tree levels");
  sweep(gradcomp::qsgd(5, 1u << 24), "qsgd(5, 2^24): one bucket");
}

TEST_CASE("cuda quantize: terngrad and scaled_sign give the host's bytes, scales and values") {
  sweep(gradcomp::terngrad{}, "terngrad (one bucket)");
  sweep(gradcomp::terngrad(300), "terngrad(300)");
  sweep(gradcomp::terngrad(5000), "terngrad(5000)");
  sweep(gradcomp::scaled_sign{}, "scaled_sign (one bucket)");
  sweep(gradcomp::scaled_sign(64), "scaled_sign(64)");
  sweep(gradcomp::scaled_sign(2049), "scaled_sign(2049)");
}

TEST_CASE("cuda quantize: one bucket above 2048^2 values (three tree levels) matches the host") {
  const std::size_t n = 2048u * 2048u + 4099u;
  const auto v = gradcomp_test::make_input<float>(gradcomp_test::dist::laplace, n, 3);
  check_against_host(gradcomp::scaled_sign{}, v, gradcomp::call_id{1, 2, 3}, nullptr);
  check_against_host(gradcomp::terngrad{}, v, gradcomp::call_id{1, 2, 3}, nullptr);
  check_against_host(gradcomp::qsgd(7, 1u << 24), v, gradcomp::call_id{1, 2, 3}, nullptr);
}

TEST_CASE("cuda quantize: bad arguments are refused before anything is written") {
  const gradcomp::qsgd q(7, 4);
  const std::size_t n = 10;  // 3 buckets, 40 bits = 5 bytes
  const std::vector<float> v(n, 1.0f);
  auto d_v = upload(v);
  device_buffer<std::byte> d_packed(16);
  device_buffer<float> d_side(8);
  cuda_check(cudaMemset(d_packed.data(), 0x11, 16), "cudaMemset");
  const device_span<const float> values{d_v.data(), n};
  gradcomp::temp_storage query;
  const gradcomp::call_id call{};
  // Wrong packed size, wrong side count.
  CHECK_THROWS_AS(
      gradcomp::on_device(q).encode(
          query, values, call, gradcomp::device_encoded{{d_packed.data(), 4}, {d_side.data(), 3}}),
      gradcomp::invalid_argument);
  CHECK_THROWS_AS(
      gradcomp::on_device(q).encode(
          query, values, call, gradcomp::device_encoded{{d_packed.data(), 5}, {d_side.data(), 2}}),
      gradcomp::invalid_argument);
  // Too little scratch.
  const gradcomp::device_encoded enc{{d_packed.data(), 5}, {d_side.data(), 3}};
  scratch_buffer s;
  gradcomp::on_device(q).encode(s.tmp, values, call, enc);
  s.allocate();
  gradcomp::temp_storage small{s.tmp.ptr, s.tmp.bytes - 1};
  CHECK_THROWS_AS(gradcomp::on_device(q).encode(small, values, call, enc),
                  gradcomp::invalid_argument);
  const auto untouched = download(d_packed.data(), 16);
  for (const auto b : untouched) CHECK(b == std::byte{0x11});
  // Decode: output size that does not match the encoding.
  device_buffer<float> d_out(n + 1);
  gradcomp::temp_storage dq;
  CHECK_THROWS_AS(gradcomp::on_device(q).decode(dq, gradcomp::device_encoded_view(enc),
                                                device_span<float>{d_out.data(), n + 1}),
                  gradcomp::payload_error);
}

namespace {

// Encodes v on the host, lets `spoil` change the payload, uploads it and expects the device
// decode to throw payload_error (like the host decoder) and to leave the output untouched.
template <class Q, class Spoil>
void expect_rejected(const Q& q, std::size_t n, Spoil spoil, const char* what) {
  CAPTURE(what);
  const auto v = gradcomp_test::make_input<float>(gradcomp_test::dist::normal, n, 9);
  gradcomp::payload p;
  p.count = static_cast<std::uint32_t>(n);
  p.dense_size = n;
  p.layout = gradcomp::index_layout::dense;
  q.encode(v, gradcomp::call_id{}, p);
  spoil(p);
  std::vector<float> host_out(n);
  CHECK_THROWS_AS(q.decode(p, host_out), gradcomp::payload_error);

  auto d_packed = upload(p.values);
  auto d_side = upload(p.side);
  device_buffer<float> d_out(n);
  cuda_check(cudaMemset(d_out.data(), 0x7f, n * sizeof(float)), "cudaMemset");
  const gradcomp::device_encoded_view in{{d_packed.data(), p.values.size()},
                                         {d_side.data(), p.side.size()}};
  scratch_buffer s;
  gradcomp::on_device(q).decode(s.tmp, in, device_span<float>{d_out.data(), n});
  s.allocate();
  std::string message;
  try {
    gradcomp::on_device(q).decode(s.tmp, in, device_span<float>{d_out.data(), n});
  } catch (const gradcomp::payload_error& e) {
    message = e.what();
  }
  CHECK(!message.empty());
  const auto out = download(d_out.data(), n);
  for (const float x : out) REQUIRE(std::bit_cast<std::uint32_t>(x) == 0x7f7f7f7fu);
}

}  // namespace

TEST_CASE("cuda quantize: malformed encodings are rejected on the device, nothing written") {
  expect_rejected(
      gradcomp::qsgd(2, 16), 100,
      [](gradcomp::payload& p) { p.side[3] = std::numeric_limits<float>::quiet_NaN(); },
      "qsgd NaN norm");
  expect_rejected(
      gradcomp::qsgd(2, 16), 100, [](gradcomp::payload& p) { p.side[0] = -1.0f; },
      "qsgd negative norm");
  expect_rejected(
      gradcomp::qsgd(2, 16), 100,
      [](gradcomp::payload& p) {
        p.values[10] = std::byte{0xff};  // 3-bit codes 7 > 2s = 4
      },
      "qsgd code above 2s");
  expect_rejected(
      gradcomp::terngrad(10), 101,
      [](gradcomp::payload& p) {
        p.values[5] = std::byte{0xff};  // code 3
      },
      "terngrad code 3");
  expect_rejected(
      gradcomp::terngrad(10), 101,
      [](gradcomp::payload& p) {
        p.values.back() |= std::byte{0x80};  // 101 * 2 bits: the last byte has 6 padding bits
      },
      "terngrad padding");
  expect_rejected(
      gradcomp::scaled_sign(7), 30,
      [](gradcomp::payload& p) { p.side[1] = std::numeric_limits<float>::infinity(); },
      "scaled_sign Inf mean");
}
