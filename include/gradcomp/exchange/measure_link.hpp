// gradcomp/exchange/measure_link.hpp: measure_link(), which measures a link_model on a
// communicator (ping-pongs or allgathers of two sizes, and the local work's three kinds timed on
// this machine).
// Part of the cost model (exchange/cost_model.hpp includes them all).
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
#include <gradcomp/exchange/cost_formulas.hpp>
#include <gradcomp/exchange/link_model.hpp>

namespace gradcomp {

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
      return detail::least_time_after_barrier(comm, repeats, [&] {
        detail::allgatherv_within(comm, msg, in, counts, receive_limit{bytes}, "measure_link");
      });
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

}  // namespace gradcomp
