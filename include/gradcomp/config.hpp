// gradcomp/config.hpp: version numbers and the GRADCOMP_HOST_DEVICE annotation
// that lets per-element math be written once for the host compiler and nvcc.
#pragma once

#define GRADCOMP_VERSION_MAJOR 0
#define GRADCOMP_VERSION_MINOR 1
#define GRADCOMP_VERSION_PATCH 0

#if defined(__CUDACC__)
#define GRADCOMP_HOST_DEVICE __host__ __device__ __forceinline__
#define GRADCOMP_DEVICE __device__ __forceinline__
#else
#define GRADCOMP_HOST_DEVICE inline
#define GRADCOMP_DEVICE inline
#endif

namespace gradcomp {

struct version_info {
  int major, minor, patch;
};

inline constexpr version_info version{GRADCOMP_VERSION_MAJOR, GRADCOMP_VERSION_MINOR,
                                      GRADCOMP_VERSION_PATCH};

}  // namespace gradcomp
