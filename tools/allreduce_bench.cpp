// allreduce_bench: mpi_comm's allreduce of n floats, in gradcomp's rank order (the default,
// what dense_allreduce runs) and MPI's own (mpi_reduction::native), against a ring shift of
// the same bytes on the same ranks in the same run (every rank sending its 4n bytes to the next
// at once: what P of a ring allreduce's 2 (P-1) steps move, so an allreduce at the shift's
// pace takes 2 (P-1)/P of it). Least and mean milliseconds of the repeats, the slowest rank's.
//
//   mpirun -np P allreduce_bench [--sizes N,N...] [--repeats R]
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <gradcomp/comm/mpi.hpp>

#include "options.hpp"

namespace {

using namespace gradcomp;

struct timing {
  double least = 0.0, mean = 0.0;  // seconds, the slowest rank's
};

// `repeats` timed runs of f after one warm-up, each started together after a barrier.
template <class F>
timing time_it(mpi_comm& comm, int repeats, F&& f) {
  double least = 0.0, total = 0.0;
  for (int i = 0; i <= repeats; ++i) {
    comm.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    f();
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (i == 0) continue;
    least = i == 1 ? t : std::min(least, t);
    total += t;
  }
  double agreed[] = {least, total / repeats};
  comm.allreduce(std::span<double>(agreed), reduce_op::max);
  return {agreed[0], agreed[1]};
}

int run(int argc, char** argv) {
  std::vector<std::size_t> sizes = {std::size_t{1} << 18, std::size_t{1} << 20, std::size_t{1} << 22};
  int repeats = 10;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--sizes" && i + 1 < argc) {
      sizes = gradcomp_tools::parse_sizes(argv[++i], 1073741824.0, "[1, 2^30]");
    } else if (a == "--repeats" && i + 1 < argc) {
      repeats = gradcomp_tools::parse_count("--repeats", argv[++i], 100000);
    } else {
      throw std::invalid_argument("unknown argument '" + a +
                                  "'; usage: mpirun -np P allreduce_bench [--sizes N,N...] [--repeats R]");
    }
  }
  mpi_comm ordered(MPI_COMM_WORLD);
  mpi_comm native(MPI_COMM_WORLD, mpi_options{.reduction = mpi_reduction::native});
  const int p = ordered.size(), r = ordered.rank();
  if (r == 0) {
    std::printf("allreduce of n floats on %d ranks, %d repeats; least / mean ms, the slowest rank's;\n"
                "ring shift: every rank sends the 4n bytes to the next at once (the baseline)\n", p, repeats);
    std::printf("%10s %21s %21s %21s %16s\n", "n", "rank order", "MPI native", "ring shift",
                "rank order/ring");
  }
  for (const std::size_t n : sizes) {
    std::vector<float> data(n, 0.0f);  // zeros: repeated sums stay finite
    std::vector<std::byte> out(n * sizeof(float), std::byte{1}), in;
    const timing a = time_it(ordered, repeats, [&] { ordered.allreduce(std::span<float>(data)); });
    const timing b = time_it(native, repeats, [&] { native.allreduce(std::span<float>(data)); });
    const timing c = time_it(ordered, repeats, [&] {
      ordered.sendrecv(std::span<const std::byte>(out), (r + 1) % p, in, (r + p - 1) % p);
    });
    if (r == 0) {
      std::printf("%10zu %10.3f / %8.3f %10.3f / %8.3f %10.3f / %8.3f %7.2f / %6.2f\n", n,
                  a.least * 1e3, a.mean * 1e3, b.least * 1e3, b.mean * 1e3, c.least * 1e3,
                  c.mean * 1e3, c.least > 0 ? a.least / c.least : 0.0, c.mean > 0 ? a.mean / c.mean : 0.0);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rc = 0;
  try {
    rc = run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "allreduce_bench: %s\n", e.what());
    rc = 2;
  }
  MPI_Finalize();
  return rc;
}
