// The SGD drivers' shared pieces (gradcomp/sgd.hpp): the density schedule.
#include <doctest/doctest.h>

#include <cmath>

#include <gradcomp/error.hpp>
#include <gradcomp/sgd.hpp>

using namespace gradcomp;

TEST_CASE("density_schedule: DGC warm-up") {
  const auto s = density_schedule::warmup(0.001, 4, 10);
  CHECK(s.at(0) == doctest::Approx(std::pow(0.001, 0.2)));
  CHECK(s.at(9) == doctest::Approx(std::pow(0.001, 0.2)));
  CHECK(s.at(10) == doctest::Approx(std::pow(0.001, 0.4)));
  CHECK(s.at(39) == doctest::Approx(std::pow(0.001, 0.8)));
  CHECK(s.at(40) == 0.001);
  CHECK(s.at(1000000) == 0.001);
  CHECK(density_schedule::constant(0.5).at(3) == 0.5);
  CHECK_THROWS_AS(density_schedule::constant(0.0), invalid_argument);
  CHECK_THROWS_AS(density_schedule::warmup(0.1, 2, 0), invalid_argument);
}
