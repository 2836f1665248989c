// gradcomp/exchange/cost_model.hpp: the cost model of each exchange (alpha seconds per
// message, beta seconds per byte, and the local work priced per element streamed, per pair
// scattered and per pair merged), the choice of the cheapest, and measure_link(), which
// measures all of them on a communicator.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <gradcomp/concepts.hpp>
#include <gradcomp/detail/exchange_common.hpp>
#include <gradcomp/detail/stream_store.hpp>
#include <gradcomp/detail/timer.hpp>
#include <gradcomp/error.hpp>
#include <gradcomp/exchange/gtopk.hpp>

namespace gradcomp {

// alpha and beta describe the network. The textbook alpha-beta formulas leave out the local
// work, which dominates on fast links and shared memory: every exchange writes a dense output
// of n values and decodes, adds or merges what it receives. Its three kinds of work cost
// differently per item, so each has its own term; all zero is the pure alpha-beta model.
struct link_model {
  double alpha = 0.0;    // seconds per message (latency)
  double beta = 0.0;     // seconds per byte (1 / bandwidth)
  double gamma = 0.0;    // seconds per element streamed by local work (fill, copy, decode, scale)
  double scatter = 0.0;  // seconds per (index, value) pair added at its index into a dense
                         // vector: a random access each, a cache miss once n outgrows the cache
  // Seconds per pair going into one of gTop-k's merges of two sets of k pairs (merge by index,
  // select the top k, sort them by index): merge + merge_log * log2(k + 1), the sort's share
  // growing with k.
  double merge = 0.0;
  double merge_log = 0.0;
  // gamma and scatter above are the costs on a dense vector of small_elements or fewer, which
  // the caches hold; gamma_large and scatter_large on one of large_elements or more, which
  // streams from memory (on the emulated cluster, 1.0-3.3x per element streamed and 9-16x per
  // pair scattered, docs/cluster.md). Between the two sizes the costs are interpolated by
  // log2 n. large_elements = 0: gamma and scatter at every size.
  double gamma_large = 0.0;
  double scatter_large = 0.0;
  std::size_t small_elements = 0;
  std::size_t large_elements = 0;
  // alpha and beta are the link as the collectives use it, every rank sending at once;
  // pair_alpha and pair_beta as one pair of ranks sees it while the others wait (measure_link's
  // ping-pong). They differ where ranks share cores or a memory bus (the emulated cluster's
  // 4 hosts on 2 cores at 1 Gbit/s, in seven kept logs: 65-152 us and 13.9-20.5 ns/byte with
  // every rank sending, 16-32 us and 8.3-9.4 alone, docs/cluster.md). gTop-k's tree pays
  // pair_beta per byte, since at most half the ranks send in a round of it, but alpha per
  // message: up to P/2 messages are in flight in a round, and where ranks share cores each
  // costs more than a lone one (on that cluster gTop-k at n = 1M, density 0.001, measured
  // 1.07-2.01x a model with pair_alpha and 0.69-1.40x one with alpha, in five runs' logs).
  // The burst (burst_bytes) is freed at pair_beta, the rate it was measured at. No formula
  // reads pair_alpha: measure_link fits dense_beta with it. pair_beta 0: beta.
  double pair_alpha = 0.0;
  double pair_beta = 0.0;
  // Seconds per byte of the communicator's own allreduce of a dense vector of m bytes, as
  // 2 (P-1)/P m of it: the bytes it moves, the copies it makes and its reduction pass together
  // (measure_link times one). It prices dense_allreduce, whose allreduce is the communicator's
  // (MPI's or gradcomp's rank-order one, an alltoallv and an allgatherv of 1/P shares) and not
  // the ring the formula assumes. Found by trying: with 4 ranks on this machine's 2 cores the
  // dense allreduce was measured 2.0-2.1x a model priced by the ring shift's beta
  // (docs/exchanges.md). 0: beta, and the reduction's pass priced as local work.
  double dense_beta = 0.0;
  // Bytes a port sends at once after it has been idle, before its rate applies: what a token
  // bucket holds, as the emulated cluster's shaped ports have (docs/cluster.md; 3028 bytes at
  // 100 Mbit/s, 16 KiB at 1 Gbit/s). A switch port serializes every byte at its rate and has
  // none; measure_link times ping-pongs after an idle pause to find it, and whatever those
  // find on a link without a bucket (the caches, the timing's noise) is priced at pair_beta,
  // so it stays small in seconds. The model frees up to burst_bytes of the first message a
  // rank sends in an exchange (the allgather's payload, TopKA2A's pairs; in gTop-k, each
  // round's sender up the tree and the broadcast's first round: cost::burst_free), at
  // pair_beta. It assumes the port idled before the exchange, as it does after a step's
  // computation; several exchanges in a row (tensors one after another, auto_exchange on
  // each) each get it, where only the first would. merge_cost prices every byte.
  // 0: every byte at the rate.
  double burst_bytes = 0.0;

  // A link of `gbit_per_s` Gbit/s with `latency_s` seconds per message.
  static link_model from_gbit(double gbit_per_s, double latency_s) {
    if (!(gbit_per_s > 0.0) || !std::isfinite(gbit_per_s)) {
      detail::throw_invalid_argument("link_model::from_gbit", "gbit_per_s", gbit_per_s,
                                     "0 < gbit_per_s < inf");
    }
    if (!(latency_s >= 0.0) || !std::isfinite(latency_s)) {
      detail::throw_invalid_argument("link_model::from_gbit", "latency_s", latency_s,
                                     "0 <= latency_s < inf");
    }
    return {latency_s, 8.0 / (gbit_per_s * 1e9)};
  }
};

// link_model's real-valued fields by name, every field but the two vector sizes: what
// auto_exchange checks and median_link() takes the median of.
inline constexpr std::array<std::pair<std::string_view, double link_model::*>, 12> link_model_fields{{
    {"alpha", &link_model::alpha},
    {"beta", &link_model::beta},
    {"gamma", &link_model::gamma},
    {"scatter", &link_model::scatter},
    {"merge", &link_model::merge},
    {"merge_log", &link_model::merge_log},
    {"gamma_large", &link_model::gamma_large},
    {"scatter_large", &link_model::scatter_large},
    {"pair_alpha", &link_model::pair_alpha},
    {"pair_beta", &link_model::pair_beta},
    {"dense_beta", &link_model::dense_beta},
    {"burst_bytes", &link_model::burst_bytes},
}};
// Every real-valued field of link_model is in the list once: link_model is those doubles and
// the two vector sizes, and no member pointer repeats.
static_assert(sizeof(link_model) == link_model_fields.size() * sizeof(double) + 2 * sizeof(std::size_t));
static_assert([] {
  for (std::size_t i = 0; i < link_model_fields.size(); ++i) {
    for (std::size_t j = i + 1; j < link_model_fields.size(); ++j) {
      if (link_model_fields[i].second == link_model_fields[j].second) return false;
    }
  }
  return true;
}());

namespace detail {

// A time, a rate or a byte count of a link: refused unless finite and >= 0 (a NaN has no order
// to compare or take a median in, and makes every comparison of the model false).
inline void check_link_value(std::string_view who, std::string_view name, double v) {
  if (!(v >= 0.0 && std::isfinite(v))) throw_invalid_argument(who, name, v, "0 <= value < inf");
}

}  // namespace detail

// The exchanges the model knows, in the order ties are broken.
enum class exchange_kind : unsigned { dense_allreduce = 0, sparse_allgather = 1, topk_a2a = 2, gtopk = 3 };
inline constexpr std::size_t exchange_kinds = 4;

inline constexpr std::string_view exchange_kind_name(exchange_kind k) noexcept {
  switch (k) {
    case exchange_kind::dense_allreduce: return "dense_allreduce";
    case exchange_kind::sparse_allgather: return "sparse_allgather";
    case exchange_kind::topk_a2a: return "topk_a2a";
    case exchange_kind::gtopk: return "gtopk";
  }
  return "?";
}

// Bit masks for the candidates an automatic choice may take.
inline constexpr unsigned exchange_bit(exchange_kind k) noexcept { return 1u << static_cast<unsigned>(k); }
inline constexpr unsigned all_exchanges = 0xfu;

// One tensor's exchange as the model sees it.
struct exchange_shape {
  std::size_t ranks = 1;           // P
  std::size_t n = 0;               // dense elements
  std::size_t value_bytes = 4;     // bytes of one dense element (4 float, 8 double)
  double k = 0.0;                  // picks per rank, mean over ranks
  std::size_t k_max = 0;           // the largest count (gtopk's k)
  double payload_bytes = 0.0;      // one rank's wire payload, mean over ranks
  std::size_t summed_bytes = 0;    // bytes dense_allreduce adds on the wire (summable payload:
                                   // count * bits / 8), or 0: decode and allreduce n values
};

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

struct link_measure_options {
  std::size_t small_bytes = 8;
  std::size_t large_bytes = std::size_t{1} << 20;
  unsigned small_repeats = 30;
  unsigned large_repeats = 8;
  // Elements of the local-work passes on a vector the caches hold (gamma, scatter, and the
  // merges when local_large_elements is 0). 0: gamma, scatter and merge = 0, the pure
  // alpha-beta model.
  std::size_t local_elements = std::size_t{1} << 20;
  // Elements of the passes on a vector beyond the caches, like a large gradient (gamma_large
  // and scatter_large): 128 MB of floats per rank, every rank at once. 0: one size only
  // (large_elements = 0).
  std::size_t local_large_elements = std::size_t{1} << 25;
  unsigned local_repeats = 4;  // timed runs of the local-work passes (after one warm-up run)
  // The ring's message grows 4x from large_bytes up to ring_max_bytes while a step takes less
  // than ring_grow_below_s (see measure_link).
  std::size_t ring_max_bytes = std::size_t{16} << 20;
  double ring_grow_below_s = 4e-3;
  // The burst (link_model::burst_bytes), with point-to-point: ping-pongs of small_bytes and of
  // burst_max_bytes / 16, / 4 and / 1, each after rank 0 has idled for burst_pause_s (longer
  // where the measured beta takes longer to send 2 burst_max_bytes, so that a bucket of that
  // size refills), the least of burst_repeats. 0: not measured, burst_bytes = 0; else more
  // than small_bytes and at most ring_max_bytes.
  std::size_t burst_max_bytes = std::size_t{64} << 10;
  unsigned burst_repeats = 4;
  double burst_pause_s = 2e-3;
};

// What measure_link() measured on the way to its link_model.
struct link_probe {
  // The ping-pong between rank 0 and rank P-1 while the other ranks wait: one link alone.
  double pingpong_alpha = 0.0, pingpong_beta = 0.0;
  // Every rank sending to the next and receiving from the previous at once, as in the ring
  // and the exchanges' collectives: the link as the exchanges share it. A communicator
  // without point-to-point gets the allgather fit in both pairs.
  double ring_alpha = 0.0, ring_beta = 0.0;
  // The communicator's allreduce of a dense float vector (link_model::dense_beta), and the
  // bytes it was timed on.
  double allreduce_beta = 0.0;
  std::size_t allreduce_bytes = 0;
};

namespace detail {

// The least time of `repeats` runs of f on this rank, each started after a barrier, after an
// untimed warm-up run (noise only adds).
template <class Comm, class F>
double least_time_after_barrier(Comm& comm, unsigned repeats, F&& f) {
  double best = 0.0;
  for (unsigned i = 0; i <= repeats; ++i) {
    comm.barrier();
    stopwatch clock;
    f();
    const double t = clock.lap();
    if (i == 1 || (i > 1 && t < best)) best = t;
  }
  return best;
}

// The strides of measure_local_costs' two merges on a vector of `elements`, and the k of each:
// sets of 1024 and 16384 pairs (fewer on a vector too small for them). A merge's cost depends
// on k, not on the vector: sets of these sizes are priced the same inside any vector.
inline std::array<std::size_t, 2> merge_strides(std::size_t elements) {
  return {std::max<std::size_t>(1, elements / 1024), std::max<std::size_t>(1, elements / 16384)};
}
inline std::array<double, 2> merge_sizes(std::size_t elements) {
  const auto st = merge_strides(elements);
  return {static_cast<double>(std::max<std::size_t>(1, elements / st[0])),
          static_cast<double>(std::max<std::size_t>(1, elements / st[1]))};
}

// Seconds per item of the three kinds of local work on a vector of `elements`: gamma, scatter,
// and (when `merges`) the merge's cost per pair at the two sizes of merge_sizes() (merge_fit()
// turns them into merge and merge_log), else zeros there; the least of `repeats` runs after a
// warm-up, as exchange timings are taken. Every rank runs this at the same time
// (measure_link), so ranks that share a machine's memory bandwidth slow each other as they do
// in an exchange.
inline std::array<double, 4> measure_local_costs(std::size_t elements, unsigned repeats, bool merges = true) {
  if (elements == 0 || repeats == 0) return {0.0, 0.0, 0.0, 0.0};
  // Sorted distinct indices, one at a pseudo-random place in each stride-wide slot (as spread
  // as a selection's picks at density 1 / stride), and values of both signs.
  auto spread = [&](std::size_t stride, std::uint64_t seed) {
    std::vector<index_value> v(std::max<std::size_t>(1, elements / stride));
    for (std::size_t j = 0; j < v.size(); ++j) {
      const std::uint64_t h = ((j + 1) * 0x9e3779b97f4a7c15ull) ^ (seed << 32);
      const std::uint64_t mixed = (h ^ (h >> 29)) * 0xbf58476d1ce4e5b9ull;
      v[j] = index_value{static_cast<std::uint32_t>(std::min<std::size_t>(elements - 1, j * stride + (mixed >> 40) % stride)),
                         static_cast<float>(static_cast<std::int64_t>(mixed >> 40) - (1 << 23))};
    }
    return v;
  };
  std::vector<float> buf(elements);
  // Scattered adds at one pair per 64 elements: every pair a cache line of its own.
  const std::vector<index_value> scattered = spread(64, 1);
  // Merges of two sets of 1024 and of 16384 pairs, keeping as many: two sizes, for the two
  // terms of the merge's cost.
  const auto strides = merge_strides(elements);
  std::vector<index_value> a1, b1, a2, b2, merged;
  if (merges) {
    a1 = spread(strides[0], 2);
    b1 = spread(strides[0], 3);
    a2 = spread(strides[1], 4);
    b2 = spread(strides[1], 5);
  }
  double best[4] = {0.0, 0.0, 0.0, 0.0};
  for (unsigned rep = 0; rep <= repeats; ++rep) {
    stopwatch clock;
    std::fill(buf.begin(), buf.end(), 0.0f);
    for (float& x : buf) x = x * 0.5f + 1.0f;
    double t[4] = {0.0, 0.0, 0.0, 0.0};
    t[0] = clock.lap();
    for (const index_value& e : scattered) buf[e.index] += e.value;
    t[1] = clock.lap();
    if (merges) {
      // Each merge timed on sets already in the cache, as an exchange's just-received pairs
      // are (the passes above evicted them): the untimed first call brings them in.
      gtopk_merge(a1, b1, a1.size(), merged);
      clock.lap();
      gtopk_merge(a1, b1, a1.size(), merged);
      t[2] = clock.lap();
      gtopk_merge(a2, b2, a2.size(), merged);
      clock.lap();
      gtopk_merge(a2, b2, a2.size(), merged);
      t[3] = clock.lap();
    }
    for (int i = 0; i < 4; ++i) {
      // The first run warms the caches and faults the pages in.
      if (rep == 1 || (rep > 1 && t[i] < best[i])) best[i] = t[i];
    }
  }
  volatile float sink = buf[elements / 2] + (merged.empty() ? 0.0f : merged.front().value);  // keep the passes
  (void)sink;
  // Per merged pair at each size (merge_sizes(elements)); merge_fit() makes the two terms.
  return {best[0] / (2.0 * static_cast<double>(elements)),
          best[1] / static_cast<double>(scattered.size()),
          merges ? best[2] / (2.0 * static_cast<double>(a1.size())) : 0.0,
          merges ? best[3] / (2.0 * static_cast<double>(a2.size())) : 0.0};
}

// {merge, merge_log}: the line c = merge + merge_log log2(k + 1) through the per-pair costs c1
// at k1 and c2 at k2 (k1 < k2), both terms >= 0 (a slope below 0 is taken as 0, the constant
// then c1; equal sizes give c1 and 0).
inline std::array<double, 2> merge_fit(double c1, double k1, double c2, double k2) {
  const double l1 = std::log2(k1 + 1.0), l2 = std::log2(k2 + 1.0);
  const double per_log = l2 > l1 ? std::max(0.0, (c2 - c1) / (l2 - l1)) : 0.0;
  return {std::max(0.0, c1 - per_log * l1), per_log};
}

// What measure_link() refuses in its options, refused by `who` (measure_link, or auto_exchange
// before its first exchange), naming the options as `name`.
inline void check_measure_options(const char* who, std::string_view name, const link_measure_options& o) {
  if (o.large_bytes <= o.small_bytes || o.small_repeats == 0 || o.large_repeats == 0) {
    throw_invalid_argument(who, name,
                           concat(o.small_bytes, " / ", o.large_bytes, " bytes, ", o.small_repeats,
                                  " / ", o.large_repeats, " repeats"),
                           "small_bytes < large_bytes and repeats >= 1");
  }
  if (o.burst_max_bytes != 0 && (o.burst_max_bytes <= o.small_bytes || o.burst_max_bytes > o.ring_max_bytes)) {
    throw_invalid_argument(who, concat(name, ".burst_max_bytes"),
                           concat(o.burst_max_bytes, " (small_bytes ", o.small_bytes, ", ring_max_bytes ",
                                  o.ring_max_bytes, ")"),
                           "0, or small_bytes < burst_max_bytes <= ring_max_bytes");
  }
  if (o.burst_max_bytes != 0 && (o.burst_repeats == 0 || !(o.burst_pause_s >= 0.0) ||
                                 !(o.burst_pause_s <= 60.0))) {
    throw_invalid_argument(who, concat(name, ".burst_repeats, ", name, ".burst_pause_s"),
                           concat(o.burst_repeats, ", ", o.burst_pause_s, " s"),
                           "burst_repeats >= 1 and 0 <= burst_pause_s <= 60 (or burst_max_bytes = 0)");
  }
  if (o.local_large_elements != 0 && o.local_large_elements <= o.local_elements) {
    throw_invalid_argument(who, concat(name, ".local_large_elements"),
                           concat(o.local_large_elements, " (local_elements ", o.local_elements, ")"),
                           "0, or more than local_elements");
  }
}

}  // namespace detail

// Measures a link_model on comm; every rank must call it, and every rank gets the same values.
// With point-to-point (mpi_comm::sendrecv): a ping-pong between rank 0 and rank P-1 (on a
// multi-node job usually two nodes) and a ring shift in which every rank sends to the next at
// once; alpha is half the round trip of small_bytes (the ring's time per step when larger), beta
// the extra time per byte of large_bytes, the ring's when larger (ranks that share a machine
// share its memory bus and cores, and the exchanges' collectives send on every rank at once;
// the ring's message grows while a step is quick, see ring_max_bytes); pair_alpha and
// pair_beta are the ping-pong's, burst_bytes found by ping-pongs after an idle pause
// (link_measure_options::burst_max_bytes; 0 without point-to-point).
// Without point-to-point, allgathers of both sizes are timed and fitted to
// log2 P alpha + (P-1) b beta. The least time of the repeats counts for the ping-pong (noise
// only adds), the slowest rank's mean for the ring. gamma, scatter and merge are the local
// work's costs per item, the least of local_repeats runs on every rank at once
// (detail::measure_local_costs), the slowest rank's (merge and merge_log fitted to the slowest
// rank's times at two set sizes), on a vector of local_elements; gamma_large and scatter_large
// the same on one of local_large_elements. dense_beta is the communicator's allreduce of the
// ring's largest message (large_bytes without point-to-point) in floats, the slowest rank's
// least time. One rank gives alpha = beta = dense_beta = burst_bytes = 0. `probe`, when given, receives the
// ping-pong's, the ring's and the allreduce's values (zeros for one rank). Every rank must pass
// the same options: the ring's growth depends on them, and ranks that differ would wait for
// each other forever.
template <communicator Comm>
link_model measure_link(Comm& comm, const link_measure_options& o = {}, link_probe* probe = nullptr) {
  detail::check_measure_options("measure_link", "options", o);
  const int p = comm.size();
  comm.barrier();
  // The small vector's costs, then the large one's; every rank runs both at once, and the
  // slowest rank's costs count, the same on every rank.
  std::array<double, 8> local{};
  const auto small = detail::measure_local_costs(o.local_elements, o.local_repeats);
  std::copy(small.begin(), small.end(), local.begin());
  const bool measured = o.local_elements > 0 && o.local_repeats > 0;
  const bool two_sizes = measured && o.local_large_elements != 0;
  if (two_sizes) {
    comm.barrier();
    const auto large = detail::measure_local_costs(o.local_large_elements, o.local_repeats, false);
    std::copy(large.begin(), large.end(), local.begin() + 4);
  }
  comm.allreduce(std::span<double>(local), reduce_op::max);  // the same on every rank
  link_model model{0.0, 0.0, local[0], local[1]};
  if (measured) {
    const auto k = detail::merge_sizes(o.local_elements);
    const auto fit = detail::merge_fit(local[2], k[0], local[3], k[1]);
    model.merge = fit[0];
    model.merge_log = fit[1];
  }
  if (two_sizes) {
    model.gamma_large = local[4];
    model.scatter_large = local[5];
    model.small_elements = o.local_elements;
    model.large_elements = o.local_large_elements;
  }
  if (probe) *probe = link_probe{};
  if (p == 1) return model;
  const int r = comm.rank();
  std::vector<std::byte> out(o.large_bytes, std::byte{1}), in;
  double result[5] = {0.0, 0.0, 0.0, 0.0, 0.0};  // alpha, beta: ping-pong, then ring; burst
  std::size_t dense_bytes = o.large_bytes;   // the allreduce's message (the ring's largest)

  if constexpr (point_to_point<Comm, std::byte>) {
    const int peer = p - 1;
    // `bytes` from rank 0 to rank P-1 and back; the other ranks pass. Its seconds on this rank.
    auto ping_pong = [&](std::size_t bytes) {
      const std::span<const std::byte> msg(out.data(), bytes);
      detail::stopwatch clock;
      if (r == 0) {
        comm.sendrecv(msg, peer, in, -1);
        comm.sendrecv(std::span<const std::byte>(), -1, in, peer);
      } else if (r == peer) {
        comm.sendrecv(std::span<const std::byte>(), -1, in, 0);
        comm.sendrecv(msg, 0, in, -1);
      }
      return clock.lap();
    };
    auto round_trip = [&](std::size_t bytes, unsigned repeats) {
      double best = 0.0;
      for (unsigned i = 0; i <= repeats; ++i) {  // the first round warms up the connection
        const double t = ping_pong(bytes);
        if (i == 1 || (i > 1 && t < best)) best = t;
      }
      return best / 2.0;
    };
    auto ring_step = [&](std::size_t bytes, unsigned repeats) {
      const std::span<const std::byte> msg(out.data(), bytes);
      double total = 0.0;
      for (unsigned i = 0; i <= repeats; ++i) {
        comm.barrier();
        detail::stopwatch clock;
        comm.sendrecv(msg, (r + 1) % p, in, (r + p - 1) % p);
        const double t = clock.lap();
        if (i > 0) total += t;
      }
      return total / static_cast<double>(repeats);
    };
    comm.barrier();
    const double small = round_trip(o.small_bytes, o.small_repeats);
    const double large = round_trip(o.large_bytes, o.large_repeats);
    // The burst: one-way times of ping-pongs after rank 0 idled (rank P-1 idles meanwhile,
    // waiting), small_bytes first for the latency after idling. A message of m bytes takes
    // alpha + (m - b) beta when a bucket of b bytes sends its start at once: b = m - (t -
    // alpha) / beta, at most m; the largest over the sizes. Its error in seconds (b beta) is
    // the timing's, so a fast link's noisy b costs next to nothing.
    const double probe_beta = std::max(0.0, (large - small) / static_cast<double>(o.large_bytes - o.small_bytes));
    double burst = 0.0;
    if (o.burst_max_bytes != 0) {
      const double pause = std::max(o.burst_pause_s, 2.0 * static_cast<double>(o.burst_max_bytes) * probe_beta);
      if (out.size() < o.burst_max_bytes) out.resize(o.burst_max_bytes, std::byte{1});
      auto after_pause = [&](std::size_t bytes) {
        double best = 0.0;
        for (unsigned i = 0; i < o.burst_repeats; ++i) {
          if (r == 0) std::this_thread::sleep_for(std::chrono::duration<double>(pause));
          const double t = ping_pong(bytes);
          if (i == 0 || t < best) best = t;
        }
        return best / 2.0;
      };
      const double idle_alpha = after_pause(o.small_bytes) - static_cast<double>(o.small_bytes) * probe_beta;
      for (std::size_t m : {o.burst_max_bytes / 16, o.burst_max_bytes / 4, o.burst_max_bytes}) {
        if (m <= o.small_bytes) continue;
        const double t = after_pause(m);
        if (probe_beta > 0.0) {
          const double md = static_cast<double>(m);
          burst = std::max(burst, std::clamp(md - (t - idle_alpha) / probe_beta, 0.0, md));
        }
      }
    }
    double ring[2] = {ring_step(o.small_bytes, o.small_repeats),
                      ring_step(o.large_bytes, o.large_repeats)};
    comm.allreduce(std::span<double>(ring), reduce_op::max);  // the slowest rank sets the pace
    // On a fast link a large_bytes message may still sit in the caches (shared memory): the
    // ring grows it 4x at a time, up to ring_max_bytes, while a step takes under
    // ring_grow_below_s, so that beta is the cost of gradient-sized messages.
    std::size_t ring_bytes = o.large_bytes;
    while (ring[1] < o.ring_grow_below_s && ring_bytes <= o.ring_max_bytes / 4) {
      ring_bytes *= 4;
      if (out.size() < ring_bytes) out.resize(ring_bytes, std::byte{1});
      ring[1] = ring_step(ring_bytes, o.large_repeats);
      comm.allreduce(std::span<double>(ring).subspan(1), reduce_op::max);
    }
    dense_bytes = ring_bytes;
    if (r == 0) {
      result[4] = burst;
      result[1] = probe_beta;
      result[0] = std::max(0.0, small - static_cast<double>(o.small_bytes) * result[1]);
      result[3] = std::max(0.0, (ring[1] - ring[0]) / static_cast<double>(ring_bytes - o.small_bytes));
      result[2] = std::max(0.0, ring[0] - static_cast<double>(o.small_bytes) * result[3]);
    }
    comm.broadcast(std::span<double>(result), 0);
  } else {
    std::vector<std::size_t> counts;
    auto gather = [&](std::size_t bytes, unsigned repeats) {
      const std::span<const std::byte> msg(out.data(), bytes);
      return detail::least_time_after_barrier(comm, repeats, [&] { comm.allgatherv(msg, in, counts); });
    };
    double t[2] = {gather(o.small_bytes, o.small_repeats), gather(o.large_bytes, o.large_repeats)};
    comm.allreduce(std::span<double>(t), reduce_op::max);  // the slowest rank sets the pace
    const double rounds = std::max(1.0, std::ceil(std::log2(static_cast<double>(p))));
    const double per_byte = (t[1] - t[0]) / static_cast<double>(o.large_bytes - o.small_bytes);
    result[1] = result[3] = std::max(0.0, per_byte / static_cast<double>(p - 1));
    result[0] = result[2] =
        std::max(0.0, (t[0] - static_cast<double>((p - 1) * o.small_bytes) * result[1]) / rounds);
  }
  model.alpha = std::max(result[0], result[2]);
  model.beta = std::max(result[1], result[3]);
  model.pair_alpha = result[0];
  model.pair_beta = result[1];
  model.burst_bytes = result[4];
  // The communicator's own allreduce of dense_bytes of floats, as dense_allreduce runs it:
  // dense_beta fitted to 2 (P-1) pair_alpha + 2 (P-1)/P m dense_beta, the slowest rank's least
  // time of large_repeats runs after a warm-up (an exchange is timed so; noise only adds). The
  // ping-pong's alpha, a least time too: the ring's is a mean, which with ranks sharing cores
  // can reach milliseconds and would leave nothing of the time. Zeros, so that the repeated
  // sums stay finite.
  std::vector<float> dense(std::max<std::size_t>(1, dense_bytes / sizeof(float)), 0.0f);
  double reduce_time[1] = {detail::least_time_after_barrier(
      comm, o.large_repeats, [&] { comm.allreduce(std::span<float>(dense), reduce_op::sum); })};
  comm.allreduce(std::span<double>(reduce_time), reduce_op::max);  // the slowest rank's pace
  const double pd = static_cast<double>(p);
  const double reduced = 2.0 * (pd - 1.0) / pd * static_cast<double>(dense.size() * sizeof(float));
  model.dense_beta = std::max(0.0, (reduce_time[0] - 2.0 * (pd - 1.0) * model.pair_alpha) / reduced);
  if (probe) {
    *probe = link_probe{result[0], result[1], result[2], result[3], model.dense_beta,
                        dense.size() * sizeof(float)};
  }
  return model;
}

namespace detail {

// The ((N + 1) / 2)-th smallest of N runs' values of one field (for an even N the lower of the
// two middle ones): always a value one run measured.
template <class T, class V>
V lower_median(std::span<const T> runs, V T::*field) {
  std::vector<V> v;
  v.reserve(runs.size());
  for (const T& r : runs) v.push_back(r.*field);
  const auto mid = v.begin() + static_cast<std::ptrdiff_t>((v.size() - 1) / 2);
  std::nth_element(v.begin(), mid, v.end());
  return *mid;
}

// Refuses an empty list and a value that is not finite and >= 0, naming runs[i].field.
template <class T, class Fields>
void check_runs(std::string_view who, std::span<const T> runs, const Fields& fields) {
  if (runs.empty()) throw_invalid_argument(who, "runs", "an empty list", "at least 1 calibration");
  for (std::size_t i = 0; i < runs.size(); ++i) {
    for (const auto& [name, field] : fields) {
      check_link_value(who, concat("runs[", i, "].", name), static_cast<double>(runs[i].*field));
    }
  }
}

}  // namespace detail

// Several calibrations of one link as one: every field the lower median of its values over the
// runs (the ((N + 1) / 2)-th smallest; for three runs the middle one). A phase in which the
// machine runs slow can move one calibration's costs by 2x (ranks sharing cores; the ring's
// alpha is a mean): the median of three ignores one such run where a least time over them would
// keep the luckiest value of each field. The fields are taken apart, so the result need not be
// any one run, and its alpha need not be max(pair_alpha, the ring's) of the medians. Every run
// must have measured its local costs on the same vector sizes (small_elements,
// large_elements); a value that is not finite and >= 0 is refused, naming runs[i].<field>.
inline link_model median_link(std::span<const link_model> runs) {
  detail::check_runs("median_link", runs, link_model_fields);
  for (std::size_t i = 1; i < runs.size(); ++i) {
    if (runs[i].small_elements != runs[0].small_elements || runs[i].large_elements != runs[0].large_elements) {
      detail::throw_invalid_argument(
          "median_link", detail::concat("runs[", i, "].small_elements, large_elements"),
          detail::concat(runs[i].small_elements, ", ", runs[i].large_elements),
          detail::concat("those of runs[0]: ", runs[0].small_elements, ", ", runs[0].large_elements));
    }
  }
  link_model m = runs[0];
  for (const auto& [name, field] : link_model_fields) m.*field = detail::lower_median(runs, field);
  return m;
}

// The same for what the calibrations measured on the way (link_probe), field by field,
// allreduce_bytes included: measure_link grows the allreduce's message by its timing, so the
// median allreduce_bytes may come from another run than the median allreduce_beta.
inline link_probe median_probe(std::span<const link_probe> runs) {
  static constexpr std::array<std::pair<std::string_view, double link_probe::*>, 5> fields{{
      {"pingpong_alpha", &link_probe::pingpong_alpha},
      {"pingpong_beta", &link_probe::pingpong_beta},
      {"ring_alpha", &link_probe::ring_alpha},
      {"ring_beta", &link_probe::ring_beta},
      {"allreduce_beta", &link_probe::allreduce_beta},
  }};
  detail::check_runs("median_probe", runs, fields);
  link_probe m;
  for (const auto& [name, field] : fields) m.*field = detail::lower_median(runs, field);
  m.allreduce_bytes = detail::lower_median(runs, &link_probe::allreduce_bytes);
  return m;
}

}  // namespace gradcomp
