// expect: gradcomp compile-fail self-test
// Exercises the compile-fail machinery itself (tests/CMakeLists.txt,
// cmake/gradcomp_compile_fail.cmake): this source must never compile.
#include <gradcomp/gradcomp.hpp>

static_assert(sizeof(int) == 0, "gradcomp compile-fail self-test");
