// Built by the consumer tests (tests/consumer/*/CMakeLists.txt) exactly as an
// outside project would build it: only through gradcomp::gradcomp.
#include <gradcomp/gradcomp.hpp>

#include <cstdio>

int main() {
  std::printf("gradcomp %d.%d.%d\n", gradcomp::version.major, gradcomp::version.minor,
              gradcomp::version.patch);
  return 0;
}
