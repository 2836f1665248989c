// gradcomp/exchange/cost_formulas.hpp: the seconds each exchange takes on a link_model (network
// and local work) and the prediction of every exchange with the cheapest.
// Part of the cost model (exchange/cost_model.hpp includes them all).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>

#include <gradcomp/detail/stream_store.hpp>
#include <gradcomp/exchange/link_model.hpp>

namespace gradcomp {

namespace cost {

// Local work of each exchange as gradcomp implements it, counted in the three kinds that
// link_model prices: elements streamed, pairs added or written at their index, pairs merged.
struct local_work {
  double elements = 0.0;
  double pairs = 0.0;
  double merged = 0.0;
  double merge_k = 0.0;  // the k of the merges
  // Pairs added into a region of the output that the caches hold (detail::rank_order_mean),
  // priced at the small vector's scatter cost whatever n.
  double cached_pairs = 0.0;
};

// {gamma, scatter} for local work on a dense vector of n elements: the small vector's costs up
// to small_elements, the large one's from large_elements, between them the line in log2 n.
inline std::array<double, 2> per_item(const link_model& l, std::size_t n) {
  if (l.large_elements == 0 || n <= l.small_elements) return {l.gamma, l.scatter};
  if (n >= l.large_elements) return {l.gamma_large, l.scatter_large};
  const double lo = static_cast<double>(std::max<std::size_t>(1, l.small_elements));
  const double at = std::log2(static_cast<double>(n) / lo) / std::log2(static_cast<double>(l.large_elements) / lo);
  return {l.gamma + at * (l.gamma_large - l.gamma), l.scatter + at * (l.scatter_large - l.scatter)};
}

// The local work's seconds when its dense vector has n elements.
inline double local_seconds(const local_work& w, const link_model& l, std::size_t n) {
  const auto c = per_item(l, n);
  return c[0] * w.elements + c[1] * w.pairs + l.scatter * w.cached_pairs +
         w.merged * (l.merge + l.merge_log * std::log2(w.merge_k + 1.0));
}

// Copy the k wire values in, the reduction's pass inside the allreduce, the output written
// (for a sparse summable payload: zeros, then a write at each index; the ranks agree on the
// count, so k is every rank's). Without a summable payload: decode into zeros (an add at each
// of the k indices), allreduce n values, scale. `reduction_timed`: the reduction's pass is
// part of a measured allreduce (link_model::dense_beta) and left out here.
inline local_work local_dense_allreduce(const exchange_shape& s, bool reduction_timed = false) {
  const double n = static_cast<double>(s.n);
  const double reduced = reduction_timed ? 0.0 : 1.0;
  if (!s.summed_bytes) return {(3.0 + reduced) * n, s.k, 0.0};
  if (s.k >= n) return {(2.0 + reduced) * n, 0.0, 0.0};
  return {n + (1.0 + reduced) * s.k, s.k, 0.0};
}
// The passes over an output of `elements` values that detail::rank_order_mean is priced at:
// one from detail::stream_min_bytes, where each region is built in a cached buffer and
// streamed out; two below it, where the regions are built in the output itself, whose zeroing
// first reads each line from memory (the emulated cluster's allgather at 1 Gbit/s, 2 hosts,
// n = 1M measured 1.58x the one-pass price, 1.08x this one).
inline double mean_passes(double elements, std::size_t value_bytes) {
  return elements * static_cast<double>(value_bytes) >=
                 static_cast<double>(detail::stream_min_bytes)
             ? 1.0
             : 2.0;
}
// sparse_allgather::combine: the P payloads decoded, their pairs added region by region in the
// cache, the output written (mean_passes).
inline local_work local_sparse_allgather(const exchange_shape& s) {
  const double n = static_cast<double>(s.n), pk = static_cast<double>(s.ranks) * s.k;
  return {.elements = mean_passes(n, s.value_bytes) * n + pk, .cached_pairs = pk};
}
// topk_a2a: the own payload decoded into pairs, about k pairs (k / P from each rank) added
// into the shard region by region in the cache, the shard written (mean_passes), the
// gathered mean copied to the output.
inline local_work local_topk_a2a(const exchange_shape& s) {
  const double n = static_cast<double>(s.n), shard = n / static_cast<double>(s.ranks);
  return {.elements = s.k + mean_passes(shard, s.value_bytes) * shard + n, .cached_pairs = s.k};
}
// gtopk, at the root (the longest path): the own payload decoded, ceil(log2 P) merges of two
// sets of up to k pairs, the output zeroed and the k global values written, the picks left
// out collected.
inline local_work local_gtopk(const exchange_shape& s) {
  const double k = static_cast<double>(s.k_max);
  const double rounds = s.ranks > 1 ? std::ceil(std::log2(static_cast<double>(s.ranks))) : 0.0;
  return {static_cast<double>(s.n) + 2.0 * k, k, rounds * 2.0 * k, k};
}

// The seconds per byte of one pair of ranks while the others wait: pair_beta where measured,
// else beta.
inline double pair_beta(const link_model& l) { return l.pair_beta > 0.0 ? l.pair_beta : l.beta; }

// The seconds saved on a message of `bytes`, priced at `priced_beta` per byte, that is the
// first its sender sends after idling: the share of it within the burst
// (link_model::burst_bytes) at the rate the burst was measured at (pair_beta()), never more
// than the message was priced at.
inline double burst_free(const link_model& l, double bytes, double priced_beta) {
  const double rate = std::min(pair_beta(l), priced_beta);
  return std::clamp(l.burst_bytes, 0.0, std::max(0.0, bytes)) * rate;
}

// The seconds per byte of an allreduce of dense values: dense_beta where measured, else beta.
inline double dense_beta(const link_model& l) { return l.dense_beta > 0.0 ? l.dense_beta : l.beta; }

// Ring allreduce of m bytes: 2 (P-1) alpha + 2 (P-1)/P m beta (dense_beta where measured).
inline double allreduce(double p, double m, const link_model& l) {
  if (p <= 1.0) return 0.0;
  return 2.0 * (p - 1.0) * l.alpha + 2.0 * (p - 1.0) / p * m * dense_beta(l);
}

// S-SGD: one allreduce of the summable wire values, or of the decoded dense vector. No burst:
// dense_beta comes from an allreduce timed as a whole (measure_link), and a gradient-sized
// allreduce makes the bucket's bytes a small share anyway.
inline double dense_allreduce(const exchange_shape& s, const link_model& l) {
  const double m = s.summed_bytes ? static_cast<double>(s.summed_bytes)
                                  : static_cast<double>(s.n * s.value_bytes);
  return allreduce(static_cast<double>(s.ranks), m, l);
}

// TopK-SGD: an allgather(v) of every rank's payload: log2 P alpha + (P-1) b beta - f, f the
// burst's seconds on the first payload a rank sends (burst_free).
inline double sparse_allgather(const exchange_shape& s, const link_model& l) {
  const double p = static_cast<double>(s.ranks);
  if (p <= 1.0) return 0.0;
  return std::ceil(std::log2(p)) * l.alpha + (p - 1.0) * s.payload_bytes * l.beta -
         burst_free(l, s.payload_bytes, l.beta);
}

// gTop-k: ceil(log2 P) rounds up the tree with k pairs of 8 bytes (and a status pair), then a
// binomial broadcast of k pairs (and a count pair): 2 ceil(log2 P) alpha +
// 2 ceil(log2 P) 8 (k + 1) beta (an alpha term of log P, as often quoted, counts the tree only),
// each byte at one pair's beta (pair_beta, where given; see link_model::pair_alpha). The burst
// (burst_free) counts ceil(log2 P) + 1 times: each round up the tree has a sender that has only
// received so far, and the broadcast's first round is the root's first send; its later rounds
// follow the root's first at once.
inline double gtopk(const exchange_shape& s, const link_model& l) {
  const double p = static_cast<double>(s.ranks);
  if (p <= 1.0) return 0.0;
  const double rounds = std::ceil(std::log2(p));
  const double beta = pair_beta(l);
  const double message = 8.0 * (static_cast<double>(s.k_max) + 1.0);
  return 2.0 * rounds * l.alpha + 2.0 * rounds * message * beta - (rounds + 1.0) * burst_free(l, message, beta);
}

// TopKA2A: header-free alltoallv of the pairs plus allgather of the shards:
// 3 (P-1) alpha + (8k + n v)(P-1)/P beta - f, v the bytes of a dense element (4 for float,
// which gives (2k + n)(P-1)/P 4 beta), f the burst's seconds on the pairs a rank sends first
// (burst_free).
inline double topk_a2a(const exchange_shape& s, const link_model& l) {
  const double p = static_cast<double>(s.ranks);
  if (p <= 1.0) return 0.0;
  const double pairs = 8.0 * s.k * (p - 1.0) / p;
  const double bytes = (8.0 * s.k + static_cast<double>(s.n * s.value_bytes)) * (p - 1.0) / p;
  return 3.0 * (p - 1.0) * l.alpha + bytes * l.beta - burst_free(l, pairs, l.beta);
}

}  // namespace cost

struct exchange_prediction {
  std::array<double, exchange_kinds> seconds{};  // by exchange_kind
  exchange_kind best = exchange_kind::dense_allreduce;
};

// The model's time of every exchange (network, plus the local work's terms) and the
// cheapest among `candidates` (a mask of
// exchange_bit()s; ties go to the earlier exchange_kind).
inline exchange_prediction predict(const exchange_shape& s, const link_model& l,
                                   unsigned candidates = all_exchanges) {
  if ((candidates & all_exchanges) == 0) {
    detail::throw_invalid_argument("predict", "candidates", candidates,
                                   "a non-empty mask of exchange_bit(exchange_kind)");
  }
  exchange_prediction p;
  const auto local = [&](const cost::local_work& w) { return cost::local_seconds(w, l, s.n); };
  p.seconds[0] = cost::dense_allreduce(s, l) + local(cost::local_dense_allreduce(s, l.dense_beta > 0.0));
  p.seconds[1] = cost::sparse_allgather(s, l) + local(cost::local_sparse_allgather(s));
  p.seconds[2] = cost::topk_a2a(s, l) + local(cost::local_topk_a2a(s));
  p.seconds[3] = cost::gtopk(s, l) + local(cost::local_gtopk(s));
  bool found = false;
  for (unsigned k = 0; k < exchange_kinds; ++k) {
    if (!(candidates & (1u << k))) continue;
    if (!found || p.seconds[k] < p.seconds[static_cast<unsigned>(p.best)]) {
      p.best = static_cast<exchange_kind>(k);
      found = true;
    }
  }
  return p;
}

}  // namespace gradcomp
