// Exact Top-k against the reference on n = 2^20 for every distribution, k in {1, n/1000,
// n/2, n}, float and double (kept apart from topk_test.cpp to bound each binary's runtime
// under sanitizers).
#include <doctest/doctest.h>

#include <cstddef>

#include "topk_sweep.hpp"

TEST_CASE("topk equals the reference selection: n = 2^20, float") {
  gradcomp_test::sweep<float>({std::size_t{1} << 20});
}

TEST_CASE("topk equals the reference selection: n = 2^20, double") {
  gradcomp_test::sweep<double>({std::size_t{1} << 20});
}
