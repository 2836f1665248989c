# docs/cluster.md's extrapolation is what the tool prints for its calibration: runs
#   exchange_model --extrapolate <ARGS>
# and compares its output with EXPECTED byte for byte (ctest exchange_model_extrapolation).
#
#   cmake -DTOOL=<exchange_model> -DARGS="14.1;0.348;..." -DEXPECTED=<file> -P check_extrapolation.cmake
cmake_minimum_required(VERSION 3.21)

foreach(_var IN ITEMS TOOL ARGS EXPECTED)
  if(NOT DEFINED ${_var} OR "${${_var}}" STREQUAL "")
    message(FATAL_ERROR "check_extrapolation.cmake: -D${_var}=... is required")
  endif()
endforeach()

execute_process(COMMAND "${TOOL}" --extrapolate ${ARGS}
                OUTPUT_VARIABLE _got RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "exchange_model --extrapolate ${ARGS} failed (${_rc})")
endif()
file(READ "${EXPECTED}" _want)
if(NOT _got STREQUAL _want)
  file(WRITE "${CMAKE_CURRENT_BINARY_DIR}/extrapolation.got" "${_got}")
  message(FATAL_ERROR "exchange_model --extrapolate ${ARGS} no longer prints ${EXPECTED} "
                      "(its output: ${CMAKE_CURRENT_BINARY_DIR}/extrapolation.got); re-run it "
                      "and update docs/cluster.md")
endif()
