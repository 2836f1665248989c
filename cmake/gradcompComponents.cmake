# The optional parts of gradcomp. Each is one INTERFACE target that carries everything its
# headers need, so that a consumer links one name:
#
#   gradcomp::mpi    comm/mpi.hpp, comm/mpi_guard.hpp     MPI::MPI_CXX
#   gradcomp::cuda   gradcomp/cuda.cuh in .cu files        nvcc: -std=c++20, --expt-relaxed-constexpr,
#                                                          code for GRADCOMP_CUDA_ARCHITECTURES
#                                                          (default 80;90); CUDA::cudart
#   gradcomp::nccl   comm/nccl.hpp                         gradcomp::cuda, gradcomp::mpi, NCCL
#   gradcomp::torch  torch/*.hpp (module_sgd, ...)         LibTorch (torch/device_module.hpp
#                                                          also CUDA::cudart, and a driver
#                                                          factory made in a .cu file)
#
# The same function makes them in gradcomp's own build (CMakeLists.txt: BUILD, an ordinary
# target with a gradcomp:: alias) and in an installed package (gradcompConfig.cmake: IMPORTED),
# so both offer the same targets with the same requirements.
#
#   gradcomp_add_component(<component> <BUILD|IMPORTED> <found-var> <why-var>)
#
# Finds the component's dependencies (quietly) and, when they are all there, makes its
# target and sets <found-var> TRUE; otherwise sets it FALSE and <why-var> to one sentence that
# names what is missing and how to get it. gradcomp::gradcomp must exist already.

set(GRADCOMP_COMPONENTS mpi cuda nccl torch)

# nvcc's flags for gradcomp's device code. CMake 3.25 knows no cuda_std_20 for CUDA 13, so the
# standard goes to nvcc directly; GRADCOMP_HOST_DEVICE functions call constexpr std:: functions
# (numeric_limits, bit_cast), which device code may only call with --expt-relaxed-constexpr.
# Machine code for every architecture in the list and PTX for the last one, which later GPUs
# compile when they load it.
function(_gradcomp_cuda_flags out)
  if(NOT DEFINED GRADCOMP_CUDA_ARCHITECTURES OR "${GRADCOMP_CUDA_ARCHITECTURES}" STREQUAL "")
    set(GRADCOMP_CUDA_ARCHITECTURES 80 90)
  endif()
  set(_flags -std=c++20 --expt-relaxed-constexpr)
  list(GET GRADCOMP_CUDA_ARCHITECTURES -1 _last)
  foreach(_arch IN LISTS GRADCOMP_CUDA_ARCHITECTURES)
    if(_arch STREQUAL _last)
      list(APPEND _flags "--generate-code=arch=compute_${_arch},code=[compute_${_arch},sm_${_arch}]")
    else()
      list(APPEND _flags "--generate-code=arch=compute_${_arch},code=sm_${_arch}")
    endif()
  endforeach()
  set(${out} "${_flags}" PARENT_SCOPE)
  if(ARGC GREATER 1)  # _gradcomp_cuda_flags(<flags-var> <archs-var>): the list used, too
    set(${ARGV1} "${GRADCOMP_CUDA_ARCHITECTURES}" PARENT_SCOPE)
  endif()
endfunction()

# A target named gradcomp::<component>: for BUILD, gradcomp_<component> with that alias and
# the export name <component>.
function(_gradcomp_make_target component mode out)
  if(mode STREQUAL "IMPORTED")
    add_library(gradcomp::${component} INTERFACE IMPORTED)
    set(${out} gradcomp::${component} PARENT_SCOPE)
  else()
    add_library(gradcomp_${component} INTERFACE)
    add_library(gradcomp::${component} ALIAS gradcomp_${component})
    set_target_properties(gradcomp_${component} PROPERTIES EXPORT_NAME ${component})
    set(${out} gradcomp_${component} PARENT_SCOPE)
  endif()
endfunction()

function(gradcomp_add_component component mode found_var why_var)
  set(${found_var} FALSE PARENT_SCOPE)
  set(${why_var} "" PARENT_SCOPE)
  if(TARGET gradcomp::${component})
    set(${found_var} TRUE PARENT_SCOPE)
    return()
  endif()

  if(component STREQUAL "mpi")
    find_package(MPI QUIET COMPONENTS CXX)
    if(NOT MPI_CXX_FOUND)
      set(${why_var} "gradcomp component 'mpi' needs MPI with its C++ interface (MPI::MPI_CXX), which was not found: install an MPI (Debian: libopenmpi-dev) or point MPI_HOME at one" PARENT_SCOPE)
      return()
    endif()
    _gradcomp_make_target(mpi ${mode} _t)
    target_link_libraries(${_t} INTERFACE gradcomp::gradcomp MPI::MPI_CXX)

  elseif(component STREQUAL "cuda")
    find_package(CUDAToolkit QUIET)
    if(NOT CUDAToolkit_FOUND)
      set(${why_var} "gradcomp component 'cuda' needs the CUDA toolkit (CUDA::cudart, nvcc), which was not found: install it or set CUDAToolkit_ROOT" PARENT_SCOPE)
      return()
    endif()
    _gradcomp_cuda_flags(_flags)
    _gradcomp_make_target(cuda ${mode} _t)
    target_compile_options(${_t} INTERFACE "$<$<COMPILE_LANGUAGE:CUDA>:${_flags}>")
    target_link_libraries(${_t} INTERFACE gradcomp::gradcomp CUDA::cudart)

  elseif(component STREQUAL "nccl")
    foreach(_needed IN ITEMS cuda mpi)
      gradcomp_add_component(${_needed} ${mode} _ok _why)
      if(NOT _ok)
        set(${why_var} "gradcomp component 'nccl' needs the component '${_needed}': ${_why}" PARENT_SCOPE)
        return()
      endif()
    endforeach()
    find_package(CUDAToolkit QUIET)  # its variables, which the call above kept to itself
    find_library(GRADCOMP_NCCL_LIBRARY nccl HINTS "${CUDAToolkit_LIBRARY_DIR}")
    find_path(GRADCOMP_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
    if(NOT GRADCOMP_NCCL_LIBRARY OR NOT GRADCOMP_NCCL_INCLUDE_DIR)
      set(${why_var} "gradcomp component 'nccl' needs NCCL (libnccl.so and nccl.h), which was not found beside the CUDA toolkit: install it or set GRADCOMP_NCCL_LIBRARY and GRADCOMP_NCCL_INCLUDE_DIR" PARENT_SCOPE)
      return()
    endif()
    _gradcomp_make_target(nccl ${mode} _t)
    target_include_directories(${_t} INTERFACE "${GRADCOMP_NCCL_INCLUDE_DIR}")
    target_link_libraries(${_t} INTERFACE gradcomp::cuda gradcomp::mpi "${GRADCOMP_NCCL_LIBRARY}")

  elseif(component STREQUAL "torch")
    find_package(Torch QUIET CONFIG HINTS /usr/lib/x86_64-linux-gnu/cmake/Torch)
    if(NOT Torch_FOUND)
      set(${why_var} "gradcomp component 'torch' needs LibTorch (its CMake package Torch), which was not found: install it (Debian: libtorch-dev) or add its prefix to CMAKE_PREFIX_PATH" PARENT_SCOPE)
      return()
    endif()
    _gradcomp_make_target(torch ${mode} _t)
    target_link_libraries(${_t} INTERFACE gradcomp::gradcomp ${TORCH_LIBRARIES})

  else()
    string(REPLACE ";" ", " _all "${GRADCOMP_COMPONENTS}")
    set(${why_var} "gradcomp has no component '${component}'; it offers ${_all}" PARENT_SCOPE)
    return()
  endif()
  set(${found_var} TRUE PARENT_SCOPE)
endfunction()
