// Properties every exchange must have over any gradcomp communicator: each rank's output
// equals the single-process reference built from all P payloads, bit for bit (the
// communicators fold in rank order); a P-rank run of sparsified_sgd equals the P-thread
// in-process one; a rank that passes another tensor size makes every rank throw, with no hang.
// Shared by the MPI tests (tests/mpi/mpi_exchange.cpp) and the torch.distributed tests
// (tests/torch/process_group_comm.cpp). Every rank must call each function, in the same order.
#pragma once

#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include <gradcomp/comm/in_process.hpp>
#include <gradcomp/exchange.hpp>
#include <gradcomp/feedback.hpp>
#include <gradcomp/quantize.hpp>
#include <gradcomp/select.hpp>
#include <gradcomp/step.hpp>

#include "exchange_reference.hpp"

namespace gradcomp_test::exchange_properties {

using namespace gradcomp;
namespace gt = gradcomp_test;


// Every rank computes all P payloads (they are seeded), exchanges its own and compares.
template <class X, class C, class Ref, class Comm>
void check_exchange(Comm& comm, X x, const C& c, std::size_t n, double density, Ref reference) {
  using T = typename C::value_type;
  const auto ps = gt::payloads_for(c, comm.size(), n, density);
  const auto me = static_cast<std::size_t>(comm.rank());
  std::vector<T> out(n, T(9));
  unused_picks unused;
  exchange_stats st;
  if constexpr (exchange_with_unused<X, C, Comm>) {
    st = x.exchange(comm, c, ps[me], std::span<T>(out), unused);
  } else {
    st = x.exchange(comm, c, ps[me], std::span<T>(out));
  }
  CHECK(gt::same_bits(out, reference(std::span<const payload>(ps))));
  if (comm.size() > 1) CHECK(st.bytes_received > 0);
}

template <class C, class Comm>
void all_sparse_exchanges(Comm& comm, const C& c, std::size_t n, double density) {
  auto mean = [&](std::span<const payload> ps) { return gt::reference_mean(c, ps, n); };
  SUBCASE("sparse_allgather") { check_exchange(comm, sparse_allgather{}, c, n, density, mean); }
  SUBCASE("topk_a2a") { check_exchange(comm, topk_a2a{}, c, n, density, mean); }
  SUBCASE("gtopk tree and exact") {
    for (auto mode : {gtopk_values::tree, gtopk_values::exact}) {
      const auto ps = gt::payloads_for(c, comm.size(), n, density);
      const auto want = gt::reference_gtopk(c, std::span<const payload>(ps), n, mode);
      const auto me = static_cast<std::size_t>(comm.rank());
      gtopk x(mode);
      std::vector<typename C::value_type> out(n);
      unused_picks unused;
      x.exchange(comm, c, ps[me], std::span<typename C::value_type>(out), unused);
      CHECK(gt::same_bits(out, want.out));
      CHECK(unused.indices.size() == want.unused[me].size());
      for (std::size_t j = 0; j < std::min(unused.indices.size(), want.unused[me].size()); ++j) {
        CHECK(unused.indices[j] == want.unused[me][j].first);
      }
    }
  }
  SUBCASE("auto_exchange, every choice") {
    for (unsigned k = 0; k < exchange_kinds; ++k) {
      const auto kind = static_cast<exchange_kind>(k);
      CAPTURE(exchange_kind_name(kind));
      auto_options o;
      o.link = link_model{1e-5, 1e-9};
      o.candidates = exchange_bit(kind);
      auto want = [&](std::span<const payload> ps) {
        return kind == exchange_kind::gtopk ? gt::reference_gtopk(c, ps, n, gtopk_values::tree).out
                                            : gt::reference_mean(c, ps, n);
      };
      check_exchange(comm, auto_exchange(o), c, n, density, want);
    }
  }
}

// Parameters after `steps` steps of sparsified_sgd on this rank, over the given communicator.
template <class C, class X, class Comm>
std::vector<float> train(Comm& comm, X x, const std::vector<std::size_t>& layers, double density,
                         int steps) {
  sparsified_sgd<C, X, Comm> sgd(comm, layers, {}, std::move(x), sgd_options{.lr = 0.05},
                                 density_schedule::constant(density));
  std::vector<float> params(sgd.size(), 0.0f);
  for (int s = 0; s < steps; ++s) {
    const auto g = gt::make_input<float>(gt::dist::laplace, sgd.size(),
                                         static_cast<std::uint64_t>(100 * s + comm.rank()));
    sgd.step(params, g);
  }
  return params;
}

template <class C, class X, class Comm>
void equals_in_process(Comm& comm, X x, double density) {
  const std::vector<std::size_t> layers = {700, 13, 300, 1};
  const auto ours = train<C>(comm, x, layers, density, 3);
  std::vector<std::vector<float>> threads(static_cast<std::size_t>(comm.size()));
  run_in_process(comm.size(), [&](in_process_comm& c) {
    threads[static_cast<std::size_t>(c.rank())] = train<C>(c, x, layers, density, 3);
  });
  CHECK(gt::same_bits(ours, threads[static_cast<std::size_t>(comm.rank())]));
}


template <class Comm>
void every_exchange_equals_reference(Comm& comm) {
  SUBCASE("topk identity") { all_sparse_exchanges(comm, compressor<topk, identity, residual>{}, 3001, 0.01); }
  SUBCASE("gaussiank qsgd: counts differ per rank") {
    all_sparse_exchanges(comm, compressor<gaussiank, qsgd, residual>{}, 2048, 0.02);
  }
  SUBCASE("topk fp16, double") {
    all_sparse_exchanges(comm, compressor<topk, fp16, residual, double>{}, 1000, 0.05);
  }
  SUBCASE("dense_allreduce: dense identity and Random-k fp16") {
    const compressor<dense, identity, no_feedback> d;
    check_exchange(comm, dense_allreduce{}, d, 4097, 1.0,
                   [&](std::span<const payload> ps) { return gt::reference_wire_mean(d, ps, 4097); });
    const compressor<randomk, fp16, residual> r;
    check_exchange(comm, dense_allreduce{}, r, 4097, 0.05,
                   [&](std::span<const payload> ps) { return gt::reference_wire_mean(r, ps, 4097); });
    check_exchange(comm, auto_exchange(auto_options{.link = link_model{1e-5, 1e-9},
                                                    .candidates = exchange_bit(exchange_kind::dense_allreduce)}),
                   r, 4097, 0.05,
                   [&](std::span<const payload> ps) { return gt::reference_wire_mean(r, ps, 4097); });
  }
  SUBCASE("topk_a2a fused buckets") {
    using C = compressor<topk, identity, residual>;
    const C c;
    const std::vector<std::size_t> sizes = {100, 7, 250, 1, 64};
    std::vector<std::vector<payload>> ps;
    for (std::size_t t = 0; t < sizes.size(); ++t) ps.push_back(gt::payloads_for(c, comm.size(), sizes[t], 0.1, 0, t));
    const auto me = static_cast<std::size_t>(comm.rank());
    std::vector<payload> mine;
    std::vector<std::vector<float>> outs;
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      mine.push_back(ps[t][me]);
      outs.emplace_back(sizes[t]);
    }
    std::vector<std::span<float>> spans(outs.begin(), outs.end());
    std::vector<exchange_stats> stats(sizes.size());
    topk_a2a x(300);
    x.exchange_tensors(comm, c, std::span<const payload>(mine), std::span<const std::span<float>>(spans),
                       std::span<exchange_stats>(stats));
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      CHECK(gt::same_bits(outs[t], gt::reference_mean(c, std::span<const payload>(ps[t]), sizes[t])));
    }
  }
}

template <class Comm>
void training_equals_in_process(Comm& comm) {
  using S = compressor<topk, identity, residual>;
  SUBCASE("sparse_allgather") { equals_in_process<S>(comm, sparse_allgather{}, 0.02); }
  SUBCASE("topk_a2a with buckets") { equals_in_process<S>(comm, topk_a2a(512), 0.02); }
  SUBCASE("gtopk exact") { equals_in_process<S>(comm, gtopk(gtopk_values::exact), 0.02); }
  SUBCASE("gtopk tree, DGC momentum") {
    equals_in_process<compressor<topk, identity, dgc_momentum>>(comm, gtopk{}, 0.05);
  }
  SUBCASE("dense_allreduce of Random-k") {
    equals_in_process<compressor<randomk, identity, residual>>(comm, dense_allreduce{}, 0.05);
  }
  SUBCASE("auto_exchange with a fixed link") {
    equals_in_process<S>(comm, auto_exchange(auto_options{.link = link_model{2e-6, 1e-10}}), 0.02);
  }
}

template <class Comm>
void disagreeing_size_throws_everywhere(Comm& comm) {
  if (comm.size() < 2) {
    MESSAGE("needs 2 or more ranks; skipped at P = 1");
    return;
  }
  const int odd = comm.size() - 1;  // this rank passes a smaller tensor
  const std::size_t n = comm.rank() == odd ? 120 : 128;
  auto expect_all_throw = [&](auto x, auto c, double density) {
    const payload p = gt::payload_for_rank(c, comm.rank(), n, density);
    std::vector<float> out(n);
    std::string what;
    try {
      x.exchange(comm, c, p, std::span<float>(out));
    } catch (const communicator_error& e) {
      what = e.what();
    }
    CHECK(what.find("120") != std::string::npos);
    CHECK(what.find("128") != std::string::npos);
    comm.barrier();  // every rank is still in step
  };
  using S = compressor<topk, identity, residual>;
  expect_all_throw(dense_allreduce{}, compressor<dense, identity, no_feedback>{}, 1.0);
  expect_all_throw(sparse_allgather{}, S{}, 0.1);
  expect_all_throw(gtopk{}, S{}, 0.1);
  expect_all_throw(topk_a2a{}, S{}, 0.1);
  expect_all_throw(auto_exchange(auto_options{.link = link_model{1e-5, 1e-9}}), S{}, 0.1);

  // A rank speaking a later payload format version.
  exchange_header h;
  h.dense_size = 10;
  if (comm.rank() == odd) h.format_version = 2;
  std::vector<std::byte> scratch;
  std::string what;
  try {
    agree_on_header(comm, "test", h, agree::dense_size, scratch);
  } catch (const communicator_error& e) {
    what = e.what();
  }
  CHECK(what.find("format version: rank " + std::to_string(odd) + " has 2, rank 0 has 1") != std::string::npos);
}

}  // namespace gradcomp_test::exchange_properties
