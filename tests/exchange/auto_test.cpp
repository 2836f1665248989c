// auto_exchange and the cost model: the formulas of exchange/cost_model.hpp, the choice of the
// cheapest candidate, that each choice gives the result of the exchange it names (bit for bit),
// that the link measurement agrees on every rank, and the statistics sparsified_sgd reports.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <gradcomp/comm/in_process.hpp>
#include <gradcomp/exchange.hpp>
#include <gradcomp/feedback.hpp>
#include <gradcomp/quantize.hpp>
#include <gradcomp/select.hpp>
#include <gradcomp/step.hpp>

#include "../support/exchange_reference.hpp"

namespace {

using namespace gradcomp;

// Runs auto_exchange with a fixed link (no measurement) on `ranks` ranks; returns rank
// outputs, stats and the choice of rank 0.
template <class C>
struct auto_run {
  std::vector<std::vector<typename C::value_type>> out;
  std::vector<exchange_stats> stats;
  std::vector<exchange_kind> choice;
};

template <class C>
auto_run<C> run_auto(const C& proto, int ranks, std::size_t n, double density, auto_options o) {
  using T = typename C::value_type;
  const auto ps = gradcomp_test::payloads_for(proto, ranks, n, density);
  auto_run<C> res;
  res.out.resize(static_cast<std::size_t>(ranks));
  res.stats.resize(static_cast<std::size_t>(ranks));
  res.choice.resize(static_cast<std::size_t>(ranks));
  run_in_process(ranks, [&](in_process_comm& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    auto_exchange x(o);
    const C c = proto;  // a compressor belongs to one rank: it keeps decoding scratch
    std::vector<T> out(n, T(3));
    unused_picks unused;
    res.stats[r] = x.exchange(comm, c, ps[r], std::span<T>(out), unused);
    res.choice[r] = x.last_choice();
    res.out[r] = std::move(out);
  });
  return res;
}


// Seconds equal to 1e-9 relative (1e-18 s absolute). doctest::Approx alone has an absolute
// tolerance of about 1e-5, which would pass most of the model's times whatever they were.
doctest::Approx same_seconds(double x) { return doctest::Approx(x).epsilon(1e-9).scale(1e-9); }
}  // namespace

TEST_CASE("cost formulas of exchange/cost_model.hpp") {
  const link_model l{1e-5, 1e-9};
  exchange_shape s;
  s.ranks = 4;
  s.n = 1000000;
  s.value_bytes = 4;
  s.k = 1000;
  s.k_max = 1200;
  s.payload_bytes = 8040;
  // 2(P-1) alpha + 2(P-1)/P m beta
  CHECK(cost::dense_allreduce(s, l) == same_seconds(6e-5 + 1.5 * 4e6 * 1e-9));
  s.summed_bytes = 2000;
  CHECK(cost::dense_allreduce(s, l) == same_seconds(6e-5 + 1.5 * 2000 * 1e-9));
  s.summed_bytes = 0;
  // log2 P alpha + (P-1) b beta
  CHECK(cost::sparse_allgather(s, l) == same_seconds(2e-5 + 3 * 8040 * 1e-9));
  // 2 ceil(log2 P) alpha + 2 ceil(log2 P) 8 (k + 1) beta
  CHECK(cost::gtopk(s, l) == same_seconds(4e-5 + 4 * 8 * 1201 * 1e-9));
  // 3(P-1) alpha + (8k + 4n)(P-1)/P beta
  CHECK(cost::topk_a2a(s, l) == same_seconds(9e-5 + (8000 + 4e6) * 0.75 * 1e-9));
  s.ranks = 1;
  CHECK(cost::dense_allreduce(s, l) == 0.0);
  CHECK(cost::gtopk(s, l) == 0.0);
  CHECK(link_model::from_gbit(10, 2e-6).beta == same_seconds(0.8e-9));
  CHECK_THROWS_AS(link_model::from_gbit(0, 1e-6), invalid_argument);
  CHECK_THROWS_AS(link_model::from_gbit(std::numeric_limits<double>::infinity(), 1e-6),
                  invalid_argument);
  CHECK_THROWS_AS(link_model::from_gbit(10, -1e-6), invalid_argument);
  CHECK_THROWS_AS(link_model::from_gbit(10, std::nan("")), invalid_argument);
}

TEST_CASE("cost formulas: gTop-k's bytes at one pair's beta, everything else on the shared link") {
  exchange_shape s{.n = 1000000, .k = 1000, .k_max = 1000, .payload_bytes = 8040};
  const link_model shared{1e-5, 1e-9};
  for (std::size_t ranks : {std::size_t{2}, std::size_t{3}, std::size_t{4}, std::size_t{64}}) {
    CAPTURE(ranks);
    s.ranks = ranks;
    link_model both = shared;
    both.pair_alpha = 2e-6;
    both.pair_beta = 4e-10;
    link_model one = link_model{1e-5, 4e-10};
    // gTop-k's bytes at the pair's beta, its messages at the shared alpha: as on a link that
    // has only those.
    CHECK(cost::gtopk(s, both) == same_seconds(cost::gtopk(s, one)));
    CHECK(cost::gtopk(s, both) < cost::gtopk(s, shared));
    // The collectives keep alpha and beta.
    CHECK(cost::dense_allreduce(s, both) == cost::dense_allreduce(s, shared));
    CHECK(cost::sparse_allgather(s, both) == cost::sparse_allgather(s, shared));
    CHECK(cost::topk_a2a(s, both) == cost::topk_a2a(s, shared));
    // 0 stands for alpha and beta, each on its own.
    link_model alpha_only = shared;
    alpha_only.pair_alpha = 2e-6;
    link_model beta_only = shared;
    beta_only.pair_beta = 4e-10;
    const double rounds = std::ceil(std::log2(static_cast<double>(ranks)));
    CHECK(cost::gtopk(s, alpha_only) == cost::gtopk(s, shared));  // pair_alpha is not used
    CHECK(cost::gtopk(s, shared) - cost::gtopk(s, beta_only) ==
          same_seconds(2.0 * rounds * 8.0 * 1001.0 * 6e-10));
    // predict uses the same terms.
    CHECK(predict(s, both).seconds[static_cast<unsigned>(exchange_kind::gtopk)] ==
          same_seconds(cost::gtopk(s, both) + cost::local_seconds(cost::local_gtopk(s), both, s.n)));
  }
}

TEST_CASE("cost formulas: the dense allreduce at the measured allreduce's beta, nothing else") {
  exchange_shape s{.ranks = 4, .n = 1000000, .k = 1000, .k_max = 1000, .payload_bytes = 8040};
  const link_model ring{1e-5, 1e-9, 2e-10};  // gamma: the local work priced too
  link_model measured = ring;
  measured.dense_beta = 3e-9;
  // 2 (P-1) alpha + 2 (P-1)/P m dense_beta, for the dense vector and for a summable payload.
  CHECK(cost::dense_allreduce(s, measured) == same_seconds(6e-5 + 1.5 * 4e6 * 3e-9));
  s.summed_bytes = 2000;
  CHECK(cost::dense_allreduce(s, measured) == same_seconds(6e-5 + 1.5 * 2000 * 3e-9));
  s.summed_bytes = 0;
  // The other exchanges keep beta.
  CHECK(cost::sparse_allgather(s, measured) == cost::sparse_allgather(s, ring));
  CHECK(cost::topk_a2a(s, measured) == cost::topk_a2a(s, ring));
  CHECK(cost::gtopk(s, measured) == cost::gtopk(s, ring));
  // The reduction's pass is inside the measured allreduce: one pass of n fewer in the local
  // work, for the dense vector, a summable sparse payload (k) and a decoded one.
  for (std::size_t summed : {std::size_t{0}, std::size_t{4000000}, std::size_t{4000}}) {
    CAPTURE(summed);
    s.summed_bytes = summed;
    s.k = summed == 4000 ? 1000.0 : 1000000.0;
    const auto untimed = cost::local_dense_allreduce(s, false);
    const auto timed = cost::local_dense_allreduce(s, true);
    CHECK(untimed.elements - timed.elements == doctest::Approx(summed == 4000 ? s.k : 1e6));
    CHECK(untimed.pairs == timed.pairs);
    const auto dense = static_cast<unsigned>(exchange_kind::dense_allreduce);
    CHECK(predict(s, measured).seconds[dense] ==
          same_seconds(cost::dense_allreduce(s, measured) + cost::local_seconds(timed, measured, s.n)));
    CHECK(predict(s, ring).seconds[dense] ==
          same_seconds(cost::dense_allreduce(s, ring) + cost::local_seconds(untimed, ring, s.n)));
  }
}

TEST_CASE("predict picks the cheapest candidate; TopKA2A beats allgather when rho > 1/(2(P-1))") {
  const link_model l{0.0, 1e-9};  // bandwidth only, as in the crossover rule
  exchange_shape s;
  s.ranks = 16;
  s.n = 1 << 20;
  s.value_bytes = 4;
  for (double rho : {0.01, 0.1}) {
    s.k = rho * static_cast<double>(s.n);
    s.k_max = static_cast<std::size_t>(s.k);
    s.payload_bytes = 8.0 * s.k;
    const auto p = predict(s, l, exchange_bit(exchange_kind::sparse_allgather) |
                                     exchange_bit(exchange_kind::topk_a2a));
    CAPTURE(rho);
    CHECK(p.best == (rho > 1.0 / (2.0 * 15.0) ? exchange_kind::topk_a2a : exchange_kind::sparse_allgather));
  }
  s.k = 100;
  s.k_max = 100;
  s.payload_bytes = 840;
  const auto all = predict(s, link_model{1e-4, 1e-9});
  for (unsigned k = 0; k < exchange_kinds; ++k) CHECK(all.seconds[static_cast<unsigned>(all.best)] <= all.seconds[k]);
  CHECK(predict(s, l, exchange_bit(exchange_kind::gtopk)).best == exchange_kind::gtopk);
  CHECK_THROWS_AS(predict(s, l, 0), invalid_argument);
}

TEST_CASE("predict: each local-work term prices its own kind of work") {
  exchange_shape s;
  s.ranks = 8;
  s.n = 1 << 20;
  s.k = 1000;
  s.k_max = 1000;
  s.payload_bytes = 8040;
  const auto at = [](const exchange_prediction& p, exchange_kind k) {
    return p.seconds[static_cast<unsigned>(k)];
  };
  const double n = static_cast<double>(s.n);
  // Only the pairs added at their index: allgather P k, TopKA2A about k, gTop-k the k writes,
  // dense (not summable here) the k adds of decoding into zeros.
  const auto pairs = predict(s, link_model{0.0, 0.0, 0.0, 1.0});
  CHECK(at(pairs, exchange_kind::sparse_allgather) == doctest::Approx(8.0 * 1000));
  CHECK(at(pairs, exchange_kind::topk_a2a) == doctest::Approx(1000));
  CHECK(at(pairs, exchange_kind::gtopk) == doctest::Approx(1000));
  CHECK(at(pairs, exchange_kind::dense_allreduce) == doctest::Approx(1000));
  // A summable payload: its k wire values written at their indices; a dense one none.
  exchange_shape summed = s;
  summed.summed_bytes = 2 * 1000;  // fp16 values: 2 bytes each, still k = 1000 writes
  CHECK(at(predict(summed, link_model{0.0, 0.0, 0.0, 1.0}), exchange_kind::dense_allreduce) ==
        doctest::Approx(1000));
  summed.k = static_cast<double>(summed.n);
  summed.summed_bytes = 2 * summed.n;
  CHECK(at(predict(summed, link_model{0.0, 0.0, 0.0, 1.0}), exchange_kind::dense_allreduce) == 0.0);
  // Only the merges: gTop-k alone, 3 rounds of 2k pairs, merge + merge_log log2(k + 1) each.
  const auto merges = predict(s, link_model{0.0, 0.0, 0.0, 0.0, 2.0, 0.5});
  CHECK(at(merges, exchange_kind::gtopk) ==
        doctest::Approx(3.0 * 2000.0 * (2.0 + 0.5 * std::log2(1001.0))));
  for (auto k : {exchange_kind::dense_allreduce, exchange_kind::sparse_allgather, exchange_kind::topk_a2a}) {
    CHECK(at(merges, k) == 0.0);
  }
  // Only streamed elements: every exchange writes its n outputs at least once.
  const auto stream = predict(s, link_model{0.0, 0.0, 1.0});
  for (unsigned k = 0; k < exchange_kinds; ++k) CHECK(stream.seconds[k] >= n);
  // The allgather's output and TopKA2A's shard: zeroed and divided in place below
  // detail::stream_min_bytes, two passes; one streamed pass from it.
  CHECK(at(stream, exchange_kind::sparse_allgather) == doctest::Approx(2.0 * n + 8000.0));
  CHECK(at(stream, exchange_kind::topk_a2a) == doctest::Approx(1000.0 + 2.0 * n / 8.0 + n));
  exchange_shape big = s;
  big.n = std::size_t{1} << 23;  // 32 MiB of floats; its shards of 4 MiB stay below
  const double nb = static_cast<double>(big.n);
  const auto streamed = predict(big, link_model{0.0, 0.0, 1.0});
  CHECK(at(streamed, exchange_kind::sparse_allgather) == doctest::Approx(nb + 8000.0));
  CHECK(at(streamed, exchange_kind::topk_a2a) == doctest::Approx(1000.0 + 2.0 * nb / 8.0 + nb));
  big.value_bytes = 8;  // doubles: shards of 8 MiB, streamed too
  CHECK(at(predict(big, link_model{0.0, 0.0, 1.0}), exchange_kind::topk_a2a) ==
        doctest::Approx(1000.0 + nb / 8.0 + nb));
  // The terms add up.
  const auto all = predict(s, link_model{1e-5, 1e-9, 1e-10, 3e-9, 2e-8, 5e-9});
  const auto net = predict(s, link_model{1e-5, 1e-9});
  for (unsigned k = 0; k < exchange_kinds; ++k) {
    const double local = 1e-10 * stream.seconds[k] + 3e-9 * pairs.seconds[k] +
                         1e-8 * merges.seconds[k];  // (2e-8, 5e-9) = 1e-8 (2, 0.5)
    CHECK(all.seconds[k] == same_seconds(net.seconds[k] + local));
  }
}

TEST_CASE("per_item: the small vector's costs, the large one's, the line in log2 n between") {
  link_model l{0.0, 0.0, 1.0, 10.0};
  l.gamma_large = 3.0;
  l.scatter_large = 40.0;
  l.small_elements = std::size_t{1} << 10;
  l.large_elements = std::size_t{1} << 20;
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1} << 10}) {
    CAPTURE(n);
    CHECK(cost::per_item(l, n) == std::array<double, 2>{1.0, 10.0});
  }
  for (std::size_t n : {std::size_t{1} << 20, (std::size_t{1} << 20) + 1, std::size_t{1} << 31}) {
    CAPTURE(n);
    CHECK(cost::per_item(l, n) == std::array<double, 2>{3.0, 40.0});
  }
  // Halfway in log2 n: halfway in cost; never outside the two, never decreasing with n.
  const auto mid = cost::per_item(l, std::size_t{1} << 15);
  CHECK(mid[0] == doctest::Approx(2.0));
  CHECK(mid[1] == doctest::Approx(25.0));
  std::array<double, 2> last = cost::per_item(l, 1);
  for (std::size_t n = 3; n < (std::size_t{1} << 22); n = n * 3 + 1) {
    CAPTURE(n);
    const auto c = cost::per_item(l, n);
    CHECK(c[0] >= last[0]);
    CHECK(c[1] >= last[1]);
    CHECK(c[0] <= 3.0);
    CHECK(c[1] <= 40.0);
    last = c;
  }
  // large_elements = 0: one size, the small costs everywhere.
  link_model one = l;
  one.large_elements = 0;
  CHECK(cost::per_item(one, std::size_t{1} << 30) == std::array<double, 2>{1.0, 10.0});
  // predict prices the local work at the tensor's n.
  exchange_shape s;
  s.ranks = 4;
  s.k = 100;
  s.k_max = 100;
  s.payload_bytes = 840;
  link_model stream{0.0, 0.0, 1.0};
  stream.gamma_large = 3.0;
  stream.small_elements = std::size_t{1} << 10;
  stream.large_elements = std::size_t{1} << 20;
  for (std::size_t n : {std::size_t{1} << 10, std::size_t{1} << 15, std::size_t{1} << 20}) {
    CAPTURE(n);
    s.n = n;
    const double gamma = cost::per_item(stream, n)[0];
    CHECK(predict(s, stream).seconds[static_cast<unsigned>(exchange_kind::sparse_allgather)] ==
          doctest::Approx(gamma * (2.0 * static_cast<double>(n) + 400.0)));
  }
  // The allgather and TopKA2A add their pairs region by region in the cache: the small vector's
  // scatter cost at every n. gTop-k's and the dense allreduce's pairs land anywhere in the
  // output: the cost at the tensor's n.
  link_model scatter{0.0, 0.0, 0.0, 10.0};
  scatter.scatter_large = 40.0;
  scatter.small_elements = std::size_t{1} << 10;
  scatter.large_elements = std::size_t{1} << 20;
  for (std::size_t n : {std::size_t{1} << 10, std::size_t{1} << 15, std::size_t{1} << 20}) {
    CAPTURE(n);
    s.n = n;
    const auto p = predict(s, scatter);
    CHECK(p.seconds[static_cast<unsigned>(exchange_kind::sparse_allgather)] == doctest::Approx(10.0 * 400.0));
    CHECK(p.seconds[static_cast<unsigned>(exchange_kind::topk_a2a)] == doctest::Approx(10.0 * 100.0));
    CHECK(p.seconds[static_cast<unsigned>(exchange_kind::gtopk)] ==
          doctest::Approx(cost::per_item(scatter, n)[1] * 100.0));
  }
}

TEST_CASE("merge_fit: the line through the two measured per-pair costs, terms never negative") {
  using gradcomp::detail::merge_fit;
  // Exactly on a line: recovered.
  const double k1 = 1023.0, k2 = 16383.0;  // log2(k + 1) = 10 and 14
  auto f = merge_fit(2.0 + 0.5 * 10.0, k1, 2.0 + 0.5 * 14.0, k2);
  CHECK(f[0] == doctest::Approx(2.0));
  CHECK(f[1] == doctest::Approx(0.5));
  // Cheaper per pair at the larger size: no negative slope, the constant the small size's cost.
  f = merge_fit(9.0, k1, 4.0, k2);
  CHECK(f[0] == 9.0);
  CHECK(f[1] == 0.0);
  // A slope so steep that the constant would be negative: the constant is 0.
  f = merge_fit(1.0, k1, 100.0, k2);
  CHECK(f[0] == 0.0);
  CHECK(f[1] > 0.0);
  // Equal sizes: no slope to fit.
  f = merge_fit(3.0, k1, 7.0, k1);
  CHECK(f[0] == 3.0);
  CHECK(f[1] == 0.0);
}

TEST_CASE("auto_exchange: each choice gives the result of the exchange it names") {
  const std::size_t n = 2000;
  using C = compressor<topk, identity, residual>;
  const C proto;
  for (int ranks : {1, 2, 3, 4, 8}) {
    CAPTURE(ranks);
    const auto ps = gradcomp_test::payloads_for(proto, ranks, n, 0.01);
    const auto mean = gradcomp_test::reference_mean(proto, std::span<const payload>(ps), n);
    for (unsigned k = 0; k < exchange_kinds; ++k) {
      const auto kind = static_cast<exchange_kind>(k);
      CAPTURE(exchange_kind_name(kind));
      auto_options o;
      o.link = link_model{1e-5, 1e-9};
      o.candidates = exchange_bit(kind);
      const auto res = run_auto(proto, ranks, n, 0.01, o);
      const auto want = kind == exchange_kind::gtopk
                            ? gradcomp_test::reference_gtopk(proto, std::span<const payload>(ps), n, gtopk_values::tree).out
                            : mean;
      for (int r = 0; r < ranks; ++r) {
        const auto rr = static_cast<std::size_t>(r);
        CHECK(res.choice[rr] == kind);
        CHECK(gradcomp_test::same_bits(res.out[rr], want));
        CHECK(res.stats[rr].name == exchange_kind_name(kind));
        if (ranks > 1) CHECK(res.stats[rr].predicted_seconds > 0.0);
      }
    }
  }
  SUBCASE("summable payloads: dense means dense_allreduce on the wire values") {
    using D = compressor<randomk, fp16, residual>;
    const D d;
    const auto ps = gradcomp_test::payloads_for(d, 4, n, 0.05);
    auto_options o;
    o.link = link_model{1e-5, 1e-9};
    o.candidates = exchange_bit(exchange_kind::dense_allreduce);
    const auto res = run_auto(d, 4, n, 0.05, o);
    const auto want = gradcomp_test::reference_wire_mean(d, std::span<const payload>(ps), n);
    for (const auto& out : res.out) CHECK(gradcomp_test::same_bits(out, want));
  }
}

TEST_CASE("auto_exchange chooses by the model: latency-bound small tensors, bandwidth-bound large") {
  using C = compressor<topk, identity, residual>;
  auto_options o;
  o.candidates = all_exchanges & ~exchange_bit(exchange_kind::gtopk);
  o.link = link_model{1e-3, 1e-12};  // latency dominates: the fewest messages win
  auto res = run_auto(C{}, 8, 4000, 0.01, o);
  CHECK(res.choice[0] == exchange_kind::sparse_allgather);
  o.link = link_model{0.0, 1e-9};  // bandwidth only, rho = 0.3 > 1/(2 (P-1)): TopKA2A
  res = run_auto(C{}, 8, 4000, 0.3, o);
  CHECK(res.choice[0] == exchange_kind::topk_a2a);
  for (auto c : res.choice) CHECK(c == res.choice[0]);
}

TEST_CASE("predict: a burst frees the first bytes of each sender, never more than it sends") {
  const auto at = [](const exchange_prediction& p, exchange_kind k) {
    return p.seconds[static_cast<unsigned>(k)];
  };
  for (std::size_t ranks : {2, 3, 4, 16}) {
    for (double k : {0.0, 1.0, 1000.0, 12345.0}) {
      for (double burst : {0.0, 1.0, 3028.0, 16384.0, 1e9}) {
        CAPTURE(ranks);
        CAPTURE(k);
        CAPTURE(burst);
        exchange_shape s;
        s.ranks = ranks;
        s.n = 1 << 20;
        s.k = k;
        s.k_max = static_cast<std::size_t>(k);
        s.payload_bytes = 40.0 + 8.0 * k;
        link_model paced{1e-5, 1e-9};
        paced.pair_alpha = 5e-6;
        paced.pair_beta = 5e-10;
        paced.dense_beta = 2e-9;
        link_model bursty = paced;
        bursty.burst_bytes = burst;
        const auto a = predict(s, paced), b = predict(s, bursty);
        const double p = static_cast<double>(ranks);
        const double rounds = std::ceil(std::log2(p));
        // The reference: the allgather's first payload, TopKA2A's first pairs, gTop-k's
        // message once per round up the tree and once for the broadcast, each up to the burst,
        // at the pair's beta (the rate the burst is measured at).
        const double gather = std::min(burst, s.payload_bytes) * 5e-10;
        const double a2a = std::min(burst, 8.0 * k * (p - 1.0) / p) * 5e-10;
        const double message = 8.0 * (k + 1.0);
        const double tree = (rounds + 1.0) * std::min(burst, message) * 5e-10;
        CHECK(at(a, exchange_kind::sparse_allgather) - at(b, exchange_kind::sparse_allgather) ==
              same_seconds(gather));
        CHECK(at(a, exchange_kind::topk_a2a) - at(b, exchange_kind::topk_a2a) == same_seconds(a2a));
        CHECK(at(a, exchange_kind::gtopk) - at(b, exchange_kind::gtopk) == same_seconds(tree));
        CHECK(at(b, exchange_kind::dense_allreduce) == at(a, exchange_kind::dense_allreduce));
        // Latency stays: a burst larger than every message leaves the alpha terms and the
        // bytes after each sender's first.
        for (unsigned e = 0; e < exchange_kinds; ++e) {
          CHECK(b.seconds[e] <= a.seconds[e]);
          CHECK(b.seconds[e] >= 0.0);
        }
        if (burst >= 1e9) {
          CHECK(at(b, exchange_kind::sparse_allgather) ==
                same_seconds(rounds * 1e-5 + (p - 1.0) * s.payload_bytes * 1e-9 - s.payload_bytes * 5e-10 +
                     cost::local_seconds(cost::local_sparse_allgather(s), bursty, s.n)));
          CHECK(at(b, exchange_kind::gtopk) ==
                same_seconds(2.0 * rounds * 1e-5 + (rounds - 1.0) * message * 5e-10 +
                     cost::local_seconds(cost::local_gtopk(s), bursty, s.n)));
        }
        // Without a pair's beta the burst is freed at beta; with a pair's beta above beta (a
        // given link), at beta: never more than the bytes were priced at.
        link_model one_beta{1e-5, 1e-9};
        one_beta.burst_bytes = burst;
        CHECK(cost::sparse_allgather(s, link_model{1e-5, 1e-9}) - cost::sparse_allgather(s, one_beta) ==
              same_seconds(std::min(burst, s.payload_bytes) * 1e-9));
        link_model slow_pair = one_beta;
        slow_pair.pair_beta = 4e-9;
        CHECK(cost::sparse_allgather(s, slow_pair) == cost::sparse_allgather(s, one_beta));
        CHECK(cost::topk_a2a(s, slow_pair) == cost::topk_a2a(s, one_beta));
        CHECK(cost::sparse_allgather(s, slow_pair) >= std::ceil(std::log2(p)) * 1e-5 * (1.0 - 1e-12));
      }
    }
  }
}

TEST_CASE("measure_link: positive values, the same on every rank") {
  for (int ranks : {1, 2, 3}) {
    std::vector<link_model> got(static_cast<std::size_t>(ranks));
    std::vector<link_probe> probes(static_cast<std::size_t>(ranks));
    run_in_process(ranks, [&](in_process_comm& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      got[r] = measure_link(comm,
                            link_measure_options{.small_repeats = 3, .large_repeats = 2,
                                                 .local_elements = std::size_t{1} << 14,
                                                 .local_large_elements = std::size_t{1} << 20},
                            &probes[r]);
    });
    for (std::size_t r = 0; r < got.size(); ++r) {
      const link_model& l = got[r];
      for (const auto& [name, field] : link_model_fields) {
        CAPTURE(name);
        CHECK(l.*field == got[0].*field);  // agreed
        CHECK(l.*field >= 0.0);
        CHECK(std::isfinite(l.*field));
      }
      // The local work is measured, the merge's two terms together positive.
      CHECK(l.gamma > 0.0);
      CHECK(l.scatter > 0.0);
      CHECK(l.merge + l.merge_log > 0.0);
      // Both sizes measured, and named.
      CHECK(l.gamma_large > 0.0);
      CHECK(l.scatter_large > 0.0);
      CHECK(l.small_elements == std::size_t{1} << 14);
      CHECK(l.large_elements == std::size_t{1} << 20);
      // The model takes the larger of the ping-pong's and the ring's values.
      CHECK(l.alpha == std::max(probes[r].pingpong_alpha, probes[r].ring_alpha));
      CHECK(l.beta == std::max(probes[r].pingpong_beta, probes[r].ring_beta));
      // One pair's link is the ping-pong's, never above the model's.
      CHECK(l.pair_alpha == probes[r].pingpong_alpha);
      CHECK(l.pair_beta == probes[r].pingpong_beta);
      CHECK(l.pair_alpha <= l.alpha);
      CHECK(l.pair_beta <= l.beta);
      // The allreduce is timed on the gather's large message, the probe saying so.
      CHECK(l.dense_beta == probes[r].allreduce_beta);
      CHECK(probes[r].allreduce_bytes == (ranks > 1 ? std::size_t{1} << 20 : 0));
    }
    // in_process_comm has no point-to-point: no burst (its ping-pongs are checked under MPI,
    // tests/mpi/mpi_comm.cpp).
    CHECK(got[0].burst_bytes == 0.0);
    if (ranks == 1) CHECK(got[0].dense_beta == 0.0);
    if (ranks == 1) CHECK(got[0].alpha == 0.0);
    if (ranks == 1) CHECK(got[0].pair_beta == 0.0);
  }
  run_in_process(1, [](in_process_comm& comm) {
    CHECK_THROWS_AS(measure_link(comm, link_measure_options{.small_bytes = 8, .large_bytes = 8}),
                    invalid_argument);
    // One size: no large vector's costs, the small ones everywhere.
    const link_model one = measure_link(
        comm, link_measure_options{.local_elements = std::size_t{1} << 14, .local_large_elements = 0});
    CHECK(one.gamma > 0.0);
    CHECK(one.large_elements == 0);
    CHECK(one.gamma_large == 0.0);
  });
}

TEST_CASE("median_link, median_probe: each field the ((N + 1) / 2)-th smallest over the runs") {
  std::mt19937_64 rng(17);
  // Values from heavy-tailed and discrete distributions, ties included, not only normal ones.
  std::cauchy_distribution<double> cauchy(0.0, 1e-6);
  std::uniform_int_distribution<int> small_int(0, 3);
  auto draw = [&](int kind) {
    switch (kind % 3) {
      case 0: return std::abs(cauchy(rng));
      case 1: return static_cast<double>(small_int(rng)) * 1e-9;  // ties
      default: return std::ldexp(1.0, -small_int(rng) * 10);
    }
  };
  for (std::size_t n : {1u, 2u, 3u, 4u, 5u, 8u, 31u}) {
    CAPTURE(n);
    std::vector<link_model> runs(n);
    std::vector<link_probe> probes(n);
    for (std::size_t i = 0; i < n; ++i) {
      int kind = static_cast<int>(i);
      for (const auto& [name, field] : link_model_fields) runs[i].*field = draw(kind++);
      runs[i].small_elements = 1000;
      runs[i].large_elements = 0;
      probes[i] = link_probe{draw(kind), draw(kind + 1), draw(kind + 2), draw(kind + 3), draw(kind + 4),
                             static_cast<std::size_t>(small_int(rng)) * 4096};
    }
    // The reference: each field's values sorted, the ((N + 1) / 2)-th.
    auto reference = [n](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[(n - 1) / 2];
    };
    const link_model m = median_link(runs);
    for (const auto& [name, field] : link_model_fields) {
      CAPTURE(name);
      std::vector<double> v;
      for (const link_model& r : runs) v.push_back(r.*field);
      CHECK(m.*field == reference(v));
      // At least half the runs at or below it, at least half at or above it.
      const auto below = std::count_if(v.begin(), v.end(), [&](double x) { return x <= m.*field; });
      const auto above = std::count_if(v.begin(), v.end(), [&](double x) { return x >= m.*field; });
      CHECK(2 * static_cast<std::size_t>(below) >= n);
      CHECK(2 * static_cast<std::size_t>(above) >= n);
    }
    CHECK(m.small_elements == 1000);
    CHECK(m.large_elements == 0);
    // The order of the runs does not matter.
    std::vector<link_model> shuffled = runs;
    std::shuffle(shuffled.begin(), shuffled.end(), rng);
    const link_model again = median_link(shuffled);
    for (const auto& [name, field] : link_model_fields) CHECK(again.*field == m.*field);
    // One run is itself.
    const link_model one = median_link(std::span<const link_model>(runs).first(1));
    for (const auto& [name, field] : link_model_fields) CHECK(one.*field == runs[0].*field);

    const link_probe pm = median_probe(probes);
    std::vector<double> pv[6];
    for (const link_probe& p : probes) {
      const double v[] = {p.pingpong_alpha, p.pingpong_beta, p.ring_alpha, p.ring_beta, p.allreduce_beta,
                          static_cast<double>(p.allreduce_bytes)};
      for (std::size_t f = 0; f < 6; ++f) pv[f].push_back(v[f]);
    }
    CHECK(pm.pingpong_alpha == reference(pv[0]));
    CHECK(pm.pingpong_beta == reference(pv[1]));
    CHECK(pm.ring_alpha == reference(pv[2]));
    CHECK(pm.ring_beta == reference(pv[3]));
    CHECK(pm.allreduce_beta == reference(pv[4]));
    CHECK(static_cast<double>(pm.allreduce_bytes) == reference(pv[5]));
  }
  // One slow run among three moves nothing; two slow ones of three do.
  link_model fast, slow;
  fast.alpha = 1e-4;
  fast.gamma = 3e-10;
  slow.alpha = 2e-4;
  slow.gamma = 7e-10;
  const link_model one_slow[] = {fast, slow, fast};
  CHECK(median_link(one_slow).alpha == fast.alpha);
  CHECK(median_link(one_slow).gamma == fast.gamma);
  const link_model two_slow[] = {slow, fast, slow};
  CHECK(median_link(two_slow).alpha == slow.alpha);

  // Refused, naming the argument: no runs; a value with no order (NaN), a negative or an
  // infinite one; runs whose local costs were measured on other vector sizes.
  CHECK_THROWS_WITH_AS(median_link(std::span<const link_model>()), doctest::Contains("'runs'"), invalid_argument);
  CHECK_THROWS_WITH_AS(median_probe(std::span<const link_probe>()), doctest::Contains("'runs'"), invalid_argument);
  for (const double bad : {std::numeric_limits<double>::quiet_NaN(), -1e-9, std::numeric_limits<double>::infinity()}) {
    for (const auto& [name, field] : link_model_fields) {
      link_model runs[3] = {fast, fast, fast};
      runs[2].*field = bad;
      // Quoted, so that runs[2].merge does not pass for runs[2].merge_log.
      CHECK_THROWS_WITH_AS(median_link(runs), doctest::Contains(("'runs[2]." + std::string(name) + "'").c_str()),
                           invalid_argument);
    }
    link_probe probes[2];
    probes[1].ring_alpha = bad;
    CHECK_THROWS_WITH_AS(median_probe(probes), doctest::Contains("'runs[1].ring_alpha'"), invalid_argument);
  }
  link_model other = fast;
  other.small_elements = 4096;
  const link_model mixed[] = {fast, other};
  CHECK_THROWS_WITH_AS(median_link(mixed), doctest::Contains("runs[1].small_elements"), invalid_argument);
  link_model larger = fast;
  larger.large_elements = std::size_t{1} << 25;
  const link_model mixed_large[] = {fast, fast, larger};
  CHECK_THROWS_WITH_AS(median_link(mixed_large), doctest::Contains("runs[2].small_elements, large_elements"),
                       invalid_argument);
}

TEST_CASE("sparsified_sgd with auto_exchange reports the choice, predicted and measured time") {
  run_in_process(3, [](in_process_comm& comm) {
    using sgd_t = sparsified_sgd<compressor<topk, identity, residual>, auto_exchange, in_process_comm>;
    auto_options o;
    o.measure = link_measure_options{.small_repeats = 3, .large_repeats = 2,
                                     .local_elements = std::size_t{1} << 16,
                                     .local_large_elements = std::size_t{1} << 20};
    sgd_t sgd(comm, {4000, 50}, {}, auto_exchange(o), sgd_options{.lr = 0.1},
              density_schedule::constant(0.01));
    std::vector<float> params(sgd.size(), 0.0f);
    const auto g = gradcomp_test::make_input<float>(gradcomp_test::dist::normal, sgd.size(), static_cast<std::uint64_t>(comm.rank()));
    const step_stats& s = sgd.step(params, g);
    REQUIRE(s.tensors.size() == 2);
    for (const auto& t : s.tensors) {
      const std::string_view name = t.exchange;
      CHECK((name == "dense_allreduce" || name == "sparse_allgather" || name == "topk_a2a" || name == "gtopk"));
      CHECK(t.predicted_seconds >= 0.0);
      CHECK(t.exchange_seconds > 0.0);
    }
    CHECK(sgd.exchange().link().has_value());
  });
}
