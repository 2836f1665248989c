// gradcomp/cuda/kernels/quantize.cuh: the quantizer kernels. All arithmetic is the host's
// (gradcomp/detail/quantize_codec.hpp, quantize_math.hpp, bitpack.hpp); these kernels only
// decide which thread does which part:
//  - bucket statistics: one thread per node of the summation tree (stat_level_kernel), then
//    one thread per bucket (stat_bucket_kernel), each reducing its values in the host's order;
//  - codes: one thread per group of codes that fills whole bytes (codes_per_group), so no
//    two threads ever write the same byte and no atomics are needed;
//  - decode: one thread per value; validate: one thread per value or side entry.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include <gradcomp/config.hpp>
#include <gradcomp/cuda/block/sparse_common.cuh>
#include <gradcomp/detail/bitpack.hpp>
#include <gradcomp/detail/quantize_codec.hpp>
#include <gradcomp/detail/quantize_math.hpp>

// Compile without --use_fast_math (or -ftz=true, -prec-div=false): they change the rounding
// of the divisions and products the codes depend on, and nvcc 13 defines no macro by which
// this header could refuse them.

namespace gradcomp::cuda::quantize_impl {

// ---------------------------------------------------------------------------------------
// Bucket statistics.

// Which values a thread reduces: node o of the level above l, or bucket b of level l.
struct node_runs {
  detail::stat_level l;
  GRADCOMP_HOST_DEVICE detail::value_run operator()(std::size_t o) const {
    return detail::node_inputs(l, o);
  }
};
struct bucket_runs {
  detail::stat_level l;
  GRADCOMP_HOST_DEVICE detail::value_run operator()(std::size_t b) const {
    return detail::level_bucket(l, b);
  }
};

// Where a reduced run goes: a node of the next level, or a bucket's side value (`leaves` is
// level 0, the values themselves, whose bucket lengths the side value may need).
template <class Acc>
struct store_node {
  Acc* out;
  GRADCOMP_HOST_DEVICE void operator()(std::size_t o, Acc v) const { out[o] = v; }
};
template <class Acc, class Side>
struct store_side {
  float* side;
  detail::stat_level leaves;
  Side side_of;
  GRADCOMP_HOST_DEVICE void operator()(std::size_t b, Acc v) const {
    side[b] = side_of(v, detail::level_bucket(leaves, b).count);
  }
};

inline constexpr unsigned stat_warps = 4;  // warps per block of stat_runs_kernel

// One lane per run of at most stat_block values (a tree node or a whole bucket), reduced in
// the host's order. A thread walking its own run would read 32 far-apart addresses per warp
// load; instead the warp stages its 32 runs 32 values at a time through shared memory (each
// row loaded by the whole warp, coalesced), and each lane then reduces its own row with
// reduce_chunk32, which keeps the order of the whole-run form. Rows are padded to 33 entries
// so that the lanes reading down their rows hit distinct banks.
template <class Reducer, class In, class RunOf, class Store>
__global__ void __launch_bounds__(stat_warps * 32)
    stat_runs_kernel(const In* in, std::size_t runs, RunOf run_of, Store store) {
  __shared__ In tile[stat_warps][32][33];
  const unsigned lane = threadIdx.x % 32u;
  const unsigned warp = threadIdx.x / 32u;
  In(*rows)[33] = tile[warp];
  const std::size_t warps = static_cast<std::size_t>(gridDim.x) * stat_warps;
  // The loop bounds depend on the warp only, so every lane runs every shuffle below.
  for (std::size_t base = (static_cast<std::size_t>(blockIdx.x) * stat_warps + warp) * 32u;
       base < runs; base += warps * 32u) {
    const std::size_t r = base + lane;
    const detail::value_run mine = r < runs ? run_of(r) : detail::value_run{0, 0};
    std::size_t longest = mine.count;
    for (unsigned offset = 16; offset > 0; offset /= 2) {
      const std::size_t other = __shfl_xor_sync(0xffffffffu, longest, offset);
      longest = other > longest ? other : longest;
    }
    typename Reducer::state st{};
    for (std::size_t c = 0; c < longest; c += 32u) {
      for (unsigned row = 0; row < 32u; ++row) {
        const std::size_t first = __shfl_sync(0xffffffffu, mine.first, row);
        const std::size_t count = __shfl_sync(0xffffffffu, mine.count, row);
        if (c + lane < count) rows[row][lane] = in[first + c + lane];
      }
      __syncwarp();
      if (c < mine.count) detail::reduce_chunk32<Reducer>(st, rows[lane], c, mine.count);
      __syncwarp();  // the row is read before the next chunk overwrites it
    }
    if (r < runs) store(r, Reducer::result(st));
  }
}

// ---------------------------------------------------------------------------------------
// Codes.

// One thread per byte-aligned group of codes (detail::pack_group): the group's bytes are
// written by that thread alone, whole, the zero padding of the last byte included.
template <class Codec>
__global__ void encode_kernel(const float* values, std::size_t n, unsigned bits, const float* side,
                              Codec codec, std::byte* packed) {
  const std::size_t per_group = detail::codes_per_group(bits);
  const std::size_t groups = (n + per_group - 1) / per_group;
  const detail::code_of_value<Codec> code_of{values, side, codec};
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t g = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += stride) {
    detail::pack_group(packed, n, bits, g, code_of);
  }
}

// One thread per value; does nothing when a validation kernel before it found a problem
// (errors == nullptr: the caller vouched for the input).
template <class Codec>
__global__ void decode_kernel(const std::byte* packed, std::size_t n, unsigned bits,
                              const float* side, Codec codec, float* out,
                              const error_record* errors, unsigned error_count) {
  if (any_error(errors, error_count)) return;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    out[i] = codec.value(detail::code_at(packed, i, bits), i, side);
  }
}

// What the host decoders check in the payload's bytes and side values, in the host's order of
// precedence: errors[0] the first side value that is not finite and >= 0 (key: index << 32 |
// its bits), errors[1] non-zero padding bits in the last byte (key 0), errors[2] the first
// code above max_code (key: position << 32 | code). A template (of the side value type, always
// float) only so that this header can be included by several translation units of one program.
template <class Side>
__global__ void validate_kernel(const std::byte* packed, std::size_t n, unsigned bits,
                                const Side* side, std::size_t side_count, std::uint32_t max_code,
                                error_record* errors) {
  const std::size_t items = n > side_count ? n : side_count;
  const bool codes_can_be_bad = max_code < detail::code_mask(bits);
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const std::size_t first = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (first == 0) {
    const unsigned used = static_cast<unsigned>((static_cast<std::uint64_t>(n) * bits) % 8u);
    const std::size_t bytes = static_cast<std::size_t>(detail::packed_size(n, bits));
    if (used != 0u && (static_cast<unsigned>(packed[bytes - 1]) >> used) != 0u) {
      report_error(&errors[1], 0ull);
    }
  }
  for (std::size_t i = first; i < items; i += stride) {
    if (i < side_count) {
      const float s = side[i];                                  // Side = float
      if (!(detail::abs_bits(s) < 0x7f800000u && s >= 0.0f)) {  // not (finite and >= 0)
        report_error(&errors[0],
                     static_cast<unsigned long long>(i) << 32 | detail::float_to_bits(s));
      }
    }
    if (codes_can_be_bad && i < n) {
      const std::uint32_t c = detail::code_at(packed, i, bits);
      if (c > max_code) report_error(&errors[2], static_cast<unsigned long long>(i) << 32 | c);
    }
  }
}

}  // namespace gradcomp::cuda::quantize_impl
