// gradcomp/detail/quantize_math.hpp: the quantizers' arithmetic, written once for the host
// encoders and the device kernels (gradcomp/cuda/quantize.cuh) so that both produce the same
// bits: the rounding of one value to a code, code -> value, and the bucket statistics (QSGD
// L2 norm, TernGrad max|v|, scaled sign mean|v|) in an order that a GPU can reproduce.
//
// The summation order. Floating-point sums depend on their order, and the device must send
// the same side values as the host, so the order is part of the definition:
//   S(x[0..n)) = chain4(x)                        if n <= stat_block (2048)
//              = S(chain4 of each stat_block-sized block of x, in order)   otherwise
// where chain4 is four interleaved double partial sums (element i into partial i % 4, the
// n % 4 leftover elements into partial 0) added as (p0 + p1) + (p2 + p3). Buckets of up to
// 2048 values (QSGD's default 512 included) are one chain4; a larger bucket is a tree of
// 2048-ary nodes whose nodes a GPU computes in parallel, one thread per node.
// The maximum is exact in any order, so TernGrad's needs no such rule.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include <gradcomp/config.hpp>
#include <gradcomp/detail/float16.hpp>

namespace gradcomp::detail {

// Values per node of the summation tree (see above).
inline constexpr std::size_t stat_block = 2048;

// The terms that are summed, exact in double: a float's square has at most 48 significand
// bits and an exponent inside double's range, so a fused multiply-add of the device gives the
// same bits as a separate multiply and add.
struct square_term {
  GRADCOMP_HOST_DEVICE double operator()(float v) const {
    return static_cast<double>(v) * static_cast<double>(v);
  }
  GRADCOMP_HOST_DEVICE double operator()(double v) const { return v; }  // upper tree levels
};
struct abs_term {
  GRADCOMP_HOST_DEVICE double operator()(float v) const {
    return std::fabs(static_cast<double>(v));
  }
  GRADCOMP_HOST_DEVICE double operator()(double v) const { return v; }  // upper tree levels
};

// chain4 of term(p[0..n)): the leaf (and node) order of the summation tree.
template <class T, class Term>
GRADCOMP_HOST_DEVICE double chain4_sum(const T* p, std::size_t n, Term term) {
  double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += term(p[i]);
    s1 += term(p[i + 1]);
    s2 += term(p[i + 2]);
    s3 += term(p[i + 3]);
  }
  for (; i < n; ++i) s0 += term(p[i]);
  return (s0 + s1) + (s2 + s3);
}

// The number of tree nodes one level up from a run of n values (ceil(n / stat_block)).
GRADCOMP_HOST_DEVICE constexpr std::size_t stat_nodes(std::size_t n) {
  return (n + stat_block - 1) / stat_block;
}

// |v| as bits: for |v| these order like the values, and NaN and Inf order above every finite
// value, so the maximum of the bits gives both max|v| and whether the bucket is finite.
GRADCOMP_HOST_DEVICE std::uint32_t abs_bits(float v) { return float_to_bits(v) & 0x7fffffffu; }

GRADCOMP_HOST_DEVICE std::uint32_t max_abs_bits(const float* p, std::size_t n) {
  std::uint32_t m = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t a = abs_bits(p[i]);
    m = a > m ? a : m;
  }
  return m;
}

// What one node of the tree computes: from the bucket's floats at the leaves, from the nodes
// below (acc) above them. Two forms of the same arithmetic: a whole run at once (operator()),
// and incrementally (state, quad, tail, result) for kernels that see a run in chunks; see
// reduce_chunk32.
template <class Term>
struct chain4_reducer {
  using acc = double;
  struct state {
    double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
  };
  GRADCOMP_HOST_DEVICE static double term(float v) { return Term{}(v); }
  GRADCOMP_HOST_DEVICE static double term(double v) { return v; }  // upper tree levels
  // Values 4q .. 4q + 3 of a run, q < count / 4.
  GRADCOMP_HOST_DEVICE static void quad(state& st, double a, double b, double c, double d) {
    st.s0 += a;
    st.s1 += b;
    st.s2 += c;
    st.s3 += d;
  }
  // The count % 4 values after the last whole quad, in order.
  GRADCOMP_HOST_DEVICE static void tail(state& st, double a) { st.s0 += a; }
  GRADCOMP_HOST_DEVICE static double result(const state& st) {
    return (st.s0 + st.s1) + (st.s2 + st.s3);
  }
  GRADCOMP_HOST_DEVICE double operator()(const float* p, std::size_t n) const {
    return chain4_sum(p, n, Term{});
  }
  GRADCOMP_HOST_DEVICE double operator()(const double* p, std::size_t n) const {
    return chain4_sum(p, n, Term{});
  }
};
using sum_squares_reducer = chain4_reducer<square_term>;
using sum_abs_reducer = chain4_reducer<abs_term>;

// Exact in any order: the tree only lets the device work on a large bucket in parallel.
struct max_abs_reducer {
  using acc = std::uint32_t;
  struct state {
    std::uint32_t m = 0;
  };
  GRADCOMP_HOST_DEVICE static std::uint32_t term(float v) { return abs_bits(v); }
  GRADCOMP_HOST_DEVICE static std::uint32_t term(std::uint32_t v) { return v; }
  GRADCOMP_HOST_DEVICE static void quad(state& st, std::uint32_t a, std::uint32_t b,
                                        std::uint32_t c, std::uint32_t d) {
    const std::uint32_t ab = a > b ? a : b;
    const std::uint32_t cd = c > d ? c : d;
    const std::uint32_t m = ab > cd ? ab : cd;
    st.m = m > st.m ? m : st.m;
  }
  GRADCOMP_HOST_DEVICE static void tail(state& st, std::uint32_t a) { st.m = a > st.m ? a : st.m; }
  GRADCOMP_HOST_DEVICE static std::uint32_t result(const state& st) { return st.m; }
  GRADCOMP_HOST_DEVICE std::uint32_t operator()(const float* p, std::size_t n) const {
    return max_abs_bits(p, n);
  }
  GRADCOMP_HOST_DEVICE std::uint32_t operator()(const std::uint32_t* p, std::size_t n) const {
    std::uint32_t m = 0;
    for (std::size_t i = 0; i < n; ++i) m = p[i] > m ? p[i] : m;
    return m;
  }
};

// Values c .. c + 31 of a run of `count` values (those below count), given as row[0..32), into
// st, in the order of the whole-run form: each partial sum receives its values in increasing
// position, so a run fed chunk by chunk (c = 0, 32, 64, ...) gives the same bits as chain4_sum.
// c must be a multiple of 4 (quads never straddle chunks); row entries at or beyond count are
// not read.
template <class Reducer, class In>
GRADCOMP_HOST_DEVICE void reduce_chunk32(typename Reducer::state& st, const In* row, std::size_t c,
                                         std::size_t count) {
  const std::size_t whole = count / 4 * 4;  // values in whole quads
  for (unsigned j = 0; j < 32; j += 4) {
    const std::size_t t = c + j;
    if (t + 4 <= whole) {
      Reducer::quad(st, Reducer::term(row[j]), Reducer::term(row[j + 1]), Reducer::term(row[j + 2]),
                    Reducer::term(row[j + 3]));
    } else {
      for (unsigned k = 0; k < 4; ++k) {
        if (t + k < count) Reducer::tail(st, Reducer::term(row[j + k]));
      }
    }
  }
}

// The tree over all buckets of a tensor at once, as the device walks it: one level holds
// `len` values in buckets of `seg` values (the last bucket may be shorter); the level above
// holds, bucket by bucket, the nodes over stat_block-sized runs of each bucket, so it has as
// many buckets, each of stat_nodes(seg) values. The device adds levels while seg > stat_block
// and then reduces each bucket with one node; a bucket shorter than the others may get levels
// it would not need, each of them a single node that reproduces its one value exactly
// (chain4 of one value x >= 0 is x).
struct stat_level {
  std::size_t len = 0;
  std::size_t seg = 1;
};

struct value_run {
  std::size_t first = 0;
  std::size_t count = 0;
};

GRADCOMP_HOST_DEVICE constexpr std::size_t level_buckets(stat_level l) {
  return l.len == 0 ? 0 : (l.len + l.seg - 1) / l.seg;
}

// Bucket b of level l.
GRADCOMP_HOST_DEVICE constexpr value_run level_bucket(stat_level l, std::size_t b) {
  const std::size_t first = b * l.seg;
  return {first, l.len - first < l.seg ? l.len - first : l.seg};
}

// Precondition: l.len > 0.
GRADCOMP_HOST_DEVICE constexpr stat_level level_above(stat_level l) {
  const std::size_t buckets = level_buckets(l);
  const std::size_t seg = stat_nodes(l.seg);
  return {(buckets - 1) * seg + stat_nodes(level_bucket(l, buckets - 1).count), seg};
}

// The values of level l that node o of level_above(l) reduces.
GRADCOMP_HOST_DEVICE constexpr value_run node_inputs(stat_level l, std::size_t o) {
  const std::size_t per_bucket = stat_nodes(l.seg);
  const value_run bucket = level_bucket(l, o / per_bucket);
  const std::size_t offset = (o % per_bucket) * stat_block;
  const std::size_t left = bucket.count - offset;
  return {bucket.first + offset, left < stat_block ? left : stat_block};
}

// The levels above the leaves: `level` holds the leaves' values (more than one), reduced in
// place to the root's.
template <class Reducer>
typename Reducer::acc reduce_levels(std::vector<typename Reducer::acc>& level, Reducer r = {}) {
  while (level.size() > stat_block) {
    const std::size_t m = level.size();
    // In place: node c reads values [c * stat_block, ...), at or after c, before writing c.
    for (std::size_t c = 0; c < stat_nodes(m); ++c) {
      const std::size_t first = c * stat_block;
      level[c] = r(level.data() + first, m - first < stat_block ? m - first : stat_block);
    }
    level.resize(stat_nodes(m));
  }
  return r(level.data(), level.size());
}

// The reduction of one bucket of n floats on the host: the tree level by level, with one
// scratch vector when the bucket is larger than stat_block.
template <class Reducer>
typename Reducer::acc tree_reduce(const float* p, std::size_t n, Reducer r = {}) {
  using acc = typename Reducer::acc;
  if (n <= stat_block) return r(p, n);
  std::vector<acc> level(stat_nodes(n));
  for (std::size_t c = 0; c < level.size(); ++c) {
    const std::size_t first = c * stat_block;
    level[c] = r(p + first, n - first < stat_block ? n - first : stat_block);
  }
  return reduce_levels(level, r);
}

// Bucket statistics, in double: no overflow for float inputs, and the fixed order above.
inline double sum_of_squares(const float* p, std::size_t n) {
  return tree_reduce(p, n, sum_squares_reducer{});
}
inline double sum_of_abs(const float* p, std::size_t n) {
  return tree_reduce(p, n, sum_abs_reducer{});
}

// ---------------------------------------------------------------------------------------
// From a bucket's statistic to the side value that is sent.

// QSGD's L2 norm: never below any |v| of the bucket (so s|v|/norm <= s), saturated at FLT_MAX
// when finite inputs overflow float, and 0 when the bucket holds NaN or Inf (the sum of
// squares of finite floats cannot overflow double, so a non-finite sum means such an input).
GRADCOMP_HOST_DEVICE float qsgd_norm_from_sum(double sum_sq) {
  if (!std::isfinite(sum_sq)) return 0.0f;
  const double r = std::sqrt(sum_sq);
  constexpr double max = std::numeric_limits<float>::max();
  return r >= max ? std::numeric_limits<float>::max() : static_cast<float>(r);
}

// TernGrad's max|v| from the largest abs_bits, 0 when the bucket holds NaN or Inf.
GRADCOMP_HOST_DEVICE float terngrad_max_from_bits(std::uint32_t max_bits) {
  return max_bits >= 0x7f800000u ? 0.0f : bits_to_float(max_bits);
}

// Scaled sign's mean|v| of a bucket of n values, 0 when the bucket holds NaN or Inf.
GRADCOMP_HOST_DEVICE float scaled_sign_mean_from_sum(double sum_abs, std::size_t n) {
  if (!std::isfinite(sum_abs)) return 0.0f;
  return static_cast<float>(sum_abs / static_cast<double>(n));  // <= max|v|, so finite
}

// ---------------------------------------------------------------------------------------
// Codes.

// a * b rounded once, never fused with a later addition: nvcc contracts a product and a
// following subtraction into one fused multiply-add by default (even across statements),
// which would round differently from the host.
GRADCOMP_HOST_DEVICE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// u below is the element's uniform draw, counter_rng::uniform(i) of the call's quantize
// stream: exact in float, the same on host and device.

// QSGD: code of v in a bucket of norm `norm` with s levels. Level xi = floor(r) or
// floor(r) + 1 with probability frac(r), r = s|v|/norm; code = s +- xi.
GRADCOMP_HOST_DEVICE std::uint32_t qsgd_code(float v, float norm, std::uint32_t s, float u) {
  if (!(norm > 0.0f)) return s;
  const float fs = static_cast<float>(s);
  // <= s when |v| <= norm, as qsgd_norm_from_sum ensures; frac below must see this rounding.
  float r = mul_rn(fs, std::fabs(v) / norm);
  // Defensive, for a norm computed elsewhere: keeps the code <= 2s and the cast below defined
  // (a NaN or Inf r would make it undefined behaviour).
  if (!(r <= fs)) r = fs;
  const auto low = static_cast<std::uint32_t>(r);  // floor, as r >= 0
  const float frac = r - static_cast<float>(low);  // exact
  // Branch-free: the comparison is a coin flip that a branch predictor cannot learn.
  const std::uint32_t level = low + static_cast<std::uint32_t>(u < frac);
  return v < 0.0f ? s - level : s + level;
}

// QSGD: decoded value of a code, norm * (code - s) / s with inv_s = 1.0f / s: two products,
// each rounded on its own (mul_rn), so no caller's addition can fuse with them on the device.
GRADCOMP_HOST_DEVICE float qsgd_value(float norm, std::uint32_t code, std::uint32_t s,
                                      float inv_s) {
  const float level =
      static_cast<float>(static_cast<std::int32_t>(code) - static_cast<std::int32_t>(s));
  return mul_rn(norm, mul_rn(level, inv_s));
}

// TernGrad codes: 0 -> 0, 1 -> +max, 2 -> -max; 3 is invalid.
GRADCOMP_HOST_DEVICE std::uint32_t terngrad_code(float v, float max, float u) {
  if (!(max > 0.0f)) return 0u;
  // Branch-free (the draw is a coin flip): hit ? (v < 0 ? 2 : 1) : 0.
  const auto hit = static_cast<std::uint32_t>(u < std::fabs(v) / max);
  return hit << static_cast<unsigned>(v < 0.0f);
}

// Precondition: code <= 2 (decoders reject 3 first). Branch-free on the bits (codes are
// random, so a branch mispredicts; as a ternary the host decoder ran 2.3x slower):
// 0 -> +0, 1 -> max, 2 -> max with the sign bit set (-max, as max >= 0 is a validated side
// value).
GRADCOMP_HOST_DEVICE float terngrad_value(std::uint32_t code, float max) {
  const std::uint32_t keep = 0u - static_cast<std::uint32_t>(code != 0u);
  return bits_to_float((float_to_bits(max) & keep) | ((code >> 1) << 31));
}

// Scaled sign: 1 = negative, 0 = non-negative (-0 and NaN included).
GRADCOMP_HOST_DEVICE std::uint32_t scaled_sign_code(float v) { return v < 0.0f ? 1u : 0u; }

// Branch-free: code 1 flips the sign bit, which is -mean exactly (as a ternary the host
// decoder ran 6x slower on random signs).
GRADCOMP_HOST_DEVICE float scaled_sign_value(std::uint32_t code, float mean) {
  return bits_to_float(float_to_bits(mean) ^ ((code & 1u) << 31));
}

}  // namespace gradcomp::detail
