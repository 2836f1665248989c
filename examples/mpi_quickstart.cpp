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

namespace {

struct problem {
  std::size_t dim = 0;
  std::size_t rows_per_worker = 0;
  std::size_t nonzeros_per_row = 0;
  std::vector<std::uint32_t> cols;  // row r's nonzeros: cols/vals[r * nonzeros_per_row + j]
  std::vector<float> vals;
  std::vector<float> b;

  double residual(std::size_t r, const std::vector<float>& x) const {
    double pred = 0.0;
    for (std::size_t j = r * nonzeros_per_row; j < (r + 1) * nonzeros_per_row; ++j) {
      pred += static_cast<double>(vals[j]) * x[cols[j]];
    }
    return pred - b[r];
  }

  double loss(const std::vector<float>& x) const {
    double sum = 0.0;
    for (std::size_t r = 0; r < b.size(); ++r) sum += residual(r, x) * residual(r, x);
    return sum / (2.0 * static_cast<double>(b.size()));
  }

  // Worker w's shard gradient, 1/m_w A_w^T (A_w x - b_w).
  void gradient(int worker, const std::vector<float>& x, std::vector<float>& g) const {
    std::fill(g.begin(), g.end(), 0.0f);
    const std::size_t first = static_cast<std::size_t>(worker) * rows_per_worker;
    const float inv_m = 1.0f / static_cast<float>(rows_per_worker);
    for (std::size_t r = first; r < first + rows_per_worker; ++r) {
      const float s = static_cast<float>(residual(r, x)) * inv_m;
      for (std::size_t j = r * nonzeros_per_row; j < (r + 1) * nonzeros_per_row; ++j) {
        g[cols[j]] += s * vals[j];
      }
    }
  }
};

// Every rank builds the same problem from the same seed and keeps to its own rows.
problem make_problem(std::size_t dim, std::size_t rows_per_worker, std::size_t nnz, int workers) {
  problem p{dim, rows_per_worker, nnz, {}, {}, {}};
  std::mt19937_64 rng(2024);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<std::uint32_t> column(0, static_cast<std::uint32_t>(dim - 1));
  std::vector<float> truth(dim);
  for (float& t : truth) t = normal(rng);
  const std::size_t m = rows_per_worker * static_cast<std::size_t>(workers);
  const float scale = std::sqrt(static_cast<float>(dim) / static_cast<float>(nnz));
  p.cols.resize(m * nnz);
  p.vals.resize(m * nnz);
  p.b.resize(m);
  for (std::size_t r = 0; r < m; ++r) {
    double y = 0.0;
    for (std::size_t j = r * nnz; j < (r + 1) * nnz; ++j) {
      p.cols[j] = column(rng);
      p.vals[j] = scale * normal(rng);
      y += static_cast<double>(p.vals[j]) * truth[p.cols[j]];
    }
    p.b[r] = static_cast<float>(y) + 0.5f * normal(rng);
  }
  return p;
}

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
