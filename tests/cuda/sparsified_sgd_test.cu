// device_sparsified_sgd (gradcomp/cuda/sparsified_sgd.cuh) against the host sparsified_sgd:
// the same compressor, exchange, options and gradients, run side by side on P = 1, 2 and 4
// ranks (threads of this process, one stream each, sharing the GPU; the device step's exchange
// over cuda::staged_comm on the same in-process communicator as the host's). Parameters,
// averaged gradient, feedback state (the residual, or DGC's u and v) and selection statistics
// must be the host's bit for bit after
// every step (Gaussian-k's threshold within float tolerance, on gradients that make its index
// sets the host's). Then the transaction: a fault in any of the device step's collectives, on any
// rank, a corrupted count or pick, or a non-finite gradient changes no state on any rank, and
// the retried step is the unfaulted one; checkpoints move between the two drivers.
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gradcomp/comm/in_process.hpp>
#include <gradcomp/cuda.cuh>
#include <gradcomp/cuda/sparsified_sgd.cuh>
#include <gradcomp/cuda/staged_comm.cuh>
#include <gradcomp/detail/sgd_checkpoint.hpp>
#include <gradcomp/sparsified_sgd.hpp>

#include "../support/cuda_buffers.hpp"
#include "../support/cuda_ranks.hpp"
#include "../support/fault_comm.hpp"

namespace {

using namespace gradcomp;
using gradcomp_test::fault_kind;
using gradcomp_test::first_difference;
using gradcomp_test::gradient;
using gradcomp_test::gradient_value;
using gradcomp_test::require_none_threw;
using gradcomp_test::run_world;
using gradcomp_test::stream_t;
using gradcomp_test::what_of;

using comm_t = gradcomp_test::fault_in_process;
using staged_t = gradcomp_test::staged_fault_comm;

// A configuration the device step runs, with its two drivers.
template <class Compressor, class Exchange>
struct policies {
  using C = Compressor;
  using X = Exchange;
  using host_t = sparsified_sgd<C, X, comm_t>;
  using device_t = device_sparsified_sgd<C, X, staged_t>;
  static C make() { return C{}; }
  static X make_x() { return X{}; }
};
using sparse_p = policies<compressor<topk, identity, residual>, sparse_allgather>;
// The same configuration stepped by graph_step (every check on the device, one wait; over
// staged_comm it queues its work without a CUDA graph): graph = 1 at every step, 2 at even
// steps with step() at odd ones (the two share the driver's buffers).
template <int Graph>
struct graph_p : sparse_p {
  static constexpr int graph = Graph;
};
// Dense SGD and Random-k over dense_allreduce, with each summable quantizer.
template <class Q>
using summed_dense_p = policies<compressor<dense, Q, residual>, dense_allreduce>;
template <class Q>
using summed_randomk_p = policies<compressor<randomk, Q, residual>, dense_allreduce>;
using dense_p = summed_dense_p<identity>;
// Dense SGD over sparse_allgather: every rank's codes gathered, decoded and added in rank order
// (the quantizers whose codes cannot be added: qsgd, terngrad, scaled_sign; and identity).
template <class Q>
using gathered_dense_p = policies<compressor<dense, Q, residual>, sparse_allgather>;
// Top-k with each quantizer that has a device form.
template <class Q>
using quantized_p = policies<compressor<topk, Q, residual>, sparse_allgather>;
// threshold at tau = 0.75: a count per tensor that differs between ranks and steps, and for
// the gradients of multiples of 1/8, values exactly at tau (selected: |x| >= tau).
template <class Q>
struct threshold_p : policies<compressor<threshold, Q, residual>, sparse_allgather> {
  static compressor<threshold, Q, residual> make() {
    return compressor<threshold, Q, residual>(threshold{0.75});
  }
};
// Gaussian-k, the default form or the published one (which ends on its threshold's own set).
// In general the device threshold is the host's within float tolerance
// (cuda/dispatch/gaussiank.cuh), and the index sets agree where no |e + g| lies between the
// two. Here the gradients are multiples of 1/8 (kind 2, whatever the setup says), and so is
// e + g unquantized: the shifted sums and sums of squares are exact in the host's float lanes
// and the device's doubles, mean and sd come out the same, and the thresholds differ at most
// in their last bits (the device may fuse |mean| + sd z), so the sets are the host's unless a
// threshold falls within those bits of a multiple of 1/8. The statistics' thresholds are
// compared within the general tolerance.
template <class Q, bool Published = false>
struct gaussiank_p : policies<compressor<gaussiank, Q, residual>, sparse_allgather> {
  static constexpr int gradient_kind = 2;
  static constexpr double threshold_tolerance = 1e-5;  // relative, as cuda_select_test's
  static compressor<gaussiank, Q, residual> make() {
    return compressor<gaussiank, Q, residual>(Published ? gaussiank::published() : gaussiank{});
  }
};
// Random-k: the host's indices (drawn on the host for the device step too), the same on
// every rank.
template <class Q>
using randomk_p = policies<compressor<randomk, Q, residual>, sparse_allgather>;
// Random-k's values added by one allreduce at the indices every rank shares.
using randomk_allreduce_p = summed_randomk_p<identity>;
// DGC's momentum correction (m = 0.9) in place of the residual, with selector S (threshold at
// tau = 0.75) and quantizer Q. DGC applies momentum itself: the setups' SGD momentum is 0.
template <class S, class Q>
struct dgc_p : policies<compressor<S, Q, dgc_momentum>, sparse_allgather> {
  static constexpr bool applies_momentum = true;
  static compressor<S, Q, dgc_momentum> make() {
    S sel{};
    if constexpr (std::is_same_v<S, threshold>) sel = threshold{0.75};
    return compressor<S, Q, dgc_momentum>(sel, Q{}, dgc_momentum{0.9, 0.0});
  }
};
// DGC with its local gradient clipping at ||g|| = 1, on gradients of multiples of 1/8, whose
// squares add up exactly in any order: the device's scale is the host's, bit for bit.
struct dgc_clip_p : policies<compressor<topk, identity, dgc_momentum>, sparse_allgather> {
  static constexpr bool applies_momentum = true;
  static constexpr int gradient_kind = 2;
  static compressor<topk, identity, dgc_momentum> make() {
    return compressor<topk, identity, dgc_momentum>(topk{}, identity{}, dgc_momentum{0.9, 1.0});
  }
};
// gTop-k, its tree's sums (gtopk_values::tree) or the exact ones, with selector S (threshold at
// tau = 0.75: counts that differ between ranks, k the largest) and quantizer Q.
template <class S, class Q, bool Exact = false>
struct gtopk_p : policies<compressor<S, Q, residual>, gtopk> {
  static compressor<S, Q, residual> make() {
    S sel{};
    if constexpr (std::is_same_v<S, threshold>) sel = threshold{0.75};
    return compressor<S, Q, residual>(sel, Q{}, residual{});
  }
  static gtopk make_x() { return gtopk(Exact ? gtopk_values::exact : gtopk_values::tree); }
};
// gTop-k with DGC's momentum correction: the picks left out go back into v.
struct gtopk_dgc_p : policies<compressor<topk, identity, dgc_momentum>, gtopk> {
  static constexpr bool applies_momentum = true;
  static compressor<topk, identity, dgc_momentum> make() {
    return compressor<topk, identity, dgc_momentum>(topk{}, identity{}, dgc_momentum{0.9, 0.0});
  }
};
// TopK-A2A, with selector S (threshold at tau = 0.75) and quantizer Q; the host fusing its
// tensors into buckets of `Bucket` elements (0: each alone), the device all into one: the same
// bits either way.
template <class S, class Q, std::size_t Bucket = 0>
struct a2a_p : policies<compressor<S, Q, residual>, topk_a2a> {
  static compressor<S, Q, residual> make() {
    S sel{};
    if constexpr (std::is_same_v<S, threshold>) sel = threshold{0.75};
    return compressor<S, Q, residual>(sel, Q{}, residual{});
  }
  static topk_a2a make_x() { return topk_a2a(Bucket); }
};
struct a2a_dgc_p : policies<compressor<topk, identity, dgc_momentum>, topk_a2a> {
  static constexpr bool applies_momentum = true;
  static compressor<topk, identity, dgc_momentum> make() {
    return compressor<topk, identity, dgc_momentum>(topk{}, identity{}, dgc_momentum{0.9, 0.0});
  }
};
// The host encoder's payload of n values of quantizer Q (the sizes of its codes and side values
// depend on n only): what the bytes counted are compared with.
template <class Q>
payload host_encoded(std::size_t n) {
  payload p;
  p.dense_size = n;
  p.layout = index_layout::dense;
  p.count = static_cast<std::uint32_t>(n);
  Q{}.encode(std::vector<float>(n, 0.5f), call_id{}, p);
  return p;
}
// The top-k configuration's, for the tests that run only it.
using C = sparse_p::C;
using device_t = sparse_p::device_t;

// One rank's drivers (a type of its own per configuration, so that functions deduce Pol).
template <class Pol>
struct rank_t : gradcomp_test::driver_rank<typename Pol::host_t, typename Pol::device_t> {};

struct setup_t {
  std::vector<std::size_t> sizes;
  double density = 0.01;
  sgd_options opt{};
  int kind = 0;
};

std::size_t total_of(const setup_t& s) {
  std::size_t n = 0;
  for (const std::size_t x : s.sizes) n += x;
  return n;
}

template <class Pol = sparse_p>
std::vector<rank_t<Pol>> make_ranks(const setup_t& s, int P, bool with_host = true) {
  const auto schedule = density_schedule::constant(s.density);
  return gradcomp_test::make_driver_ranks<rank_t<Pol>>(P, total_of(s), [&](rank_t<Pol>& k, int) {
    if (with_host) {
      k.host = std::make_unique<typename Pol::host_t>(*k.comm, s.sizes, Pol::make(),
                                                      Pol::make_x(), s.opt, schedule);
    }
    k.dev = std::make_unique<typename Pol::device_t>(*k.staged, s.sizes, Pol::make(),
                                                     Pol::make_x(), s.opt, schedule);
  });
}

// The device step of rank r on gradient g (host memory), waited for.
template <class Pol>
void device_step(rank_t<Pol>& k, const std::vector<float>& g) {
  if (!g.empty()) {
    detail::cuda_check(cudaMemcpyAsync(k.dev_grad.data(), g.data(), g.size() * sizeof(float),
                                       cudaMemcpyHostToDevice, k.stream->s),
                       "cudaMemcpyAsync");
  }
  const device_span<float> params(k.dev_params.data(), g.size());
  const device_span<const float> grads(k.dev_grad.data(), g.size());
  bool graph = false;
  if constexpr (requires { Pol::graph; }) graph = Pol::graph == 1 || k.dev->steps_done() % 2 == 0;
  if (graph) {
    if constexpr (requires { Pol::graph; }) k.dev->graph_step(params, grads);
  } else {
    k.dev->step(params, grads);
  }
  detail::cuda_check(cudaStreamSynchronize(k.stream->s), "cudaStreamSynchronize");
}

// The device step of every rank on its step-`step` gradient, nothing armed: each rank's
// exception (or none).
template <class Pol>
auto device_steps(std::vector<rank_t<Pol>>& ranks, const setup_t& s, int step) {
  return run_world(static_cast<int>(ranks.size()), [&](int r, in_process_comm& comm, in_process_world&) {
    auto& k = ranks[static_cast<std::size_t>(r)];
    k.comm->rebind(comm);
    k.comm->disarm();
    k.comm->on_throw = nullptr;
    device_step(k, gradient(total_of(s), s.kind, r, step));
  });
}

// Both drivers, one step, every rank.
template <class Pol>
void step_both(std::vector<rank_t<Pol>>& ranks, const setup_t& s, int step) {
  const int P = static_cast<int>(ranks.size());
  const auto errors = run_world(P, [&](int r, in_process_comm& comm, in_process_world& world) {
    auto& k = ranks[static_cast<std::size_t>(r)];
    k.comm->rebind(comm);
    k.comm->disarm();
    k.comm->on_throw = [&world, r](std::string_view what) { world.abort(r, what); };
    const std::vector<float> g = gradient(total_of(s), s.kind, r, step);
    k.host->step(std::span<float>(k.host_params), std::span<const float>(g));
    device_step(k, g);
  });
  require_none_threw(errors);
}

template <class U>
std::vector<U> down(device_span<const U> d) {
  return gradcomp_test::download(d.data(), d.size());
}

template <class Pol>
void check_same_state(rank_t<Pol>& k, int r) {
  CAPTURE(r);
  const std::size_t n = k.host_params.size();
  const std::vector<float> p = gradcomp_test::download(k.dev_params.data(), n);
  CHECK(first_difference(p, k.host_params) == -1);
  CHECK(first_difference(down(k.dev->averaged_gradient()), k.host->averaged_gradient()) == -1);
  for (std::size_t t = 0; t < k.dev->tensors().size(); ++t) {
    CAPTURE(t);
    // The residual's e, or DGC's u and v.
    const auto dev_buffers = k.dev->feedback_buffers(t);
    const auto host_buffers = k.host->feedback_state(t).buffers();
    REQUIRE(dev_buffers.size() == host_buffers.size());
    for (std::size_t b = 0; b < dev_buffers.size(); ++b) {
      CAPTURE(b);
      CHECK(first_difference(down(dev_buffers[b]), host_buffers[b]) == -1);
    }
    const tensor_stats& d = k.dev->last_stats().tensors[t];
    const tensor_stats& h = k.host->last_stats().tensors[t];
    CHECK(d.selected == h.selected);
    if constexpr (requires { Pol::threshold_tolerance; }) {
      CHECK(std::fabs(d.threshold - h.threshold) <=
            Pol::threshold_tolerance * std::max(std::fabs(h.threshold), 1e-30));
    } else {
      CHECK(d.threshold == h.threshold);
    }
    CHECK(d.fallback == h.fallback);
  }
  CHECK(k.dev->steps_done() == k.host->steps_done());
  CHECK(k.dev->last_stats().selected == k.host->last_stats().selected);
}

template <class Device>
std::string checkpoint_of(const Device& d) {
  std::ostringstream os;
  d.save_state(os);
  return os.str();
}

struct snapshot_t {
  std::vector<float> params;
  std::vector<float> average;
  std::string checkpoint;
  std::uint64_t steps = 0;
};

template <class Pol>
snapshot_t snapshot(rank_t<Pol>& k) {
  return {gradcomp_test::download(k.dev_params.data(), k.host_params.size()),
          down(k.dev->averaged_gradient()), checkpoint_of(*k.dev), k.dev->steps_done()};
}

template <class Pol>
void check_unchanged(rank_t<Pol>& k, const snapshot_t& before, int r) {
  CAPTURE(r);
  const snapshot_t now = snapshot(k);
  CHECK(first_difference(now.params, before.params) == -1);
  CHECK(first_difference(now.average, before.average) == -1);
  CHECK(now.checkpoint == before.checkpoint);
  CHECK(now.steps == before.steps);
}

// The layouts, densities, options and gradient kinds the bit-for-bit tests run: one element to
// 2^20 + 3, an empty tensor, plain SGD, momentum with weight decay, Nesterov.
std::vector<setup_t> bit_for_bit_setups() {
  sgd_options plain{};
  plain.lr = 0.1;
  sgd_options momentum{};
  momentum.lr = 0.05;
  momentum.momentum = 0.9;
  momentum.weight_decay = 1e-4;
  sgd_options nesterov = momentum;
  nesterov.nesterov = true;
  return {
      {{1}, 0.01, plain, 0},
      {{0, 5, 1000}, 0.01, momentum, 1},
      {{4097, 3, 1}, 0.3, nesterov, 2},
      {{1000, 1000}, 1.0, plain, 2},
      {{(std::size_t{1} << 20) + 3}, 0.001, momentum, 1},
      {{65536, 300000, 17}, 0.01, nesterov, 0},
  };
}

// Every bit_for_bit_setups() layout at P = 1, 2 and 4: fresh ranks, start(ranks, setup), then
// 3 steps on both drivers, after each of which every rank's state is the host's
// (check_same_state) and more(rank, setup) checks what else it will. Under compute-sanitizer
// (scripts/gpu_check.sh sets GRADCOMP_CUDA_TEST_SMALL), or with small_only, the large layouts
// are left out: the kernels they run are the small ones' on more elements. A configuration
// with a gradient_kind runs every layout on gradients of that kind.
template <class Pol, class Start, class More>
void check_bit_for_bit(Start&& start, More&& more, bool small_only = false) {
  std::vector<setup_t> setups = bit_for_bit_setups();
  if constexpr (requires { Pol::gradient_kind; }) {
    for (setup_t& s : setups) s.kind = Pol::gradient_kind;
  }
  if constexpr (requires { Pol::applies_momentum; }) {
    for (setup_t& s : setups) {
      if (Pol::applies_momentum) s.opt.momentum = 0.0;
      s.opt.nesterov = s.opt.nesterov && s.opt.momentum > 0.0;
    }
  }
  const bool small = small_only || std::getenv("GRADCOMP_CUDA_TEST_SMALL") != nullptr;
  for (const int P : {1, 2, 4}) {
    for (std::size_t c = 0; c < setups.size(); ++c) {
      if (small && total_of(setups[c]) > 70000) continue;
      CAPTURE(P);
      CAPTURE(c);
      auto ranks = make_ranks<Pol>(setups[c], P);
      start(ranks, setups[c]);
      for (int step = 0; step < 3; ++step) {
        CAPTURE(step);
        step_both(ranks, setups[c], step);
        for (int r = 0; r < P; ++r) {
          check_same_state(ranks[static_cast<std::size_t>(r)], r);
          more(ranks[static_cast<std::size_t>(r)], setups[c]);
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("device_sparsified_sgd: the host step bit for bit, P = 1, 2, 4") {
  check_bit_for_bit<sparse_p>([](auto&, const setup_t&) {}, [](auto&, const setup_t&) {});
}

namespace {

// The transaction under faults, from the ranks' current state (step 0 done): a fault before
// each of the device step's `collectives` calls on the first or the last rank, then the last
// rank corrupting each of the calls `corrupted` (refused on every rank, naming that rank),
// leave every rank's parameters, average, checkpoint and step counter as they were; then the
// retried step, on both drivers, is still the host's.
template <class Pol>
void check_faults_change_nothing(std::vector<rank_t<Pol>>& ranks, const setup_t& s,
                                 std::size_t collectives,
                                 const std::vector<std::size_t>& corrupted, int corrupter = -1) {
  const int P = static_cast<int>(ranks.size());
  if (corrupter < 0) corrupter = P - 1;
  std::vector<snapshot_t> before;
  for (auto& k : ranks) before.push_back(snapshot(k));
  const auto device_only = [&](int faulty, fault_kind kind, std::size_t at) {
    return run_world(P, [&](int r, in_process_comm& comm, in_process_world& world) {
      auto& k = ranks[static_cast<std::size_t>(r)];
      k.comm->rebind(comm);
      k.comm->on_throw = [&world, r](std::string_view what) { world.abort(r, what); };
      if (r == faulty) k.comm->arm(kind, at);
      else k.comm->disarm();
      device_step(k, gradient(total_of(s), s.kind, r, 1));
    });
  };
  for (const int faulty : {0, P - 1}) {
    for (std::size_t at = 0; at < collectives; ++at) {
      CAPTURE(faulty);
      CAPTURE(at);
      const auto errors = device_only(faulty, fault_kind::throw_before, at);
      for (int r = 0; r < P; ++r) {
        CAPTURE(r);
        CHECK(errors[static_cast<std::size_t>(r)] != nullptr);
        check_unchanged(ranks[static_cast<std::size_t>(r)], before[static_cast<std::size_t>(r)], r);
      }
    }
  }
  for (const std::size_t at : corrupted) {
    CAPTURE(at);
    const auto errors = device_only(corrupter, fault_kind::corrupt, at);
    for (int r = 0; r < P; ++r) {
      CAPTURE(r);
      REQUIRE(errors[static_cast<std::size_t>(r)] != nullptr);
      const std::string what = what_of(errors[static_cast<std::size_t>(r)]);
      CAPTURE(what);
      CHECK(what.find("rank " + std::to_string(corrupter)) != std::string::npos);
      check_unchanged(ranks[static_cast<std::size_t>(r)], before[static_cast<std::size_t>(r)], r);
    }
  }
  step_both(ranks, s, 1);
  for (int r = 0; r < P; ++r) check_same_state(ranks[static_cast<std::size_t>(r)], r);
}

// check_faults_change_nothing on fresh ranks of configuration Pol after one step, at P = 2
// and 3: three tensors, density 0.05, momentum (DGC's, where it applies its own), gradients of
// the given kind.
template <class Pol>
void check_faults_at_2_and_3(int kind, std::size_t collectives,
                             const std::vector<std::size_t>& corrupted) {
  sgd_options opt{};
  opt.lr = 0.05;
  opt.momentum = 0.9;
  if constexpr (requires { Pol::applies_momentum; }) {
    if (Pol::applies_momentum) opt.momentum = 0.0;  // DGC: its own
  }
  const setup_t s{{1000, 37, 4096}, 0.05, opt, kind};
  for (const int P : {2, 3}) {
    CAPTURE(P);
    auto ranks = make_ranks<Pol>(s, P);
    step_both(ranks, s, 0);
    check_faults_change_nothing(ranks, s, collectives, corrupted);
  }
}

// Rank bad_rank's gradient holds `bad` at flat index `at` (index `index` of tensor `tensor`):
// the device step fails on every rank, that rank's error naming the tensor, the index and the
// non-finite value (e + g: `bad` itself where e is finite, inf where a finite `bad` overflows
// it), the others' naming the rank, and changes nothing; then the step with finite values is
// the host's.
template <class Pol>
void check_nonfinite_fails_everywhere(std::vector<rank_t<Pol>>& ranks, const setup_t& s,
                                      int bad_rank, std::size_t at, float bad, int tensor,
                                      std::size_t index) {
  const int P = static_cast<int>(ranks.size());
  std::vector<snapshot_t> before;
  for (auto& k : ranks) before.push_back(snapshot(k));
  const auto errors = run_world(P, [&](int r, in_process_comm& comm, in_process_world&) {
    auto& k = ranks[static_cast<std::size_t>(r)];
    k.comm->rebind(comm);
    k.comm->disarm();
    k.comm->on_throw = nullptr;
    std::vector<float> g = gradient(total_of(s), s.kind, r, 1);
    if (r == bad_rank) g[at] = bad;
    device_step(k, g);
  });
  for (int r = 0; r < P; ++r) {
    CAPTURE(r);
    REQUIRE(errors[static_cast<std::size_t>(r)] != nullptr);
    const std::string what = what_of(errors[static_cast<std::size_t>(r)]);
    CAPTURE(what);
    if (r == bad_rank) {
      CHECK(what.find("tensor " + std::to_string(tensor) + " ") != std::string::npos);
      CHECK(what.find("index " + std::to_string(index)) != std::string::npos);
      if (std::isnan(bad)) {  // the sign of a NaN sum is not promised
        CHECK((what.find("holds nan ") != std::string::npos ||
               what.find("holds -nan ") != std::string::npos));
      } else {
        CHECK(what.find(bad > 0.0f ? "holds inf " : "holds -inf ") != std::string::npos);
      }
    } else {
      CHECK(what.find("rank " + std::to_string(bad_rank)) != std::string::npos);
    }
    check_unchanged(ranks[static_cast<std::size_t>(r)], before[static_cast<std::size_t>(r)], r);
  }
  step_both(ranks, s, 1);
  for (int r = 0; r < P; ++r) check_same_state(ranks[static_cast<std::size_t>(r)], r);
}

// check_nonfinite_fails_everywhere on fresh ranks of configuration Pol after one step, at
// P = 1 and 2: the last rank's gradient holds `bad` at index 1234 of tensor 1 (of 100, 2000).
template <class Pol>
void check_nonfinite_in_tensor_1(int kind, float bad) {
  const setup_t s{{100, 2000}, 0.01, {}, kind};
  for (const int P : {1, 2}) {
    CAPTURE(P);
    auto ranks = make_ranks<Pol>(s, P);
    step_both(ranks, s, 0);
    check_nonfinite_fails_everywhere(ranks, s, P - 1, 100 + 1234, bad, 1, 1234);
  }
}

}  // namespace

TEST_CASE("device_sparsified_sgd: a failed step changes nothing on any rank; the retry is the unfaulted step") {
  // Three collectives: the counts, the picks' indices, their values. A lying peer: a
  // corrupted count (call 0) or corrupted indices (call 1), refused by the same check.
  check_faults_at_2_and_3<sparse_p>(1, 3, {0, 1});
}

TEST_CASE("device_sparsified_sgd: a non-finite gradient is refused before any state changes") {
  const setup_t s{{100, 2000}, 0.01, {}, 0};
  auto ranks = make_ranks(s, 1);
  step_both(ranks, s, 0);
  auto& k = ranks[0];
  const snapshot_t before = snapshot(k);
  for (const float bad : {std::nanf(""), INFINITY, -INFINITY}) {
    std::vector<float> g = gradient(total_of(s), s.kind, 0, 1);
    g[100 + 1234] = bad;  // tensor 1, index 1234
    const auto errors = run_world(1, [&](int, in_process_comm& comm, in_process_world&) {
      k.comm->rebind(comm);
      k.comm->disarm();
      k.comm->on_throw = nullptr;
      device_step(k, g);
    });
    REQUIRE(errors[0] != nullptr);
    const std::string what = what_of(errors[0]);
    CAPTURE(what);
    CHECK(what.find("tensor 1 ") != std::string::npos);
    CHECK(what.find("index 1234") != std::string::npos);
    check_unchanged(k, before, 0);
  }
  step_both(ranks, s, 1);
  check_same_state(k, 0);
}

TEST_CASE("device_sparsified_sgd: a non-finite gradient on one rank fails the step on every rank") {
  const setup_t s{{100, 2000}, 0.01, {}, 2};
  for (const int P : {2, 3}) {
    CAPTURE(P);
    auto ranks = make_ranks(s, P);
    step_both(ranks, s, 0);
    check_nonfinite_fails_everywhere(ranks, s, P - 1, 7, std::nanf(""), 0, 7);  // tensor 0, index 7
  }
}

TEST_CASE_TEMPLATE("device_sparsified_sgd::graph_step: the host step bit for bit, P = 1, 2, 4", Pol,
                   graph_p<1>, graph_p<2>) {
  // Over staged_comm nothing is captured (nccl_comm_local checks the captured graphs).
  check_bit_for_bit<Pol>([](auto&, const setup_t&) {},
                         [](auto& k, const setup_t&) { CHECK(k.dev->graph_captures() == 0); });
}

TEST_CASE("device_sparsified_sgd::graph_step: a failed step or a lying peer changes nothing on any rank") {
  // Four collectives: the status words, the picks' indices, their values, the verdicts. A
  // lying peer: a corrupted status word (call 0: an unknown status) or corrupted indices
  // (call 1: refused by every rank that received them, then through the verdicts).
  check_faults_at_2_and_3<graph_p<1>>(1, 4, {0, 1});
}

TEST_CASE("device_sparsified_sgd::graph_step: a non-finite gradient fails the step on every rank") {
  check_nonfinite_in_tensor_1<graph_p<1>>(0, std::nanf(""));
  check_nonfinite_in_tensor_1<graph_p<1>>(2, -INFINITY);
}

TEST_CASE("device_sparsified_sgd::graph_step: a rank with another density is refused on every rank") {
  const setup_t s{{100, 2000}, 0.01, {}, 0};
  for (const int P : {2, 3}) {
    CAPTURE(P);
    auto ranks = make_ranks<graph_p<1>>(s, P, /*with_host=*/false);
    auto& odd = ranks[static_cast<std::size_t>(P - 1)];
    odd.dev = std::make_unique<device_t>(*odd.staged, s.sizes, C{}, sparse_allgather{}, s.opt,
                                         density_schedule::constant(0.02));
    const auto errors = device_steps(ranks, s, 0);
    for (int r = 0; r < P; ++r) {
      CAPTURE(r);
      REQUIRE(errors[static_cast<std::size_t>(r)] != nullptr);
      const std::string what = what_of(errors[static_cast<std::size_t>(r)]);
      CAPTURE(what);
      CHECK(what.find("graph_step") != std::string::npos);
      CHECK(what.find(r == P - 1 ? "rank 0 " : "rank " + std::to_string(P - 1) + " ") !=
            std::string::npos);
      CHECK(ranks[static_cast<std::size_t>(r)].dev->steps_done() == 0);
    }
  }
}

TEST_CASE("device_sparsified_sgd: checkpoints move between the host and the device driver") {
  sgd_options opt{};
  opt.momentum = 0.5;
  const setup_t s{{300, 5000}, 0.02, opt, 2};
  auto ranks = make_ranks(s, 1);
  step_both(ranks, s, 0);
  auto& k = ranks[0];
  // The device driver's checkpoint is the host's, byte for byte.
  std::ostringstream host_cp;
  k.host->save_state(host_cp);
  CHECK(checkpoint_of(*k.dev) == host_cp.str());
  // A truncated checkpoint is refused and changes nothing.
  const snapshot_t before = snapshot(k);
  std::istringstream truncated(host_cp.str().substr(0, host_cp.str().size() - 3));
  CHECK_THROWS_AS(k.dev->load_state(truncated), invalid_argument);
  check_unchanged(k, before, 0);
  // A fresh device driver loads the host's checkpoint and steps as the host does.
  auto fresh = std::make_unique<device_t>(*k.staged, s.sizes, C{}, sparse_allgather{}, s.opt,
                                          density_schedule::constant(s.density));
  std::istringstream in(host_cp.str());
  fresh->load_state(in);
  k.dev = std::move(fresh);
  step_both(ranks, s, 1);
  check_same_state(k, 0);
}

TEST_CASE("device_sparsified_sgd: bad arguments are refused, naming them") {
  const setup_t s{{10, 20}, 0.1, {}, 0};
  auto ranks = make_ranks(s, 1, false);
  auto& k = ranks[0];
  const snapshot_t before = snapshot(k);
  const device_span<float> short_params(k.dev_params.data(), 29);
  const device_span<const float> grads(k.dev_grad.data(), 30);
  try {
    k.dev->step(short_params, grads);
    FAIL("a short params was accepted");
  } catch (const invalid_argument& e) {
    CHECK(std::string(e.what()).find("params.size()") != std::string::npos);
  }
  try {
    k.dev->commit_step(device_span<float>(k.dev_params.data(), 30));
    FAIL("commit_step without a staged step was accepted");
  } catch (const invalid_argument& e) {
    CHECK(std::string(e.what()).find("exchange_step") != std::string::npos);
  }
  check_unchanged(k, before, 0);
  sgd_options bad{};
  bad.lr = -1.0;
  CHECK_THROWS_AS(device_t(*k.staged, s.sizes, C{}, sparse_allgather{}, bad,
                           density_schedule::constant(0.1)),
                  invalid_argument);
  // NaN and Inf pass through only on the host so far (the residual keeps e - v there).
  const C propagate(topk{}, identity{}, residual{}, nonfinite_policy::propagate);
  try {
    device_t d(*k.staged, s.sizes, propagate, sparse_allgather{}, {}, density_schedule::constant(0.1));
    FAIL("nonfinite_policy::propagate was accepted");
  } catch (const invalid_argument& e) {
    CHECK(std::string(e.what()).find("nonfinite") != std::string::npos);
  }
}

// ---- the dense path: compressor<dense, Q, residual> with dense_allreduce (Q identity, fp16,
// bf16) ----------------------------------------------------------------------------------------
// A dense step leaves the residual 0, so each test first loads a checkpoint whose residual is
// not (the format both drivers load, detail/sgd_checkpoint.hpp): the step then adds e + g
// with e != 0, and a step that wrongly wrote the committed residual would show.

namespace {

// Rank r's checkpoint at `step`: a heavy-tailed residual of its own, the velocity zero; with
// `big`, e = 3e38 at flat index `at` (e + g overflows where g is as large).
std::string residual_checkpoint(const setup_t& s, int r, std::uint64_t step, bool big = false,
                                std::size_t at = 0) {
  const std::vector<tensor_spec> tensors = detail::tensor_specs(s.sizes);
  const std::size_t n = total_of(s);
  std::vector<float> e(n);
  for (std::size_t i = 0; i < n; ++i) e[i] = 0.5f * gradient_value(1, r + 8, 99, i);
  if (big) e[at] = 3e38f;
  const std::vector<float> v(s.opt.momentum > 0.0 ? n : 0, 0.0f);
  std::vector<std::size_t> offsets(tensors.size(), 0);
  for (std::size_t t = 1; t < tensors.size(); ++t) offsets[t] = offsets[t - 1] + tensors[t - 1].size;
  std::ostringstream os;
  detail::save_sgd_checkpoint<float>(
      os, "test", step, std::span<const tensor_spec>(tensors),
      [&](std::size_t t) {
        return std::vector<std::span<const float>>{{e.data() + offsets[t], tensors[t].size}};
      },
      std::span<const float>(v));
  return os.str();
}

// Both drivers of every rank load rank r's residual_checkpoint (with `big` on rank big_rank).
template <class Pol>
void load_both(std::vector<rank_t<Pol>>& ranks, const setup_t& s, std::uint64_t step,
               int big_rank = -1, std::size_t at = 0) {
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    const std::string cp =
        residual_checkpoint(s, static_cast<int>(r), step, static_cast<int>(r) == big_rank, at);
    std::istringstream a(cp), b(cp);
    ranks[r].host->load_state(a);
    ranks[r].dev->load_state(b);
  }
}

}  // namespace

TEST_CASE_TEMPLATE("device_sparsified_sgd, dense with dense_allreduce: the host step bit for bit, P = 1, 2, 4",
                   Q, identity, fp16, bf16) {
  // The density is not used by the dense selector: every step sends every coordinate. Each
  // layout starts from a residual that is not 0. fp16 and bf16: the codes are added (fp16's
  // divided by P first), and the residual keeps what each code lost, as the host's.
  check_bit_for_bit<summed_dense_p<Q>>(
      [](auto& ranks, const setup_t& s) { load_both(ranks, s, 0); },
      [](auto& k, const setup_t& s) {
        const step_stats& st = k.dev->last_stats();
        CHECK(st.selected == total_of(s));
        for (std::size_t t = 0; t < st.tensors.size(); ++t) {
          CAPTURE(t);
          CHECK(st.tensors[t].exchange == "dense_allreduce");
          CHECK(st.tensors[t].contraction == k.host->last_stats().tensors[t].contraction);
          // The reduced buffer: 4 bytes a value, 2 a code; and 8 for the count.
          CHECK(st.tensors[t].bytes_sent == st.tensors[t].n * (std::is_same_v<Q, identity> ? 4 : 2) + 8);
        }
      });
}

TEST_CASE_TEMPLATE("device_sparsified_sgd, dense with fp16 or bf16: large values are sent as the host sends them, the rest kept in the residual",
                   Q, fp16, bf16) {
  // e = 3e38 at one index of the last rank: fp16 sends 65504 (it saturates) and keeps the
  // excess in e; bf16 sends its nearest code and keeps the rounding error. Both drivers alike,
  // at P = 1, 2 and 4, and that residual exactly the expected one.
  const setup_t s{{100, 2000}, 1.0, {}, 0};
  const std::size_t at = 100 + 1234;
  for (const int P : {1, 2, 4}) {
    CAPTURE(P);
    auto ranks = make_ranks<summed_dense_p<Q>>(s, P);
    load_both(ranks, s, 0, P - 1, at);
    step_both(ranks, s, 0);
    for (int r = 0; r < P; ++r) check_same_state(ranks[static_cast<std::size_t>(r)], r);
    const std::vector<float> e = down(ranks.back().dev->residual(1));
    const float x = 3e38f + gradient(total_of(s), 0, P - 1, 0)[at];  // e + g, what is encoded
    const float sent = std::is_same_v<Q, fp16>
                           ? 65504.0f
                           : detail::bf16_bits_to_float(detail::float_to_bf16_bits(x));
    CAPTURE(x);
    CAPTURE(sent);
    CHECK(e[1234] == x - sent);
    if constexpr (std::is_same_v<Q, bf16>) CHECK(sent > 2.9e38f);
  }
}

TEST_CASE_TEMPLATE("device_sparsified_sgd, dense: a failed collective or a lying count changes nothing on any rank",
                   Q, identity, fp16, bf16) {
  using dense_p = summed_dense_p<Q>;
  sgd_options opt{};
  opt.lr = 0.05;
  opt.momentum = 0.9;
  const setup_t s{{1000, 37, 4096}, 1.0, opt, 1};
  for (const int P : {2, 3}) {
    CAPTURE(P);
    auto ranks = make_ranks<dense_p>(s, P);
    step_both(ranks, s, 0);
    load_both(ranks, s, 1);  // a residual that is not 0
    // Two collectives: the counts and statuses, then the allreduce; a count that is not the
    // tensor's size (call 0) is refused before the allreduce.
    check_faults_change_nothing(ranks, s, 2, {0});
  }
}

TEST_CASE_TEMPLATE("device_sparsified_sgd, dense: a non-finite gradient or e + g fails the step on every rank",
                   Q, identity, fp16, bf16) {
  using dense_p = summed_dense_p<Q>;
  const setup_t s{{100, 2000}, 1.0, {}, 2};
  const std::size_t at = 100 + 1234;  // tensor 1, index 1234
  // An infinite gradient; then e = 3e38 and g = 3e38, whose sum overflows (the retried step's
  // g is finite and small: e + g = 3e38 is sent).
  for (const bool overflow : {false, true}) {
    for (const int P : {1, 2}) {
      CAPTURE(overflow);
      CAPTURE(P);
      auto ranks = make_ranks<dense_p>(s, P);
      step_both(ranks, s, 0);
      load_both(ranks, s, 1, overflow ? P - 1 : -1, at);
      check_nonfinite_fails_everywhere(ranks, s, P - 1, at, overflow ? 3e38f : -INFINITY, 1, 1234);
    }
  }
}

TEST_CASE_TEMPLATE("device_sparsified_sgd, quantized top-k: the host step bit for bit, P = 1, 2, 4",
                   Q, fp16, bf16, qsgd, terngrad, scaled_sign) {
  // The codes and side values are the host encoder's (the same call_id per rank, step and
  // tensor), the residual keeps (e + g) - decoded, every rank's payloads are decoded and added
  // in rank order; each layout starts from a residual that is not 0. qsgd (buckets of 512,
  // many per tensor) runs every layout; the others the small ones, to keep the test short.
  check_bit_for_bit<quantized_p<Q>>(
      [](auto& ranks, const setup_t& s) { load_both(ranks, s, 0); },
      [](auto& k, const setup_t&) {
        const step_stats& st = k.dev->last_stats();
        const auto others = static_cast<std::size_t>(k.staged->size() - 1);
        for (std::size_t t = 0; t < st.tensors.size(); ++t) {
          CAPTURE(t);
          const tensor_stats& ts = st.tensors[t];
          CHECK(ts.exchange == "sparse_allgather");
          // An index each, the host encoder's codes and side values for as many values, and
          // the count; every rank sends as many picks of each tensor.
          const payload p = host_encoded<Q>(ts.selected);
          CHECK(ts.bytes_sent == 4 * ts.selected + p.values.size() + 4 * p.side.size() + 8);
          CHECK(ts.bytes_received == others * ts.bytes_sent);
        }
      },
      /*small_only=*/!std::is_same_v<Q, qsgd>);
}

TEST_CASE_TEMPLATE("device_sparsified_sgd, quantized top-k: a failed step or a lying peer changes nothing on any rank",
                   Q, fp16, bf16, qsgd, terngrad, scaled_sign) {
  // Four collectives: the counts, the picks' indices, the packed codes, the side values. A
  // lying peer: a corrupted count (call 0), corrupted indices (call 1), or (for the
  // quantizers with side values) a first side value with its bits inverted, negative or not
  // finite (call 3), refused by the decoder's checks on every rank. Corrupted codes can be
  // valid codes, so call 2 is not among them.
  const bool has_side = device_encoded_size(Q{}, 100).side_count > 0;
  check_faults_at_2_and_3<quantized_p<Q>>(
      1, 4, has_side ? std::vector<std::size_t>{0, 1, 3} : std::vector<std::size_t>{0, 1});
}

TEST_CASE("device_sparsified_sgd, quantized top-k: a non-finite gradient fails the step on every rank") {
  check_nonfinite_in_tensor_1<quantized_p<qsgd>>(2, INFINITY);
}

TEST_CASE_TEMPLATE("device_sparsified_sgd, threshold: the host step bit for bit, P = 1, 2, 4", Q,
                   identity, qsgd) {
  // Counts that the device learns only after its selection: each rank's own, packed, gathered
  // and added like top-k's (quantized: the small layouts). From a zero residual, so that with
  // the gradients of multiples of 1/8 (unquantized, the residual keeps such values too) e + g
  // has values exactly at tau in every step; an empty tensor's statistics name tau as well.
  check_bit_for_bit<threshold_p<Q>>(
      [](auto&, const setup_t&) {},
      [](auto& k, const setup_t&) {
        const step_stats& st = k.dev->last_stats();
        for (std::size_t t = 0; t < st.tensors.size(); ++t) {
          CAPTURE(t);
          CHECK(st.tensors[t].threshold == 0.75);
        }
      },
      /*small_only=*/!std::is_same_v<Q, identity>);
}

TEST_CASE("device_sparsified_sgd, threshold: a failed step or a lying peer changes nothing on any rank") {
  // As top-k's: the counts, the indices, the values; a corrupted count or corrupted indices.
  check_faults_at_2_and_3<threshold_p<identity>>(2, 3, {0, 1});
}

TEST_CASE("device_sparsified_sgd, threshold: a non-finite gradient fails the step on every rank") {
  // NaN and Inf are always selected (NaN ranks above +Inf, and Inf >= tau), so the check of
  // the packed picks finds them.
  check_nonfinite_in_tensor_1<threshold_p<identity>>(0, std::nanf(""));
}

TEST_CASE_TEMPLATE("device_sparsified_sgd, gaussiank: the host step bit for bit, P = 1, 2, 4", Pol,
                   gaussiank_p<identity>, gaussiank_p<identity, true>, gaussiank_p<qsgd>) {
  // Counts the device learns after its selection, as threshold's, with the addition of g
  // fused into the statistics pass, as top-k's; the default form (in the band, or the exact
  // top-k when its thresholds miss it) and the published one (its threshold's set). Quantized
  // (the small layouts), the residual also holds quantization errors off the 1/8 grid at the
  // coordinates sent before: the sums then differ in their last bits (about 1e-7 relative),
  // and a set differs only if one of those few hundred values lies that close to the
  // threshold. Either way the outcome is deterministic: both sides reduce in a fixed order.
  check_bit_for_bit<Pol>([](auto&, const setup_t&) {}, [](auto&, const setup_t&) {},
                         /*small_only=*/!std::is_same_v<typename Pol::C::quantizer_type, identity>);
}

TEST_CASE("device_sparsified_sgd, gaussiank: a failed step or a lying peer changes nothing on any rank") {
  check_faults_at_2_and_3<gaussiank_p<identity>>(2, 3, {0, 1});
}

TEST_CASE("device_sparsified_sgd, gaussiank: a non-finite gradient fails the step on every rank") {
  // NaN makes the statistics non-finite: the device Gaussian-k takes the exact top-k, which
  // ranks NaN above every value, so the check of the packed picks finds it.
  check_nonfinite_in_tensor_1<gaussiank_p<identity>>(2, std::nanf(""));
}

TEST_CASE_TEMPLATE("device_sparsified_sgd, randomk: the host step bit for bit, P = 1, 2, 4", Q,
                   identity, qsgd) {
  // Fixed counts as top-k's, from indices that do not depend on the values: the same on every
  // rank, so the rank-order sums add P values at each pick (quantized: the small layouts).
  check_bit_for_bit<randomk_p<Q>>([](auto&, const setup_t&) {}, [](auto&, const setup_t&) {},
                                  /*small_only=*/!std::is_same_v<Q, identity>);
}

TEST_CASE("device_sparsified_sgd, randomk: a failed step or a lying peer changes nothing on any rank") {
  check_faults_at_2_and_3<randomk_p<identity>>(1, 3, {0, 1});
}

TEST_CASE("device_sparsified_sgd, randomk: a NaN or Inf that is not picked fails the step on every rank") {
  // At density 0.01, tensor 1 (2000 elements) sends 20 picks, drawn in the faulty step (step
  // 1) without index 1234 (checked here): the check reads every coordinate of e + g, not only
  // the picks, as the host's.
  std::vector<std::uint32_t> picks(20);
  detail::floyd_sampler sampler;
  randomk::draw(sampler, 2000, 20, call_id{sgd_options{}.seed, 1, 1, 0}, picks.data());
  REQUIRE(std::find(picks.begin(), picks.end(), 1234u) == picks.end());
  check_nonfinite_in_tensor_1<randomk_p<identity>>(0, std::nanf(""));
  check_nonfinite_in_tensor_1<randomk_p<identity>>(1, INFINITY);
}

TEST_CASE("device_sparsified_sgd, randomk: a NaN or Inf that is picked is refused with its value") {
  // The faulty step's first pick of tensor 1: gather_and_clear zeroes it in e, so the refusal
  // names the value the check kept before (as the host's, which reads e + g).
  std::vector<std::uint32_t> picks(20);
  detail::floyd_sampler sampler;
  randomk::draw(sampler, 2000, 20, call_id{sgd_options{}.seed, 1, 1, 0}, picks.data());
  const setup_t s{{100, 2000}, 0.01, {}, 0};
  for (const float bad : {-INFINITY, std::nanf("")}) {
    for (const int P : {1, 2}) {
      CAPTURE(bad);
      CAPTURE(P);
      auto ranks = make_ranks<randomk_p<identity>>(s, P);
      step_both(ranks, s, 0);
      check_nonfinite_fails_everywhere(ranks, s, P - 1, 100 + picks[0], bad, 1, picks[0]);
    }
  }
}

TEST_CASE_TEMPLATE("device_sparsified_sgd, randomk with dense_allreduce: the host step bit for bit, P = 1, 2, 4",
                   Q, identity, fp16, bf16) {
  // The sum of every rank's values (fp16, bf16: codes; fp16's divided by P first) at the
  // shared indices, each divided by P (fp16: not again), as the host's dense_allreduce; the
  // statistics name the exchange and count 4 bytes a value or 2 a code, and 16 a tensor.
  check_bit_for_bit<summed_randomk_p<Q>>(
      [](auto&, const setup_t&) {},
      [](auto& k, const setup_t&) {
        for (const tensor_stats& ts : k.dev->last_stats().tensors) {
          CHECK(ts.exchange == "dense_allreduce");
          CHECK(ts.bytes_sent == ts.selected * (std::is_same_v<Q, identity> ? 4 : 2) + 16);
        }
      });
}

TEST_CASE_TEMPLATE("device_sparsified_sgd, randomk with dense_allreduce: a failed step or a lying peer changes nothing on any rank",
                   Q, identity, fp16, bf16) {
  // Three collectives: the counts, the hashes of the picks, the allreduce. A lying peer: a
  // corrupted count (call 0) or a corrupted hash (call 1: as a rank whose indices differ),
  // refused on every rank naming it, before the allreduce.
  check_faults_at_2_and_3<summed_randomk_p<Q>>(1, 3, {0, 1});
}

TEST_CASE_TEMPLATE("device_sparsified_sgd, randomk with dense_allreduce: a non-finite gradient fails the step on every rank",
                   Q, identity, fp16, bf16) {
  check_nonfinite_in_tensor_1<summed_randomk_p<Q>>(0, INFINITY);
}

TEST_CASE("device_sparsified_sgd, randomk with dense_allreduce: ranks with other seeds are refused before the allreduce") {
  // Rank 1's seed differs: its indices do too, and every rank refuses the step naming a rank,
  // with nothing changed, after the counts and the hashes (2 collectives) and before the
  // allreduce.
  const setup_t s{{1000, 37}, 0.05, {}, 0};
  using D = randomk_allreduce_p::device_t;
  const int P = 2;
  auto ranks = make_ranks<randomk_allreduce_p>(s, P, /*with_host=*/false);
  sgd_options other = s.opt;
  other.seed = 12345;
  ranks[1].dev = std::make_unique<D>(*ranks[1].staged, s.sizes, randomk_allreduce_p::make(),
                                     dense_allreduce{}, other, density_schedule::constant(s.density));
  std::vector<snapshot_t> before;
  for (auto& k : ranks) before.push_back(snapshot(k));
  const auto errors = device_steps(ranks, s, 0);
  for (int r = 0; r < P; ++r) {
    CAPTURE(r);
    REQUIRE(errors[static_cast<std::size_t>(r)] != nullptr);
    const std::string what = what_of(errors[static_cast<std::size_t>(r)]);
    CAPTURE(what);
    CHECK(what.find("other Random-k indices") != std::string::npos);
    CHECK(ranks[static_cast<std::size_t>(r)].comm->calls() == 2);
    check_unchanged(ranks[static_cast<std::size_t>(r)], before[static_cast<std::size_t>(r)], r);
  }
}

TEST_CASE_TEMPLATE("device_sparsified_sgd, DGC feedback: the host step bit for bit, P = 1, 2, 4", Pol,
                   dgc_p<topk, identity>, dgc_clip_p, dgc_p<topk, qsgd>, dgc_p<threshold, identity>,
                   dgc_p<randomk, identity>) {
  // u and v after every step as the host's (check_same_state), and the checkpoint (u, then v,
  // per tensor) the host's byte for byte. Quantized (the small layouts), v keeps the error.
  check_bit_for_bit<Pol>(
      [](auto&, const setup_t&) {},
      [](auto& k, const setup_t&) {
        std::ostringstream host_cp;
        k.host->save_state(host_cp);
        CHECK(checkpoint_of(*k.dev) == host_cp.str());
      },
      /*small_only=*/!std::is_same_v<typename Pol::C::quantizer_type, identity>);
}

TEST_CASE("device_sparsified_sgd, DGC feedback: a failed step or a lying peer changes nothing on any rank") {
  check_faults_at_2_and_3<dgc_p<topk, identity>>(1, 3, {0, 1});
}

TEST_CASE("device_sparsified_sgd, DGC feedback: a non-finite gradient fails the step on every rank") {
  // The accumulation pass checks every v it writes: NaN and Inf, picked or not.
  check_nonfinite_in_tensor_1<dgc_p<topk, identity>>(0, std::nanf(""));
  check_nonfinite_in_tensor_1<dgc_p<randomk, identity>>(1, -INFINITY);
}

TEST_CASE("device_sparsified_sgd, DGC feedback: SGD momentum and DGC settings out of range are refused") {
  const setup_t s{{10, 20}, 0.1, {}, 0};
  auto ranks = make_ranks<dgc_p<topk, identity>>(s, 1, /*with_host=*/false);
  using D = dgc_p<topk, identity>::device_t;
  using DC = dgc_p<topk, identity>::C;
  const auto schedule = density_schedule::constant(s.density);
  sgd_options with_momentum{};
  with_momentum.momentum = 0.9;
  CHECK_THROWS_WITH_AS(D(*ranks[0].staged, s.sizes, DC{}, sparse_allgather{}, with_momentum, schedule),
                       doctest::Contains("momentum"), invalid_argument);
  CHECK_THROWS_WITH_AS(D(*ranks[0].staged, s.sizes, DC(topk{}, identity{}, dgc_momentum{1.0, 0.0}),
                         sparse_allgather{}, s.opt, schedule),
                       doctest::Contains("0 <= momentum < 1"), invalid_argument);
  CHECK_THROWS_WITH_AS(D(*ranks[0].staged, s.sizes, DC(topk{}, identity{}, dgc_momentum{0.9, -1.0}),
                         sparse_allgather{}, s.opt, schedule),
                       doctest::Contains("clip_norm"), invalid_argument);
}

TEST_CASE("device_sparsified_sgd, DGC feedback: checkpoints move from the host driver to the device driver and back") {
  using Pol = dgc_p<topk, identity>;
  const setup_t s{{300, 5000}, 0.02, {}, 1};
  const auto schedule = density_schedule::constant(s.density);
  auto ranks = make_ranks<Pol>(s, 1);
  auto& k = ranks[0];
  step_both(ranks, s, 0);
  step_both(ranks, s, 1);
  // The host's u and v into a fresh device driver, whose steps are then the host's.
  std::ostringstream host_cp;
  k.host->save_state(host_cp);
  auto fresh = std::make_unique<Pol::device_t>(*k.staged, s.sizes, Pol::make(), sparse_allgather{},
                                               s.opt, schedule);
  std::istringstream in(host_cp.str());
  fresh->load_state(in);
  CHECK(checkpoint_of(*fresh) == host_cp.str());
  k.dev = std::move(fresh);
  step_both(ranks, s, 2);
  check_same_state(k, 0);
  // The device's into a fresh host driver: the same, the other way.
  auto fresh_host = std::make_unique<Pol::host_t>(*k.comm, s.sizes, Pol::make(), sparse_allgather{},
                                                  s.opt, schedule);
  std::istringstream dev_in(checkpoint_of(*k.dev));
  fresh_host->load_state(dev_in);
  k.host = std::move(fresh_host);
  step_both(ranks, s, 3);
  check_same_state(k, 0);
}

TEST_CASE("device_sparsified_sgd, DGC feedback: an accumulation that overflows is refused, as on the host") {
  // Random-k at density 0.01 picks 20 of tensor 1's 2000 coordinates, drawn without index 1234
  // in step 0 (checked here): v keeps the 2e38 step 0 adds there. In step 1, g = 1e38 there
  // gives u = 0.9 * 2e38 + 1e38, finite, and v = 2e38 + u, which overflows.
  using Pol = dgc_p<randomk, identity>;
  std::vector<std::uint32_t> picks(20);
  detail::floyd_sampler sampler;
  randomk::draw(sampler, 2000, 20, call_id{sgd_options{}.seed, 0, 1, 0}, picks.data());
  REQUIRE(std::find(picks.begin(), picks.end(), 1234u) == picks.end());
  const setup_t s{{100, 2000}, 0.01, {}, 0};
  auto ranks = make_ranks<Pol>(s, 1);
  auto& k = ranks[0];
  // One step of the host driver, the device driver or both, g[1234] of tensor 1 = at_1234.
  const auto step_with = [&](int step, float at_1234, bool host, bool device) {
    return run_world(1, [&](int r, in_process_comm& comm, in_process_world&) {
      k.comm->rebind(comm);
      k.comm->disarm();
      k.comm->on_throw = nullptr;
      std::vector<float> g = gradient(total_of(s), s.kind, r, step);
      g[100 + 1234] = at_1234;
      if (host) k.host->step(std::span<float>(k.host_params), std::span<const float>(g));
      if (device) device_step(k, g);
    });
  };
  require_none_threw(step_with(0, 2e38f, true, true));
  check_same_state(k, 0);
  const snapshot_t before = snapshot(k);
  for (const bool host : {false, true}) {
    CAPTURE(host);
    const auto errors = step_with(1, 1e38f, host, !host);
    REQUIRE(errors[0] != nullptr);
    const std::string what = what_of(errors[0]);
    CAPTURE(what);
    CHECK(what.find("tensor 1 ") != std::string::npos);
    CHECK(what.find(host ? "overflowed to inf at index 1234" : "holds inf at index 1234") !=
          std::string::npos);
  }
  check_unchanged(k, before, 0);
  // Both drivers' state as it was: the next step is the same on both (g = -2e38 there: u =
  // 0.9 * 2e38 - 2e38 and v = 2e38 + u, finite).
  require_none_threw(step_with(1, -2e38f, true, true));
  check_same_state(k, 0);
}

// ---- gTop-k: the merge tree on the device (cuda/gtopk.cuh) -----------------------------------

TEST_CASE_TEMPLATE("device_sparsified_sgd, gtopk: the host step bit for bit, P = 1, 2, 4", Pol,
                   gtopk_p<topk, identity>, gtopk_p<topk, identity, true>, gtopk_p<topk, qsgd>,
                   gtopk_p<threshold, identity>, gtopk_p<randomk, identity, true>, gtopk_dgc_p) {
  // The staged average is the tree's (or the exact) sums over P at the host's global indices,
  // and the residual (DGC: v) holds the picks left out, as the host's restore: every rank's
  // state is the host's (check_same_state), each tensor's count of restored picks too. With
  // top-k and threshold the ranks pick different indices at P = 2 and 4, so some picks are
  // left out (Random-k's indices are every rank's: none are).
  std::size_t restored = 0;
  check_bit_for_bit<Pol>(
      [](auto&, const setup_t&) {},
      [&restored](auto& k, const setup_t&) {
        const auto& d = k.dev->last_stats().tensors;
        const auto& h = k.host->last_stats().tensors;
        REQUIRE(d.size() == h.size());
        for (std::size_t t = 0; t < d.size(); ++t) {
          CAPTURE(t);
          CHECK(d[t].restored == h[t].restored);
          CHECK(d[t].exchange == "gtopk");
          restored += d[t].restored;
        }
      },
      /*small_only=*/!std::is_same_v<typename Pol::C::quantizer_type, identity>);
  if constexpr (std::is_same_v<typename Pol::C::selector_type, randomk>) {
    CHECK(restored == 0);
  } else {
    CHECK(restored > 0);
  }
}

TEST_CASE("device_sparsified_sgd, gtopk: a tensor whose union is sorted on its own (2^16 picks or more)") {
  // 2^20 + 3 elements at density 0.1: k = 104858, so each merge's union (up to 2 k) and the k
  // kept are sorted by cub::DeviceRadixSort, not by the segmented sort; beside a small tensor
  // that the segmented sort still takes. The host step bit for bit at P = 2 and 4.
  if (std::getenv("GRADCOMP_CUDA_TEST_SMALL") != nullptr) return;
  sgd_options opt{};
  opt.lr = 0.05;
  opt.momentum = 0.9;
  const setup_t s{{(std::size_t{1} << 20) + 3, 5000}, 0.1, opt, 1};
  for (const int P : {2, 4}) {
    CAPTURE(P);
    auto ranks = make_ranks<gtopk_p<topk, identity>>(s, P);
    for (int step = 0; step < 2; ++step) {
      CAPTURE(step);
      step_both(ranks, s, step);
      for (int r = 0; r < P; ++r) {
        check_same_state(ranks[static_cast<std::size_t>(r)], r);
        const auto& d = ranks[static_cast<std::size_t>(r)].dev->last_stats().tensors;
        const auto& h = ranks[static_cast<std::size_t>(r)].host->last_stats().tensors;
        CHECK(d[0].restored == h[0].restored);
        CHECK(d[0].restored > 0);
      }
    }
  }
}

TEST_CASE_TEMPLATE("device_sparsified_sgd, gtopk: a failed step or a lying peer changes nothing on any rank",
                   Pol, gtopk_p<topk, identity>, gtopk_p<topk, identity, true>) {
  // The collectives: the counts, ceil(log2 P) rounds of the tree, the broadcast, and for the
  // exact sums an allreduce. A lying peer: a corrupted count (call 0), or the last rank's
  // message up the tree (its status word: refused by the rank it goes to, and the refusal
  // broadcast, every rank naming the sender); then rank 0's broadcast of a corrupted set.
  sgd_options opt{};
  opt.lr = 0.05;
  opt.momentum = 0.9;
  const setup_t s{{1000, 37, 4096}, 0.05, opt, 1};
  const std::size_t exact = Pol::make_x().values() == gtopk_values::exact ? 1 : 0;
  for (const int P : {2, 3}) {
    CAPTURE(P);
    const std::size_t rounds = detail::ceil_log2(static_cast<std::size_t>(P));
    auto ranks = make_ranks<Pol>(s, P);
    step_both(ranks, s, 0);
    check_faults_change_nothing(ranks, s, 2 + rounds + exact, {0, rounds});
    check_faults_change_nothing(ranks, s, 0, {1 + rounds}, /*corrupter=*/0);
  }
}

TEST_CASE("device_sparsified_sgd, gtopk: a non-finite gradient fails the step on every rank") {
  check_nonfinite_in_tensor_1<gtopk_p<topk, identity>>(0, std::nanf(""));
}

// ---- dense SGD over sparse_allgather (quantizers that are not summable) ----------------------

TEST_CASE_TEMPLATE("device_sparsified_sgd, dense with sparse_allgather: the host step bit for bit, P = 1, 2, 4",
                   Q, identity, qsgd, terngrad, scaled_sign) {
  // Every coordinate of e + g encoded with the host step's call_id (the same random draws), the
  // residual keeping e + g - decoded, every rank's codes decoded and added in rank order; no
  // indices travel (the host's payloads use index_layout::dense). Each layout starts from a
  // residual that is not 0; the quantizers run the four small layouts.
  check_bit_for_bit<gathered_dense_p<Q>>(
      [](auto& ranks, const setup_t& s) { load_both(ranks, s, 0); },
      [](auto& k, const setup_t& s) {
        const step_stats& st = k.dev->last_stats();
        CHECK(st.selected == total_of(s));
        const auto others = static_cast<std::size_t>(k.staged->size() - 1);
        for (std::size_t t = 0; t < st.tensors.size(); ++t) {
          CAPTURE(t);
          const tensor_stats& ts = st.tensors[t];
          CHECK(ts.exchange == "sparse_allgather");
          CHECK(ts.contraction == k.host->last_stats().tensors[t].contraction);
          // The host encoder's codes (identity: 4 bytes a value) and side values for every
          // coordinate, and the count.
          const payload p = host_encoded<Q>(ts.n);
          CHECK(ts.bytes_sent == p.values.size() + 4 * p.side.size() + 8);
          CHECK(ts.bytes_received == others * ts.bytes_sent);
        }
      },
      /*small_only=*/!std::is_same_v<Q, identity>);
}

TEST_CASE_TEMPLATE("device_sparsified_sgd, dense with sparse_allgather: a failed step or a lying peer changes nothing on any rank",
                   Q, identity, qsgd, terngrad, scaled_sign) {
  // The collectives: the counts, then the values (identity) or the packed codes and the side
  // values. A lying peer: a corrupted count (call 0: each rank must announce every tensor's
  // size), or a first side value with its bits inverted (call 2), refused by the decoder's
  // checks on every rank.
  constexpr bool quantized = !std::is_same_v<Q, identity>;
  check_faults_at_2_and_3<gathered_dense_p<Q>>(
      1, quantized ? 3 : 2, quantized ? std::vector<std::size_t>{0, 2} : std::vector<std::size_t>{0});
}

TEST_CASE("device_sparsified_sgd, dense with sparse_allgather: a non-finite gradient fails the step on every rank") {
  check_nonfinite_in_tensor_1<gathered_dense_p<qsgd>>(0, INFINITY);
}

// ---- TopK-A2A: the picks to their shards' owners (cuda/sparsified_sgd.cuh) -------------------

TEST_CASE_TEMPLATE("device_sparsified_sgd, topk_a2a: the host step bit for bit, P = 1, 2, 4", Pol,
                   a2a_p<topk, identity>, a2a_p<topk, identity, 1000>, a2a_p<topk, qsgd>,
                   a2a_p<threshold, identity>, a2a_p<randomk, fp16>, a2a_dgc_p) {
  // Each owner's shard is the rank-order sum of the picks sent to it, over P, the host's bits;
  // the host's buckets (here of 1000 elements) change its messages, not its result. The bytes:
  // over the ranks of one step, the pairs one rank sends another are the pairs that rank
  // receives, and each shard goes to the P - 1 others, so the totals differ by what every
  // rank's counts and verdict cost and by the shards: checked once every rank has stepped.
  std::size_t sent = 0, received = 0;
  check_bit_for_bit<Pol>(
      [](auto&, const setup_t&) {},
      [&](auto& k, const setup_t& s) {
        const step_stats& st = k.dev->last_stats();
        for (const tensor_stats& ts : st.tensors) CHECK(ts.exchange == "topk_a2a");
        sent += st.bytes_sent;
        received += st.bytes_received;
        const auto P = static_cast<std::size_t>(k.staged->size());
        if (static_cast<std::size_t>(k.staged->rank()) + 1 < P) return;
        const std::size_t nt = s.sizes.size(), n = total_of(s);
        // Per rank: 8 a tensor's count and 8 (P + 1) for the owners' counts and the verdict,
        // to the others and from each of them; 4 a shard element out, the others' in.
        const std::size_t words = 8 * (nt + P + 1);
        CHECK(sent >= P * words + 4 * n);
        CHECK(received + P * words + 4 * n == sent + P * (P - 1) * words + 4 * n * (P - 1));
        sent = received = 0;
      },
      /*small_only=*/!std::is_same_v<typename Pol::C::quantizer_type, identity>);
}

TEST_CASE("device_sparsified_sgd, topk_a2a: a failed step or a lying peer changes nothing on any rank") {
  // The collectives: the counts (with the counts for the owners), the indices and the values
  // to the owners, the verdicts, the shards. A lying peer: a corrupted count (call 0),
  // corrupted indices (call 1: the first pick it sends an owner is then outside that owner's
  // shard, refused there and the refusal gathered, every rank naming the sender), or a
  // corrupted verdict (call 3: an unknown one, refused on every rank).
  check_faults_at_2_and_3<a2a_p<topk, identity>>(1, 5, {0, 1, 3});
}

TEST_CASE("device_sparsified_sgd, topk_a2a: a non-finite gradient fails the step on every rank") {
  check_nonfinite_in_tensor_1<a2a_p<topk, identity>>(0, std::nanf(""));
}
