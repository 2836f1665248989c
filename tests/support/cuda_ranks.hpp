// Helpers of the CUDA tests that run the device drivers beside the host ones on P ranks
// (threads of this process sharing the GPU, one stream each): gradients that are not
// Gaussian, a stream, a fresh in-process world per collective step, the bitwise comparison
// of two float vectors, and each rank's scaffolding (driver_rank: its communicators, stream,
// drivers and buffers, made by make_driver_ranks).
#pragma once

#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <gradcomp/comm/in_process.hpp>
#include <gradcomp/cuda/memory.cuh>
#include <gradcomp/cuda/staged_comm.cuh>

#include "cuda_buffers.hpp"
#include "fault_comm.hpp"

namespace gradcomp_test {

// Not Gaussian: kind 0 uniform in [-1, 1), 1 heavy-tailed (a ratio of uniforms, as Cauchy),
// 2 multiples of 1/8 in [-1, 1] (many ties and zeros). Every rank and step its own values.
inline float gradient_value(int kind, int rank, int step, std::size_t i) {
  std::uint64_t x = (static_cast<std::uint64_t>(rank) << 56) ^ (static_cast<std::uint64_t>(step) << 40) ^ i;
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  const float u = static_cast<float>(x >> 40) / static_cast<float>(1ull << 24) * 2.0f - 1.0f;
  const float v = static_cast<float>((x >> 16) & 0xffffff) / static_cast<float>(1ull << 24) + 1e-3f;
  switch (kind) {
    case 0: return u;
    case 1: return u / v;
    default: return std::round(u * 8.0f) / 8.0f;
  }
}

inline std::vector<float> gradient(std::size_t n, int kind, int rank, int step) {
  std::vector<float> g(n);
  for (std::size_t i = 0; i < n; ++i) g[i] = gradient_value(kind, rank, step, i);
  return g;
}

struct stream_t {
  cudaStream_t s = nullptr;
  stream_t() { gradcomp::detail::cuda_check(cudaStreamCreate(&s), "cudaStreamCreate"); }
  stream_t(const stream_t&) = delete;
  stream_t& operator=(const stream_t&) = delete;
  ~stream_t() { cudaStreamDestroy(s); }
};

// Runs body(r, comm, world) on P threads over a fresh world; a rank that throws keeps its
// exception and fails the world, so that the others stop waiting.
template <class Body>
std::vector<std::exception_ptr> run_world(int P, Body&& body) {
  gradcomp::in_process_world world(P);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(P));
  std::vector<std::thread> threads;
  for (int r = 0; r < P; ++r) {
    threads.emplace_back([&, r] {
      gradcomp::in_process_comm comm = world.comm(r);
      try {
        gradcomp::detail::cuda_check(cudaSetDevice(0), "cudaSetDevice");
        body(r, comm, world);
        world.rank_done(r);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
        world.abort(r, "failed");
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

// The first index where a and b differ in their bits, or -1 (-2: their sizes differ).
inline long long first_difference(std::span<const float> a, std::span<const float> b) {
  if (a.size() != b.size()) return -2;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) return static_cast<long long>(i);
  }
  return -1;
}

inline std::string what_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  }
}

inline void require_none_threw(const std::vector<std::exception_ptr>& errors) {
  for (std::size_t r = 0; r < errors.size(); ++r) {
    if (errors[r]) FAIL("rank ", r, " threw: ", what_of(errors[r]));
  }
}

// The tests' communicators: in-process ranks with faults on demand, and the device drivers'
// over them.
using fault_in_process = fault_comm<gradcomp::in_process_comm>;
using staged_fault_comm = gradcomp::cuda::staged_comm<fault_in_process>;

// One rank of a test that runs a host driver and its device twin side by side: its
// communicator (rebound to a fresh world each step), its stream, both drivers, their
// parameters and the device gradient.
template <class Host, class Device>
struct driver_rank {
  std::shared_ptr<gradcomp::in_process_world> first_world;  // comm's until the first step
  std::unique_ptr<gradcomp::in_process_comm> first;
  std::unique_ptr<fault_in_process> comm;
  std::unique_ptr<stream_t> stream;  // the device driver's (its communicator's)
  std::unique_ptr<staged_fault_comm> staged;
  std::unique_ptr<Host> host;
  std::unique_ptr<Device> dev;
  std::vector<float> host_params;
  gradcomp::device_buffer<float> dev_params;
  gradcomp::device_buffer<float> dev_grad;
};

// P ranks of n parameters each, the same on every rank (the drivers' requirement where they
// average parameters), with their communicators and streams; make(rank, r) then makes its
// drivers (on *rank.comm and *rank.staged). The constructors need a communicator to point
// at: a world of P that each step replaces.
template <class Rank, class Make>
std::vector<Rank> make_driver_ranks(int P, std::size_t n, Make&& make) {
  const auto first = std::make_shared<gradcomp::in_process_world>(P);
  std::vector<Rank> ranks(static_cast<std::size_t>(P));
  std::vector<float> init(n);
  for (std::size_t i = 0; i < n; ++i) init[i] = 0.5f - static_cast<float>(i % 7) * 0.125f;
  for (int r = 0; r < P; ++r) {
    Rank& k = ranks[static_cast<std::size_t>(r)];
    k.first_world = first;
    k.first = std::make_unique<gradcomp::in_process_comm>(first->comm(r));
    k.comm = std::make_unique<fault_in_process>(*k.first);
    k.stream = std::make_unique<stream_t>();
    k.staged = std::make_unique<staged_fault_comm>(*k.comm, k.stream->s);
    make(k, r);
    k.host_params = init;
    k.dev_params = upload(init);
    k.dev_grad.resize(n > 0 ? n : 1);
  }
  return ranks;
}

}  // namespace gradcomp_test
