// runtime/registry.hpp and runtime/bucket_engine.hpp without torch: every policy reachable by
// name, every combination the registry allows runs and keeps the replicas equal, the ones it
// refuses are refused with the field and what is allowed, and the engine's transaction (run,
// then commit or discard) over in-process ranks.
// ctest-threads: no (each rank's engine is its own; the ranks share only in_process_comm)
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <gradcomp/comm/in_process.hpp>
#include <gradcomp/runtime/bucket_engine.hpp>
#include <gradcomp/runtime/registry.hpp>

#include "../support/data.hpp"

namespace {

using namespace gradcomp;
using rt_config = runtime::engine_config;

rt_config config_of(std::string_view s, std::string_view q, std::string_view f, std::string_view x) {
  rt_config c;
  c.selector = s;
  c.quantizer = q;
  c.feedback = f;
  c.exchange = x;
  c.threshold = 0.5;  // for selector 'threshold'; the others ignore it
  return c;
}

bool accepted(const rt_config& c) {
  try {
    runtime::check_config(c);
    return true;
  } catch (const invalid_argument&) {
    return false;
  }
}

std::string refusal(const rt_config& c) {
  try {
    runtime::check_config(c);
  } catch (const invalid_argument& e) {
    return e.what();
  }
  return "";
}

// Rank r's bucket at a step: heavy-tailed (Student-t, 2 degrees of freedom), other on each rank.
std::vector<float> bucket_for(int rank, std::uint64_t step, std::size_t n) {
  return gradcomp_test::make_input<float>(gradcomp_test::dist::student_t2, n,
                                          1000 * step + static_cast<std::uint64_t>(rank) + 1);
}

}  // namespace

TEST_CASE("registry: every name of every list is reachable, redsync included") {
  int selectors = 0;
  for (std::string_view s : runtime::selector_names) {
    rt_config c = config_of(s, "fp32", s == "dgc" ? "dgc" : "residual", "allgather");
    runtime::with_selector(c, [&](auto) { ++selectors; });
  }
  CHECK(selectors == static_cast<int>(std::size(runtime::selector_names)));
  bool has_redsync = false;
  for (std::string_view s : runtime::selector_names) has_redsync = has_redsync || s == "redsync";
  CHECK(has_redsync);
  int others = 0;
  for (std::string_view q : runtime::quantizer_names) {
    runtime::with_quantizer(config_of("topk", q, "residual", "allgather"), [&](auto) { ++others; });
  }
  for (std::string_view f : runtime::feedback_names) {
    runtime::with_feedback(config_of("topk", "fp32", f, "allgather"), [&](auto) { ++others; });
  }
  for (std::string_view x : runtime::exchange_names) {
    runtime::with_exchange(config_of("topk", "fp32", "residual", x), [&](auto) { ++others; });
  }
  CHECK(others == static_cast<int>(std::size(runtime::quantizer_names) +
                                   std::size(runtime::feedback_names) +
                                   std::size(runtime::exchange_names)));
}

TEST_CASE("registry: refusals name the field, the value and what is allowed") {
  CHECK(refusal(config_of("top-k", "fp32", "residual", "allgather")) ==
        "gradcomp: selector = 'top-k' is not allowed; allowed: one of 'topk', 'gaussiank', "
        "'gaussiank_published', 'randomk', 'threshold', 'redsync', 'dgc', 'dense'");
  CHECK(refusal(config_of("topk", "int8", "residual", "allgather")).find("quantizer = 'int8'") !=
        std::string::npos);
  rt_config c = config_of("threshold", "fp32", "residual", "allgather");
  c.threshold = 0.0;  // what a caller that gave none passes
  CHECK(refusal(c).find("needs a threshold, and none was given") != std::string::npos);
  c.threshold = -1.0;
  CHECK(refusal(c).find("threshold = -1 is not allowed; allowed: 0 < threshold < inf") != std::string::npos);
  c = config_of("topk", "qsgd", "residual", "allgather");
  c.bits = 17;
  CHECK(refusal(c).find("bits = 17 is not allowed; allowed: 2 <= bits <= 16") != std::string::npos);
  c = config_of("topk", "fp32", "residual", "allgather");
  c.density = 0.0;
  CHECK(refusal(c).find("density = 0 is not allowed") != std::string::npos);
  c = config_of("topk", "fp32", "dgc", "allgather");
  c.dgc_momentum = 1.0;
  CHECK(refusal(c).find("dgc_momentum = 1 is not allowed") != std::string::npos);
  CHECK(refusal(config_of("gaussiank", "fp32", "dgc", "allgather")).find("is not a valid combination") !=
        std::string::npos);
  CHECK(refusal(config_of("dgc", "fp32", "residual", "allgather")).find("is not a valid combination") !=
        std::string::npos);
  CHECK(refusal(config_of("topk", "fp32", "residual", "allreduce")).find("exchange 'allreduce'") !=
        std::string::npos);
  CHECK(accepted(config_of("randomk", "fp16", "residual", "allreduce")));
  CHECK(accepted(config_of("dense", "bf16", "none", "allreduce")));
  CHECK_FALSE(accepted(config_of("dense", "qsgd", "none", "allreduce")));
}

TEST_CASE("bucket_engine: every combination the registry accepts runs, and replicas agree") {
  constexpr std::size_t n = 517;  // odd, several quantizer buckets of 512 and 16-lane chunks
  int ran = 0;
  int refused = 0;
  for (std::string_view s : runtime::selector_names) {
    for (std::string_view q : runtime::quantizer_names) {
      for (std::string_view f : runtime::feedback_names) {
        for (std::string_view x : runtime::exchange_names) {
          // 'auto' measures the link at its first exchange (about a second): it runs for two
          // combinations below, the refusals for all.
          const bool measured = x == "auto";
          if (measured && !((s == "topk" && q == "fp32" && f == "residual") ||
                            (s == "randomk" && q == "bf16" && f == "none"))) {
            if (!accepted(config_of(s, q, f, x))) ++refused;
            continue;
          }
          const rt_config c = config_of(s, q, f, x);
          if (!accepted(c)) {
            // The engine refuses what the registry refuses, before it makes anything.
            run_in_process(1, [&](in_process_comm& comm) {
              CHECK_THROWS_AS(runtime::bucket_engine<in_process_comm>(comm, c), invalid_argument);
            });
            ++refused;
            continue;
          }
          CAPTURE(c.selector);
          CAPTURE(c.quantizer);
          CAPTURE(c.feedback);
          CAPTURE(c.exchange);
          std::vector<std::vector<float>> out(2);
          run_in_process(2, [&](in_process_comm& comm) {
            runtime::bucket_engine<in_process_comm> e(comm, c);
            for (std::uint64_t step = 0; step < 2; ++step) {
              std::vector<float> g = bucket_for(comm.rank(), step, n);
              const tensor_stats st = e.run(3, g, step, 0.05);
              e.commit();
              CHECK(st.id == 3u);
              CHECK(st.n == n);
              CHECK(st.density == doctest::Approx(static_cast<double>(st.selected) / n));
              CHECK(st.bytes_sent > 0u);
              CHECK(std::all_of(g.begin(), g.end(), [](float v) { return std::isfinite(v); }));
              out[static_cast<std::size_t>(comm.rank())] = g;
            }
          });
          CHECK(out[0] == out[1]);
          ++ran;
        }
      }
    }
  }
  CHECK(ran > 100);  // every valid combination but the auto exchange of most
  CHECK(refused > 0);
}

TEST_CASE("bucket_engine: discard leaves every bucket's feedback as the last commit did") {
  run_in_process(2, [](in_process_comm& comm) {
    runtime::bucket_engine<in_process_comm> e(comm, config_of("topk", "fp32", "residual", "allgather"));
    std::vector<float> a = bucket_for(comm.rank(), 0, 500);
    std::vector<float> b = bucket_for(comm.rank(), 1, 300);
    e.run(0, a, 0, 0.01);
    e.run(1, b, 0, 0.01);
    e.commit();
    const std::vector<float> e0(e.feedback().buffers(0)[0].begin(), e.feedback().buffers(0)[0].end());
    const std::vector<float> e1(e.feedback().buffers(1)[0].begin(), e.feedback().buffers(1)[0].end());
    a = bucket_for(comm.rank(), 2, 500);
    b = bucket_for(comm.rank(), 3, 300);
    e.run(0, a, 1, 0.01);
    e.run(1, b, 1, 0.01);
    CHECK(e.feedback().pending());
    e.discard();
    CHECK_FALSE(e.feedback().pending());
    const auto after0 = e.feedback().buffers(0)[0];
    const auto after1 = e.feedback().buffers(1)[0];
    CHECK(std::vector<float>(after0.begin(), after0.end()) == e0);
    CHECK(std::vector<float>(after1.begin(), after1.end()) == e1);
    // A bucket that changes size is refused, naming the size it had.
    std::vector<float> wrong(499, 1.0f);
    CHECK_THROWS_WITH_AS(e.run(0, wrong, 2, 0.01), doctest::Contains("had before (500)"), invalid_argument);
  });
}
