// nccl_comm on real GPUs, one per MPI rank: the checks of tests/support/nccl_checks.cuh (the
// device collectives and every exchange through the host API). Without enough CUDA devices it
// prints "SKIPPED: ..." and exits with 77, which ctest reports as skipped.
#include <cuda_runtime.h>

#include <cstdio>
#include <span>

#include <gradcomp/comm/mpi.hpp>
#include <gradcomp/comm/nccl.hpp>

#include "../support/nccl_checks.cuh"

using namespace gradcomp;
using gradcomp_test::nccl_checks::device_collectives;
using gradcomp_test::nccl_checks::exchanges;

int main(int argc, char** argv) {
  mpi_environment env(argc, argv);
  mpi_comm world;
  int devices = 0;
  const cudaError_t rc = cudaGetDeviceCount(&devices);
  int usable[] = {rc == cudaSuccess && devices > 0 ? 1 : 0};
  world.allreduce(std::span<int>(usable), reduce_op::min);
  if (!usable[0]) {
    if (world.rank() == 0) {
      std::printf("SKIPPED: no CUDA device (cudaGetDeviceCount: %s)\n",
                  rc == cudaSuccess ? "0 devices" : cudaGetErrorString(rc));
    }
    return 77;
  }
  if (devices < world.size()) {
    if (world.rank() == 0) {
      std::printf("SKIPPED: %d ranks need %d CUDA devices (one each); %d found\n", world.size(),
                  world.size(), devices);
    }
    return 77;
  }
  detail::cuda_check(cudaSetDevice(world.rank()), "cudaSetDevice");
  cudaStream_t stream = nullptr;
  detail::cuda_check(cudaStreamCreate(&stream), "cudaStreamCreate");
  {
    nccl_comm comm = nccl_comm::from_mpi(world, stream);
    device_collectives(comm);
    exchanges(comm);
  }
  cudaStreamDestroy(stream);
  int failed[] = {gradcomp_test::nccl_checks::failures.load()};
  world.allreduce(std::span<int>(failed), reduce_op::max);
  if (world.rank() == 0) {
    std::printf("nccl_comm test on %d rank(s): %s\n", world.size(), failed[0] ? "FAILED" : "passed");
  }
  return failed[0] ? 1 : 0;
}
