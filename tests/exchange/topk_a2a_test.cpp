// topk_a2a: a P-rank in-process exchange equals the single-process rank-order mean bit for bit
// (the same result as sparse_allgather); fusing tensors into buckets changes nothing but the
// number of messages; the bucket planner and the binary search of the bucket size.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <iterator>
#include <random>
#include <span>
#include <string>
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

constexpr int rank_counts[] = {1, 2, 3, 4, 8};

template <class C>
void check_a2a(const C& proto, std::size_t n, double density) {
  using T = typename C::value_type;
  for (int ranks : rank_counts) {
    CAPTURE(ranks);
    const auto ps = gradcomp_test::payloads_for(proto, ranks, n, density);
    const auto want = gradcomp_test::reference_mean(proto, std::span<const payload>(ps), n);
    std::vector<std::vector<T>> got(static_cast<std::size_t>(ranks));
    std::vector<exchange_stats> stats(static_cast<std::size_t>(ranks));
    run_in_process(ranks, [&](in_process_comm& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      topk_a2a x;
      const C c = proto;  // a compressor belongs to one rank: it keeps decoding scratch
      std::vector<T> out(n, T(5));
      stats[r] = x.exchange(comm, c, ps[r], std::span<T>(out));
      got[r] = std::move(out);
    });
    for (std::size_t r = 0; r < got.size(); ++r) {
      CAPTURE(r);
      CHECK(gradcomp_test::same_bits(got[r], want));
      CHECK(stats[r].name == "topk_a2a");
      if (ranks > 1) CHECK(stats[r].bytes_received > 0);
    }
  }
}

// A step of layers, each rank its own gradient; returns each rank's parameters after `steps`.
template <class X>
std::vector<std::vector<float>> train(int ranks, const std::vector<std::size_t>& layers, X proto,
                                      int steps) {
  std::size_t n = 0;
  for (auto s : layers) n += s;
  std::vector<std::vector<float>> params(static_cast<std::size_t>(ranks), std::vector<float>(n, 0.0f));
  run_in_process(ranks, [&](in_process_comm& comm) {
    using sgd_t = sparsified_sgd<compressor<gaussiank, identity, residual>, X, in_process_comm>;
    sgd_t sgd(comm, layers, {}, proto, sgd_options{.lr = 0.05}, density_schedule::constant(0.05));
    auto& p = params[static_cast<std::size_t>(comm.rank())];
    for (int s = 0; s < steps; ++s) {
      const auto g = gradcomp_test::make_input<float>(gradcomp_test::dist::student_t2, n, static_cast<std::uint64_t>(31 * s + comm.rank()));
      sgd.step(p, g);
    }
  });
  return params;
}

}  // namespace

TEST_CASE("topk_a2a equals the reference mean for every quantizer, P in {1,2,3,4,8}") {
  const std::size_t n = 3001;
  SUBCASE("topk identity") { check_a2a(compressor<topk, identity, residual>{}, n, 0.01); }
  SUBCASE("gaussiank qsgd: counts differ per rank") { check_a2a(compressor<gaussiank, qsgd, residual>{}, n, 0.02); }
  SUBCASE("randomk terngrad") { check_a2a(compressor<randomk, terngrad, residual>{}, n, 0.1); }
  SUBCASE("dense bf16 double") { check_a2a(compressor<dense, bf16, no_feedback, double>{}, n, 1.0); }
  SUBCASE("tiny tensor: fewer elements than ranks") { check_a2a(compressor<topk, identity, residual>{}, 5, 0.5); }
  SUBCASE("empty tensor") { check_a2a(compressor<topk, identity, residual>{}, 0, 0.5); }
}

TEST_CASE("plan_buckets groups consecutive tensors up to the bucket size") {
  const std::vector<std::size_t> sizes = {10, 20, 5, 100, 3, 3, 3};
  CHECK(plan_buckets(sizes, 0) == std::vector<std::size_t>{0, 1, 2, 3, 4, 5, 6, 7});
  CHECK(plan_buckets(sizes, 35) == std::vector<std::size_t>{0, 3, 4, 7});
  CHECK(plan_buckets(sizes, 30) == std::vector<std::size_t>{0, 2, 3, 4, 7});
  CHECK(plan_buckets(sizes, 1000) == std::vector<std::size_t>{0, 7});
  CHECK(plan_buckets(std::vector<std::size_t>{}, 10) == std::vector<std::size_t>{0});
}

TEST_CASE("fused buckets give every tensor exactly what it gets alone") {
  const std::vector<std::size_t> layers = {300, 17, 1, 256, 999, 64, 64, 2};
  for (int ranks : {1, 3, 4}) {
    CAPTURE(ranks);
    const auto alone = train(ranks, layers, sparse_allgather{}, 3);
    for (std::size_t bucket : {std::size_t{0}, std::size_t{64}, std::size_t{400}, std::size_t{1} << 20}) {
      CAPTURE(bucket);
      const auto fused = train(ranks, layers, topk_a2a(bucket), 3);
      for (int r = 0; r < ranks; ++r) {
        CHECK(gradcomp_test::same_bits(fused[static_cast<std::size_t>(r)], alone[static_cast<std::size_t>(r)]));
      }
    }
  }
}

TEST_CASE("tune_bucket_elements: binary search on an injected cost finds the least time") {
  // A fake clock: time(bucket) is V-shaped around a chosen best, so the search is exact and
  // deterministic; every rank must agree on it.
  const std::vector<std::size_t> bests = {1024, 2048, 4096, 1 << 14, 1 << 20};
  for (std::size_t best : bests) {
    CAPTURE(best);
    run_in_process(3, [&](in_process_comm& comm) {
      int calls = 0;
      auto fake = [&](std::size_t bucket) {
        ++calls;
        const double d = std::log2(static_cast<double>(bucket)) - std::log2(static_cast<double>(best));
        return 1.0 + std::fabs(d) + 0.01 * comm.rank();  // ranks disagree a little: max wins
      };
      const bucket_tuning t = tune_bucket_elements(comm, 1024, std::size_t{1} << 20, fake, 2);
      CHECK(t.best == best);
      CHECK(t.probes.size() <= 8);  // 11 candidates: at most 2 per halving
      CHECK(calls == static_cast<int>(2 * t.probes.size()));
    });
  }
  SUBCASE("monotone costs end at either end") {
    run_in_process(2, [](in_process_comm& comm) {
      CHECK(tune_bucket_elements(comm, 1, 1024, [](std::size_t b) { return static_cast<double>(b); }).best == 1);
      CHECK(tune_bucket_elements(comm, 1, 1024, [](std::size_t b) { return 1.0 / static_cast<double>(b); }).best == 1024);
      CHECK(tune_bucket_elements(comm, 5, 5, [](std::size_t) { return 1.0; }).best == 5);
    });
  }
  SUBCASE("bad ranges") {
    run_in_process(1, [](in_process_comm& comm) {
      auto f = [](std::size_t) { return 1.0; };
      CHECK_THROWS_AS(tune_bucket_elements(comm, 0, 10, f), invalid_argument);
      CHECK_THROWS_AS(tune_bucket_elements(comm, 10, 5, f), invalid_argument);
    });
  }
}

TEST_CASE("tune_bucket_elements measures real sparsified_sgd steps and every rank agrees") {
  const std::vector<std::size_t> layers(24, 200);  // many small layers: fusion pays
  std::vector<std::size_t> chosen(3);
  run_in_process(3, [&](in_process_comm& comm) {
    using sgd_t = sparsified_sgd<compressor<topk, identity, residual>, topk_a2a, in_process_comm>;
    sgd_t sgd(comm, layers, {}, {}, sgd_options{.lr = 0.01}, density_schedule::constant(0.05));
    std::vector<float> params(sgd.size(), 0.0f);
    const auto g = gradcomp_test::make_input<float>(gradcomp_test::dist::normal, sgd.size(), static_cast<std::uint64_t>(comm.rank()));
    auto step_time = [&](std::size_t bucket) {
      sgd.exchange().set_bucket_elements(bucket);
      return sgd.step(params, g).seconds.exchange;
    };
    const bucket_tuning t = tune_bucket_elements(comm, 200, 200 * 24, step_time);
    chosen[static_cast<std::size_t>(comm.rank())] = t.best;
    CHECK(t.best >= 200);
    CHECK(t.best <= 200 * 24);
    CHECK(!t.probes.empty());
  });
  CHECK(chosen[0] == chosen[1]);
  CHECK(chosen[1] == chosen[2]);
}

TEST_CASE("topk_a2a: a tensor of another size on one rank fails on every rank") {
  std::vector<int> failures(4, 0);
  CHECK_THROWS_AS(run_in_process(4, [&](in_process_comm& comm) {
    compressor<topk, identity, residual> c;
    const std::size_t n = comm.rank() == 1 ? 64 : 80;
    const payload p = gradcomp_test::payload_for_rank(c, comm.rank(), n, 0.1);
    std::vector<float> out(n);
    topk_a2a x;
    try {
      x.exchange(comm, c, p, std::span<float>(out));
    } catch (const communicator_error& e) {
      if (std::string(e.what()).find("rank 1 has 64, rank 0 has 80") != std::string::npos) {
        failures[static_cast<std::size_t>(comm.rank())] = 1;
      }
      throw;
    }
  }), communicator_error);
  CHECK(failures == std::vector<int>{1, 1, 1, 1});
}

TEST_CASE("topk_a2a::reduce_shard: the mean of the ranks' pairs in rank order; malformed pairs refused, shard unchanged") {
  // reduce_shard() is the owner's local work on its own (what gradcomp_bench measures): its
  // result is the rank-order sum of the pairs, divided by the number of ranks, over shards of
  // sizes 0, 1, small, odd and 2^20 + 3, with values that are not Gaussian (wide exponents,
  // both signs, repeated magnitudes).
  std::mt19937_64 rng(11);
  for (const std::size_t size : {std::size_t{0}, std::size_t{1}, std::size_t{64}, std::size_t{999},
                                 (std::size_t{1} << 20) + 3}) {
    for (const std::size_t ranks : {std::size_t{1}, std::size_t{3}, std::size_t{16}}) {
      CAPTURE(size);
      CAPTURE(ranks);
      const std::uint64_t begin = 12345;
      std::vector<index_value> received;
      std::vector<std::size_t> counts;
      std::vector<float> ref(size, 0.0f);
      for (std::size_t r = 0; r < ranks; ++r) {
        std::size_t c = 0;
        for (std::size_t i = 0; i < size; ++i) {
          if (rng() % 8 != 0) continue;  // density 1/8
          const int e = static_cast<int>(rng() % 40) - 20;
          const float v = std::ldexp(rng() % 2 ? 1.5f : -1.0f, e);
          received.push_back(index_value{static_cast<std::uint32_t>(begin + i), v});
          ref[i] += v;  // rank order, in float: what the shard must hold bit for bit
          ++c;
        }
        counts.push_back(c);
      }
      std::vector<float> shard(size, 7.0f);
      CHECK(topk_a2a::reduce_shard(std::span<const index_value>(received),
                                   std::span<const std::size_t>(counts), begin,
                                   std::span<float>(shard))
                .empty());
      bool same = true;
      for (std::size_t i = 0; i < size; ++i) {
        same = same && shard[i] == ref[i] / static_cast<float>(ranks);
      }
      CHECK(same);

      if (received.empty()) continue;
      // Refused, the shard left as it was: counts that do not add up, an index outside the
      // shard, a repeated index.
      const std::vector<float> kept = shard;
      const std::size_t wrapping[] = {SIZE_MAX, received.size() + 1};  // sums to received.size()
      CHECK(topk_a2a::reduce_shard(std::span<const index_value>(received),
                                   std::span<const std::size_t>(wrapping), begin,
                                   std::span<float>(shard))
                .find("do not add up") != std::string::npos);
      CHECK(shard == kept);
      std::vector<std::size_t> more = counts;
      more.back() += 1;
      CHECK(topk_a2a::reduce_shard(std::span<const index_value>(received),
                                   std::span<const std::size_t>(more), begin, std::span<float>(shard))
                .find("do not add up") != std::string::npos);
      CHECK(shard == kept);
      std::vector<index_value> bad = received;
      bad.back().index = static_cast<std::uint32_t>(begin + size);  // one past the shard
      CHECK(topk_a2a::reduce_shard(std::span<const index_value>(bad),
                                   std::span<const std::size_t>(counts), begin, std::span<float>(shard))
                .find("outside this rank's shard") != std::string::npos);
      CHECK(shard == kept);
      bad = received;
      bad.front().index = static_cast<std::uint32_t>(begin - 1);  // below it
      CHECK(topk_a2a::reduce_shard(std::span<const index_value>(bad),
                                   std::span<const std::size_t>(counts), begin, std::span<float>(shard))
                .find("outside this rank's shard") != std::string::npos);
      CHECK(shard == kept);
      if (counts.front() >= 2) {
        bad = received;
        bad[1].index = bad[0].index;
        CHECK(topk_a2a::reduce_shard(std::span<const index_value>(bad),
                                     std::span<const std::size_t>(counts), begin,
                                     std::span<float>(shard))
                  .find("strictly increasing") != std::string::npos);
        CHECK(shard == kept);
      }
    }
  }
}

TEST_CASE("topk_a2a: one exchange object over tensors of changing size keeps giving the reference mean") {
  // The shard and the gathered vector are kept between exchanges: a large tensor, a small one,
  // an empty one and the large one again must each get exactly the reference mean.
  using C = compressor<topk, identity, residual>;
  const C proto;
  const int ranks = 3;
  const std::size_t sizes[] = {5003, 17, 0, 5003, 2};
  std::vector<std::vector<std::vector<float>>> got(std::size(sizes));
  std::vector<std::vector<payload>> ps;
  for (const std::size_t n : sizes) ps.push_back(gradcomp_test::payloads_for(proto, ranks, n, 0.05));
  run_in_process(ranks, [&](in_process_comm& comm) {
    topk_a2a x;
    const C c = proto;
    for (std::size_t t = 0; t < std::size(sizes); ++t) {
      std::vector<float> out(sizes[t], 9.0f);
      x.exchange(comm, c, ps[t][static_cast<std::size_t>(comm.rank())], std::span<float>(out));
      if (comm.rank() == 0) got[t].push_back(out);
    }
  });
  for (std::size_t t = 0; t < std::size(sizes); ++t) {
    CAPTURE(sizes[t]);
    const auto want = gradcomp_test::reference_mean(proto, std::span<const payload>(ps[t]), sizes[t]);
    REQUIRE(got[t].size() == 1);
    CHECK(gradcomp_test::same_bits(got[t][0], want));
  }
}

TEST_CASE("share_by_size: shares in proportion to the sizes, rounded down, the last taking the rest") {
  const auto shares = [](std::vector<std::size_t> sizes, std::size_t amount) {
    std::vector<std::size_t> out(sizes.size(), 12345);
    share_by_size(sizes, amount, out);
    std::size_t sum = 0;
    for (const std::size_t s : out) sum += s;
    if (!sizes.empty()) CHECK(sum == amount);
    return out;
  };
  CHECK(shares({}, 7).empty());
  CHECK(shares({5}, 7) == std::vector<std::size_t>{7});
  CHECK(shares({1, 1, 1}, 10) == std::vector<std::size_t>{3, 3, 4});
  CHECK(shares({0, 0}, 9) == std::vector<std::size_t>{4, 5});            // equally where all are 0
  CHECK(shares({0, 3, 1}, 100) == std::vector<std::size_t>{0, 75, 25});
  CHECK(shares({1000, 37, 4096}, 0) == std::vector<std::size_t>{0, 0, 0});
  const std::vector<std::size_t> big = shares({(std::size_t{1} << 20) + 3, 17, 65537}, 987654321);
  CHECK(big[0] == 929542146);  // 987654321 (2^20 + 3) / 1114133, rounded down
  CHECK(big[1] == 15070);      // 987654321 17 / 1114133, rounded down
}

TEST_CASE("check_topk_a2a_counts: rows must add up to each rank's picks, entries fit their shard") {
  // n = 10 over p = 3: shards [0, 3), [3, 6), [6, 10).
  const std::vector<std::size_t> totals = {4, 0, 10};
  std::vector<std::size_t> m = {1, 2, 1,   //
                                0, 0, 0,   //
                                3, 3, 4};  // every element: the largest row allowed
  CHECK(check_topk_a2a_counts(m, totals, 10).empty());
  SUBCASE("an entry beyond its shard, naming the rank, the owner and the shard's length") {
    m[0] = 0;
    m[1] = 4;
    m[2] = 0;  // the row still adds up to 4
    const std::string why = check_topk_a2a_counts(m, totals, 10);
    CHECK(why.find("rank 0 announced 4 picks for rank 1's shard") != std::string::npos);
    CHECK(why.find("at most its 3 elements") != std::string::npos);
  }
  SUBCASE("a row that does not add up to the rank's picks") {
    m[6] = 2;
    const std::string why = check_topk_a2a_counts(m, totals, 10);
    CHECK(why.find("rank 2 announced 9 picks for the shards' owners and 10 picks") != std::string::npos);
  }
  SUBCASE("counts that would overflow a sum are refused by the shard bound first") {
    m[3] = ~std::size_t{0};
    CHECK(check_topk_a2a_counts(m, totals, 10).find("rank 1 announced") != std::string::npos);
  }
  SUBCASE("one rank, an empty buffer") {
    CHECK(check_topk_a2a_counts(std::vector<std::size_t>{0}, std::vector<std::size_t>{0}, 0).empty());
    CHECK(!check_topk_a2a_counts(std::vector<std::size_t>{1}, std::vector<std::size_t>{1}, 0).empty());
  }
}
