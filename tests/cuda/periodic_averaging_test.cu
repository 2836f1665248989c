// device_periodic_averaging (gradcomp/cuda/periodic_averaging.cuh) against the host
// periodic_averaging: the same quantizer, exchange, options and gradients on P = 1, 2 and 4
// ranks (threads of this process, one stream each; the device rounds over cuda::staged_comm
// on the same in-process communicator as the host's). After every step the parameters are the
// host's bit for bit and the two checkpoints are the same bytes (anchor, velocity, every
// slice's residual, the counters). Then the transaction (a fault in a round's collectives, on
// any rank, changes nothing on any rank, and the retried step is the unfaulted one), a
// non-finite gradient, checkpoints moved between the two drivers, and the argument checks.
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdlib>
#include <limits>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include <gradcomp/comm/in_process.hpp>
#include <gradcomp/cuda.cuh>
#include <gradcomp/cuda/periodic_averaging.cuh>
#include <gradcomp/cuda/staged_comm.cuh>
#include <gradcomp/schedule/periodic_averaging.hpp>

#include "../support/cuda_buffers.hpp"
#include "../support/cuda_ranks.hpp"
#include "../support/fault_comm.hpp"

namespace {

using namespace gradcomp;
using gradcomp_test::fault_kind;
using gradcomp_test::first_difference;
using gradcomp_test::gradient;
using gradcomp_test::require_none_threw;
using gradcomp_test::run_world;
using gradcomp_test::stream_t;

using comm_t = gradcomp_test::fault_in_process;
using staged_t = gradcomp_test::staged_fault_comm;

template <class Quantizer, class Exchange>
struct pol {
  using Q = Quantizer;
  using X = Exchange;
  using host_t = periodic_averaging<Q, X, comm_t>;
  using device_t = device_periodic_averaging<Q, X, staged_t>;
};

struct setup_t {
  std::vector<std::size_t> sizes;
  sgd_options opt{};
  averaging_options avg{};
  int kind = 0;
};

std::size_t total_of(const setup_t& s) {
  std::size_t n = 0;
  for (const std::size_t x : s.sizes) n += x;
  return n;
}

// One rank's drivers (a type of its own per configuration, so that functions deduce Pol).
template <class Pol>
struct rank_t : gradcomp_test::driver_rank<typename Pol::host_t, typename Pol::device_t> {};

// Every rank starts from the same parameters, as the drivers require.
template <class Pol>
std::vector<rank_t<Pol>> make_ranks(const setup_t& s, int P) {
  using Q = typename Pol::Q;
  using X = typename Pol::X;
  const std::vector<tensor_spec> specs = detail::tensor_specs(s.sizes);
  return gradcomp_test::make_driver_ranks<rank_t<Pol>>(P, total_of(s), [&](rank_t<Pol>& k, int) {
    k.host = std::make_unique<typename Pol::host_t>(*k.comm, specs, Q{}, X{}, s.opt, s.avg);
    k.dev = std::make_unique<typename Pol::device_t>(*k.staged, specs, Q{}, X{}, s.opt, s.avg);
  });
}

template <class Pol>
void device_step(rank_t<Pol>& k, const std::vector<float>& g) {
  if (!g.empty()) {
    detail::cuda_check(cudaMemcpyAsync(k.dev_grad.data(), g.data(), g.size() * sizeof(float),
                                       cudaMemcpyHostToDevice, k.stream->s),
                       "cudaMemcpyAsync");
  }
  k.dev->step(device_span<float>(k.dev_params.data(), g.size()),
              device_span<const float>(k.dev_grad.data(), g.size()));
  detail::cuda_check(cudaStreamSynchronize(k.stream->s), "cudaStreamSynchronize");
}

// One step of both drivers on every rank (average: an averaging round instead).
template <class Pol>
void step_both(std::vector<rank_t<Pol>>& ranks, const setup_t& s, int step, bool average = false) {
  const int P = static_cast<int>(ranks.size());
  require_none_threw(run_world(P, [&](int r, in_process_comm& comm, in_process_world& world) {
    auto& k = ranks[static_cast<std::size_t>(r)];
    k.comm->rebind(comm);
    k.comm->disarm();
    k.comm->on_throw = [&world, r](std::string_view what) { world.abort(r, what); };
    const std::size_t n = total_of(s);
    if (average) {
      k.host->average(std::span<float>(k.host_params));
      k.dev->average(device_span<float>(k.dev_params.data(), n));
      detail::cuda_check(cudaStreamSynchronize(k.stream->s), "cudaStreamSynchronize");
      return;
    }
    const std::vector<float> g = gradient(n, s.kind, r, step);
    k.host->step(std::span<float>(k.host_params), std::span<const float>(g));
    device_step(k, g);
  }));
}

template <class D>
std::string checkpoint_of(const D& d) {
  std::ostringstream os;
  d.save_state(os);
  return os.str();
}

template <class Pol>
std::vector<float> device_params(const rank_t<Pol>& k) {
  return gradcomp_test::download(k.dev_params.data(), k.host_params.size());
}

template <class Pol>
void check_same_state(const rank_t<Pol>& k) {
  CHECK(first_difference(device_params(k), k.host_params) == -1);
  CHECK(checkpoint_of(*k.dev) == checkpoint_of(*k.host));
  CHECK(k.dev->steps_done() == k.host->steps_done());
  CHECK(k.dev->rounds_done() == k.host->rounds_done());
  CHECK(k.dev->just_averaged() == k.host->just_averaged());
  const step_stats& d = k.dev->last_stats();
  const step_stats& h = k.host->last_stats();
  CHECK(d.n == h.n);
  CHECK(d.selected == h.selected);
  CHECK(d.target_density == h.target_density);
  CHECK(d.tensors.size() == h.tensors.size());
}

// One element to 2^20 + 3, an empty tensor; plain SGD, momentum with weight decay, Nesterov;
// periods 1 to 3, one to three slices, with and without error feedback.
std::vector<setup_t> setups() {
  sgd_options plain{};
  plain.lr = 0.1;
  plain.seed = 7;
  sgd_options momentum = plain;
  momentum.lr = 0.05;
  momentum.momentum = 0.9;
  momentum.weight_decay = 1e-4;
  sgd_options nesterov = momentum;
  nesterov.nesterov = true;
  return {
      {{1}, plain, {1, 1, true}, 0},
      {{0, 5, 1000}, momentum, {2, 3, true}, 1},
      {{4097, 3, 1}, nesterov, {3, 1, false}, 2},
      {{2, 1}, plain, {1, 3, true}, 0},  // slices of one element, and empty ones
      {{(std::size_t{1} << 20) + 3}, momentum, {2, 2, true}, 1},
  };
}

// Every setup at P = 1, 2, 4: 7 steps and a final average() on both drivers, the state the
// host's after each.
template <class Pol>
void check_bit_for_bit() {
  const bool small = std::getenv("GRADCOMP_CUDA_TEST_SMALL") != nullptr;
  const std::vector<setup_t> all = setups();
  for (const int P : {1, 2, 4}) {
    for (std::size_t c = 0; c < all.size(); ++c) {
      if (small && total_of(all[c]) > 70000) continue;
      CAPTURE(P);
      CAPTURE(c);
      auto ranks = make_ranks<Pol>(all[c], P);
      for (int step = 0; step < 8; ++step) {
        CAPTURE(step);
        step_both(ranks, all[c], step, /*average=*/step == 7);
        for (const auto& k : ranks) check_same_state(k);
      }
    }
  }
}

}  // namespace

TEST_CASE("device_periodic_averaging: the host's bits, summable quantizers over dense_allreduce") {
  SUBCASE("identity") { check_bit_for_bit<pol<identity, dense_allreduce>>(); }
  SUBCASE("fp16") { check_bit_for_bit<pol<fp16, dense_allreduce>>(); }
  SUBCASE("bf16") { check_bit_for_bit<pol<bf16, dense_allreduce>>(); }
}

TEST_CASE("device_periodic_averaging: the host's bits, every quantizer over sparse_allgather") {
  // The stochastic quantizers draw with the host round's call_id (the rank in the seed).
  SUBCASE("identity") { check_bit_for_bit<pol<identity, sparse_allgather>>(); }
  SUBCASE("qsgd") { check_bit_for_bit<pol<qsgd, sparse_allgather>>(); }
  SUBCASE("terngrad") { check_bit_for_bit<pol<terngrad, sparse_allgather>>(); }
  SUBCASE("scaled_sign") { check_bit_for_bit<pol<scaled_sign, sparse_allgather>>(); }
}

namespace {

// A fault before each of a round's collective calls in turn (the call count from 0 up, until
// one goes past the round's last call), on every rank of P: every rank throws, none changes
// anything, and the retried step is the host's. At least `least` calls must have faulted.
template <class Pol>
void check_failed_rounds(const setup_t& s, std::size_t least) {
  for (const int P : {2, 4}) {
    for (int faulty = 0; faulty < P; ++faulty) {
      std::size_t at = 0;
      for (;; ++at) {
        CAPTURE(P);
        CAPTURE(faulty);
        CAPTURE(at);
        auto ranks = make_ranks<Pol>(s, P);
        step_both(ranks, s, 0);  // a local step: the next one has the round
        std::vector<std::vector<float>> params;
        std::vector<std::string> saved;
        for (const auto& k : ranks) {
          params.push_back(device_params(k));
          saved.push_back(checkpoint_of(*k.dev));
        }
        const auto errors = run_world(P, [&](int r, in_process_comm& comm, in_process_world& world) {
          auto& k = ranks[static_cast<std::size_t>(r)];
          k.comm->rebind(comm);
          k.comm->arm(r == faulty ? fault_kind::throw_before : fault_kind::none, at);
          k.comm->on_throw = [&world, r](std::string_view what) { world.abort(r, what); };
          device_step(k, gradient(total_of(s), s.kind, r, 1));
        });
        if (ranks[static_cast<std::size_t>(faulty)].comm->effect() !=
            gradcomp_test::fault_effect::thrown) {
          // Past the round's last call: the round went through, as the host's does.
          require_none_threw(errors);
          require_none_threw(run_world(P, [&](int r, in_process_comm& comm, in_process_world&) {
            auto& k = ranks[static_cast<std::size_t>(r)];
            k.comm->rebind(comm);
            k.comm->disarm();
            const std::vector<float> g = gradient(total_of(s), s.kind, r, 1);
            k.host->step(std::span<float>(k.host_params), std::span<const float>(g));
          }));
          for (const auto& k : ranks) check_same_state(k);
          break;
        }
        for (std::size_t r = 0; r < ranks.size(); ++r) {
          CAPTURE(r);
          CHECK(errors[r] != nullptr);
          CHECK(first_difference(device_params(ranks[r]), params[r]) == -1);
          CHECK(checkpoint_of(*ranks[r].dev) == saved[r]);
        }
        step_both(ranks, s, 1);  // the retry is the unfaulted step
        for (const auto& k : ranks) check_same_state(k);
      }
      CHECK(at >= least);
    }
  }
}

}  // namespace

TEST_CASE("device_periodic_averaging: a failed round changes nothing on any rank") {
  setup_t s{{300, 7}, {}, {2, 1, true}, 1};
  s.opt.lr = 0.1;
  s.opt.momentum = 0.9;
  // qsgd over sparse_allgather: the counts, the codes and the side values.
  check_failed_rounds<pol<qsgd, sparse_allgather>>(s, 3);
  // fp16 over dense_allreduce: the counts, then the allreduce of the codes.
  check_failed_rounds<pol<fp16, dense_allreduce>>(s, 2);
}

TEST_CASE("device_periodic_averaging: a non-finite gradient is refused and changes nothing") {
  using P1 = pol<identity, dense_allreduce>;
  setup_t s{{10, 3}, {}, {2, 1, true}, 0};
  s.opt.momentum = 0.5;
  auto ranks = make_ranks<P1>(s, 1);
  step_both(ranks, s, 0);
  auto& k = ranks[0];
  const std::vector<float> params = device_params(k);
  const std::string saved = checkpoint_of(*k.dev);
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::infinity()}) {
    std::vector<float> g = gradient(total_of(s), 0, 0, 1);
    g[11] = bad;
    CHECK_THROWS_AS(device_step(k, g), nonfinite_error);
    CHECK(first_difference(device_params(k), params) == -1);
    CHECK(checkpoint_of(*k.dev) == saved);
  }
  step_both(ranks, s, 1);
  check_same_state(k);
}

TEST_CASE("device_periodic_averaging: checkpoints move between the host and device drivers") {
  using Pq = pol<qsgd, sparse_allgather>;
  setup_t s{{33, 0, 1000}, {}, {2, 3, true}, 1};
  s.opt.momentum = 0.9;
  s.opt.lr = 0.05;
  for (const int saved_at : {0, 1, 5}) {  // no anchor yet; a local step; after two rounds
    CAPTURE(saved_at);
    auto ranks = make_ranks<Pq>(s, 2);
    for (int step = 0; step < saved_at; ++step) step_both(ranks, s, step);
    // Fresh drivers on the same parameters: the device ones load the host checkpoints, the host
    // ones the device checkpoints; then each pair goes on as one, and as the originals.
    auto fresh = make_ranks<Pq>(s, 2);
    for (std::size_t r = 0; r < ranks.size(); ++r) {
      std::istringstream from_host(checkpoint_of(*ranks[r].host));
      std::istringstream from_device(checkpoint_of(*ranks[r].dev));
      fresh[r].dev->load_state(from_host);
      fresh[r].host->load_state(from_device);
      fresh[r].host_params = ranks[r].host_params;
      fresh[r].dev_params = gradcomp_test::upload(ranks[r].host_params);
      check_same_state(fresh[r]);
    }
    for (int step = saved_at; step < saved_at + 4; ++step) {
      step_both(ranks, s, step);
      step_both(fresh, s, step);
      for (std::size_t r = 0; r < ranks.size(); ++r) {
        check_same_state(fresh[r]);
        CHECK(first_difference(device_params(fresh[r]), ranks[r].host_params) == -1);
        CHECK(checkpoint_of(*fresh[r].dev) == checkpoint_of(*ranks[r].host));
      }
    }
  }
  // A checkpoint of another layout is refused and changes nothing.
  auto ranks = make_ranks<Pq>(s, 1);
  step_both(ranks, s, 0);
  setup_t other = s;
  other.sizes = {33, 1, 1000};
  auto wrong = make_ranks<Pq>(other, 1);
  std::istringstream is(checkpoint_of(*wrong[0].host));
  const std::string saved = checkpoint_of(*ranks[0].dev);
  CHECK_THROWS_WITH_AS(ranks[0].dev->load_state(is), doctest::Contains("tensor 1 of 0"),
                       invalid_argument);
  CHECK(checkpoint_of(*ranks[0].dev) == saved);
}

TEST_CASE("device_periodic_averaging: bad arguments are refused, naming them") {
  in_process_world world(1);
  in_process_comm inner = world.comm(0);
  comm_t comm(inner);
  stream_t stream;
  staged_t staged(comm, stream.s);
  const std::vector<tensor_spec> specs = detail::tensor_specs({4, 5});
  using D = device_periodic_averaging<identity, dense_allreduce, staged_t>;
  CHECK_THROWS_WITH_AS(D(staged, specs, {}, {}, {}, averaging_options{0, 1, true}),
                       doctest::Contains("period"), invalid_argument);
  CHECK_THROWS_WITH_AS(D(staged, specs, {}, {}, {}, averaging_options{1, 0, true}),
                       doctest::Contains("subsets"), invalid_argument);
  sgd_options bad_lr{};
  bad_lr.lr = -1.0;
  CHECK_THROWS_WITH_AS(D(staged, specs, {}, {}, bad_lr, {}), doctest::Contains("lr"),
                       invalid_argument);
  D d(staged, specs);
  device_buffer<float> p(9);
  CHECK_THROWS_WITH_AS(d.step(device_span<float>(p.data(), 8), device_span<const float>(p.data(), 9)),
                       doctest::Contains("params.size()"), invalid_argument);
  CHECK_THROWS_WITH_AS(d.average(device_span<float>(p.data(), 10)),
                       doctest::Contains("params.size()"), invalid_argument);
  CHECK(d.steps_done() == 0);
}
