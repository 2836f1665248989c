// Determinism on the host: with a fixed seed, two runs of the same multi-rank training give
// bit-identical parameters, whatever the thread scheduling, and every rank holds the same
// parameters; a different seed gives different ones. Random policies (randomk, dgc_sampling,
// qsgd, terngrad) draw from (seed, step, tensor id) and exchanges add in rank order.
#include <doctest/doctest.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <thread>
#include <type_traits>
#include <vector>

#include <gradcomp/gradcomp.hpp>

#include "support.hpp"

namespace {

using namespace gradcomp;
using reliability::byte_snapshot;
using reliability::bytes_of;
using reliability::gradient;

const std::vector<std::size_t> layers{1000, 37, 3000};
constexpr std::size_t total = 4037;
constexpr int ranks = 4;
constexpr int steps = 6;

struct randomk_qsgd {
  using compressor_type = compressor<randomk, qsgd, residual>;
  using exchange_type = sparse_allgather;
  static compressor_type make() { return compressor_type(randomk{}, qsgd(7, 64)); }
};
struct dgc_terngrad {
  using compressor_type = compressor<dgc_sampling, terngrad, dgc_momentum>;
  using exchange_type = sparse_allgather;
  static compressor_type make() { return compressor_type(dgc_sampling{}, terngrad(128)); }
};
struct randomk_fp16_allreduce {
  using compressor_type = compressor<randomk, fp16, residual>;
  using exchange_type = dense_allreduce;
  static compressor_type make() { return compressor_type{}; }
};
struct gaussiank_sign_double {
  using compressor_type = compressor<gaussiank, scaled_sign, residual, double>;
  using exchange_type = sparse_allgather;
  static compressor_type make() { return compressor_type(gaussiank{}, scaled_sign(256)); }
};

// Every rank's parameters after `steps` steps. jitter: ranks sleep different times before
// each step, so that they reach the collectives in another order than without it.
template <class Setup>
std::vector<byte_snapshot> train(std::uint64_t seed, bool jitter) {
  using C = typename Setup::compressor_type;
  using T = typename C::value_type;
  std::vector<byte_snapshot> out(ranks);
  run_in_process(ranks, [&](in_process_comm& comm) {
    sgd_options opt;
    opt.lr = 0.05;
    opt.seed = seed;
    if constexpr (!std::is_same_v<typename C::feedback_type, dgc_momentum>) opt.momentum = 0.5;
    sparsified_sgd<C, typename Setup::exchange_type, in_process_comm> sgd(
        comm, layers, Setup::make(), {}, opt, density_schedule::warmup(0.02, 2, 2));
    std::vector<T> params(total, T(0));
    for (int s = 0; s < steps; ++s) {
      if (jitter) {
        std::this_thread::sleep_for(std::chrono::microseconds(200 * ((comm.rank() + s) % ranks)));
      }
      const auto g = gradient<T>(total, static_cast<std::uint64_t>(1000 * s + comm.rank()),
                                 reliability::dist::laplace);
      sgd.step(params, g);
    }
    out[static_cast<std::size_t>(comm.rank())] = bytes_of(params);
  });
  return out;
}

}  // namespace

TEST_CASE_TEMPLATE("determinism: a fixed seed gives bit-identical parameters across runs and ranks",
                   Setup, randomk_qsgd, dgc_terngrad, randomk_fp16_allreduce,
                   gaussiank_sign_double) {
  const auto a = train<Setup>(42, false);
  const auto b = train<Setup>(42, true);
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    CHECK(a[static_cast<std::size_t>(r)] == b[static_cast<std::size_t>(r)]);  // run to run
    CHECK(a[static_cast<std::size_t>(r)] == a[0]);                            // rank to rank
  }
  // The parameters moved at all, so the comparison above means something.
  using T = typename Setup::compressor_type::value_type;
  CHECK(a[0] != bytes_of(std::vector<T>(total, T(0))));
}

TEST_CASE_TEMPLATE("determinism: another seed gives other parameters", Setup, randomk_qsgd,
                   dgc_terngrad, randomk_fp16_allreduce) {
  const auto a = train<Setup>(42, false);
  const auto c = train<Setup>(43, false);
  CHECK(a[0] != c[0]);
  for (int r = 1; r < ranks; ++r) CHECK(c[static_cast<std::size_t>(r)] == c[0]);
}

TEST_CASE("determinism: a random policy's payload is a function of (seed, step, tensor id)") {
  const auto g = gradient<float>(5000, 7, reliability::dist::laplace);
  auto payload_of = [&](auto c, call_id id) {
    auto st = c.make_state(g.size());
    payload p;
    c.compress(g, st, {0.01, id}, p);
    std::vector<std::byte> w;
    encode_wire(p, w);
    return w;
  };
  auto check = [&](auto c) {
    const call_id base{42, 3, 9};
    CHECK(payload_of(c, base) == payload_of(c, base));
    CHECK(payload_of(c, base) != payload_of(c, call_id{43, 3, 9}));
    CHECK(payload_of(c, base) != payload_of(c, call_id{42, 4, 9}));
    CHECK(payload_of(c, base) != payload_of(c, call_id{42, 3, 10}));
  };
  check(compressor<randomk, identity, residual>{});
  check(compressor<topk, qsgd, residual>(topk{}, qsgd(3, 8)));
  check(compressor<topk, terngrad, residual>(topk{}, terngrad(8)));
}
