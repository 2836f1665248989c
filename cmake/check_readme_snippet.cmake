# Keeps a README code block and the file it shows byte-identical, so the
# README can only show code that is compiled and run by the test suite.
#
#   cmake -DSOURCE_DIR=<repo root> -DREADME=README.md -DSNIPPET=examples/usage.cpp -P check_readme_snippet.cmake
#
# README must contain the line `<!-- snippet: <SNIPPET> -->`, immediately
# followed by a ```cpp fence; everything up to the closing ``` line must equal
# the file SNIPPET (both relative to SOURCE_DIR). On mismatch the README's
# version is written to <SNIPPET name>.from-readme in the current directory.
cmake_minimum_required(VERSION 3.21)

foreach(_var IN ITEMS SOURCE_DIR README SNIPPET)
  if(NOT DEFINED ${_var} OR "${${_var}}" STREQUAL "")
    message(FATAL_ERROR "check_readme_snippet.cmake: -D${_var}=... is required")
  endif()
endforeach()

set(_readme_path "${SOURCE_DIR}/${README}")
set(_snippet_path "${SOURCE_DIR}/${SNIPPET}")
foreach(_path IN ITEMS "${_readme_path}" "${_snippet_path}")
  if(NOT EXISTS "${_path}")
    message(FATAL_ERROR "readme snippet check: ${_path} does not exist")
  endif()
endforeach()

file(READ "${_readme_path}" _readme)
file(READ "${_snippet_path}" _expected)

# The marker must be a whole line; prepend a newline so line 1 also counts.
set(_open "<!-- snippet: ${SNIPPET} -->\n```cpp\n")
string(FIND "\n${_readme}" "\n${_open}" _pos)
if(_pos EQUAL -1)
  message(FATAL_ERROR
    "readme snippet check: ${README} has no line '<!-- snippet: ${SNIPPET} -->' "
    "immediately followed by a line '```cpp'")
endif()
string(LENGTH "${_open}" _open_len)
math(EXPR _start "${_pos} + ${_open_len}")
string(SUBSTRING "${_readme}" ${_start} -1 _rest)

# The block ends at the first line starting with ```; the newline before it
# belongs to the block (a source file ends with one).
string(FIND "\n${_rest}" "\n```" _end)
if(_end EQUAL -1)
  message(FATAL_ERROR "readme snippet check: the ```cpp block for ${SNIPPET} in ${README} is not closed")
endif()
string(SUBSTRING "${_rest}" 0 ${_end} _actual)

if(NOT "${_actual}" STREQUAL "${_expected}")
  get_filename_component(_name "${SNIPPET}" NAME)
  set(_dump "${CMAKE_CURRENT_BINARY_DIR}/${_name}.from-readme")
  file(WRITE "${_dump}" "${_actual}")
  message(FATAL_ERROR
    "readme snippet check: the ```cpp block after '<!-- snippet: ${SNIPPET} -->' in "
    "${README} differs from ${SNIPPET}.\n"
    "Copy the file into the README. To see the difference:\n"
    "  diff -u ${_snippet_path} ${_dump}")
endif()
message(STATUS "readme snippet check: ${README} shows ${SNIPPET} verbatim")
