// gradcomp/context.hpp: what a policy is told per call (target count, seed, step, tensor id)
// and what it reports back (count, threshold, refinements). Shared by host and device code.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include <gradcomp/error.hpp>

namespace gradcomp {

// Identity of one call of a policy on one tensor. Random policies derive their stream from
// (seed, step, tensor_id) so that every rank draws the same numbers for the same tensor.
struct call_id {
  std::uint64_t seed = 0;
  std::uint64_t step = 0;
  std::uint32_t tensor_id = 0;
  // The calling rank. Quantizers mix it into their rounding stream, so that ranks round
  // independently and the rounding noise averages out over ranks (rank 0 keeps the stream of
  // (seed, step, tensor_id) alone); selectors ignore it, so every rank draws the same Random-k
  // indices and DGC sample positions. sparsified_sgd sets it to comm.rank().
  std::uint32_t rank = 0;
};

struct select_context {
  std::size_t k = 0;     // target count, 0 <= k <= n (see k_for_density)
  double density = 0.0;  // the density k was derived from, (0, 1]
  call_id id{};
};

// What a selector reports for one call.
struct selection_stats {
  std::size_t count = 0;    // coordinates selected
  double threshold = 0.0;   // |g| threshold used (the k-th largest |g| for exact top-k)
  unsigned iterations = 0;  // refinement rounds (Gaussian-k, DGC, RedSync) or radix passes
  bool fallback = false;    // exact top-k: the sampled bracket missed, radix select finished
  // ||v||^2 of the vector v selected from (e + g under error feedback), where the selector's
  // own pass computed it (Gaussian-k always, from its statistics; top-k when it adds e + g in
  // its pass); NaN where not measured. compressor<> turns it into the top-k contraction.
  double energy = std::numeric_limits<double>::quiet_NaN();
  // A selector's fused accumulation (select_accumulate_into) found a NaN or Inf in e + g, in
  // the pass it makes anyway; the selection is then not meaningful. select() never sets it.
  bool nonfinite = false;
};

// Validate a density and turn it into a target count: k = clamp(round(density * n), 1, n)
// for n > 0, and 0 for an empty tensor.
inline std::size_t k_for_density(std::size_t n, double density) {
  if (!(density > 0.0 && density <= 1.0)) {  // also rejects NaN
    detail::throw_invalid_argument("k_for_density", "density", density, "0 < density <= 1");
  }
  if (n == 0) return 0;
  const double k = std::round(density * static_cast<double>(n));
  if (k < 1.0) return 1;
  if (k >= static_cast<double>(n)) return n;
  return static_cast<std::size_t>(k);
}

// Validate an explicit k against n.
inline void check_k(std::string_view where, std::size_t k, std::size_t n) {
  if (k > n) {
    detail::throw_invalid_argument(where, "k", k, detail::concat("0 <= k <= n (n = ", n, ")"));
  }
}

// What to do when a gradient holds NaN or Inf.
enum class nonfinite_policy {
  error,      // throw nonfinite_error before any state changes (default)
  propagate,  // compress as given; NaN sorts above +Inf in |g| order and is sent
};

}  // namespace gradcomp
