// gradcomp/cuda/dispatch/quantize.cuh: the launch sequences of the device quantizers, with the
// CUB convention: every call carves its scratch from the caller's one buffer, and a call with
// tmp.ptr == nullptr only reports the size. Arguments are checked here, on the host, before
// anything is launched; the checks that need the data (side values, codes) run on the device.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <utility>

#include <gradcomp/cuda/block/sparse_common.cuh>
#include <gradcomp/cuda/dispatch/launch.cuh>
#include <gradcomp/cuda/dispatch/scratch.cuh>
#include <gradcomp/cuda/kernels/quantize.cuh>
#include <gradcomp/cuda/memory.cuh>
#include <gradcomp/cuda/tuning.cuh>
#include <gradcomp/detail/bitpack.hpp>
#include <gradcomp/detail/quantize_math.hpp>
#include <gradcomp/device.hpp>
#include <gradcomp/error.hpp>

namespace gradcomp {

// A quantized value span in device memory: the packed codes (exactly the bytes of the host
// payload's `values`) and the side values (the payload's `side`). How many values it holds
// and with which quantizer settings is the caller's to know, as for the host's raw arrays.
struct device_encoded {
  device_span<std::byte> packed;
  device_span<float> side;
};

struct device_encoded_view {
  device_span<const std::byte> packed;
  device_span<const float> side;

  device_encoded_view() = default;
  device_encoded_view(device_span<const std::byte> p, device_span<const float> s)
      : packed(p), side(s) {}
  device_encoded_view(device_encoded e) : packed(e.packed), side(e.side) {}  // NOLINT: implicit
};

namespace cuda::quantize_impl {

// Launch shapes: cuda/tuning.cuh (the statistics kernel's block size is fixed by its shared
// tile, stat_warps).
using quantize_tuning = elementwise_tuning;

// The scratch of the statistics tree: a ping and a pong buffer for its upper levels (none
// when every bucket is one node).
template <class Acc>
struct stat_scratch {
  Acc* ping = nullptr;
  Acc* pong = nullptr;
};

template <class Acc>
stat_scratch<Acc> carve_stats(scratch_carver& s, std::size_t n, std::size_t bucket) {
  stat_scratch<Acc> out;
  detail::stat_level l{n, bucket};
  if (n == 0 || l.seg <= detail::stat_block) return out;
  l = detail::level_above(l);
  out.ping = s.take<Acc>(l.len);  // the levels shrink: odd ones fit in ping, even in pong
  if (l.seg > detail::stat_block) out.pong = s.take<Acc>(detail::level_above(l).len);
  return out;
}

// side[b] = side_of(statistic of bucket b, its length), the tree level by level on `stream`.
template <class Reducer, class Side>
void launch_stats(const float* values, std::size_t n, std::size_t bucket, Side side_of, float* side,
                  stat_scratch<typename Reducer::acc> tmp, cudaStream_t stream,
                  const quantize_tuning& t = quantize_tuning_sm90) {
  using acc = typename Reducer::acc;
  const detail::stat_level leaves{n, bucket};
  const std::size_t buckets = detail::level_buckets(leaves);
  if (buckets == 0) return;
  constexpr unsigned th = stat_warps * 32u;
  const store_side<acc, Side> to_side{side, leaves, side_of};
  if (leaves.seg <= detail::stat_block) {
    stat_runs_kernel<Reducer><<<grid_for(buckets, th, t.max_blocks), th, 0, stream>>>(
        values, buckets, bucket_runs{leaves}, to_side);
    check_launch("stat_runs_kernel launch");
    return;
  }
  detail::stat_level l = leaves;
  detail::stat_level up = detail::level_above(l);
  stat_runs_kernel<Reducer><<<grid_for(up.len, th, t.max_blocks), th, 0, stream>>>(
      values, up.len, node_runs{l}, store_node<acc>{tmp.ping});
  check_launch("stat_runs_kernel launch");
  acc* cur = tmp.ping;
  acc* other = tmp.pong;
  l = up;
  while (l.seg > detail::stat_block) {
    up = detail::level_above(l);
    stat_runs_kernel<Reducer><<<grid_for(up.len, th, t.max_blocks), th, 0, stream>>>(
        static_cast<const acc*>(cur), up.len, node_runs{l}, store_node<acc>{other});
    check_launch("stat_runs_kernel launch");
    std::swap(cur, other);
    l = up;
  }
  stat_runs_kernel<Reducer><<<grid_for(buckets, th, t.max_blocks), th, 0, stream>>>(
      static_cast<const acc*>(cur), buckets, bucket_runs{l}, to_side);
  check_launch("stat_runs_kernel launch");
}

// Host-side checks of an encode call, the same for every quantizer.
inline void check_encode_args(std::string_view where, std::size_t n, unsigned bits,
                              std::size_t side_count, const device_encoded& out) {
  if (n > 0xffffffffu) {
    detail::throw_invalid_argument(where, "values.size()", n, "<= 2^32 - 1 (a payload's count)");
  }
  const std::uint64_t need = detail::packed_size(n, bits);
  if (out.packed.size() != need) {
    detail::throw_invalid_argument(
        where, "out.packed.size()", out.packed.size(),
        detail::concat("exactly ceil(values.size() * ", bits, " / 8) = ", need));
  }
  if (out.side.size() != side_count) {
    detail::throw_invalid_argument(
        where, "out.side.size()", out.side.size(),
        detail::concat("exactly the side count ", side_count, " (one per bucket)"));
  }
}

template <class Codec>
void launch_encode(const float* values, std::size_t n, unsigned bits, const float* side,
                   Codec codec, std::byte* packed, cudaStream_t stream,
                   const quantize_tuning& t = quantize_tuning_sm90) {
  if (n == 0) return;
  const std::size_t groups =
      (n + detail::codes_per_group(bits) - 1) / detail::codes_per_group(bits);
  encode_kernel<Codec><<<grid_for(groups, t.threads, t.max_blocks), t.threads, 0, stream>>>(
      values, n, bits, side, codec, packed);
  check_launch("encode_kernel launch");
}

// encode for the quantizers with bucket statistics. `bucket` is never 0 here.
template <class Reducer, class Side, class Codec>
void encode_bucketed(std::string_view where, temp_storage& tmp, device_span<const float> values,
                     unsigned bits, std::size_t bucket, std::size_t side_count, Side side_of,
                     Codec codec, const device_encoded& out, cudaStream_t stream) {
  const std::size_t n = values.size();
  check_encode_args(where, n, bits, side_count, out);
  scratch_carver s(tmp.ptr);
  const auto stats = carve_stats<typename Reducer::acc>(s, n, bucket);
  if (finish_size_query(where, tmp, s)) return;
  if (n == 0) return;
  launch_stats<Reducer>(values.data(), n, bucket, side_of, out.side.data(), stats, stream);
  launch_encode(values.data(), n, bits, out.side.data(), codec, out.packed.data(), stream);
}

// encode for the element-wise quantizers (fp16, bf16).
template <class Codec>
void encode_elementwise(std::string_view where, temp_storage& tmp, device_span<const float> values,
                        unsigned bits, Codec codec, const device_encoded& out,
                        cudaStream_t stream) {
  check_encode_args(where, values.size(), bits, 0, out);
  scratch_carver s(tmp.ptr);
  if (finish_size_query(where, tmp, s)) return;
  launch_encode(values.data(), values.size(), bits, nullptr, codec, out.packed.data(), stream);
}

// What a quantizer's decoder accepts for `count` values: the bits per code, the side values,
// the largest valid code and how its rule reads in a message, and the decoder's name.
struct decode_rule {
  std::string_view where;
  std::size_t count = 0;
  unsigned bits = 32;
  std::size_t side_count = 0;
  std::uint32_t max_code = 0xffffffffu;
  std::string_view code_rule;
};

// What a decode checks on the host before it launches: the sizes (check_decode's checks that
// do not read the data).
inline void check_decode_args(const decode_rule& r, const device_encoded_view& in) {
  if (r.count > 0xffffffffu) {
    detail::throw_invalid_argument(r.where, "decoded.size()", r.count,
                                   "<= 2^32 - 1 (a payload's count)");
  }
  const std::uint64_t need = detail::packed_size(r.count, r.bits);
  if (in.packed.size() != need) {
    detail::throw_payload_error(r.where, "values has ", in.packed.size(), " bytes; expected ",
                                need, " for ", r.count, " values of ", r.bits, " bits");
  }
  if (in.side.size() != r.side_count) {
    detail::throw_payload_error(r.where, "side has ", in.side.size(), " entries; expected ",
                                r.side_count);
  }
}

// Whether a payload under rule r can be malformed at all (side values to check, padding bits,
// or codes above the largest valid one): fp16's, bf16's and identity's cannot.
inline bool decode_can_fail(const decode_rule& r) {
  return r.side_count != 0 || (static_cast<std::uint64_t>(r.count) * r.bits) % 8u != 0 ||
         r.max_code < detail::code_mask(r.bits);
}

// The device checks of a decode under rule r, launched without waiting: the sizes first (on
// the host, thrown at once), then validate_kernel into errors[0..2], which must hold
// no_error; throw_decode_error reads the verdict once the caller has copied it back. Several
// checks can share one wait that way.
inline void launch_decode_check(const decode_rule& r, const device_encoded_view& in,
                                error_record* errors, cudaStream_t stream,
                                const quantize_tuning& t = quantize_tuning_sm90) {
  check_decode_args(r, in);
  if (r.count == 0 || !decode_can_fail(r)) return;
  const std::size_t items = r.count > r.side_count ? r.count : r.side_count;
  validate_kernel<float><<<grid_for(items, t.threads, t.max_blocks), t.threads, 0, stream>>>(
      in.packed.data(), r.count, r.bits, in.side.data(), r.side_count, r.max_code, errors);
  check_launch("validate_kernel launch");
}

// The host decoder's payload_error for the verdict `found` (3 records, as launch_decode_check
// leaves them) of a decode under rule r; returns when there is none.
inline void throw_decode_error(const decode_rule& r, const error_record* found) {
  if (found[0].first != no_error) {
    const auto b = static_cast<std::size_t>(found[0].first >> 32);
    const float v = detail::bits_to_float(static_cast<std::uint32_t>(found[0].first));
    detail::throw_payload_error(r.where, "side[", b, "] = ", v, "; expected finite and >= 0");
  }
  if (found[1].first != no_error) {
    detail::throw_payload_error(r.where, "padding bits of the last value byte are not zero");
  }
  if (found[2].first != no_error) {
    const auto at = static_cast<std::size_t>(found[2].first >> 32);
    const auto code = static_cast<std::uint32_t>(found[2].first);
    detail::throw_payload_error(r.where, "code ", code, " at value ", at, "; expected <= ",
                                r.max_code, " (", r.code_rule, ")");
  }
}

// decode: with device_validation::check, the check first, the decode kernel (which writes
// nothing if the check found a problem), then one host round trip to read the verdict and
// throw the host decoder's payload_error. decoded.size() must be r.count.
template <class Codec>
void decode_codes(const decode_rule& r, temp_storage& tmp, const device_encoded_view& in,
                  device_span<float> decoded, Codec codec, cudaStream_t stream,
                  device_validation validation, const quantize_tuning& t = quantize_tuning_sm90) {
  const std::size_t n = decoded.size();
  check_decode_args(r, in);
  scratch_carver s(tmp.ptr);
  error_record* errors = s.take<error_record>(3);
  if (finish_size_query(r.where, tmp, s)) return;
  if (n == 0) return;
  const bool check = validation == device_validation::check && decode_can_fail(r);
  if (check) {
    detail::cuda_check(cudaMemsetAsync(errors, 0xff, 3 * sizeof(error_record), stream),
                       "cudaMemsetAsync");
    launch_decode_check(r, in, errors, stream, t);
  }
  decode_kernel<Codec><<<grid_for(n, t.threads, t.max_blocks), t.threads, 0, stream>>>(
      in.packed.data(), n, r.bits, in.side.data(), codec, decoded.data(), check ? errors : nullptr,
      3);
  check_launch("decode_kernel launch");
  if (!check) return;
  // The host round trip: the exception must be raised here, so the stream is waited for.
  error_record found[3];
  detail::cuda_check(cudaMemcpyAsync(found, errors, sizeof(found), cudaMemcpyDeviceToHost, stream),
                     "cudaMemcpyAsync");
  detail::cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  throw_decode_error(r, found);
}

}  // namespace cuda::quantize_impl
}  // namespace gradcomp
