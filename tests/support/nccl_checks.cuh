// The NCCL communicator's checks on real GPUs, shared by its two tests: tests/mpi/nccl_comm.cu
// (one MPI rank per GPU) and tests/cuda/nccl_local.cu (one thread per GPU of one process, no
// MPI at run time). The device collectives (allreduce, the grouped-broadcast allgatherv, the
// send/recv alltoallv) against host references, and every exchange through the host API
// against the single-process reference. Each failed check prints its rank and counts in
// nccl_checks::failures.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include <gradcomp/comm/nccl.hpp>
#include <gradcomp/exchange.hpp>
#include <gradcomp/feedback.hpp>
#include <gradcomp/quantize.hpp>
#include <gradcomp/select.hpp>
#include <gradcomp/step.hpp>

#include "exchange_reference.hpp"

namespace gradcomp_test::nccl_checks {

using namespace gradcomp;
namespace gt = gradcomp_test;

// Failed checks in this process, over all its ranks (threads or one MPI rank).
inline std::atomic<int> failures{0};

inline void check(bool ok, const std::string& what, int rank) {
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "nccl_comm test, rank %d: FAILED: %s\n", rank, what.c_str());
  }
}

// Exactly representable values, so that any order of addition gives the same sums.
static __global__ void fill(float* x, std::size_t n, int rank) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i < n) x[i] = static_cast<float>(rank) + 0.5f * static_cast<float>(i % 1024);
}

inline void device_collectives(nccl_comm& comm) {
  const int p = comm.size(), me = comm.rank();
  const std::size_t n = 10007;
  device_buffer<float> x(n);
  fill<<<static_cast<unsigned>((n + 255) / 256), 256, 0, comm.stream()>>>(x.data(), n, me);
  detail::cuda_check(cudaGetLastError(), "fill<<<>>>");
  comm.allreduce(x.span(), reduce_op::sum);
  std::vector<float> host(n);
  detail::cuda_check(cudaMemcpyAsync(host.data(), x.data(), n * sizeof(float), cudaMemcpyDeviceToHost,
                                     comm.stream()),
                     "cudaMemcpyAsync");
  comm.synchronize();
  std::size_t off = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const float want = static_cast<float>(p * (p - 1) / 2) + static_cast<float>(p) * 0.5f * static_cast<float>(i % 1024);
    off += host[i] != want;
  }
  check(off == 0, "device allreduce sum", me);

  // allgatherv: rank r sends (r + 1) * 3 elements of value r (so one rank alone still
  // broadcasts).
  std::vector<float> mine(static_cast<std::size_t>(me + 1) * 3, static_cast<float>(me));
  device_buffer<float> send(mine.size());
  cudaMemcpy(send.data(), mine.data(), mine.size() * sizeof(float), cudaMemcpyHostToDevice);
  device_buffer<float> recv;
  std::vector<std::size_t> counts;
  comm.allgatherv(device_span<const float>(send.data(), mine.size()), recv, counts);
  comm.synchronize();
  std::vector<float> got(recv.size());
  if (!got.empty()) cudaMemcpy(got.data(), recv.data(), got.size() * sizeof(float), cudaMemcpyDeviceToHost);
  std::vector<float> want;
  for (int r = 0; r < p; ++r) want.insert(want.end(), static_cast<std::size_t>(r + 1) * 3, static_cast<float>(r));
  check(got == want, "device allgatherv", me);

  // alltoallv: block (s -> d) holds s + d + 1 copies of 100 s + d.
  std::vector<float> blocks;
  std::vector<std::size_t> send_counts;
  for (int d = 0; d < p; ++d) {
    blocks.insert(blocks.end(), static_cast<std::size_t>(me + d + 1), static_cast<float>(100 * me + d));
    send_counts.push_back(static_cast<std::size_t>(me + d + 1));
  }
  device_buffer<float> a(blocks.size());
  cudaMemcpy(a.data(), blocks.data(), blocks.size() * sizeof(float), cudaMemcpyHostToDevice);
  device_buffer<float> b;
  comm.alltoallv(device_span<const float>(a.data(), blocks.size()), send_counts, b, counts);
  comm.synchronize();
  got.resize(b.size());
  cudaMemcpy(got.data(), b.data(), got.size() * sizeof(float), cudaMemcpyDeviceToHost);
  want.clear();
  for (int s = 0; s < p; ++s) want.insert(want.end(), static_cast<std::size_t>(s + me + 1), static_cast<float>(100 * s + me));
  check(got == want, "device alltoallv", me);
}

template <class X, class C, class Ref>
void host_exchange(nccl_comm& comm, const char* name, X x, const C& c, std::size_t n, double density,
                   Ref reference, bool exact) {
  const auto ps = gt::payloads_for(c, comm.size(), n, density);
  std::vector<float> out(n);
  unused_picks unused;
  if constexpr (exchange_with_unused<X, C, nccl_comm>) {
    x.exchange(comm, c, ps[static_cast<std::size_t>(comm.rank())], std::span<float>(out), unused);
  } else {
    x.exchange(comm, c, ps[static_cast<std::size_t>(comm.rank())], std::span<float>(out));
  }
  const auto want = reference(std::span<const payload>(ps));
  bool ok = out.size() == want.size();
  for (std::size_t i = 0; ok && i < n; ++i) {
    ok = exact ? std::bit_cast<std::uint32_t>(out[i]) == std::bit_cast<std::uint32_t>(want[i])
               : std::fabs(out[i] - want[i]) <= 1e-5f * (1.0f + std::fabs(want[i]));
  }
  check(ok, std::string("host exchange ") + name, comm.rank());
}

inline void exchanges(nccl_comm& comm) {
  using S = compressor<topk, identity, residual>;
  const S s;
  const std::size_t n = 3001;
  auto mean = [&](std::span<const payload> ps) { return gt::reference_mean(s, ps, n); };
  auto tree = [&](std::span<const payload> ps) { return gt::reference_gtopk(s, ps, n, gtopk_values::tree).out; };
  // Moving bytes is exact; NCCL's sums follow its own order.
  host_exchange(comm, "sparse_allgather", sparse_allgather{}, s, n, 0.01, mean, true);
  host_exchange(comm, "topk_a2a", topk_a2a{}, s, n, 0.01, mean, true);
  host_exchange(comm, "gtopk", gtopk{}, s, n, 0.01, tree, true);
  const compressor<dense, identity, no_feedback> d;
  host_exchange(comm, "dense_allreduce", dense_allreduce{}, d, n, 1.0,
                [&](std::span<const payload> ps) { return gt::reference_wire_mean(d, ps, n); }, false);
  host_exchange(comm, "auto_exchange", auto_exchange(), s, n, 0.01, mean, false);
}

}  // namespace gradcomp_test::nccl_checks
