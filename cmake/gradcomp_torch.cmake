# Finds what gradcomp's PyTorch parts need, without assuming which `python3` imports torch:
# on some machines the first python3 on PATH is not the interpreter torch was installed for.
#
# Sets, when all is found:
#   GRADCOMP_TORCH_FOUND        TRUE
#   GRADCOMP_TORCH_PYTHON       the interpreter that imports torch (cache: set it to choose)
#   GRADCOMP_TORCH_PYTHON_FLAGS the flags PyTorch's own extension builder uses: the C++11 ABI of
#                               libstdc++ and pybind11's ABI tags, so that pybind11 shares torch's
#                               type registry (the ProcessGroup class) with our module
#   TORCH_LIBRARIES, TORCH_PYTHON_LIBRARY, pybind11::module (from find_package)
set(GRADCOMP_TORCH_FOUND FALSE)

find_package(Torch QUIET CONFIG HINTS /usr/lib/x86_64-linux-gnu/cmake/Torch)
if(NOT Torch_FOUND)
  message(STATUS "gradcomp: LibTorch not found (libtorch-dev); the PyTorch parts are not built")
  return()
endif()

set(GRADCOMP_TORCH_PYTHON "" CACHE FILEPATH
    "Python interpreter that imports torch (found by trying the candidates when empty)")
if(NOT GRADCOMP_TORCH_PYTHON)
  set(_gradcomp_candidates)
  find_program(_gradcomp_path_python NAMES python3 NO_CACHE)
  foreach(_c IN ITEMS "${_gradcomp_path_python}" /usr/bin/python3 /usr/local/bin/python3)
    if(_c AND EXISTS "${_c}")
      list(APPEND _gradcomp_candidates "${_c}")
    endif()
  endforeach()
  list(REMOVE_DUPLICATES _gradcomp_candidates)
  foreach(_c IN LISTS _gradcomp_candidates)
    execute_process(COMMAND "${_c}" -c "import torch, torch.distributed"
                    RESULT_VARIABLE _rc OUTPUT_QUIET ERROR_QUIET)
    if(_rc EQUAL 0)
      set(GRADCOMP_TORCH_PYTHON "${_c}" CACHE FILEPATH
          "Python interpreter that imports torch (found by trying the candidates when empty)" FORCE)
      break()
    endif()
  endforeach()
endif()
if(NOT GRADCOMP_TORCH_PYTHON)
  message(STATUS "gradcomp: no Python interpreter here imports torch (tried: ${_gradcomp_candidates}); "
                 "the PyTorch parts are not built. Install python3-torch or set GRADCOMP_TORCH_PYTHON.")
  return()
endif()

execute_process(
  COMMAND "${GRADCOMP_TORCH_PYTHON}" -c
    "import torch, sys; c = torch._C; print(int(c._GLIBCXX_USE_CXX11_ABI), c._PYBIND11_COMPILER_TYPE, c._PYBIND11_STDLIB, c._PYBIND11_BUILD_ABI, torch.__version__, '%d.%d' % sys.version_info[:2], sep=';')"
  OUTPUT_VARIABLE _gradcomp_torch_facts OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0)
  message(STATUS "gradcomp: ${GRADCOMP_TORCH_PYTHON} imports torch but its build facts could not be read; "
                 "the PyTorch parts are not built")
  return()
endif()
list(GET _gradcomp_torch_facts 0 _abi)
list(GET _gradcomp_torch_facts 1 _compiler_type)
list(GET _gradcomp_torch_facts 2 _stdlib)
list(GET _gradcomp_torch_facts 3 _build_abi)
list(GET _gradcomp_torch_facts 4 GRADCOMP_TORCH_VERSION)
list(GET _gradcomp_torch_facts 5 _py_version)
set(GRADCOMP_TORCH_PYTHON_FLAGS
  "_GLIBCXX_USE_CXX11_ABI=${_abi}"
  "PYBIND11_COMPILER_TYPE=\"${_compiler_type}\""
  "PYBIND11_STDLIB=\"${_stdlib}\""
  "PYBIND11_BUILD_ABI=\"${_build_abi}\"")

# pybind11's CMake package, for the interpreter found above.
set(PYTHON_EXECUTABLE "${GRADCOMP_TORCH_PYTHON}" CACHE FILEPATH "Python for pybind11" FORCE)
find_package(pybind11 CONFIG QUIET)
if(NOT pybind11_FOUND)
  message(STATUS "gradcomp: pybind11 not found (pybind11-dev); the PyTorch parts are not built")
  return()
endif()

find_library(TORCH_PYTHON_LIBRARY torch_python HINTS "${TORCH_INSTALL_PREFIX}/lib")
if(NOT TORCH_PYTHON_LIBRARY)
  message(STATUS "gradcomp: libtorch_python not found; the PyTorch parts are not built")
  return()
endif()

set(GRADCOMP_TORCH_FOUND TRUE)
message(STATUS "gradcomp: PyTorch ${GRADCOMP_TORCH_VERSION} with ${GRADCOMP_TORCH_PYTHON} (Python ${_py_version})")
