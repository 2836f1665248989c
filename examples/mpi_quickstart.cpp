// gradcomp over MPI: every MPI rank is a worker fitting its shard of the rows of a sparse
// least-squares problem (the one of quickstart.cpp). The same training runs with dense S-SGD
// and with top-k + residual at density 0.01 under each sparse exchange (gtopk also with
// exact global values); switching exchange is one template argument. Run it as
//   mpirun -np 4 build/default/examples/mpi_quickstart [steps] [lr]
// and it prints, per exchange, the final loss, the bytes each worker sent and the time per step.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <gradcomp/comm/mpi.hpp>
#include <gradcomp/gradcomp.hpp>

#include "least_squares.hpp"

namespace {

// Every rank builds the same problem from the same seed and keeps to its own rows.
using gradcomp_example::make_problem;
using gradcomp_example::problem;

template <class Compressor, class Exchange>
void train(gradcomp::mpi_comm& comm, const char* label, const problem& prob, double density,
           int steps, double lr, Exchange exchange = {}) {
  gradcomp::sparsified_sgd<Compressor, Exchange, gradcomp::mpi_comm> sgd(
      comm, {prob.dim}, Compressor{}, std::move(exchange), gradcomp::sgd_options{.lr = lr},
      gradcomp::density_schedule::constant(density));
  std::vector<float> x(prob.dim, 0.0f), g(prob.dim);
  comm.barrier();
  const auto start = std::chrono::steady_clock::now();
  std::string_view chosen;
  for (int step = 0; step < steps; ++step) {
    prob.gradient(comm.rank(), x, g);
    chosen = sgd.step(x, g).tensors[0].exchange;
  }
  comm.barrier();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (comm.rank() == 0) {
    std::printf("%-34s loss %.6f  sent/worker %10zu B  %7.1f us/step  (ran: %.*s)\n", label,
                prob.loss(x), sgd.total_bytes_sent(), 1e6 * seconds / steps,
                static_cast<int>(chosen.size()), chosen.data());
  }
}

}  // namespace

int main(int argc, char** argv) {
  gradcomp::mpi_environment env(argc, argv);
  gradcomp::mpi_comm comm;  // MPI_COMM_WORLD, duplicated
  const int steps = argc > 1 ? std::atoi(argv[1]) : 2000;
  const double lr = argc > 2 ? std::atof(argv[2]) : 0.01;
  if (steps < 1 || !(lr > 0.0)) {
    if (comm.rank() == 0) std::fprintf(stderr, "usage: mpi_quickstart [steps >= 1] [learning rate > 0]\n");
    return 2;
  }
  const problem prob = make_problem(/*dim=*/5000, /*rows_per_worker=*/20000 / comm.size(),
                                    /*nonzeros_per_row=*/10, comm.size());
  if (comm.rank() == 0) {
    std::printf("least squares over MPI: %zu parameters, %d ranks x %zu rows, %d steps, lr %.3g\n",
                prob.dim, comm.size(), prob.rows_per_worker, steps, lr);
  }

  using namespace gradcomp;
  using topk_residual = compressor<topk, identity, residual>;
  train<compressor<dense, identity, no_feedback>, dense_allreduce>(comm, "dense S-SGD", prob, 1.0, steps, lr);
  train<topk_residual, sparse_allgather>(comm, "top-k 0.01, sparse_allgather", prob, 0.01, steps, lr);
  train<topk_residual, topk_a2a>(comm, "top-k 0.01, topk_a2a", prob, 0.01, steps, lr);
  train<topk_residual, gtopk>(comm, "top-k 0.01, gtopk", prob, 0.01, steps, lr);
  train<topk_residual, gtopk>(comm, "top-k 0.01, gtopk (exact values)", prob, 0.01, steps, lr,
                              gtopk(gtopk_values::exact));
  train<topk_residual, auto_exchange>(comm, "top-k 0.01, auto_exchange", prob, 0.01, steps, lr);
  return 0;
}
