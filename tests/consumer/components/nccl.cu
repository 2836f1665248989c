// gradcomp::nccl alone builds an NCCL program; with a CUDA device it runs one allreduce on
// one rank (an MPI singleton), without one it only says so.
#include <cstdio>
#include <vector>

#include <gradcomp/comm/mpi.hpp>
#include <gradcomp/comm/nccl.hpp>

int main(int argc, char** argv) {
  gradcomp::mpi_environment env(argc, argv);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("gradcomp::nccl: compiled; no CUDA device here to run it on\n");
    return 0;
  }
  gradcomp::mpi_comm mpi;
  gradcomp::nccl_comm comm = gradcomp::nccl_comm::from_mpi(mpi, nullptr);
  std::vector<float> x(16, 1.5f);
  comm.allreduce(std::span<float>(x), gradcomp::reduce_op::sum);
  std::printf("gradcomp::nccl: allreduce over %d rank(s) gave %g\n", comm.size(), x[0]);
  return x[0] == 1.5f * static_cast<float>(comm.size()) ? 0 : 1;
}
