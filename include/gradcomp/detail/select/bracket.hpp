// gradcomp/detail/select/bracket.hpp: the plan of exact top-k's sampled path, decided from n and
// k alone, which the host selector and the device kernels share.
#pragma once

#include <cstddef>

namespace gradcomp::detail {

// Where the bracket's upper end hi comes from. Keys above hi are sure to be selected.
enum class bracket_hi : unsigned char {
  largest_key,  // hi = the largest possible key: no sure elements
  lo,           // hi = lo: everything in the bracket is sure
  sample_rank,  // hi = the sample key at hi_pos
};

// What the bracketed path decides from n and k alone (topk::bracket_plan): the sample size,
// where lo and hi sit among the sample keys sorted largest first (0-based), and the candidate
// budget. The device topk (gradcomp/cuda/dispatch/topk.cuh) uses the same plan.
struct topk_bracket_plan {
  std::size_t s = 0;       // sample size, 1 <= s <= n / 16
  std::size_t lo_pos = 0;  // lo = sample key lo_pos; lo_pos == s: lo = 0 (everything)
  bracket_hi hi = bracket_hi::largest_key;
  std::size_t hi_pos = 0;  // bracket_hi::sample_rank: hi = sample key hi_pos (< lo_pos)
  std::size_t budget = 0;  // candidates before the pass gives up
};

}  // namespace gradcomp::detail
