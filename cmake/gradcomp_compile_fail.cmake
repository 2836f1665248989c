# Runs one compile-fail test (see gradcomp_add_compile_fail_test in
# tests/CMakeLists.txt): builds TARGET in BUILD_DIR and succeeds only if that
# build FAILS and its output matches REGEX (CMake regex syntax).
#
#   cmake -DBUILD_DIR=... -DTARGET=... -DREGEX=... [-DCONFIG=...] -P gradcomp_compile_fail.cmake
#
# Checking both conditions here (rather than with ctest's PASS_REGULAR_EXPRESSION,
# which ignores the exit code and also sees our own messages) means a source
# that compiles can never pass, and the regex only sees the compiler's output.
cmake_minimum_required(VERSION 3.21)

foreach(_var IN ITEMS BUILD_DIR TARGET REGEX)
  if(NOT DEFINED ${_var} OR "${${_var}}" STREQUAL "")
    message(FATAL_ERROR "gradcomp_compile_fail.cmake: -D${_var}=... is required")
  endif()
endforeach()

set(_build "${CMAKE_COMMAND}" --build "${BUILD_DIR}" --target "${TARGET}")
if(NOT "${CONFIG}" STREQUAL "")
  list(APPEND _build --config "${CONFIG}")
endif()

# LC_ALL=C: GCC quotes names with typographic quotes in UTF-8 locales; the
# regexes are written against the plain ASCII ones.
execute_process(
  COMMAND "${CMAKE_COMMAND}" -E env LC_ALL=C ${_build}
  RESULT_VARIABLE _result
  OUTPUT_VARIABLE _output
  ERROR_VARIABLE _output)

# The build output is printed as-is (message(FATAL_ERROR) would re-wrap it).
if(_result EQUAL 0)
  message("${_output}")
  message(FATAL_ERROR "compile-fail test '${TARGET}': the source COMPILED, but it must not.")
endif()
if(NOT _output MATCHES "${REGEX}")
  message("${_output}")
  message(FATAL_ERROR "compile-fail test '${TARGET}': the build failed as expected, "
    "but the output above does not match the expected regex '${REGEX}'")
endif()
message(STATUS "compile-fail test '${TARGET}': failed to compile as expected, matching '${REGEX}'")
