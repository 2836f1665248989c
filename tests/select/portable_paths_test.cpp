// The selectors built without the GCC/Clang vector extensions (GRADCOMP_NO_VECTOR_EXTENSIONS):
// the portable loops, which also turn off the SSE2 compare masks, must select exactly what
// the references select. This executable is the only one built that way.
#define GRADCOMP_NO_VECTOR_EXTENSIONS 1

#include <doctest/doctest.h>

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include <gradcomp/detail/moments.hpp>
#include <gradcomp/quantize/identity.hpp>
#include <gradcomp/select/gaussiank.hpp>
#include <gradcomp/select/topk.hpp>

#include "fast_paths.hpp"
#include "select_test_inputs.hpp"
#include "topk_sweep.hpp"

namespace gt = gradcomp_test;

static_assert(!GRADCOMP_VECTOR_EXTENSIONS && !GRADCOMP_SSE2_MASKS);

TEST_CASE("portable topk equals sort-and-truncate") {
  gt::sweep<float>({0, 1, 2049, 77777, std::size_t{1} << 18});
  gt::sweep<double>({3, 5003, 65537});
}

TEST_CASE("portable select_accumulate and fused step equal the plain forms") {
  gt::accumulate_paths<gradcomp::topk, float>(gradcomp::topk{});
  gt::accumulate_paths<gradcomp::gaussiank, float>(gradcomp::gaussiank{});
  gt::check_fused_step<gradcomp::topk, gradcomp::identity, float>(gradcomp::identity{});
}

TEST_CASE("portable gaussiank: sampled and plain forms agree, statistics match the double loop") {
  const std::size_t n = std::size_t{1} << 18;
  for (gt::dist d : gt::all_dists) {
    const std::string dist_name = gt::name(d);
    CAPTURE(dist_name);
    const auto g = gt::make_input<float>(d, n, 9);
    gt::check_same_selection(gradcomp::gaussiank{.predict_sample = 0}, gradcomp::gaussiank{}, g,
                             n / 1000);
    const auto a = gradcomp::detail::mean_and_sd(std::span<const float>(g));
    const auto b = gradcomp::detail::mean_and_sd_double(std::span<const float>(g));
    CHECK(a.mean == b.mean);
    CHECK(a.sd == b.sd);
  }
}
