// Run under mpiexec by the ctest tests reliability_mpi_rank_failure (expects the job to fail)
// and reliability_mpi_no_failure (expects success). Every rank trains with sparsified_sgd
// over mpi_comm; with --fail, rank 1 gets a NaN gradient at step 2 and throws
// nonfinite_error while the others wait for it in the exchange. mpi_run then reports
// "gradcomp: rank 1 of P failed: <cause>" and aborts the job: no rank hangs.
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <gradcomp/comm/mpi.hpp>
#include <gradcomp/comm/mpi_guard.hpp>
#include <gradcomp/gradcomp.hpp>

#if defined(__SANITIZE_ADDRESS__) && defined(__linux__)
// As in tests/mpi/mpi_main.cpp: keeps Open MPI's components loaded so that tests/lsan.supp
// can name their allocations when LeakSanitizer runs at exit.
extern "C" int dlclose(void*) { return 0; }
#endif

int main(int argc, char** argv) {
  const bool fail = argc > 1 && std::strcmp(argv[1], "--fail") == 0;
  gradcomp::mpi_environment env(argc, argv);
  return gradcomp::mpi_run(MPI_COMM_WORLD, [&] {
    using namespace gradcomp;
    mpi_comm comm;
    using sgd_t = sparsified_sgd<compressor<topk, identity, residual>, sparse_allgather, mpi_comm>;
    sgd_t sgd(comm, {300, 700}, {}, {}, sgd_options{}, density_schedule::constant(0.05));
    std::vector<float> params(1000, 0.0f), grads(1000);
    for (std::uint64_t step = 0; step < 5; ++step) {
      for (std::size_t i = 0; i < grads.size(); ++i) {
        grads[i] = static_cast<float>((i * 7919 + step * 31 + static_cast<std::size_t>(comm.rank())) % 1000) - 500.0f;
      }
      if (fail && comm.rank() == 1 && step == 2) grads[5] = std::numeric_limits<float>::quiet_NaN();
      sgd.step(params, grads);
    }
    return 0;
  });
}
