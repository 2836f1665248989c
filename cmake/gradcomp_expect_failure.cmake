# Runs COMMAND (a ;-list) and passes only if it exits non-zero, within TIMEOUT seconds, with
# output (stdout and stderr) matching REGEX: a test of a failure that must be reported, not
# hang and not pass silently.
#   cmake -DCOMMAND=<prog;args> -DREGEX=<regex> -DTIMEOUT=<s> -P gradcomp_expect_failure.cmake
execute_process(COMMAND ${COMMAND}
  RESULT_VARIABLE _rc
  OUTPUT_VARIABLE _out
  ERROR_VARIABLE _out
  TIMEOUT ${TIMEOUT})
message("${_out}")
if(_rc MATCHES "timeout" OR _rc MATCHES "Process terminated due to timeout")
  message(FATAL_ERROR "expected a failure within ${TIMEOUT} s, but the command hung (${_rc})")
endif()
if(_rc EQUAL 0)
  message(FATAL_ERROR "expected the command to fail, but it exited 0")
endif()
if(NOT _out MATCHES "${REGEX}")
  message(FATAL_ERROR "the command failed (${_rc}), but its output does not match: ${REGEX}")
endif()
message(STATUS "failed as expected (${_rc}), output matches: ${REGEX}")
