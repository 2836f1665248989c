// gtopk: a P-rank in-process exchange equals a sequential simulation of the same merge tree,
// bit for bit, on every rank; the global set has at most k entries; the picks left out are
// exactly the local picks outside it; and in sparsified_sgd they go back to the residual.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
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

constexpr int rank_counts[] = {1, 2, 3, 4, 5, 6, 7, 8};

template <class C>
void check_gtopk(const C& proto, std::size_t n, double density, gtopk_values mode) {
  using T = typename C::value_type;
  for (int ranks : rank_counts) {
    CAPTURE(ranks);
    const auto ps = gradcomp_test::payloads_for(proto, ranks, n, density);
    const auto want = gradcomp_test::reference_gtopk(proto, std::span<const payload>(ps), n, mode);
    std::size_t k = 0;
    for (const auto& p : ps) k = std::max<std::size_t>(k, p.count);
    CHECK(want.global.size() <= k);

    std::vector<std::vector<T>> got(static_cast<std::size_t>(ranks));
    std::vector<unused_picks> unused(static_cast<std::size_t>(ranks));
    std::vector<exchange_stats> stats(static_cast<std::size_t>(ranks));
    std::vector<std::size_t> global(static_cast<std::size_t>(ranks));
    run_in_process(ranks, [&](in_process_comm& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      gtopk x(mode);
      const C c = proto;  // a compressor belongs to one rank: it keeps decoding scratch
      std::vector<T> out(n, T(7));
      stats[r] = x.exchange(comm, c, ps[r], std::span<T>(out), unused[r]);
      global[r] = x.last_global_count();
      got[r] = std::move(out);
    });
    for (std::size_t r = 0; r < got.size(); ++r) {
      CAPTURE(r);
      CHECK(gradcomp_test::same_bits(got[r], want.out));
      CHECK(global[r] == want.global.size());
      REQUIRE(unused[r].indices.size() == want.unused[r].size());
      for (std::size_t j = 0; j < want.unused[r].size(); ++j) {
        CHECK(unused[r].indices[j] == want.unused[r][j].first);
        CHECK(std::bit_cast<std::uint32_t>(unused[r].values[j]) ==
              std::bit_cast<std::uint32_t>(want.unused[r][j].second));
      }
      CHECK(stats[r].name == "gtopk");
      if (ranks > 1) CHECK(stats[r].bytes_received > 0);
    }
  }
}

}  // namespace

TEST_CASE("gtopk merge: equal indices add, the top k by |value| stay, ties go to the lower index") {
  const std::vector<index_value> a = {{1, 1.0f}, {3, -5.0f}, {7, 2.0f}};
  const std::vector<index_value> b = {{3, 1.0f}, {4, 2.0f}, {9, -4.0f}};
  std::vector<index_value> out;
  detail::gtopk_merge(a, b, 3, out);
  // union: 1:1, 3:-4, 4:2, 7:2, 9:-4 -> |.| order 3, 9 (tie, 3 first), then 4 and 7 tie at 2
  const std::vector<index_value> want = {{3, -4.0f}, {4, 2.0f}, {9, -4.0f}};
  CHECK(out == want);
  detail::gtopk_merge(a, b, 10, out);
  CHECK(out.size() == 5);
  detail::gtopk_merge(a, {}, 1, out);
  CHECK(out == std::vector<index_value>{{3, -5.0f}});
  const std::vector<index_value> with_nan = {{0, 1.0f}, {2, NAN}, {5, INFINITY}};
  detail::gtopk_merge(with_nan, {}, 2, out);
  REQUIRE(out.size() == 2);
  CHECK(out[0].index == 2);  // NaN ranks above +Inf, as topk ranks it
  CHECK(out[1].index == 5);
}

TEST_CASE("gtopk equals the simulated merge tree, P in 1..8 (powers of two and not)") {
  const std::size_t n = 2501;
  for (auto mode : {gtopk_values::tree, gtopk_values::exact}) {
    CAPTURE(static_cast<int>(mode));
    SUBCASE("topk identity") { check_gtopk(compressor<topk, identity, residual>{}, n, 0.01, mode); }
    SUBCASE("gaussiank: counts differ per rank") {
      check_gtopk(compressor<gaussiank, identity, residual>{}, n, 0.02, mode);
    }
    SUBCASE("topk qsgd") { check_gtopk(compressor<topk, qsgd, residual>{}, n, 0.05, mode); }
    SUBCASE("randomk fp16: every rank picks the same indices") {
      check_gtopk(compressor<randomk, fp16, residual>{}, n, 0.03, mode);
    }
    SUBCASE("topk identity double") {
      check_gtopk(compressor<topk, identity, residual, double>{}, n, 0.01, mode);
    }
    SUBCASE("dense selector, k = n") { check_gtopk(compressor<dense, identity, no_feedback>{}, 300, 1.0, mode); }
  }
}

TEST_CASE("gtopk in sparsified_sgd gives the picks left out back to the residual") {
  // identity values: decoded == acc exactly, so the residual of a restored coordinate is acc
  // again, bit for bit, and that of a coordinate used globally is acc - acc = 0.
  const std::size_t n = 1500;
  for (int ranks : {1, 3, 4}) {
    CAPTURE(ranks);
    run_in_process(ranks, [&](in_process_comm& comm) {
      using sgd_t = sparsified_sgd<compressor<topk, identity, residual>, gtopk, in_process_comm>;
      sgd_t sgd(comm, {1000, 500}, {}, gtopk(gtopk_values::exact), sgd_options{.lr = 0.1},
                density_schedule::constant(0.02));
      std::vector<float> params(n, 0.0f);
      const auto g = gradcomp_test::make_input<float>(gradcomp_test::dist::laplace, n, 77 + static_cast<std::uint64_t>(comm.rank()));
      const step_stats& s = sgd.step(params, g);
      const auto global = sgd.averaged_gradient();
      std::size_t restored = 0;
      for (std::size_t t = 0; t < 2; ++t) {
        const auto& e = sgd.feedback_state(t).e;
        const std::size_t off = t == 0 ? 0 : 1000;
        for (std::size_t i = 0; i < e.size(); ++i) {
          // Either this coordinate went into the global average (its residual is 0) or all of
          // g stayed in the residual.
          const bool used = e[i] == 0.0f && global[off + i] != 0.0f;
          if (!used) REQUIRE(e[i] == g[off + i]);
        }
        restored += s.tensors[t].restored;
        CHECK(s.tensors[t].exchange == "gtopk");
      }
      if (comm.size() == 1) CHECK(restored == 0);
      if (comm.size() > 1) CHECK(restored > 0);  // k of the union of P ranks' k picks stay
    });
  }
}

TEST_CASE("gtopk: a tensor of another size on one rank fails on every rank") {
  std::vector<int> failures(3, 0);
  CHECK_THROWS_AS(run_in_process(3, [&](in_process_comm& comm) {
    compressor<topk, identity, residual> c;
    const std::size_t n = comm.rank() == 2 ? 90 : 100;
    const payload p = gradcomp_test::payload_for_rank(c, comm.rank(), n, 0.1);
    std::vector<float> out(n);
    gtopk x;
    try {
      x.exchange(comm, c, p, std::span<float>(out));
    } catch (const communicator_error& e) {
      const std::string what = e.what();
      if (what.find("rank 2 has 90") != std::string::npos && what.find("rank 0 has 100") != std::string::npos) {
        failures[static_cast<std::size_t>(comm.rank())] = 1;
      }
      throw;
    }
  }), communicator_error);
  CHECK(failures == std::vector<int>{1, 1, 1});
}
