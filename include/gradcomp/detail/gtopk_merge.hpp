// gradcomp/detail/gtopk_merge.hpp: the per-element steps of gTop-k's pairwise merge as the
// device runs it (cuda/kernels/gtopk_kernels.cuh), written once for host and device so that a
// host test (tests/detail/gtopk_merge_test.cpp) runs the same steps against the host's merge
// (exchange/gtopk.hpp's detail::gtopk_merge), without a GPU.
//
// The device merges two ranks' picks of a tensor, a (its own) and b (received), both ascending
// by index, without a sequential pass: each pick finds its place in the union of the two by a
// binary search in the other set (gtopk_merge_slot); equal indices land side by side, a's
// slot holding the sum a + b and b's left as a hole. The union is then sorted by
// gtopk_order_key (the host's gtopk_before order: NaN first, then |value| descending, ties to
// the lower index; holes last), its first min(k, distinct picks) kept and sorted by index again.
#pragma once

#include <cstdint>

#include <gradcomp/config.hpp>
#include <gradcomp/detail/float16.hpp>

namespace gradcomp::detail {

// The key of a hole: above every real key (a real key's low word is an index below 2^32 - 1,
// which the device step keeps below 2^30).
inline constexpr std::uint64_t gtopk_hole_key = ~std::uint64_t{0};
// A padding index after the top k were taken: above every real index.
inline constexpr std::uint32_t gtopk_padding_index = ~std::uint32_t{0};

// The last segment that starts at or before s, of the `segments` that at[] lays out (at has
// segments + 1 running sums, s < at[segments]; empty segments share their start, so the
// segment found is never empty). Also the device step's check of received picks
// (cuda/kernels/step_kernels.cuh) finds each pick's segment with it.
GRADCOMP_HOST_DEVICE unsigned segment_of(const std::uint64_t* at, unsigned segments,
                                         std::uint64_t s) {
  unsigned a = 0, b = segments;
  while (b - a > 1) {
    const unsigned mid = a + (b - a) / 2;
    if (at[mid] <= s) a = mid;
    else b = mid;
  }
  return a;
}

// The number of x[0..n) below v, or at most v with or_equal; x ascending.
GRADCOMP_HOST_DEVICE std::uint32_t count_below(const std::uint32_t* x, std::uint32_t n,
                                               std::uint32_t v, bool or_equal) {
  std::uint32_t a = 0, b = n;
  while (a < b) {
    const std::uint32_t mid = a + (b - a) / 2;
    if (x[mid] < v || (or_equal && x[mid] == v)) a = mid + 1;
    else b = mid;
  }
  return a;
}

// Where v is in x[0..n) (ascending), or n.
GRADCOMP_HOST_DEVICE std::uint32_t find_sorted(const std::uint32_t* x, std::uint32_t n,
                                               std::uint32_t v) {
  const std::uint32_t j = count_below(x, n, v, false);
  return j < n && x[j] == v ? j : n;
}

// Ascending keys are gtopk_before's order: NaN first, then |value| descending, ties to the
// lower index (every NaN one magnitude above +Inf, so that its payload bits do not order it).
GRADCOMP_HOST_DEVICE std::uint64_t gtopk_order_key(std::uint32_t index, float value) {
  std::uint32_t mag = float_to_bits(value) & 0x7fffffffu;
  if (mag > 0x7f800000u) mag = 0x7fffffffu;
  return (static_cast<std::uint64_t>(~mag) << 32) | index;
}

// One correctly rounded float addition (never contracted: the host's a + b).
GRADCOMP_HOST_DEVICE float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// A pick's slot in its tensor's union: the offset in the union's segment, its key and value
// bits; hole where it is b's copy of an index a holds too.
struct gtopk_union_slot {
  std::uint64_t at;
  std::uint64_t key;
  std::uint32_t value;
  bool hole;
};

// Pick j (index x, value v) of a (from_b false) or of b, against the other set's n_other
// indices and value bits: a's pick j goes to j + (b's picks below x), b's pick j to
// j + (a's picks at or below x), so that equal indices land side by side, a's first; a's slot
// holds a + b there (the host's merge adds a.value + b.value), b's is a hole.
GRADCOMP_HOST_DEVICE gtopk_union_slot gtopk_merge_slot(std::uint32_t j, std::uint32_t x, float v,
                                                       const std::uint32_t* other_index,
                                                       const std::uint32_t* other_value,
                                                       std::uint32_t n_other, bool from_b) {
  const std::uint32_t below = count_below(other_index, n_other, x, from_b);
  gtopk_union_slot out{std::uint64_t{j} + below, 0, 0, false};
  if (from_b) {
    if (below > 0 && other_index[below - 1] == x) {
      out.key = gtopk_hole_key;
      out.hole = true;
    } else {
      out.key = gtopk_order_key(x, v);
      out.value = float_to_bits(v);
    }
    return out;
  }
  float sum = v;
  if (below < n_other && other_index[below] == x) sum = add_rn(v, bits_to_float(other_value[below]));
  out.key = gtopk_order_key(x, sum);
  out.value = float_to_bits(sum);
  return out;
}

}  // namespace gradcomp::detail
