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
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <span>
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
  // Every selector the registry has, in its order ('topk', 'gaussiank', ...).
  std::string listed;
  for (std::string_view s : runtime::selector_names) listed += (listed.empty() ? "'" : ", '") + std::string(s) + "'";
  CHECK(listed.starts_with("'topk', 'gaussiank', "));
  CHECK(refusal(config_of("top-k", "fp32", "residual", "allgather")) ==
        "gradcomp: selector = 'top-k' is not allowed; allowed: one of " + listed);
  CHECK(refusal(config_of("topk", "int8", "residual", "allgather")).find("quantizer = 'int8'") !=
        std::string::npos);
  rt_config c = config_of("threshold", "fp32", "residual", "allgather");
  c.threshold.reset();  // none given
  CHECK(refusal(c).find("needs a threshold, and none was given") != std::string::npos);
  c.threshold = 0.0;  // given, and out of range: the value the caller gave, not "none"
  CHECK(refusal(c).find("threshold = 0 is not allowed; allowed: 0 < threshold < inf") != std::string::npos);
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

namespace {

// Top-k with residual feedback over allgather, its buckets 0 (500 elements) and 1 (300) run at
// step 0 and committed.
void run_two_buckets(runtime::bucket_engine<in_process_comm>& e, int rank) {
  std::vector<float> a = bucket_for(rank, 0, 500);
  std::vector<float> b = bucket_for(rank, 1, 300);
  e.run(0, a, 0, 0.01);
  e.run(1, b, 0, 0.01);
  e.commit();
}

}  // namespace

TEST_CASE("bucket_engine: discard leaves every bucket's feedback as the last commit did") {
  run_in_process(2, [](in_process_comm& comm) {
    runtime::bucket_engine<in_process_comm> e(comm, config_of("topk", "fp32", "residual", "allgather"));
    run_two_buckets(e, comm.rank());
    const std::vector<float> e0(e.feedback().buffers(0)[0].begin(), e.feedback().buffers(0)[0].end());
    const std::vector<float> e1(e.feedback().buffers(1)[0].begin(), e.feedback().buffers(1)[0].end());
    std::vector<float> a = bucket_for(comm.rank(), 2, 500);
    std::vector<float> b = bucket_for(comm.rank(), 3, 300);
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

TEST_CASE("bucket_engine: drop frees one bucket's state and leaves the others'") {
  run_in_process(2, [](in_process_comm& comm) {
    runtime::bucket_engine<in_process_comm> e(comm, config_of("topk", "fp32", "residual", "allgather"));
    run_two_buckets(e, comm.rank());
    const auto kept = e.feedback().buffers(1)[0];
    const std::vector<float> e1(kept.begin(), kept.end());
    e.feedback().drop(0);
    e.feedback().drop(7);  // no state: nothing happens
    CHECK(e.feedback().buffers(0).empty());
    const auto after1 = e.feedback().buffers(1)[0];
    CHECK(std::vector<float>(after1.begin(), after1.end()) == e1);
    // The dropped index runs again from zeros, at another size too (its slot is reused): the
    // residual of a first step is the bucket less what was sent, as for a bucket never run.
    std::vector<float> c = bucket_for(comm.rank(), 2, 123);
    const std::vector<float> c0 = c;
    std::vector<float> fresh_c = c;
    runtime::bucket_engine<in_process_comm> fresh(comm, config_of("topk", "fp32", "residual", "allgather"));
    e.run(0, c, 1, 0.01);
    fresh.run(0, fresh_c, 1, 0.01);
    e.commit();
    fresh.commit();
    CHECK(c == fresh_c);
    const auto r = e.feedback().buffers(0)[0];
    const auto rf = fresh.feedback().buffers(0)[0];
    CHECK(r.size() == 123);
    CHECK(std::vector<float>(r.begin(), r.end()) == std::vector<float>(rf.begin(), rf.end()));
    CHECK_FALSE(std::vector<float>(r.begin(), r.end()) == c0);  // picks were taken out
  });
}

namespace {

std::vector<float> committed_state(runtime::bucket_engine<in_process_comm>& e, std::int64_t bucket) {
  const auto b = e.feedback().buffers(bucket);
  return b.empty() ? std::vector<float>{} : std::vector<float>(b[0].begin(), b[0].end());
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

// A rank whose gradient holds a NaN still takes part in the bucket's agreement: every rank
// throws in the same call, the others naming the rank and carrying its message; no rank's
// feedback changes, and a retry of the step with finite gradients succeeds everywhere.
TEST_CASE("bucket_engine: a non-finite gradient on one rank fails the bucket on every rank") {
  for (const std::size_t bad_bucket : {std::size_t{0}, std::size_t{1}, std::size_t{2}}) {
    CAPTURE(bad_bucket);
    run_in_process(3, [&](in_process_comm& comm) {
      runtime::bucket_engine<in_process_comm> e(comm, config_of("topk", "fp32", "residual", "allgather"));
      std::vector<std::vector<float>> g;
      for (std::size_t b = 0; b < 3; ++b) g.push_back(bucket_for(comm.rank(), b, 400 + 50 * b));
      for (std::size_t b = 0; b < 3; ++b) e.run(static_cast<std::int64_t>(b), g[b], 0, 0.05);
      e.commit();
      std::vector<std::vector<float>> before;
      for (std::int64_t b = 0; b < 3; ++b) before.push_back(committed_state(e, b));
      // Step 1: rank 1's bucket `bad_bucket` holds a NaN.
      for (std::size_t b = 0; b < 3; ++b) g[b] = bucket_for(comm.rank(), 10 + b, 400 + 50 * b);
      if (comm.rank() == 1) g[bad_bucket][7] = std::numeric_limits<float>::quiet_NaN();
      std::string failure;
      for (std::size_t b = 0; b < 3 && failure.empty(); ++b) {
        std::vector<float> copy = g[b];
        try {
          e.run(static_cast<std::int64_t>(b), copy, 1, 0.05);
        } catch (const nonfinite_error& ex) {
          failure = ex.what();
          CHECK(b == bad_bucket);
          // The bucket is left as it was (bit for bit: rank 1's holds a NaN).
          CHECK(std::memcmp(copy.data(), g[b].data(), copy.size() * sizeof(float)) == 0);
        }
      }
      REQUIRE_FALSE(failure.empty());
      if (comm.rank() != 1) {
        CHECK(failure.find("failed on rank 1") != std::string::npos);
        CHECK(failure.find("holds nan") != std::string::npos);
        CHECK(failure.find(std::string("bucket ") + std::to_string(bad_bucket) + " of step 1") !=
              std::string::npos);
      }
      e.discard();
      for (std::int64_t b = 0; b < 3; ++b) CHECK(committed_state(e, b) == before[static_cast<std::size_t>(b)]);
      // The retry, finite everywhere, runs on every rank and the replicas agree.
      g[bad_bucket] = bucket_for(comm.rank(), 10 + bad_bucket, 400 + 50 * bad_bucket);
      std::vector<float> mean0;
      for (std::size_t b = 0; b < 3; ++b) {
        e.run(static_cast<std::int64_t>(b), g[b], 1, 0.05);
        if (b == 0) mean0 = g[0];
      }
      e.commit();
      std::vector<float> rank0_mean = mean0;
      comm.broadcast(std::span<float>(rank0_mean), 0);
      CHECK(rank0_mean == mean0);
    });
  }
}

// With labels, the refusal names the parameter, the bucket and the element on every rank, the
// failing rank's and the others' alike; labels that do not cover the bucket fall back to the
// compressor's words.
TEST_CASE("bucket_engine: labels name the parameter with a non-finite gradient on every rank") {
  for (const std::size_t at : {std::size_t{0}, std::size_t{99}, std::size_t{100}, std::size_t{330}}) {
    CAPTURE(at);
    run_in_process(2, [&](in_process_comm& comm) {
      runtime::bucket_engine<in_process_comm> e(comm, config_of("topk", "fp32", "residual", "allgather"));
      const std::vector<runtime::tensor_label> labels{{"fc.weight", 100}, {"fc.bias", 1}, {"out.weight", 230}};
      std::vector<float> g = bucket_for(comm.rank(), 0, 331);
      if (comm.rank() == 1) g[at] = -std::numeric_limits<float>::infinity();
      const std::string err = error_of([&] { e.run(4, g, 0, 0.05, labels); });
      const std::string want = at < 100    ? "parameter 'fc.weight' (bucket 4) holds -inf at element " + std::to_string(at)
                               : at == 100 ? std::string("parameter 'fc.bias' (bucket 4) holds -inf at element 0")
                                           : "parameter 'out.weight' (bucket 4) holds -inf at element " + std::to_string(at - 101);
      CHECK(err.find(want) != std::string::npos);
      if (comm.rank() == 0) CHECK(err.find("failed on rank 1") != std::string::npos);
      CHECK(err.find("tensor 4") == std::string::npos);
    });
  }
  run_in_process(2, [](in_process_comm& comm) {
    runtime::bucket_engine<in_process_comm> e(comm, config_of("topk", "fp32", "residual", "allgather"));
    const std::vector<runtime::tensor_label> short_labels{{"fc.weight", 10}};
    std::vector<float> g = bucket_for(comm.rank(), 0, 50);
    if (comm.rank() == 0) g[20] = std::numeric_limits<float>::quiet_NaN();
    const std::string err = error_of([&] { e.run(0, g, 0, 0.05, short_labels); });
    CHECK(err.find("holds nan at index 20") != std::string::npos);
  });
  CHECK(runtime::name_nonfinite(1, std::vector<float>{1.0f, 2.0f}, {}, "fine") == "fine");
}

// skip_nonfinite: every rank gets the bucket back as NaN, skipped() says so, nothing exchanged,
// and no feedback state changed; the next bucket runs as usual.
TEST_CASE("bucket_engine: skip_nonfinite skips the bucket on every rank") {
  run_in_process(2, [](in_process_comm& comm) {
    rt_config c = config_of("topk", "fp32", "residual", "allgather");
    c.skip_nonfinite = true;
    runtime::bucket_engine<in_process_comm> e(comm, c);
    std::vector<float> a = bucket_for(comm.rank(), 0, 300);
    e.run(0, a, 0, 0.05);
    e.commit();
    const std::vector<float> before = committed_state(e, 0);
    a = bucket_for(comm.rank(), 1, 300);
    if (comm.rank() == 0) a[3] = std::numeric_limits<float>::infinity();
    e.run(0, a, 1, 0.05);
    CHECK(e.skipped());
    CHECK(std::all_of(a.begin(), a.end(), [](float x) { return std::isnan(x); }));
    CHECK_FALSE(e.feedback().pending());
    CHECK(committed_state(e, 0) == before);
    a = bucket_for(comm.rank(), 2, 300);
    e.run(0, a, 2, 0.05);
    CHECK_FALSE(e.skipped());
    CHECK(std::all_of(a.begin(), a.end(), [](float x) { return std::isfinite(x); }));
    // Other errors are not skipped: a wrong size still fails on every rank.
    std::vector<float> wrong(comm.rank() == 1 ? 299 : 300, 1.0f);
    const std::string err = error_of([&] { e.run(0, wrong, 3, 0.05); });
    if (comm.rank() == 1) {
      CHECK(err.find("had before (300)") != std::string::npos);
    } else {
      CHECK(err.find("failed on rank 1") != std::string::npos);
    }
  });
}

// Ranks at different buckets (or steps) refuse to exchange, every one of them, naming both.
TEST_CASE("bucket_engine: buckets of different indices or steps never pair up") {
  run_in_process(2, [](in_process_comm& comm) {
    runtime::bucket_engine<in_process_comm> e(comm, config_of("topk", "fp32", "residual", "allgather"));
    std::vector<float> a = bucket_for(comm.rank(), 0, 256);  // the same size: only the tag differs
    const std::string err = error_of([&] { e.run(comm.rank() == 0 ? 0 : 1, a, 0, 0.05); });
    CHECK(err.find("ranks are at different buckets: rank 1 is at step 0, bucket 1; rank 0 at step 0, bucket 0") !=
          std::string::npos);
    CHECK_FALSE(e.feedback().pending());
    const std::string err2 = error_of([&] { e.run(0, a, comm.rank() == 0 ? 5 : 6, 0.05); });
    CHECK(err2.find("rank 1 is at step 6, bucket 0; rank 0 at step 5") != std::string::npos);
  });
}

// fail(): a caller's own error before run() is carried to every rank.
TEST_CASE("bucket_engine: fail carries a caller's own error to every rank") {
  run_in_process(2, [](in_process_comm& comm) {
    runtime::bucket_engine<in_process_comm> e(comm, config_of("topk", "fp32", "residual", "allgather"));
    std::vector<float> a = bucket_for(comm.rank(), 0, 256);
    if (comm.rank() == 0) {
      CHECK_THROWS_WITH_AS(e.fail(0, 0, "checkpoint entry 'w' has 3 elements"),
                           "checkpoint entry 'w' has 3 elements", invalid_argument);
    } else {
      CHECK_THROWS_WITH_AS(e.run(0, a, 0, 0.05),
                           doctest::Contains("failed on rank 0 (no rank exchanged it, and no "
                                             "feedback state changed): checkpoint entry 'w' has 3 elements"),
                           communicator_error);
    }
  });
}

// The records peers send are checked before they are used.
TEST_CASE("bucket_engine: malformed bucket records are refused") {
  runtime::bucket_record r{7, 3, runtime::bucket_outcome::nonfinite, "holds nan"};
  std::vector<std::byte> ok = runtime::detail_engine::write_record(r);
  const runtime::bucket_record back = runtime::detail_engine::read_record(ok.data(), ok.size(), 1);
  CHECK(back.step == 7);
  CHECK(back.bucket == 3);
  CHECK(back.outcome == runtime::bucket_outcome::nonfinite);
  CHECK(back.message == "holds nan");
  const auto refused = [](std::vector<std::byte> bytes) {
    return error_of([&] { runtime::detail_engine::read_record(bytes.data(), bytes.size(), 2); });
  };
  CHECK(refused(std::vector<std::byte>(5)).find("rank 2 sent 5 bytes that are not a bucket record") !=
        std::string::npos);
  std::vector<std::byte> bad = ok;
  bad[16] = std::byte{9};
  CHECK(refused(bad).find("outcome 9") != std::string::npos);
  bad = ok;
  bad[18] = std::byte{0xff};  // a length that does not match the bytes
  CHECK(refused(bad).find("a message of") != std::string::npos);
  bad = ok;
  bad.push_back(std::byte{0});
  CHECK(refused(bad).find("exactly the bytes that follow") != std::string::npos);
  // Messages are cut at bucket_message_max.
  r.message.assign(5000, 'x');
  CHECK(runtime::detail_engine::write_record(r).size() ==
        runtime::bucket_record_head + runtime::bucket_message_max);
}
