// gradcomp/detail/select/bracket_pass.hpp: exact top-k's bracketed pass (select/topk.hpp),
// the one read of the values that splits them into the sure, the candidates and the rest.
//
// bracket_pass is the portable form: it visits the elements of a hot block one set bit at a
// time and decides sure or candidate per element. For float on AVX-512 and AVX2 the split
// passes below do the same without data-dependent branches per element: at density 0.01
// about a third of the blocks are hot, each with one or two keys in the bracket, and the
// bit loop's exits and the hot/cold test of every block are coin flips to the branch
// predictor. They compare a block's 32 keys at once and compact the indices (and the
// candidates' keys) with a vector compress (AVX-512) or a permutation looked up by the 8-bit
// compare mask (AVX2), stored whole: the counts grow by the popcounts. With `dense`, every
// block is split, hot or not (a cold block stores nothing that counts), so the only branches
// left are the loop's and the rarely taken budget check. The lists come out exactly as
// bracket_pass writes them: the same indices, in index order.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <gradcomp/detail/host_dispatch.hpp>
#include <gradcomp/detail/select/keys.hpp>
#include <gradcomp/detail/select/scan.hpp>

namespace gradcomp::detail {

// The pass's output: indices with key > hi go to `sure`, lo <= key <= hi to `cand` with their
// keys in `cand_keys` (the finish then never goes back to g), all in index order. The buffers
// need cap + scan_block entries, as they are checked once per block.
template <class T>
struct bracket_lists {
  std::uint32_t* sure;
  std::size_t sure_cap;
  std::uint32_t* cand;
  abs_key_t<T>* cand_keys;
  std::size_t cand_cap;
  std::size_t n_sure = 0;
  std::size_t n_cand = 0;
};

// Sorts the keys > lo - 1 of p[0, len) into the lists after their first n_sure and n_cand
// entries, one element at a time.
template <class T>
void bracket_visit(const T* p, std::size_t b, std::size_t len, signed_key_t<T> t,
                   abs_key_t<T> hi, bracket_lists<T>& out, std::size_t& ns, std::size_t& nc) {
  using key = abs_key_t<T>;
  std::uint32_t* const sure = out.sure;
  std::uint32_t* const cand = out.cand;
  key* const cand_keys = out.cand_keys;
  for_each_above(p, len, t, [&](std::size_t j, key kk) {
    // Written to both lists, kept in one: whether a value is sure or a candidate is a coin
    // flip to the branch predictor when the bracket holds many.
    const auto i = static_cast<std::uint32_t>(b + j);
    const bool is_sure = kk > hi;
    sure[ns] = i;
    cand[nc] = i;
    cand_keys[nc] = kk;
    ns += is_sure;
    nc += !is_sure;
  });
}

// The end of every form of the pass, from the first block it did not take (at i, with
// out.n_sure and out.n_cand so far): the budget check, the last partial block and finish(n).
template <class T, class Source>
bool bracket_tail(const Source& src, std::size_t i, abs_key_t<T> lo, abs_key_t<T> hi,
                  bracket_lists<T>& out) {
  const std::size_t n = src.size();
  std::size_t ns = out.n_sure;
  std::size_t nc = out.n_cand;
  if (ns > out.sure_cap || nc > out.cand_cap) {
    src.finish(i);
    return false;
  }
  if (i < n) {
    const std::size_t len = std::min(scan_block, n - i);  // bounded, for the compiler
    bracket_visit<T>(src.block(i, len), i, len, static_cast<signed_key_t<T>>(lo) - 1, hi, out, ns,
                     nc);
  }
  src.finish(n);  // nothing left to add; a source may still hold what it gathered (sum_source)
  out.n_sure = ns;
  out.n_cand = nc;
  return true;
}

// The bracketed pass, portable form. Blocks without any key >= lo cost one vectorised test.
// Gives up as soon as sure exceeds sure_cap or cand exceeds cand_cap (the bracket missed, or
// the input is dominated by ties) and returns false; the source's side effects (e += g) are
// completed either way.
template <class T, class Source>
bool bracket_pass(const Source& source, abs_key_t<T> lo, abs_key_t<T> hi, bracket_lists<T>& out) {
  // A local copy: the stores to e cannot change it, so its pointers stay in registers.
  const Source src = source;
  const std::size_t n = src.size();
  const auto t = static_cast<signed_key_t<T>>(lo) - 1;
  std::size_t ns = 0;
  std::size_t nc = 0;
  std::size_t i = 0;
  for (; i + scan_block <= n; i += scan_block) {
    const T* p = src.hot_block(i, t);
    if (p == nullptr) continue;
    if (ns > out.sure_cap || nc > out.cand_cap) {
      src.finish(i + scan_block);
      return false;
    }
    bracket_visit<T>(p, i, scan_block, t, hi, out, ns, nc);
  }
  out.n_sure = ns;
  out.n_cand = nc;
  return bracket_tail<T>(src, i, lo, hi, out);
}

#if GRADCOMP_HOST_DISPATCH

// For each 8-bit mask, the positions of its set bits, lowest first (the rest 0): the
// permutation that packs an 8-lane vector's selected lanes to the front.
inline constexpr std::array<std::uint64_t, 256> pack_positions = [] {
  std::array<std::uint64_t, 256> t{};
  for (unsigned m = 0; m < 256; ++m) {
    std::uint64_t v = 0;
    unsigned at = 0;
    for (unsigned j = 0; j < 8; ++j) {
      if (m & (1u << j)) v |= static_cast<std::uint64_t>(j) << (8 * at++);
    }
    t[m] = v;
  }
  return t;
}();

// The pass over `src` (a read_source<float> or sum_source<float>) with the lists of
// bracket_pass; returns what bracket_pass returns.
template <class Source>
[[gnu::target("avx512f,avx512bw,avx512dq,avx512vl,popcnt")]] bool split_pass_avx512(
    const Source& source, std::uint32_t lo, std::uint32_t hi, bracket_lists<float>& out,
    bool dense) {
  const Source src = source;
  const std::size_t n = src.size();
  const auto t = static_cast<std::int32_t>(lo) - 1;
  std::uint32_t* const sure = out.sure;
  std::uint32_t* const cand = out.cand;
  std::uint32_t* const cand_keys = out.cand_keys;
  const __m512i mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i tt = _mm512_set1_epi32(t);
  // hi <= 0x7fffffff (the largest key): a signed compare is exact for keys >= 0.
  const __m512i hh = _mm512_set1_epi32(static_cast<std::int32_t>(hi));
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  std::size_t ns = 0;
  std::size_t nc = 0;
  std::size_t i = 0;
  for (; i + scan_block <= n; i += scan_block) {
    const float* p;
    if (dense) {
      bool hot = false;
      p = src.any_block(i, t, hot);
    } else {
      p = src.hot_block(i, t);
      if (p == nullptr) continue;
    }
    if (ns > out.sure_cap || nc > out.cand_cap) {
      src.finish(i + scan_block);
      return false;
    }
    for (std::size_t h = 0; h < scan_block; h += 16) {
      // Loaded in 16-byte pieces: a sum_source's block was just written by 16-byte stores,
      // and a wider load that spans several of them cannot take its data from the store
      // buffer (a stall of some 15 cycles per block).
      __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + h)));
      v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + h + 4)), 1);
      v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + h + 8)), 2);
      v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + h + 12)), 3);
      const __m512i k = _mm512_and_si512(v, mask);
      const __mmask16 above = _mm512_cmpgt_epi32_mask(k, tt);
      const __mmask16 s = _mm512_mask_cmpgt_epi32_mask(above, k, hh);
      const auto c = static_cast<__mmask16>(above & ~s);
      const __m512i idx = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<std::int32_t>(i + h)));
      // Compress in registers and store whole: a compressing store to memory is microcoded
      // (slow) on some AVX-512 CPUs.
      _mm512_storeu_si512(sure + ns, _mm512_maskz_compress_epi32(s, idx));
      _mm512_storeu_si512(cand + nc, _mm512_maskz_compress_epi32(c, idx));
      _mm512_storeu_si512(cand_keys + nc, _mm512_maskz_compress_epi32(c, k));
      ns += static_cast<std::size_t>(__builtin_popcount(s));
      nc += static_cast<std::size_t>(__builtin_popcount(c));
    }
  }
  out.n_sure = ns;
  out.n_cand = nc;
  return bracket_tail<float>(src, i, lo, hi, out);
}

template <class Source>
[[gnu::target("avx2,popcnt")]] bool split_pass_avx2(const Source& source, std::uint32_t lo,
                                                     std::uint32_t hi, bracket_lists<float>& out,
                                                     bool dense) {
  const Source src = source;
  const std::size_t n = src.size();
  const auto t = static_cast<std::int32_t>(lo) - 1;
  std::uint32_t* const sure = out.sure;
  std::uint32_t* const cand = out.cand;
  std::uint32_t* const cand_keys = out.cand_keys;
  const __m256i mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i tt = _mm256_set1_epi32(t);
  const __m256i hh = _mm256_set1_epi32(static_cast<std::int32_t>(hi));
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const std::uint64_t* const packs = pack_positions.data();
  std::size_t ns = 0;
  std::size_t nc = 0;
  std::size_t i = 0;
  for (; i + scan_block <= n; i += scan_block) {
    const float* p;
    if (dense) {
      bool hot = false;
      p = src.any_block(i, t, hot);
    } else {
      p = src.hot_block(i, t);
      if (p == nullptr) continue;
    }
    if (ns > out.sure_cap || nc > out.cand_cap) {
      src.finish(i + scan_block);
      return false;
    }
    for (std::size_t h = 0; h < scan_block; h += 8) {
      // In 16-byte pieces, as above.
      const __m256i k = _mm256_and_si256(
          _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + h + 4)),
                           _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + h))),
          mask);
      const auto above = static_cast<unsigned>(
          _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(k, tt))));
      const auto s = above & static_cast<unsigned>(
          _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(k, hh))));
      const unsigned c = above & ~s;
      const __m256i idx = _mm256_add_epi32(lanes, _mm256_set1_epi32(static_cast<std::int32_t>(i + h)));
      const __m256i ps = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(packs[s])));
      const __m256i pc = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(packs[c])));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(sure + ns), _mm256_permutevar8x32_epi32(idx, ps));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(cand + nc), _mm256_permutevar8x32_epi32(idx, pc));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(cand_keys + nc), _mm256_permutevar8x32_epi32(k, pc));
      ns += static_cast<std::size_t>(__builtin_popcount(s));
      nc += static_cast<std::size_t>(__builtin_popcount(c));
    }
  }
  out.n_sure = ns;
  out.n_cand = nc;
  return bracket_tail<float>(src, i, lo, hi, out);
}

#endif  // GRADCOMP_HOST_DISPATCH

// The pass in the clone `Isa` runs in (detail/host_dispatch.hpp): the split pass for float on
// AVX-512 and AVX2, bracket_pass otherwise. The lists are the same either way.
template <class T, host_isa Isa, class Source>
bool bracket_pass_on(isa_tag<Isa>, const Source& src, abs_key_t<T> lo, abs_key_t<T> hi,
                     bracket_lists<T>& out, bool dense) {
#if GRADCOMP_HOST_DISPATCH
  if constexpr (std::is_same_v<T, float> && Isa == host_isa::avx512) {
    return split_pass_avx512(src, lo, hi, out, dense);
  } else if constexpr (std::is_same_v<T, float> && Isa == host_isa::avx2) {
    return split_pass_avx2(src, lo, hi, out, dense);
  }
#endif
  (void)dense;
  return bracket_pass<T>(src, lo, hi, out);
}

}  // namespace gradcomp::detail
