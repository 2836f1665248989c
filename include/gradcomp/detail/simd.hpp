// gradcomp/detail/simd.hpp: whether the host code uses GCC/Clang vector extensions for its hot
// loops (GRADCOMP_VECTOR_EXTENSIONS), and the one horizontal test they share.
#pragma once

#include <bit>
#include <cstddef>

// GCC and Clang vector extensions (16-byte lanes, SSE2 on x86-64) for the hot reductions:
// the plain loops are also vectorised, but at -O2 GCC leaves them as loops of tiny
// iterations (or, for double sums, cannot reorder them at all). Define
// GRADCOMP_NO_VECTOR_EXTENSIONS to build the portable loops instead (tests do both).
#if defined(__GNUC__) && !defined(__CUDACC__) && !defined(GRADCOMP_NO_VECTOR_EXTENSIONS)
#define GRADCOMP_VECTOR_EXTENSIONS 1
#else
#define GRADCOMP_VECTOR_EXTENSIONS 0
#endif

#if GRADCOMP_VECTOR_EXTENSIONS && defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace gradcomp::detail {

#if GRADCOMP_VECTOR_EXTENSIONS
// A 16-byte vector of T and how many T it holds.
template <class T>
struct lanes {
  typedef T type __attribute__((vector_size(16)));
  static constexpr std::size_t count = 16 / sizeof(T);
};

// Whether any lane of a 16-byte vector of signed keys is negative: the sign bits in one
// instruction on x86 (the lane loop compiles to a chain of shuffles and ORs).
template <class V>
inline bool any_negative(V a) noexcept {
#if defined(__SSE2__)
  if constexpr (sizeof(a[0]) == 4) {
    return _mm_movemask_ps(std::bit_cast<__m128>(a)) != 0;
  } else {
    return _mm_movemask_pd(std::bit_cast<__m128d>(a)) != 0;
  }
#else
  auto acc = a[0];
  for (std::size_t j = 1; j < sizeof(V) / sizeof(a[0]); ++j) acc |= a[j];
  return acc < 0;
#endif
}

#endif

// x * x, rounded on its own: the empty asm keeps the compiler from fusing it with the add that
// follows into one FMA, which a clone with AVX-512 (or a build for a target with FMA: GCC
// contracts across statements by default in C++) would otherwise do, making a sum of squares
// depend on the instruction set it was compiled for. Works on a 16-byte vector and on a scalar
// float or double (a double's square is rounded too).
template <class V>
inline V square_unfused(const V& x) noexcept {
  V s = x * x;
#if !GRADCOMP_VECTOR_EXTENSIONS
  // no clones to agree with (and no barrier in nvcc's passes)
#elif defined(__SSE2__)
  __asm__("" : "+x"(s));
#elif defined(__aarch64__)
  __asm__("" : "+w"(s));
#endif
  return s;
}

}  // namespace gradcomp::detail
