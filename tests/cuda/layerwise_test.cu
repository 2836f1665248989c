// device_layerwise_sgd (gradcomp/cuda/layerwise.cuh) against the host layerwise_sgd: the same
// compressor, densities, options and gradients on P = 1, 2 and 4 ranks (threads of this
// process; the device exchanges over cuda::staged_comm on the same in-process communicator as
// the host's). Each rank writes its gradients on a compute stream of its own, one tensor at a
// time from the last, and makes each ready as soon as it is queued, as autograd would. After
// every step the parameters and every tensor's checkpoint are the host's bit for bit, and the
// timings measured with CUDA events are consistent. Then the transaction (a fault at one of
// the step's collective calls, on the first or last rank, changes nothing on any rank; the
// retry is the host's step), a step
// whose tensors are not all made ready, agree_max, and the argument checks (ready() after
// wait_exchanges() among them).
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include <gradcomp/comm/in_process.hpp>
#include <gradcomp/cuda.cuh>
#include <gradcomp/cuda/layerwise.cuh>
#include <gradcomp/cuda/staged_comm.cuh>
#include <gradcomp/schedule/layerwise.hpp>

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

template <class Compressor>
struct pol {
  using C = Compressor;
  using host_t = layerwise_sgd<C, sparse_allgather, comm_t>;
  using device_t = device_layerwise_sgd<C, sparse_allgather, staged_t>;
};

struct setup_t {
  std::vector<std::size_t> sizes;
  std::vector<double> densities;
  sgd_options opt{};
  int kind = 0;
};

std::size_t total_of(const setup_t& s) {
  std::size_t n = 0;
  for (const std::size_t x : s.sizes) n += x;
  return n;
}

// A rank, and the compute stream it writes its gradients on.
template <class Pol>
struct rank_t : gradcomp_test::driver_rank<typename Pol::host_t, typename Pol::device_t> {
  std::unique_ptr<stream_t> compute = std::make_unique<stream_t>();
};

template <class Pol>
std::vector<rank_t<Pol>> make_ranks(const setup_t& s, int P) {
  const std::vector<tensor_spec> specs = detail::tensor_specs(s.sizes);
  return gradcomp_test::make_driver_ranks<rank_t<Pol>>(P, total_of(s), [&](rank_t<Pol>& k, int) {
    k.host = std::make_unique<typename Pol::host_t>(*k.comm, specs, s.densities,
                                                    typename Pol::C{}, sparse_allgather{}, s.opt);
    k.dev = std::make_unique<typename Pol::device_t>(*k.staged, specs, s.densities,
                                                     typename Pol::C{}, sparse_allgather{}, s.opt);
  });
}

// The device step as a backward pass would drive it: each tensor's gradient written on the
// compute stream, last tensor first, and made ready at once (ready: how many to hand over).
template <class Pol>
void device_step(rank_t<Pol>& k, const setup_t& s, const std::vector<float>& g,
                 std::size_t ready = static_cast<std::size_t>(-1)) {
  const std::size_t n = total_of(s);
  k.dev->begin_step(device_span<float>(k.dev_params.data(), n),
                    device_span<const float>(k.dev_grad.data(), n), k.compute->s);
  std::size_t at = n, handed = 0;
  for (std::size_t t = s.sizes.size(); t-- > 0 && handed < ready; ++handed) {
    at -= s.sizes[t];
    if (s.sizes[t]) {
      detail::cuda_check(cudaMemcpyAsync(k.dev_grad.data() + at, g.data() + at,
                                         s.sizes[t] * sizeof(float), cudaMemcpyHostToDevice,
                                         k.compute->s),
                         "cudaMemcpyAsync");
    }
    k.dev->ready(t);
  }
  k.dev->finish_step();
  detail::cuda_check(cudaStreamSynchronize(k.stream->s), "cudaStreamSynchronize");
}

template <class Pol>
void host_step(rank_t<Pol>& k, const setup_t& s, const std::vector<float>& g) {
  k.host->begin_step(std::span<float>(k.host_params), std::span<const float>(g));
  for (std::size_t t = s.sizes.size(); t-- > 0;) k.host->ready(t);
  k.host->finish_step();
}

template <class Pol>
void step_both(std::vector<rank_t<Pol>>& ranks, const setup_t& s, int step) {
  const int P = static_cast<int>(ranks.size());
  require_none_threw(run_world(P, [&](int r, in_process_comm& comm, in_process_world& world) {
    auto& k = ranks[static_cast<std::size_t>(r)];
    k.comm->rebind(comm);
    k.comm->disarm();
    k.comm->on_throw = [&world, r](std::string_view what) { world.abort(r, what); };
    const std::vector<float> g = gradient(total_of(s), s.kind, r, step);
    host_step(k, s, g);
    device_step(k, s, g);
  }));
}

template <class Pol>
std::vector<float> device_params(const rank_t<Pol>& k) {
  return gradcomp_test::download(k.dev_params.data(), k.host_params.size());
}

// Every tensor's checkpoint (residual and velocity), one after the other.
template <class D>
std::string checkpoints_of(D& d, std::size_t tensors) {
  std::ostringstream os;
  for (std::size_t t = 0; t < tensors; ++t) d.optimizer(t).save_state(os);
  return os.str();
}

template <class Pol>
void check_same_state(rank_t<Pol>& k, const setup_t& s) {
  CHECK(first_difference(device_params(k), k.host_params) == -1);
  CHECK(checkpoints_of(*k.dev, s.sizes.size()) == checkpoints_of(*k.host, s.sizes.size()));
  CHECK(k.dev->steps_done() == k.host->steps_done());
  const layerwise_stats& d = k.dev->last_stats();
  const layerwise_stats& h = k.host->last_stats();
  CHECK(d.step.n == h.step.n);
  CHECK(d.step.selected == h.step.selected);
  REQUIRE(d.layers.size() == h.layers.size());
  // The device's timings: each layer ready (before the backward pass's end: its event was
  // recorded on the compute stream before that one), then taken up, then done, in order; the
  // step's communication, overlap and wait are what the layers' timings make.
  double previous_end = 0.0, busy = 0.0, overlapped = 0.0;
  for (std::size_t j = 0; j < d.layers.size(); ++j) {
    const layer_timing& l = d.layers[j];
    CHECK(l.id == h.layers[j].id);
    CHECK(l.density == h.layers[j].density);
    CHECK(l.ready >= 0.0);
    CHECK(l.ready <= d.backward_seconds);
    CHECK(l.comm_begin >= l.ready);
    CHECK(l.comm_begin >= previous_end);
    CHECK(l.comm_end >= l.comm_begin);
    previous_end = l.comm_end;
    busy += l.comm_end - l.comm_begin;
    overlapped += std::max(0.0, std::min(l.comm_end, d.backward_seconds) - l.comm_begin);
  }
  CHECK(d.communication_seconds == doctest::Approx(busy).epsilon(1e-12));
  CHECK(d.overlapped_seconds == doctest::Approx(overlapped).epsilon(1e-12));
  CHECK(d.wait_seconds ==
        doctest::Approx(std::max(previous_end, d.backward_seconds) - d.backward_seconds));
}

std::vector<setup_t> setups() {
  sgd_options plain{};
  plain.lr = 0.1;
  sgd_options momentum{};
  momentum.lr = 0.05;
  momentum.momentum = 0.9;
  momentum.weight_decay = 1e-4;
  sgd_options nesterov = momentum;
  nesterov.nesterov = true;
  return {
      {{1}, {1.0}, plain, 0},
      {{0, 5, 1000}, {0.5, 0.2, 0.01}, momentum, 1},
      {{4097, 3, 1, 300}, {0.001, 1.0, 1.0, 0.1}, nesterov, 2},
      {{(std::size_t{1} << 20) + 3, 77}, {0.001, 0.3}, momentum, 1},
  };
}

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
      for (int step = 0; step < 3; ++step) {
        CAPTURE(step);
        step_both(ranks, all[c], step);
        for (auto& k : ranks) check_same_state(k, all[c]);
      }
    }
  }
}

}  // namespace

TEST_CASE("device_layerwise_sgd: the host's bits and consistent event timings, P = 1, 2, 4") {
  SUBCASE("top-k") { check_bit_for_bit<pol<compressor<topk, identity, residual>>>(); }
  SUBCASE("top-k, qsgd") { check_bit_for_bit<pol<compressor<topk, qsgd, residual>>>(); }
}

TEST_CASE("device_layerwise_sgd: a failed exchange changes nothing on any rank") {
  using Pt = pol<compressor<topk, identity, residual>>;
  const setup_t s{{300, 7, 50}, {0.1, 1.0, 0.2}, {0.05, 0.9, false, 0.0, 0}, 1};
  for (const int P : {2, 4}) {
    for (const int faulty : {0, P - 1}) {
      for (std::size_t at = 0; at < 9; at += 2) {
        CAPTURE(P);
        CAPTURE(faulty);
        CAPTURE(at);
        auto ranks = make_ranks<Pt>(s, P);
        step_both(ranks, s, 0);
        std::vector<std::vector<float>> params;
        std::vector<std::string> saved;
        for (auto& k : ranks) {
          params.push_back(device_params(k));
          saved.push_back(checkpoints_of(*k.dev, s.sizes.size()));
        }
        const auto errors = run_world(P, [&](int r, in_process_comm& comm, in_process_world& world) {
          auto& k = ranks[static_cast<std::size_t>(r)];
          k.comm->rebind(comm);
          k.comm->arm(r == faulty ? fault_kind::throw_before : fault_kind::none, at);
          k.comm->on_throw = [&world, r](std::string_view what) { world.abort(r, what); };
          device_step(k, s, gradient(total_of(s), s.kind, r, 1));
        });
        // Three collective calls a tensor (the counts, the indices, the values): every `at`
        // here is one of the step's nine.
        REQUIRE(ranks[static_cast<std::size_t>(faulty)].comm->effect() ==
                gradcomp_test::fault_effect::thrown);
        for (std::size_t r = 0; r < ranks.size(); ++r) {
          CAPTURE(r);
          CHECK(errors[r] != nullptr);
          CHECK(first_difference(device_params(ranks[r]), params[r]) == -1);
          CHECK(checkpoints_of(*ranks[r].dev, s.sizes.size()) == saved[r]);
          CHECK(ranks[r].dev->steps_done() == 1);
        }
        step_both(ranks, s, 1);
        for (auto& k : ranks) check_same_state(k, s);
      }
    }
  }
}

TEST_CASE("device_layerwise_sgd: a step with a tensor not made ready is refused and changes nothing") {
  using Pt = pol<compressor<topk, identity, residual>>;
  const setup_t s{{10, 20}, {0.5, 0.5}, {}, 0};
  auto ranks = make_ranks<Pt>(s, 1);
  step_both(ranks, s, 0);
  auto& k = ranks[0];
  const std::vector<float> params = device_params(k);
  // In a world of its own, as every step here (the last one's is gone).
  const auto errors = run_world(1, [&](int, in_process_comm& comm, in_process_world&) {
    k.comm->rebind(comm);
    k.comm->disarm();
    device_step(k, s, gradient(total_of(s), 0, 0, 1), /*ready=*/1);
  });
  REQUIRE(errors[0] != nullptr);
  CHECK(gradcomp_test::what_of(errors[0]).find("tensors made ready") != std::string::npos);
  CHECK(first_difference(device_params(k), params) == -1);
  CHECK(k.dev->steps_done() == 1);
  step_both(ranks, s, 1);
  check_same_state(k, s);
}

TEST_CASE("device_layerwise_sgd: agree_max gives every rank the largest number") {
  using Pt = pol<compressor<topk, identity, residual>>;
  const setup_t s{{10}, {0.5}, {}, 0};
  const int P = 3;
  auto ranks = make_ranks<Pt>(s, P);
  std::vector<float> agreed(P);
  require_none_threw(run_world(P, [&](int r, in_process_comm& comm, in_process_world&) {
    auto& k = ranks[static_cast<std::size_t>(r)];
    k.comm->rebind(comm);
    const std::size_t n = total_of(s);
    // A finite gradient (the buffer's memory is not zeroed when it is made).
    detail::cuda_check(cudaMemset(k.dev_grad.data(), 0, n * sizeof(float)), "cudaMemset");
    k.dev->begin_step(device_span<float>(k.dev_params.data(), n),
                      device_span<const float>(k.dev_grad.data(), n), k.compute->s);
    k.dev->ready(0);
    REQUIRE(k.dev->wait_exchanges());
    agreed[static_cast<std::size_t>(r)] = k.dev->agree_max(r == 1 ? 2.0f : 0.0f);
    k.dev->abandon_step();
  }));
  for (const float a : agreed) CHECK(a == 2.0f);
  for (auto& k : ranks) CHECK(k.dev->steps_done() == 0);
}

TEST_CASE("device_layerwise_sgd: bad arguments are refused, naming them") {
  in_process_world world(1);
  in_process_comm inner = world.comm(0);
  comm_t comm(inner);
  stream_t stream;
  staged_t staged(comm, stream.s);
  const std::vector<tensor_spec> specs = detail::tensor_specs({4, 5});
  using D = device_layerwise_sgd<compressor<topk, identity, residual>, sparse_allgather, staged_t>;
  const std::vector<double> one{0.5};
  CHECK_THROWS_WITH_AS(D(staged, specs, one), doctest::Contains("densities.size()"),
                       invalid_argument);
  const std::vector<double> two{0.5, 0.5};
  D d(staged, specs, two);
  device_buffer<float> p(9);
  CHECK_THROWS_WITH_AS(d.ready(0), doctest::Contains("begin_step() first"), invalid_argument);
  CHECK_THROWS_WITH_AS(d.begin_step(device_span<float>(p.data(), 8),
                                    device_span<const float>(p.data(), 9), nullptr),
                       doctest::Contains("params.size()"), invalid_argument);
  d.begin_step(device_span<float>(p.data(), 9), device_span<const float>(p.data(), 9), nullptr);
  CHECK_THROWS_WITH_AS(d.ready(2), doctest::Contains("< the number of tensors"), invalid_argument);
  d.ready(1);
  CHECK_THROWS_WITH_AS(d.ready(1), doctest::Contains("each tensor once per step"),
                       invalid_argument);
  d.abandon_step();  // (waits for tensor 1's exchange, which may fail: its gradient is not set)
  d.begin_step(device_span<float>(p.data(), 9), device_span<const float>(p.data(), 9), nullptr);
  d.ready(0);
  (void)d.wait_exchanges();
  CHECK_THROWS_WITH_AS(d.ready(1), doctest::Contains("after wait_exchanges()"), invalid_argument);
  d.abandon_step();
  CHECK(d.steps_done() == 0);
}
