// gradcomp/detail/host_simd/sums.hpp: the bucket statistics (sums of squares and of |v|, maxima)
// in the order of detail/quantize_math.hpp, with the intrinsics of the clone they run in.
// Part of the host quantizers' vector paths (detail/host_simd.hpp says how they are built and
// checked).
#pragma once

#include <gradcomp/detail/host_simd/lanes.hpp>

namespace gradcomp::detail {

#if GRADCOMP_VECTOR_EXTENSIONS

namespace simd16 {

// ---------------------------------------------------------------------------------------
// Bucket statistics in the order of detail/quantize_math.hpp.

typedef float f32x4 __attribute__((vector_size(16)));
typedef double f64x4 __attribute__((vector_size(32)));

// chain4_sum(p, n, square_term or abs_term) with the four partial sums as the lanes of one
// vector: lane j receives the values 4q + j in increasing q, as partial j does, and the
// n % 4 values after the last whole quad go to lane 0 in order. The same additions in the
// same order, so the same bits.
template <bool Squares>
[[gnu::always_inline]] inline void chain4_term(const f32x4& x, f64x4& acc) {
  const f64x4 d = __builtin_convertvector(x, f64x4);
  if constexpr (Squares) {
    acc += d * d;
  } else {
    acc += __builtin_bit_cast(f64x4, __builtin_bit_cast(u64x4, d) & 0x7fffffffffffffffULL);
  }
}

template <bool Squares>
[[gnu::always_inline]] inline double chain4_finish(const f64x4& acc, const float* p,
                                                   std::size_t from, std::size_t n) {
  double s0 = acc[0];
  for (std::size_t i = from; i < n; ++i) {
    const auto d = static_cast<double>(p[i]);
    s0 += Squares ? d * d : std::fabs(d);
  }
  return (s0 + acc[1]) + (acc[2] + acc[3]);
}

template <bool Squares>
[[gnu::always_inline]] inline double chain4(const float* p, std::size_t n) {
  f64x4 acc{};
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    f32x4 x;
    load(x, p + i);
    chain4_term<Squares>(x, acc);
  }
  return chain4_finish<Squares>(acc, p, i, n);
}

// chain4 of `chains` runs of n values each, `stride` values apart, into out[0 .. chains): each
// run's additions in chain4's order, but the runs' chains interleaved in one loop. One chain
// waits on its previous addition (4 values per addition's latency, about a quarter of what
// the memory delivers); `chains` independent ones keep up with it. Same bits as chain4 per run.
inline constexpr std::size_t chains = 8;

// The chains' lanes, 4 per run, back in chain4's form.
template <bool Squares>
[[gnu::always_inline]] inline void chain4_many_finish(const double* lanes, const float* p,
                                                      std::size_t stride, std::size_t i,
                                                      std::size_t n, double* out) {
  for (std::size_t r = 0; r < chains; ++r) {
    const f64x4 acc = {lanes[4 * r], lanes[4 * r + 1], lanes[4 * r + 2], lanes[4 * r + 3]};
    out[r] = chain4_finish<Squares>(acc, p + r * stride, i, n);
  }
}

// The AVX-512 and AVX2 clones take intrinsics: from the vector-extension form GCC 12 emits
// each 4-float to 4-double conversion as two half-width ones and an insert, and the loop ran
// at half the memory's speed. Products d * d of floats are exact in double, so whether the
// compiler fuses the multiply and the add makes no difference to the bits.
#if GRADCOMP_HOST_DISPATCH
// Runs of a few KB are too short for the hardware prefetcher to follow 8 of them at once
// (512 values each, QSGD's default: 2.0-2.4x the time of a streaming read, in scratch
// timings on the development machine). When the runs are back to back, the loops below
// fetch the next group of runs (`next`, chains * n values after this group's start) into L2
// as they go, two lines per step of 4 values, so that the whole group has been fetched when
// the step count runs out: 1.11x a streaming read at runs of 512 in the same timings. (Into
// L1 it measured 1.7x at every run length.)
[[gnu::always_inline]] inline void fetch_next_group(const float* next, std::size_t i) {
  _mm_prefetch(reinterpret_cast<const char*>(next + i * chains), _MM_HINT_T2);
  _mm_prefetch(reinterpret_cast<const char*>(next + i * chains + 16), _MM_HINT_T2);
}

template <bool Squares>
[[gnu::target("avx512f,avx512bw,avx512dq,avx512vl")]] inline void
chain4_many_avx512(const float* p, std::size_t stride, std::size_t n, double* out,
                   bool fetch_next) {
  // Register r holds runs 2r (lanes 0-3) and 2r + 1 (lanes 4-7).
  __m512d acc[chains / 2];
  for (auto& a : acc) a = _mm512_setzero_pd();
  const __m512i abs_mask = _mm512_set1_epi64(0x7fffffffffffffffLL);
  const float* next = p + chains * stride;
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    if (fetch_next) fetch_next_group(next, i);
#pragma GCC unroll 4
    for (std::size_t r = 0; r < chains / 2; ++r) {
      const __m256 x = _mm256_set_m128(_mm_loadu_ps(p + (2 * r + 1) * stride + i),
                                       _mm_loadu_ps(p + 2 * r * stride + i));
      const __m512d d = _mm512_maskz_cvtps_pd(0xff, x);
      if constexpr (Squares) {
        acc[r] += d * d;
      } else {
        acc[r] += _mm512_castsi512_pd(_mm512_castpd_si512(d) & abs_mask);
      }
    }
  }
  alignas(64) double lanes[4 * chains];
  for (std::size_t r = 0; r < chains / 2; ++r) _mm512_store_pd(lanes + 8 * r, acc[r]);
  chain4_many_finish<Squares>(lanes, p, stride, i, n, out);
}

template <bool Squares>
[[gnu::target("avx2")]] inline void chain4_many_avx2(const float* p, std::size_t stride,
                                                     std::size_t n, double* out,
                                                     bool fetch_next) {
  __m256d acc[chains];
  for (auto& a : acc) a = _mm256_setzero_pd();
  const __m256i abs_mask = _mm256_set1_epi64x(0x7fffffffffffffffLL);
  const float* next = p + chains * stride;
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    if (fetch_next) fetch_next_group(next, i);
#pragma GCC unroll 8
    for (std::size_t r = 0; r < chains; ++r) {
      const __m256d d = _mm256_cvtps_pd(_mm_loadu_ps(p + r * stride + i));
      if constexpr (Squares) {
        acc[r] += d * d;
      } else {
        acc[r] += _mm256_castsi256_pd(_mm256_castpd_si256(d) & abs_mask);
      }
    }
  }
  alignas(32) double lanes[4 * chains];
  for (std::size_t r = 0; r < chains; ++r) _mm256_store_pd(lanes + 4 * r, acc[r]);
  chain4_many_finish<Squares>(lanes, p, stride, i, n, out);
}
#endif

// fetch_next: the runs are back to back (stride == n) and the next `chains` runs exist, to
// be prefetched.
template <bool Squares, host_isa Isa>
[[gnu::always_inline]] inline void chain4_many(const float* p, std::size_t stride,
                                               std::size_t n, double* out, bool fetch_next) {
#if GRADCOMP_HOST_DISPATCH
  if constexpr (Isa == host_isa::avx512) {
    chain4_many_avx512<Squares>(p, stride, n, out, fetch_next);
    return;
  } else if constexpr (Isa == host_isa::avx2) {
    chain4_many_avx2<Squares>(p, stride, n, out, fetch_next);
    return;
  }
#endif
  (void)fetch_next;
  f64x4 acc[chains] = {};
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4) {
#pragma GCC unroll 8
    for (std::size_t r = 0; r < chains; ++r) {
      f32x4 x;
      load(x, p + r * stride + i);
      chain4_term<Squares>(x, acc[r]);
    }
  }
  double lanes[4 * chains];
  for (std::size_t r = 0; r < chains; ++r) {
    for (std::size_t j = 0; j < 4; ++j) lanes[4 * r + j] = acc[r][j];
  }
  chain4_many_finish<Squares>(lanes, p, stride, i, n, out);
}

// detail::sum_of_squares (Squares) or detail::sum_of_abs of n values: detail::tree_reduce with
// the leaves above (the levels above them are few and stay scalar). The leaf loop is written
// out here rather than passed to tree_reduce: the compiler may keep tree_reduce out of line,
// which compiles the leaves for the build's target instead of the clone's (measured 2.5x
// slower for scaled sign's encoder). Whole leaves go `chains` at a time. After each group of
// leaves has been summed, visit(begin, end) is called with the group's range of p
// (consecutive, covering [0, n) in order, each begin a multiple of stat_block), while the
// cache still holds those values.
struct no_visit {
  void operator()(std::size_t, std::size_t) const noexcept {}
};

template <bool Squares, host_isa Isa, class Visit = no_visit>
[[gnu::always_inline]] inline double sum_tree(const float* p, std::size_t n, Visit&& visit = {}) {
  if (n <= stat_block) {
    const double sum = chain4<Squares>(p, n);
    visit(std::size_t{0}, n);
    return sum;
  }
  std::vector<double> level(stat_nodes(n));
  const std::size_t whole = n / stat_block;
  std::size_t c = 0;
  for (; c + chains <= whole; c += chains) {
    chain4_many<Squares, Isa>(p + c * stat_block, stat_block, stat_block, level.data() + c,
                              c + 2 * chains <= whole);
    visit(c * stat_block, (c + chains) * stat_block);
  }
  for (; c < level.size(); ++c) {
    const std::size_t first = c * stat_block;
    const std::size_t len = n - first < stat_block ? n - first : stat_block;
    level[c] = chain4<Squares>(p + first, len);
    visit(first, first + len);
  }
  return reduce_levels(level, sum_squares_reducer{});  // nodes are added as they are
}

// detail::max_abs_bits (exact in any order). Two maxima of 8 lanes rather than one of 16: GCC
// 12 lowers the select of a 64-byte vector on AVX2 to pieces through the stack (TernGrad's
// max pass ran at 2.4x a streaming read there); a 32-byte one is a vpmaxud, and on AVX-512
// the pass is bound by memory either way.
[[gnu::always_inline]] inline std::uint32_t max_abs_bits(const float* p, std::size_t n) {
  u32h m0{}, m1{};
  std::size_t i = 0;
  for (; i + width <= n; i += width) {
    u32h x, y;
    load(x, p + i);
    load(y, p + i + width / 2);
    x &= 0x7fffffffu;
    y &= 0x7fffffffu;
    m0 = x > m0 ? x : m0;
    m1 = y > m1 ? y : m1;
  }
  m0 = m1 > m0 ? m1 : m0;
  std::uint32_t best = 0;
  for (std::size_t j = 0; j < width / 2; ++j) best = m0[j] > best ? m0[j] : best;
  for (; i < n; ++i) {
    const std::uint32_t a = abs_bits(p[i]);
    best = a > best ? a : best;
  }
  return best;
}

}  // namespace simd16

#endif  // GRADCOMP_VECTOR_EXTENSIONS

}  // namespace gradcomp::detail
