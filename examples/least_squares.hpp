// The sparse least-squares problem of the quick-start examples (quickstart.cpp, threads;
// mpi_quickstart.cpp, MPI ranks):
//   min_x  1/(2m) ||A x - b||^2,   A: m x n with a few nonzeros per row (bag-of-features),
// the rows split into equal shards, one per worker. Built from a fixed seed, so every process
// (every MPI rank) builds the same problem.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

namespace gradcomp_example {

struct problem {
  std::size_t dim = 0;              // n, the parameters
  std::size_t rows_per_worker = 0;
  std::size_t nonzeros_per_row = 0;
  int workers = 0;
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

  // This worker's shard gradient, 1/m_w A_w^T (A_w x - b_w).
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

inline problem make_problem(std::size_t dim, std::size_t rows_per_worker, std::size_t nnz, int workers) {
  problem p{dim, rows_per_worker, nnz, workers, {}, {}, {}};
  std::mt19937_64 rng(2024);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<std::uint32_t> column(0, static_cast<std::uint32_t>(dim - 1));
  std::vector<float> truth(dim);
  for (float& t : truth) t = normal(rng);
  const std::size_t m = rows_per_worker * static_cast<std::size_t>(workers);
  // Scaled so that A^T A / m is close to the identity: well conditioned, like a normalised
  // feature matrix.
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
    p.b[r] = static_cast<float>(y) + 0.5f * normal(rng);  // noise: the loss floor is ~0.125
  }
  return p;
}

}  // namespace gradcomp_example
