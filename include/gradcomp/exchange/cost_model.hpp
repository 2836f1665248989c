// gradcomp/exchange/cost_model.hpp: the alpha-beta cost model of each exchange (alpha
// seconds per message, beta seconds per byte), the choice of the cheapest,
// and measure_link(), a short ping-pong that measures alpha and beta on a communicator.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include <gradcomp/concepts.hpp>
#include <gradcomp/detail/exchange_common.hpp>
#include <gradcomp/detail/timer.hpp>
#include <gradcomp/error.hpp>

namespace gradcomp {

// alpha and beta describe the network. gamma, which the textbook alpha-beta formulas leave out, is the
// local work: every exchange writes a dense output of n values and decodes or folds what it
// receives, which dominates on fast links and shared memory. gamma = 0 is the pure alpha-beta
// model.
struct link_model {
  double alpha = 0.0;  // seconds per message (latency)
  double beta = 0.0;   // seconds per byte (1 / bandwidth)
  double gamma = 0.0;  // seconds per element touched by local work (fill, decode, add, scale)

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

// Local work, in elements touched, of each exchange as gradcomp implements it (the output is
// filled, contributions are decoded and added, the sum scaled): rough counts, good to a small
// factor, that make the model rank exchanges sensibly where the network is not the bottleneck.
inline double local_dense_allreduce(const exchange_shape& s) {
  const double n = static_cast<double>(s.n);
  if (!s.summed_bytes) return 4.0 * n;  // decode into zeros, fold, scale
  const double c = static_cast<double>(s.summed_bytes) / static_cast<double>(s.value_bytes);
  return n + 3.0 * c;  // fill the output, copy in, fold, write out
}
inline double local_sparse_allgather(const exchange_shape& s) {
  return 2.0 * static_cast<double>(s.n) + 2.0 * static_cast<double>(s.ranks) * s.k;
}
inline double local_topk_a2a(const exchange_shape& s) {
  const double n = static_cast<double>(s.n), p = static_cast<double>(s.ranks);
  return n + 2.0 * n / p + 3.0 * s.k;
}
inline double local_gtopk(const exchange_shape& s) {
  // Each round's merge: a pass over the union, a selection, a sort of k by index.
  const double k = static_cast<double>(s.k_max);
  const double rounds = std::ceil(std::log2(static_cast<double>(s.ranks)));
  return static_cast<double>(s.n) + 2.0 * k + rounds * k * (4.0 + std::log2(k + 1.0));
}

// Ring allreduce of m bytes: 2 (P-1) alpha + 2 (P-1)/P m beta.
inline double allreduce(double p, double m, const link_model& l) {
  if (p <= 1.0) return 0.0;
  return 2.0 * (p - 1.0) * l.alpha + 2.0 * (p - 1.0) / p * m * l.beta;
}

// S-SGD: one allreduce of the summable wire values, or of the decoded dense vector.
inline double dense_allreduce(const exchange_shape& s, const link_model& l) {
  const double m = s.summed_bytes ? static_cast<double>(s.summed_bytes)
                                  : static_cast<double>(s.n * s.value_bytes);
  return allreduce(static_cast<double>(s.ranks), m, l);
}

// TopK-SGD: an allgather(v) of every rank's payload: log2 P alpha + (P-1) b beta.
inline double sparse_allgather(const exchange_shape& s, const link_model& l) {
  const double p = static_cast<double>(s.ranks);
  if (p <= 1.0) return 0.0;
  return std::ceil(std::log2(p)) * l.alpha + (p - 1.0) * s.payload_bytes * l.beta;
}

// gTop-k: ceil(log2 P) rounds up the tree with k pairs of 8 bytes (and a status pair), then a
// binomial broadcast of k pairs (and a count pair): 2 ceil(log2 P) alpha +
// 2 ceil(log2 P) 8 (k + 1) beta (an alpha term of log P, as often quoted, counts the tree only).
inline double gtopk(const exchange_shape& s, const link_model& l) {
  const double p = static_cast<double>(s.ranks);
  if (p <= 1.0) return 0.0;
  const double rounds = std::ceil(std::log2(p));
  return 2.0 * rounds * l.alpha +
         2.0 * rounds * 8.0 * (static_cast<double>(s.k_max) + 1.0) * l.beta;
}

// TopKA2A: header-free alltoallv of the pairs plus allgather of the shards:
// 3 (P-1) alpha + (8k + n v)(P-1)/P beta, v the bytes of a dense element (4 for float, which gives
// (2k + n)(P-1)/P 4 beta).
inline double topk_a2a(const exchange_shape& s, const link_model& l) {
  const double p = static_cast<double>(s.ranks);
  if (p <= 1.0) return 0.0;
  const double bytes = 8.0 * s.k + static_cast<double>(s.n * s.value_bytes);
  return 3.0 * (p - 1.0) * l.alpha + bytes * (p - 1.0) / p * l.beta;
}

}  // namespace cost

struct exchange_prediction {
  std::array<double, exchange_kinds> seconds{};  // by exchange_kind
  exchange_kind best = exchange_kind::dense_allreduce;
};

// The model's time of every exchange (network, plus gamma times the local work) and the
// cheapest among `candidates` (a mask of
// exchange_bit()s; ties go to the earlier exchange_kind).
inline exchange_prediction predict(const exchange_shape& s, const link_model& l,
                                   unsigned candidates = all_exchanges) {
  if ((candidates & all_exchanges) == 0) {
    detail::throw_invalid_argument("predict", "candidates", candidates,
                                   "a non-empty mask of exchange_bit(exchange_kind)");
  }
  exchange_prediction p;
  p.seconds[0] = cost::dense_allreduce(s, l) + l.gamma * cost::local_dense_allreduce(s);
  p.seconds[1] = cost::sparse_allgather(s, l) + l.gamma * cost::local_sparse_allgather(s);
  p.seconds[2] = cost::topk_a2a(s, l) + l.gamma * cost::local_topk_a2a(s);
  p.seconds[3] = cost::gtopk(s, l) + l.gamma * cost::local_gtopk(s);
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
  // Elements of the local-work pass; larger than the caches, like a gradient. 0: gamma = 0, the
  // pure alpha-beta model.
  std::size_t local_elements = std::size_t{1} << 22;
};

namespace detail {

// Seconds per element of a pass that writes and scales a buffer of floats, as the exchanges'
// output handling does; the least of a few runs.
inline double measure_local_work(std::size_t elements) {
  if (elements == 0) return 0.0;
  std::vector<float> buf(elements);
  double best = 0.0;
  for (int rep = 0; rep < 4; ++rep) {
    stopwatch clock;
    std::fill(buf.begin(), buf.end(), 0.0f);
    for (float& x : buf) x = x * 0.5f + 1.0f;
    const double t = clock.lap();
    volatile float sink = buf[elements / 2];  // keep the passes
    (void)sink;
    if (rep == 1 || (rep > 1 && t < best)) best = t;
  }
  return best / (2.0 * static_cast<double>(elements));
}

}  // namespace detail

// Measures alpha and beta on comm; every rank must call it, and every rank gets the same
// values. With point-to-point (mpi_comm::sendrecv) it is a ping-pong between rank 0 and rank
// P-1 (on a multi-node job usually two nodes): alpha is half the round trip of small_bytes,
// beta the extra half round trip per byte of large_bytes. Without it, allgathers of both sizes
// are timed and fitted to log2 P alpha + (P-1) b beta. The least time of the repeats counts
// (noise only adds). gamma is the least time per element of a fill-and-scale pass over
// local_elements floats, the slowest rank's. One rank gives alpha = beta = 0.
template <communicator Comm>
link_model measure_link(Comm& comm, const link_measure_options& o = {}) {
  if (o.large_bytes <= o.small_bytes || o.small_repeats == 0 || o.large_repeats == 0) {
    detail::throw_invalid_argument("measure_link", "options",
                                   detail::concat(o.small_bytes, " / ", o.large_bytes, " bytes"),
                                   "small_bytes < large_bytes and repeats >= 1");
  }
  const int p = comm.size();
  double gamma[] = {detail::measure_local_work(o.local_elements)};
  comm.allreduce(std::span<double>(gamma), reduce_op::max);  // the same on every rank
  if (p == 1) return {0.0, 0.0, gamma[0]};
  const int r = comm.rank();
  std::vector<std::byte> out(o.large_bytes, std::byte{1}), in;
  double result[2] = {0.0, 0.0};  // alpha, beta

  if constexpr (point_to_point<Comm, std::byte>) {
    const int peer = p - 1;
    auto round_trip = [&](std::size_t bytes, unsigned repeats) {
      const std::span<const std::byte> msg(out.data(), bytes);
      double best = 0.0;
      for (unsigned i = 0; i <= repeats; ++i) {  // the first round warms up the connection
        detail::stopwatch clock;
        if (r == 0) {
          comm.sendrecv(msg, peer, in, -1);
          comm.sendrecv(std::span<const std::byte>(), -1, in, peer);
        } else if (r == peer) {
          comm.sendrecv(std::span<const std::byte>(), -1, in, 0);
          comm.sendrecv(msg, 0, in, -1);
        }
        const double t = clock.lap();
        if (i == 1 || (i > 1 && t < best)) best = t;
      }
      return best / 2.0;
    };
    comm.barrier();
    const double small = round_trip(o.small_bytes, o.small_repeats);
    const double large = round_trip(o.large_bytes, o.large_repeats);
    if (r == 0) {
      result[1] = std::max(0.0, (large - small) / static_cast<double>(o.large_bytes - o.small_bytes));
      result[0] = std::max(0.0, small - static_cast<double>(o.small_bytes) * result[1]);
    }
    comm.broadcast(std::span<double>(result), 0);
  } else {
    std::vector<std::size_t> counts;
    auto gather = [&](std::size_t bytes, unsigned repeats) {
      const std::span<const std::byte> msg(out.data(), bytes);
      double best = 0.0;
      for (unsigned i = 0; i <= repeats; ++i) {
        comm.barrier();
        detail::stopwatch clock;
        comm.allgatherv(msg, in, counts);
        const double t = clock.lap();
        if (i == 1 || (i > 1 && t < best)) best = t;
      }
      return best;
    };
    double t[2] = {gather(o.small_bytes, o.small_repeats), gather(o.large_bytes, o.large_repeats)};
    comm.allreduce(std::span<double>(t), reduce_op::max);  // the slowest rank sets the pace
    const double rounds = std::max(1.0, std::ceil(std::log2(static_cast<double>(p))));
    const double per_byte = (t[1] - t[0]) / static_cast<double>(o.large_bytes - o.small_bytes);
    result[1] = std::max(0.0, per_byte / static_cast<double>(p - 1));
    result[0] = std::max(0.0, (t[0] - static_cast<double>((p - 1) * o.small_bytes) * result[1]) / rounds);
  }
  return {result[0], result[1], gamma[0]};
}

}  // namespace gradcomp
