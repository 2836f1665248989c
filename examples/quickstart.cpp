// gradcomp quick start: 4 in-process workers fit a sparse least-squares problem
//   min_x  1/(2m) ||A x - b||^2,   A: m x n with a few nonzeros per row (bag-of-features),
// each worker on its own shard of the rows, once with dense S-SGD (allreduce of the full
// gradient) and once with exact top-k + residual error feedback at density 0.01 (allgather
// of sparse payloads). It prints the loss every few steps and the bytes each worker sent.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <span>
#include <vector>

#include <gradcomp/gradcomp.hpp>

#include "least_squares.hpp"

namespace {

using gradcomp_example::make_problem;
using gradcomp_example::problem;

struct run_result {
  double loss = 0.0;
  std::size_t bytes_sent_per_worker = 0;
};

// Trains with the given compressor and exchange on prob.workers threads; prints progress.
template <class Compressor, class Exchange>
run_result train(const char* label, const problem& prob, double density, int steps, double lr) {
  std::vector<float> final_x;
  std::size_t bytes = 0;
  std::printf("\n%s\n%6s %12s %20s\n", label, "step", "loss", "bytes sent/worker");
  gradcomp::run_in_process(prob.workers, [&](gradcomp::in_process_comm& comm) {
    gradcomp::sgd_options opt;
    opt.lr = lr;
    gradcomp::sparsified_sgd<Compressor, Exchange, gradcomp::in_process_comm> sgd(
        comm, {prob.dim}, Compressor{}, Exchange{}, opt,
        gradcomp::density_schedule::constant(density));
    std::vector<float> x(prob.dim, 0.0f), g(prob.dim);
    for (int step = 0;; ++step) {
      if (comm.rank() == 0 && step % (steps / 8) == 0) {
        std::printf("%6d %12.6f %20zu\n", step, prob.loss(x), sgd.total_bytes_sent());
      }
      if (step == steps) break;
      prob.gradient(comm.rank(), x, g);
      sgd.step(x, g);
    }
    if (comm.rank() == 0) {
      final_x = x;
      bytes = sgd.total_bytes_sent();
    }
  });
  return {prob.loss(final_x), bytes};
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 4000;
  const double lr = argc > 2 ? std::atof(argv[2]) : 0.01;
  if (steps < 8 || !(lr > 0.0)) {
    std::fprintf(stderr, "usage: quickstart [steps >= 8] [learning rate > 0]\n");
    return 2;
  }
  const problem prob = make_problem(/*dim=*/5000, /*rows_per_worker=*/5000, /*nonzeros_per_row=*/10,
                                    /*workers=*/4);
  std::printf("least squares: %zu parameters, %d workers x %zu rows, %d steps, lr %.3g\n", prob.dim,
              prob.workers, prob.rows_per_worker, steps, lr);

  using namespace gradcomp;
  const run_result dense_run = train<compressor<dense, identity, no_feedback>, dense_allreduce>(
      "dense S-SGD (allreduce)", prob, 1.0, steps, lr);
  const run_result sparse_run = train<compressor<topk, identity, residual>, sparse_allgather>(
      "top-k + residual, density 0.01 (allgather)", prob, 0.01, steps, lr);

  std::printf("\nfinal loss: dense %.6f, top-k %.6f (%+.2f%%)\n", dense_run.loss, sparse_run.loss,
              100.0 * (sparse_run.loss - dense_run.loss) / dense_run.loss);
  std::printf("bytes sent per worker: dense %zu, top-k %zu (%.2f%% of dense)\n",
              dense_run.bytes_sent_per_worker, sparse_run.bytes_sent_per_worker,
              100.0 * static_cast<double>(sparse_run.bytes_sent_per_worker) /
                  static_cast<double>(dense_run.bytes_sent_per_worker));
  return 0;
}
