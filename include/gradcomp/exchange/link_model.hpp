// gradcomp/exchange/link_model.hpp: a link as the cost model sees it (alpha seconds per message,
// beta seconds per byte, the local work priced per element streamed, per pair scattered and per
// pair merged), the exchanges it knows, and one tensor's exchange as it sees it.
// Part of the cost model (exchange/cost_model.hpp includes them all).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include <gradcomp/error.hpp>

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

}  // namespace gradcomp
