// gradcomp::mpi alone builds an MPI program: one top-k step over an MPI communicator.
#include <cstdio>
#include <vector>

#include <gradcomp/comm/mpi.hpp>
#include <gradcomp/gradcomp.hpp>

int main(int argc, char** argv) {
  gradcomp::mpi_environment env(argc, argv);
  gradcomp::mpi_comm comm;
  using namespace gradcomp;
  sparsified_sgd<compressor<topk, identity, residual>, sparse_allgather, mpi_comm> sgd(
      comm, {1000}, {}, {}, sgd_options{.lr = 0.1}, density_schedule::constant(0.01));
  std::vector<float> params(1000, 0.0f), grads(1000);
  for (std::size_t i = 0; i < grads.size(); ++i) grads[i] = static_cast<float>(i % 17) - 8.0f;
  const step_stats& s = sgd.step(params, grads);
  std::printf("gradcomp::mpi: rank %d of %d sent %zu of %zu coordinates\n", comm.rank(),
              comm.size(), s.selected, s.n);
  return s.selected == 10 ? 0 : 1;
}
