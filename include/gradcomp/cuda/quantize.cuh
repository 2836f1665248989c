// gradcomp/cuda/quantize.cuh: the six quantizers on device memory. With this header (nvcc),
// the same quantizer object that encodes a host span into a payload encodes a device span
// into a device_encoded (packed codes + side values), and decodes one:
//
//   gradcomp::qsgd q(7, 512);
//   const auto size = gradcomp::device_encoded_size(q, n);     // bytes and side entries
//   gradcomp::temp_storage tmp;                                 // CUB style: size query...
//   gradcomp::on_device(q).encode(tmp, gradcomp::device_span<const float>{d_v, n}, call, enc,
//                                 stream);
//   /* allocate tmp.bytes at tmp.ptr */                         // ...then the work
//   gradcomp::on_device(q).encode(tmp, gradcomp::device_span<const float>{d_v, n}, call, enc,
//                                 stream);
//   gradcomp::on_device(q).decode(tmp, enc, gradcomp::device_span<float>{d_out, n}, stream);
//
// Same bits as the host: for the same values and call_id the packed bytes and side values
// equal the host payload's `values` and `side` exactly (the random draws come from the same
// counter-based stream, indexed by element; the bucket statistics follow the same summation
// tree, detail/quantize_math.hpp; the conversions are integer-only). Copying them into a
// payload gives one the host decoder accepts. Decoding gives the host decoder's floats bit
// for bit (NaN payloads of fp16/bf16 included: the conversions are integer-only, and the
// other decoders only multiply finite side values).
//
// Arguments (span sizes, the scratch size) are checked on the host, before anything is
// launched and in the size query too, where the spans' pointers may still be null. The
// device code must be compiled without --use_fast_math (which would change the rounding of
// QSGD's and TernGrad's divisions).
//
// Encode is asynchronous. Decode with device_validation::check (the default) validates side
// values, padding and codes on the device, writes nothing if they are bad, and waits for the
// stream once to throw the host decoder's payload_error; device_validation::trusted skips
// the check and the wait (for bytes from the device encoder or a validated payload). To check
// many payloads with one wait: on_device(q).rule(count) names what the decoder accepts, and
// cuda::quantize_impl::launch_decode_check / throw_decode_error run its check without the
// wait and read its verdict afterwards (then decode with device_validation::trusted).
#pragma once

#include <cuda_runtime.h>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include <gradcomp/context.hpp>
#include <gradcomp/cuda/dispatch/quantize.cuh>
#include <gradcomp/detail/quantize_codec.hpp>
#include <gradcomp/detail/quantizer_layout.hpp>
#include <gradcomp/detail/random.hpp>
#include <gradcomp/device.hpp>
#include <gradcomp/quantize.hpp>

namespace gradcomp {

// What `count` values encoded by q occupy in a device_encoded (and in a payload).
struct encoded_size {
  std::size_t packed_bytes = 0;
  std::size_t side_count = 0;
};

template <class Q>
encoded_size device_encoded_size(const Q& q, std::size_t count) {
  const auto l = detail::layout_of(Q::id, q.params(), count);
  return {static_cast<std::size_t>(detail::packed_size(count, l.bits_per_value)),
          static_cast<std::size_t>(l.side_count)};
}

namespace cuda::quantize_impl {

// Bucket size as the kernels see it: "0 = one bucket" becomes the whole span.
inline std::size_t effective_bucket(std::uint32_t bucket, std::size_t n) {
  return bucket != 0 ? bucket : (n > 0 ? n : 1);
}

}  // namespace cuda::quantize_impl

template <>
class device_policy<identity> {
 public:
  // identity has no settings: nothing to keep.
  explicit device_policy(const identity&) noexcept {}

  static_assert(std::endian::native == std::endian::little,
                "identity's device encoding copies float bytes as the little-endian wire form");

  void encode(temp_storage& tmp, device_span<const float> values,
              const call_id& /*unused: deterministic*/, const device_encoded& out,
              cudaStream_t stream = nullptr) const {
    constexpr std::string_view where = "identity::encode (device)";
    cuda::quantize_impl::check_encode_args(where, values.size(), 32, 0, out);
    cuda::scratch_carver s(tmp.ptr);
    if (cuda::finish_size_query(where, tmp, s) || values.empty()) return;
    detail::cuda_check(cudaMemcpyAsync(out.packed.data(), values.data(), values.size_bytes(),
                                       cudaMemcpyDeviceToDevice, stream),
                       "cudaMemcpyAsync");
  }

  // Every 32-bit pattern is a valid value: nothing to validate.
  static cuda::quantize_impl::decode_rule rule(std::size_t count) noexcept {
    return {"identity::decode (device)", count, 32, 0, 0xffffffffu, ""};
  }
  void decode(temp_storage& tmp, const device_encoded_view& in, device_span<float> decoded,
              cudaStream_t stream = nullptr, device_validation = device_validation::check) const {
    const auto r = rule(decoded.size());
    cuda::quantize_impl::check_decode_args(r, in);
    cuda::scratch_carver s(tmp.ptr);
    if (cuda::finish_size_query(r.where, tmp, s) || decoded.empty()) return;
    detail::cuda_check(cudaMemcpyAsync(decoded.data(), in.packed.data(), decoded.size_bytes(),
                                       cudaMemcpyDeviceToDevice, stream),
                       "cudaMemcpyAsync");
  }
};

template <>
class device_policy<fp16> {
 public:
  // fp16 has no settings: nothing to keep.
  explicit device_policy(const fp16&) noexcept {}

  void encode(temp_storage& tmp, device_span<const float> values,
              const call_id& /*unused: deterministic*/, const device_encoded& out,
              cudaStream_t stream = nullptr) const {
    cuda::quantize_impl::encode_elementwise("fp16::encode (device)", tmp, values, 16,
                                            detail::fp16_codec{}, out, stream);
  }
  // Every 16-bit pattern is a valid value and there is no padding: nothing to validate.
  static cuda::quantize_impl::decode_rule rule(std::size_t count) noexcept {
    return {"fp16::decode (device)", count, 16, 0, 0xffffu, ""};
  }
  void decode(temp_storage& tmp, const device_encoded_view& in, device_span<float> decoded,
              cudaStream_t stream = nullptr, device_validation = device_validation::check) const {
    cuda::quantize_impl::decode_codes(rule(decoded.size()), tmp, in, decoded, detail::fp16_codec{},
                                      stream, device_validation::trusted);
  }
};

template <>
class device_policy<bf16> {
 public:
  // bf16 has no settings: nothing to keep.
  explicit device_policy(const bf16&) noexcept {}

  void encode(temp_storage& tmp, device_span<const float> values,
              const call_id& /*unused: deterministic*/, const device_encoded& out,
              cudaStream_t stream = nullptr) const {
    cuda::quantize_impl::encode_elementwise("bf16::encode (device)", tmp, values, 16,
                                            detail::bf16_codec{}, out, stream);
  }
  // Every 16-bit pattern is a valid value and there is no padding: nothing to validate.
  static cuda::quantize_impl::decode_rule rule(std::size_t count) noexcept {
    return {"bf16::decode (device)", count, 16, 0, 0xffffu, ""};
  }
  void decode(temp_storage& tmp, const device_encoded_view& in, device_span<float> decoded,
              cudaStream_t stream = nullptr, device_validation = device_validation::check) const {
    cuda::quantize_impl::decode_codes(rule(decoded.size()), tmp, in, decoded, detail::bf16_codec{},
                                      stream, device_validation::trusted);
  }
};

template <>
class device_policy<qsgd> {
 public:
  explicit device_policy(const qsgd& policy) noexcept : q_(policy) {}

  void encode(temp_storage& tmp, device_span<const float> values, const call_id& call,
              const device_encoded& out, cudaStream_t stream = nullptr) const {
    const std::size_t n = values.size();
    const detail::qsgd_codec codec{
        detail::counter_rng{detail::stream_key(call, detail::stream_tag::quantize)}, q_.levels(),
        1.0f / static_cast<float>(q_.levels()), q_.bucket_size()};
    cuda::quantize_impl::encode_bucketed<detail::sum_squares_reducer>(
        "qsgd::encode (device)", tmp, values, q_.bits_per_value(), q_.bucket_size(),
        device_encoded_size(q_, n).side_count, detail::qsgd_side{}, codec, out, stream);
  }
  // v = norm * (code - s) / s; codes above 2s are rejected (with device_validation::check).
  cuda::quantize_impl::decode_rule rule(std::size_t count) const {
    return {"qsgd::decode (device)", count, q_.bits_per_value(),
            device_encoded_size(q_, count).side_count, 2u * q_.levels(), "2 * levels"};
  }
  void decode(temp_storage& tmp, const device_encoded_view& in, device_span<float> decoded,
              cudaStream_t stream = nullptr,
              device_validation validation = device_validation::check) const {
    const detail::qsgd_codec codec{detail::counter_rng{}, q_.levels(),
                                   1.0f / static_cast<float>(q_.levels()), q_.bucket_size()};
    cuda::quantize_impl::decode_codes(rule(decoded.size()), tmp, in, decoded, codec, stream,
                                      validation);
  }

 private:
  const qsgd& q_;
};

template <>
class device_policy<terngrad> {
 public:
  explicit device_policy(const terngrad& policy) noexcept : q_(policy) {}

  void encode(temp_storage& tmp, device_span<const float> values, const call_id& call,
              const device_encoded& out, cudaStream_t stream = nullptr) const {
    const std::size_t n = values.size();
    const std::size_t bucket = cuda::quantize_impl::effective_bucket(q_.bucket_size(), n);
    const detail::terngrad_codec codec{
        detail::counter_rng{detail::stream_key(call, detail::stream_tag::quantize)}, bucket};
    cuda::quantize_impl::encode_bucketed<detail::max_abs_reducer>(
        "terngrad::encode (device)", tmp, values, 2, bucket, device_encoded_size(q_, n).side_count,
        detail::terngrad_side{}, codec, out, stream);
  }
  cuda::quantize_impl::decode_rule rule(std::size_t count) const {
    return {"terngrad::decode (device)", count, 2, device_encoded_size(q_, count).side_count, 2u,
            "0, 1 = +max, 2 = -max"};
  }
  void decode(temp_storage& tmp, const device_encoded_view& in, device_span<float> decoded,
              cudaStream_t stream = nullptr,
              device_validation validation = device_validation::check) const {
    const std::size_t n = decoded.size();
    const detail::terngrad_codec codec{detail::counter_rng{},
                                       cuda::quantize_impl::effective_bucket(q_.bucket_size(), n)};
    cuda::quantize_impl::decode_codes(rule(n), tmp, in, decoded, codec, stream, validation);
  }

 private:
  const terngrad& q_;
};

template <>
class device_policy<scaled_sign> {
 public:
  explicit device_policy(const scaled_sign& policy) noexcept : q_(policy) {}

  void encode(temp_storage& tmp, device_span<const float> values,
              const call_id& /*unused: deterministic*/, const device_encoded& out,
              cudaStream_t stream = nullptr) const {
    const std::size_t n = values.size();
    const std::size_t bucket = cuda::quantize_impl::effective_bucket(q_.bucket_size(), n);
    cuda::quantize_impl::encode_bucketed<detail::sum_abs_reducer>(
        "scaled_sign::encode (device)", tmp, values, 1, bucket,
        device_encoded_size(q_, n).side_count, detail::scaled_sign_side{},
        detail::scaled_sign_codec{bucket}, out, stream);
  }
  // Every code is valid; side values and padding are checked.
  cuda::quantize_impl::decode_rule rule(std::size_t count) const {
    return {"scaled_sign::decode (device)", count, 1, device_encoded_size(q_, count).side_count,
            1u, "0 or 1"};
  }
  void decode(temp_storage& tmp, const device_encoded_view& in, device_span<float> decoded,
              cudaStream_t stream = nullptr,
              device_validation validation = device_validation::check) const {
    const std::size_t n = decoded.size();
    cuda::quantize_impl::decode_codes(
        rule(n), tmp, in, decoded,
        detail::scaled_sign_codec{cuda::quantize_impl::effective_bucket(q_.bucket_size(), n)},
        stream, validation);
  }

 private:
  const scaled_sign& q_;
};

}  // namespace gradcomp
