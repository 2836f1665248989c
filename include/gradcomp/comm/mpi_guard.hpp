// gradcomp/comm/mpi_guard.hpp: what a rank does when its work throws under MPI. MPI cannot
// release ranks blocked in a collective that a failed rank will never join, and unwinding to
// MPI_Finalize (an RAII environment's destructor) would block too. So mpi_run() reports the
// failure on stderr, naming the rank and the cause, and calls MPI_Abort: the launcher ends
// every rank and exits non-zero, and nobody hangs. Needs <mpi.h>; link MPI::MPI_CXX.
#pragma once

#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <type_traits>
#include <utility>

namespace gradcomp {

namespace detail {

// One fprintf per line, so that lines of ranks failing together do not interleave.
[[noreturn]] inline void mpi_abort_with(MPI_Comm comm, const char* cause) noexcept {
  int world_rank = -1;
  int world_size = 0;
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) {
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  }
  std::fprintf(stderr, "gradcomp: rank %d of %d failed: %s; calling MPI_Abort\n", world_rank,
               world_size, cause);
  std::fflush(stderr);
  if (initialized && !finalized) MPI_Abort(comm, 1);
  std::abort();  // MPI_Abort should not return; if it does, this process still ends
}

}  // namespace detail

// Runs f() and returns its result. If f throws, this rank prints
//   gradcomp: rank R of P failed: <what()>; calling MPI_Abort
// (R, P: the rank and size in MPI_COMM_WORLD) and aborts `comm` with error code 1, which ends
// the whole job. Wrap the body of main() (after MPI is initialised) in it:
//   gradcomp::mpi_environment env(argc, argv);
//   return gradcomp::mpi_run(MPI_COMM_WORLD, [&] { ...; return 0; });
template <class F>
  requires std::invocable<F&>
decltype(auto) mpi_run(MPI_Comm comm, F&& f) noexcept {
  try {
    return std::invoke(f);
  } catch (const std::exception& e) {
    detail::mpi_abort_with(comm, e.what());
  } catch (...) {
    detail::mpi_abort_with(comm, "an exception not derived from std::exception");
  }
}

}  // namespace gradcomp
