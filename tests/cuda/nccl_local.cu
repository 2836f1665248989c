// nccl_comm without MPI: one process, one thread per CUDA device, each thread a rank of one
// NCCL communicator made by nccl_comm::from_unique_id from a shared ncclUniqueId. Runs the
// checks of tests/support/nccl_checks.cuh (the device collectives and every exchange through
// the host API), then the device-resident step (device_sparsified_sgd) over NCCL against the
// host step over the same communicator, bit for bit, and its graph_step captured in CUDA graphs
// against step() and the uncaptured graph_step. First, on any machine, it checks that from_unique_id rejects a bad size or
// rank before NCCL sees it. `nccl_comm_local [ranks]` uses that many devices (default: all).
// A rank that throws ends the process at once (exit 1): the others would wait for it forever.
// Without a CUDA device it then prints "SKIPPED: ..." and exits with 77, which ctest reports
// as skipped (a failed argument check fails it even there). On one GPU the
// communicator has one rank (NCCL allows one rank per device in a communicator).
#include <cuda_runtime.h>
#include <nccl.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <gradcomp/comm/nccl.hpp>
#include <gradcomp/cuda.cuh>
#include <gradcomp/cuda/sparsified_sgd.cuh>
#include <gradcomp/error.hpp>
#include <gradcomp/sparsified_sgd.hpp>

#include "../support/nccl_checks.cuh"

namespace {

using namespace gradcomp;
using gradcomp_test::nccl_checks::check;

// Each bad (size, rank) must throw gradcomp::invalid_argument naming the argument.
void bad_arguments(const ncclUniqueId& id) {
  struct bad_case {
    int size, rank;
    const char* names;
  };
  for (const bad_case c : {bad_case{0, 0, "'size' = 0"}, bad_case{-1, 0, "'size' = -1"},
                           bad_case{2, 2, "'rank' = 2"}, bad_case{2, -1, "'rank' = -1"}}) {
    std::string what;
    try {
      const nccl_comm comm = nccl_comm::from_unique_id(id, c.size, c.rank, nullptr);
      what = "no exception";
    } catch (const invalid_argument& e) {
      what = e.what();
    } catch (const std::exception& e) {
      what = std::string("another exception: ") + e.what();
    }
    check(what.find(c.names) != std::string::npos,
          "from_unique_id(size " + std::to_string(c.size) + ", rank " + std::to_string(c.rank) +
              ") should reject " + c.names + "; got: " + what,
          -1);
  }
}

// g = rank `me`'s gradient of step `step`: heavy-tailed, distinct per rank and step.
void gradient_into(std::vector<float>& g, int step, int me) {
  for (std::size_t i = 0; i < g.size(); ++i) {
    const auto h = static_cast<std::uint32_t>((i * 2654435761u) ^ (static_cast<std::size_t>(step) << 20) ^
                                              (static_cast<std::size_t>(me) << 28));
    g[i] = (static_cast<float>(h % 2001) - 1000.0f) / (1.0f + static_cast<float>(h % 97));
  }
}

// The device-resident step over NCCL (top-k, unquantized and with QSGD: its picks, codes and
// side values through allgatherv_known, its counts through gather_counts; dense: one
// ncclAllReduce of the flat buffer, of floats or of fp16 codes) against the host step over
// the same communicator's host API: the parameters bit for bit after every step (gtopk: its
// tree's ncclSend/ncclRecv rounds and ncclBroadcast, the merges on the device; topk_a2a: its
// picks through alltoallv_known's ncclSend/ncclRecv group, its shards through
// allgatherv_known). The host's
// dense_allreduce reduces tensor by tensor, the device step the whole buffer at once: NCCL may
// add more than two ranks' values in another order for another length, so from 3 ranks on the
// dense step is compared within a relative 1e-5, and fp16's dense step (whose half sums may
// then differ by a rounding step of the largest partial sum) by its residual only, which each
// rank computes alone: bit for bit at every size.
template <class C, class X>
void device_step(nccl_comm& comm) {
  const std::vector<std::size_t> sizes = {1000, 3, 65537};
  sgd_options opt{};
  opt.lr = 0.05;
  opt.momentum = 0.9;
  const auto schedule = density_schedule::constant(0.01);
  sparsified_sgd<C, X, nccl_comm> host(comm, sizes, C{}, X{}, opt, schedule);
  device_sparsified_sgd<C, X, nccl_comm> dev(comm, sizes, C{}, X{}, opt, schedule);
  constexpr bool dense_step = std::is_same_v<X, dense_allreduce>;
  constexpr bool quantized = !std::is_same_v<typename C::quantizer_type, identity>;
  constexpr bool tree = std::is_same_v<X, gtopk>;
  constexpr bool a2a = std::is_same_v<X, topk_a2a>;
  const std::string name = dense_step  ? (quantized ? "device_sparsified_sgd (dense, fp16) over NCCL"
                                                    : "device_sparsified_sgd (dense) over NCCL")
                           : quantized ? "device_sparsified_sgd (top-k, qsgd) over NCCL"
                           : tree      ? "device_sparsified_sgd (gtopk) over NCCL"
                           : a2a       ? "device_sparsified_sgd (topk_a2a) over NCCL"
                                       : "device_sparsified_sgd over NCCL";
  const std::size_t n = dev.size();
  const int me = comm.rank();
  std::vector<float> params(n, 0.25f), g(n), from_device(n);
  device_buffer<float> d_params(n), d_g(n);
  detail::cuda_check(cudaMemcpy(d_params.data(), params.data(), n * sizeof(float), cudaMemcpyHostToDevice),
                     "cudaMemcpy");
  for (int step = 0; step < 4; ++step) {
    gradient_into(g, step, me);
    host.step(std::span<float>(params), std::span<const float>(g));
    detail::cuda_check(cudaMemcpyAsync(d_g.data(), g.data(), n * sizeof(float), cudaMemcpyHostToDevice,
                                       comm.stream()),
                       "cudaMemcpyAsync");
    dev.step(d_params.span(), device_span<const float>(d_g.data(), n));
    detail::cuda_check(cudaMemcpyAsync(from_device.data(), d_params.data(), n * sizeof(float),
                                       cudaMemcpyDeviceToHost, comm.stream()),
                       "cudaMemcpyAsync");
    comm.synchronize();
    bool same = std::memcmp(from_device.data(), params.data(), n * sizeof(float)) == 0;
    if (dense_step && comm.size() > 2) {
      same = true;  // fp16: compared by its residual below
      if constexpr (!quantized) {
        for (std::size_t i = 0; i < n; ++i) {
          same = same && std::fabs(from_device[i] - params[i]) <= 1e-5f * (1.0f + std::fabs(params[i]));
        }
      }
    }
    check(same, name + ": the host step's parameters, step " + std::to_string(step), me);
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      const device_span<const float> e = dev.residual(t);
      std::vector<float> e_host(e.size());
      if (!e.empty()) {
        detail::cuda_check(cudaMemcpy(e_host.data(), e.data(), e.size() * sizeof(float),
                                      cudaMemcpyDeviceToHost),
                           "cudaMemcpy");
      }
      const std::span<const float> want = host.feedback_state(t).buffers()[0];
      check(e_host.size() == want.size() &&
                std::memcmp(e_host.data(), want.data(), want.size() * sizeof(float)) == 0,
            name + ": the host step's residual of tensor " + std::to_string(t) + ", step " +
                std::to_string(step),
            me);
    }
    check(dev.last_stats().selected == host.last_stats().selected,
          name + ": the host step's count, step " + std::to_string(step), me);
  }
}

// device_sparsified_sgd::graph_step over NCCL: three drivers on the same communicator and the
// same gradients, one stepping with step(), one with graph_step() uncaptured
// (capture_graphs(false)), one with graph_step() captured in CUDA graphs and replayed. Their
// parameters, residuals and averages must be bit for bit the same after each of 5 steps, the
// captured one having captured two graphs (one per parity of its double-buffered state, each
// on its second call) and replayed them, on new gradient values in the same buffer. Then a
// NaN in the last rank's gradient fails the replayed step on every rank (that rank's error
// naming the tensor and the index, the others' naming that rank) and changes nothing; the step
// after it is again the others'.
void graph_step_check(nccl_comm& comm) {
  using C = compressor<topk, identity, residual>;
  using D = device_sparsified_sgd<C, sparse_allgather, nccl_comm>;
  const std::vector<std::size_t> sizes = {1000, 0, 3, 65537};
  sgd_options opt{};
  opt.lr = 0.05;
  opt.momentum = 0.9;
  opt.nesterov = true;
  opt.weight_decay = 1e-4;
  const auto schedule = density_schedule::constant(0.01);
  D plain(comm, sizes, C{}, sparse_allgather{}, opt, schedule);
  D queued(comm, sizes, C{}, sparse_allgather{}, opt, schedule);
  D graphed(comm, sizes, C{}, sparse_allgather{}, opt, schedule);
  queued.capture_graphs(false);
  const std::string name = "device_sparsified_sgd::graph_step over NCCL";
  const std::size_t n = plain.size();
  const int me = comm.rank();
  const cudaStream_t s = comm.stream();
  std::vector<float> g(n);
  std::vector<float> start(n, 0.25f);
  device_buffer<float> d_g(n), p_plain(n), p_queued(n), p_graphed(n);
  for (device_buffer<float>* p : {&p_plain, &p_queued, &p_graphed}) {
    detail::cuda_check(cudaMemcpy(p->data(), start.data(), n * sizeof(float), cudaMemcpyHostToDevice),
                       "cudaMemcpy");
  }
  const auto down = [&](const float* d, std::size_t m) {
    std::vector<float> h(m);
    if (m) {
      detail::cuda_check(cudaMemcpyAsync(h.data(), d, m * sizeof(float), cudaMemcpyDeviceToHost, s),
                         "cudaMemcpyAsync");
    }
    comm.synchronize();
    return h;
  };
  const auto same = [&](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };
  const auto compare = [&](const std::string& when) {
    const std::vector<float> want = down(p_plain.data(), n);
    check(same(down(p_queued.data(), n), want), name + ": uncaptured, the parameters of step(), " + when, me);
    check(same(down(p_graphed.data(), n), want), name + ": captured, the parameters of step(), " + when, me);
    const std::vector<float> avg = down(plain.averaged_gradient().data(), n);
    check(same(down(queued.averaged_gradient().data(), n), avg) &&
              same(down(graphed.averaged_gradient().data(), n), avg),
          name + ": the average of step(), " + when, me);
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      const std::vector<float> e = down(plain.residual(t).data(), sizes[t]);
      check(same(down(queued.residual(t).data(), sizes[t]), e) &&
                same(down(graphed.residual(t).data(), sizes[t]), e),
            name + ": the residual of step(), tensor " + std::to_string(t) + ", " + when, me);
    }
    check(graphed.last_stats().selected == plain.last_stats().selected &&
              queued.last_stats().selected == plain.last_stats().selected &&
              graphed.steps_done() == plain.steps_done(),
          name + ": the counts and steps of step(), " + when, me);
  };
  const auto fill = [&](int step) {
    gradient_into(g, step, me);
    detail::cuda_check(cudaMemcpyAsync(d_g.data(), g.data(), n * sizeof(float), cudaMemcpyHostToDevice, s),
                       "cudaMemcpyAsync");
  };
  const device_span<const float> grads(d_g.data(), n);
  for (int step = 0; step < 5; ++step) {
    fill(step);
    plain.step(p_plain.span(), grads);
    queued.graph_step(p_queued.span(), grads);
    graphed.graph_step(p_graphed.span(), grads);
    compare("step " + std::to_string(step));
  }
  check(queued.graph_captures() == 0, name + ": capture_graphs(false) captures nothing", me);
  check(graphed.graph_captures() == 2,
        name + ": two graphs captured in 5 steps (one per parity), got " +
            std::to_string(graphed.graph_captures()),
        me);
  // A NaN at index 17 of tensor 3 (flat 1003 + 17) on the last rank: refused, nothing changed.
  fill(5);
  const int bad = comm.size() - 1;
  const float nan = std::nanf("");
  if (me == bad) {
    detail::cuda_check(cudaMemcpyAsync(d_g.data() + 1003 + 17, &nan, sizeof nan, cudaMemcpyHostToDevice, s),
                       "cudaMemcpyAsync");
  }
  const std::vector<float> before = down(p_graphed.data(), n);
  std::string what = "no exception";
  bool nonfinite = false;
  try {
    graphed.graph_step(p_graphed.span(), grads);
  } catch (const nonfinite_error& e) {
    what = e.what();
    nonfinite = true;
  } catch (const communicator_error& e) {
    what = e.what();
  } catch (const std::exception& e) {
    what = std::string("another exception: ") + e.what();
  }
  if (me == bad) {
    check(nonfinite && what.find("tensor 3 ") != std::string::npos &&
              what.find("index 17") != std::string::npos,
          name + ": a NaN gradient is refused naming tensor 3 and index 17; got: " + what, me);
  } else {
    check(!nonfinite && what.find("rank " + std::to_string(bad) + " refused its gradient") != std::string::npos,
          name + ": a NaN on rank " + std::to_string(bad) + " fails the step here, naming it; got: " + what, me);
  }
  check(same(down(p_graphed.data(), n), before) && graphed.steps_done() == plain.steps_done(),
        name + ": the refused captured step changed nothing", me);
  fill(5);
  plain.step(p_plain.span(), grads);
  queued.graph_step(p_queued.span(), grads);
  graphed.graph_step(p_graphed.span(), grads);
  compare("the step after the refused one");
}

void run_rank(const ncclUniqueId& id, int size, int rank) {
  try {
    detail::cuda_check(cudaSetDevice(rank), "cudaSetDevice");
    cudaStream_t stream = nullptr;
    detail::cuda_check(cudaStreamCreate(&stream), "cudaStreamCreate");
    {
      nccl_comm comm = nccl_comm::from_unique_id(id, size, rank, stream);
      check(comm.rank() == rank && comm.size() == size, "rank() and size()", rank);
      gradcomp_test::nccl_checks::device_collectives(comm);
      gradcomp_test::nccl_checks::exchanges(comm);
      device_step<compressor<topk, identity, residual>, sparse_allgather>(comm);
      device_step<compressor<dense, identity, residual>, dense_allreduce>(comm);
      device_step<compressor<dense, fp16, residual>, dense_allreduce>(comm);
      device_step<compressor<topk, qsgd, residual>, sparse_allgather>(comm);
      device_step<compressor<topk, identity, residual>, gtopk>(comm);
      device_step<compressor<topk, identity, residual>, topk_a2a>(comm);
      graph_step_check(comm);
    }
    detail::cuda_check(cudaStreamDestroy(stream), "cudaStreamDestroy");
  } catch (const std::exception& e) {
    // The other ranks would block in NCCL waiting for this one: end the process now.
    std::fprintf(stderr, "nccl_comm_local, rank %d: FAILED: exception: %s\n", rank, e.what());
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  bad_arguments(ncclUniqueId{});  // rejected before NCCL or a device is needed
  if (gradcomp_test::nccl_checks::failures.load() != 0) return 1;
  int devices = 0;
  const cudaError_t rc = cudaGetDeviceCount(&devices);
  if (rc != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device (cudaGetDeviceCount: %s)\n",
                rc == cudaSuccess ? "0 devices" : cudaGetErrorString(rc));
    return 77;
  }
  int ranks = devices;
  if (argc > 1) {
    ranks = std::atoi(argv[1]);
    if (ranks < 1 || ranks > devices) {
      std::fprintf(stderr, "nccl_comm_local: ranks = %s; allowed: 1 to %d (the CUDA devices)\n",
                   argv[1], devices);
      return 2;
    }
  }
  int version = 0;
  ncclGetVersion(&version);
  std::printf("NCCL %d, %d CUDA device(s), %d rank(s)\n", version, devices, ranks);

  ncclUniqueId id{};
  detail::nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) threads.emplace_back(run_rank, std::cref(id), ranks, r);
  for (auto& t : threads) t.join();

  const int failed = gradcomp_test::nccl_checks::failures.load();
  std::printf("nccl_comm_local test on %d rank(s): %s\n", ranks, failed ? "FAILED" : "passed");
  return failed ? 1 : 0;
}
