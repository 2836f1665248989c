// detail::staged_slots and detail::staged_feedback, the step's transaction every driver uses,
// and detail::bucket_slots, its slots named by bucket id (the DDP hook's engines):
// a discarded step leaves every slot's committed state as it was, bit for bit; a committed one
// keeps exactly what the step staged (for top-k with residual feedback: e + g less what was
// sent, so sent + kept == e + g element by element); only the slots a step staged change; a
// second compression of a slot in one step starts again from the committed state; refusals
// (wrong gradient size, wrong number of states) change nothing. Sizes 0, 1, odd, small and
// 2^20 + 1, with gradients that are not Gaussian (zeros of both signs, repeated magnitudes,
// wide exponents).
#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <gradcomp/engine/staged_feedback.hpp>
#include <gradcomp/error.hpp>
#include <gradcomp/feedback/residual.hpp>
#include <gradcomp/quantize/identity.hpp>
#include <gradcomp/select/topk.hpp>

namespace {

using gradcomp::compress_context;
using gradcomp::payload;
using compressor_t = gradcomp::compressor<gradcomp::topk, gradcomp::identity, gradcomp::residual>;

std::vector<float> odd_gradient(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<float> g(n);
  for (float& v : g) {
    switch (rng() % 6) {
      case 0: v = 0.0f; break;
      case 1: v = -0.0f; break;
      case 2: v = (rng() % 2) ? 2.5f : -2.5f; break;  // repeated magnitudes: ties
      default: {
        const int e = static_cast<int>(rng() % 40) - 20;
        v = std::ldexp(static_cast<float>(rng() % 1000 + 1) * ((rng() % 2) ? 1.0f : -1.0f), e);
      }
    }
  }
  return g;
}

std::vector<float> dense_of(const payload& p, std::size_t n) {
  std::vector<float> d(n, 0.0f);
  compressor_t().decompress(p, d);
  return d;
}

bool same_bits(const std::vector<float>& a, std::span<const float> b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::signbit(a[i]) != std::signbit(b[i]) || !(a[i] == b[i])) return false;
  }
  return true;
}

std::vector<float> copy_of(std::span<const float> s) { return {s.begin(), s.end()}; }

}  // namespace

TEST_CASE("staged_slots: commit keeps only the staged slots, discard keeps none") {
  gradcomp::detail::staged_slots<std::vector<int>> s;
  const std::size_t a = s.add({1, 2}, {0, 0}, 2);
  const std::size_t b = s.add({3}, {0}, 1);
  CHECK(s.size() == 2);
  CHECK_FALSE(s.pending());

  s.staged(a) = {10, 20};
  s.staged(b) = {30};
  s.stage(a);
  CHECK(s.pending());
  s.discard();
  CHECK_FALSE(s.pending());
  CHECK(s.committed(a) == std::vector<int>{1, 2});
  CHECK(s.committed(b) == std::vector<int>{3});

  s.stage(a);
  s.commit();
  CHECK_FALSE(s.pending());
  CHECK(s.committed(a) == std::vector<int>{10, 20});
  CHECK(s.committed(b) == std::vector<int>{3});  // not staged: kept as it was

  // A slot unmarked after it was staged (a step that starts rewriting it) is not kept.
  s.staged(b) = {99};
  s.stage(b);
  s.stage(b, false);
  s.commit();
  CHECK(s.committed(b) == std::vector<int>{3});

  s.reset(b, {7, 8, 9}, {0, 0, 0}, 3);
  CHECK(s.elements(b) == 3);
  CHECK(s.committed(b) == std::vector<int>{7, 8, 9});
}

TEST_CASE("staged_slots: a released slot is freed, stays out of commits, and is reused by add") {
  gradcomp::detail::staged_slots<std::vector<int>> s;
  const std::size_t a = s.add({1, 2, 3}, {0, 0, 0}, 3);
  const std::size_t b = s.add({4}, {0}, 1);
  s.staged(a) = {7, 8, 9};
  s.stage(a);
  s.release(a, {}, {});
  CHECK_FALSE(s.pending());  // the released slot's staged state is not kept
  CHECK(s.committed(a).empty());
  CHECK(s.elements(a) == 0);
  s.commit();
  CHECK(s.committed(a).empty());
  const std::size_t c = s.add({5, 6}, {0, 0}, 2);
  CHECK(c == a);  // reused
  CHECK(s.size() == 2);
  CHECK(s.committed(c) == std::vector<int>{5, 6});
  CHECK(s.committed(b) == std::vector<int>{4});
  CHECK(s.add({9}, {0}, 1) == 2);  // no released slot left: a new one

  // A second release of a slot, or a reset of a released one, never hands one slot to two.
  s.release(b, {}, {});
  s.release(b, {}, {});
  const std::size_t d = s.add({1}, {0}, 1);
  CHECK(d == b);
  CHECK(s.add({2}, {0}, 1) == 3);  // not b again
  s.release(0, {}, {});
  s.reset(0, {3}, {0}, 1);  // in use again: no longer free
  CHECK(s.add({4}, {0}, 1) == 4);
  CHECK(s.committed(0) == std::vector<int>{3});
}

TEST_CASE("staged_slots: replace_committed refuses the wrong number of states and changes nothing") {
  gradcomp::detail::staged_slots<std::vector<int>> s;
  s.add({1}, {0}, 1);
  s.add({2}, {0}, 1);
  s.stage(0);
  std::vector<std::vector<int>> one{{5}};
  try {
    s.replace_committed(std::move(one));
    FAIL("expected an invalid_argument");
  } catch (const gradcomp::invalid_argument& e) {
    const std::string what = e.what();
    CHECK(what.find("states.size()") != std::string::npos);
    CHECK(what.find("2 (one per slot)") != std::string::npos);
  }
  CHECK(s.pending());
  CHECK(s.committed(0) == std::vector<int>{1});
  CHECK(s.committed(1) == std::vector<int>{2});

  s.replace_committed({{5}, {6}});
  CHECK_FALSE(s.pending());
  CHECK(s.committed(0) == std::vector<int>{5});
  CHECK(s.committed(1) == std::vector<int>{6});
}

TEST_CASE("bucket_slots: a bucket keeps its slot and size, drop frees it for the next bucket") {
  gradcomp::detail::bucket_slots<std::vector<int>> s;
  int made = 0;
  const auto zeros = [&made](std::size_t n) {
    return [&made, n] {
      ++made;
      return std::pair{std::vector<int>(n, 0), std::vector<int>(n, 0)};
    };
  };
  CHECK_FALSE(s.find(7).has_value());
  const std::size_t a = s.slot_for(7, 3, zeros(3));
  const std::size_t b = s.slot_for(-2, 1, zeros(1));  // any id, negative included
  CHECK(a != b);
  CHECK(s.slot_for(7, 3, zeros(3)) == a);  // found again: nothing made
  CHECK(made == 2);
  CHECK(s.find(7) == a);
  CHECK(s.find(-2) == b);

  // A bucket of another size is refused, naming the bucket and both sizes; nothing changes.
  s.staged(a) = {1, 2, 3};
  s.stage(a);
  try {
    (void)s.slot_for(7, 4, zeros(4));
    FAIL("expected an invalid_argument");
  } catch (const gradcomp::invalid_argument& e) {
    const std::string what = e.what();
    CHECK(what.find("bucket size") != std::string::npos);
    CHECK(what.find("the size bucket 7 had before (3)") != std::string::npos);
  }
  CHECK(made == 2);
  CHECK(s.pending());
  s.commit();
  CHECK(s.committed(a) == std::vector<int>{1, 2, 3});

  // put() replaces a bucket's state whole (nothing pending) or names a new slot.
  s.staged(b) = {9};
  s.stage(b);
  CHECK(s.put(-2, {5, 6}, {0, 0}, 2) == b);
  CHECK_FALSE(s.pending());
  CHECK(s.elements(b) == 2);
  CHECK(s.committed(b) == std::vector<int>{5, 6});
  const std::size_t c = s.put(11, {4}, {0}, 1);
  CHECK(s.find(11) == c);
  CHECK(s.size() == 3);

  // drop() forgets the bucket and frees its state; its slot goes to the next new bucket, and the
  // dropped id starts again from what make() gives. Dropping twice, or an unknown id, does
  // nothing.
  s.stage(a);
  s.drop(7, {}, {});
  s.drop(7, {}, {});
  s.drop(12345, {}, {});
  CHECK_FALSE(s.find(7).has_value());
  CHECK_FALSE(s.pending());
  CHECK(s.committed(a).empty());
  CHECK(s.slot_for(8, 2, zeros(2)) == a);
  CHECK(s.committed(a) == std::vector<int>{0, 0});
  CHECK(s.slot_for(7, 5, zeros(5)) == 3);  // a new size is fine once dropped: a new slot
  CHECK(s.size() == 4);

  s.clear();
  CHECK(s.size() == 0);
  CHECK_FALSE(s.find(8).has_value());
  CHECK(s.slot_for(8, 1, zeros(1)) == 0);
}

TEST_CASE("staged_feedback: discard leaves the committed state, commit keeps e + g less what was sent") {
  for (const std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1000},
                              std::size_t{(1u << 20) + 1}}) {
    CAPTURE(n);
    compressor_t c;
    gradcomp::detail::staged_feedback<compressor_t> fb;
    const std::size_t i = fb.add(c, n);
    const std::size_t other = fb.add(c, 5);
    const compress_context ctx{0.01, {}};
    payload p;

    // A first committed step, so that the committed state is not zero.
    const std::vector<float> g0 = odd_gradient(n, 1);
    fb.compress(c, i, g0, ctx, p);
    fb.commit();
    const std::vector<float> e0 = copy_of(fb.committed(i).e);
    const std::vector<float> other0 = copy_of(fb.committed(other).e);

    // A discarded step: nothing changes, and the same step again makes the same payload.
    const std::vector<float> g1 = odd_gradient(n, 2);
    fb.compress(c, i, g1, ctx, p);
    CHECK(fb.pending());
    const std::vector<float> sent = dense_of(p, n);
    fb.discard();
    CHECK_FALSE(fb.pending());
    CHECK(same_bits(e0, fb.committed(i).e));

    payload again;
    fb.compress(c, i, g1, ctx, again);
    CHECK(same_bits(sent, dense_of(again, n)));
    fb.commit();
    const auto& e1 = fb.committed(i).e;
    REQUIRE(e1.size() == n);
    bool conserved = true;
    for (std::size_t j = 0; j < n; ++j) conserved = conserved && (sent[j] + e1[j] == e0[j] + g1[j]);
    CHECK(conserved);
    CHECK(same_bits(other0, fb.committed(other).e));  // a slot the step did not compress
  }
}

TEST_CASE("staged_feedback: a second compression in one step starts from the committed state") {
  compressor_t c;
  gradcomp::detail::staged_feedback<compressor_t> fb;
  const std::size_t n = 333;
  const std::size_t i = fb.add(c, n);
  const compress_context ctx{0.05, {}};
  payload p;
  fb.compress(c, i, odd_gradient(n, 3), ctx, p);
  fb.commit();
  const std::vector<float> e0 = copy_of(fb.committed(i).e);

  const std::vector<float> g = odd_gradient(n, 4);
  fb.compress(c, i, odd_gradient(n, 5), ctx, p);
  fb.compress(c, i, g, ctx, p);
  const std::vector<float> sent = dense_of(p, n);
  fb.commit();
  for (std::size_t j = 0; j < n; ++j) {
    CAPTURE(j);
    CHECK(sent[j] + fb.committed(i).e[j] == e0[j] + g[j]);
  }
}

TEST_CASE("staged_feedback: a gradient of the wrong size is refused, naming it, and changes nothing") {
  compressor_t c;
  gradcomp::detail::staged_feedback<compressor_t> fb;
  const std::size_t i = fb.add(c, 10);
  const compress_context ctx{0.1, {}};
  payload p;
  fb.compress(c, i, odd_gradient(10, 6), ctx, p);
  fb.commit();
  const std::vector<float> e0 = copy_of(fb.committed(i).e);
  const std::vector<float> wrong = odd_gradient(11, 7);
  try {
    fb.compress(c, i, wrong, ctx, p);
    FAIL("expected an invalid_argument");
  } catch (const gradcomp::invalid_argument& e) {
    const std::string what = e.what();
    CHECK(what.find("gradient size") != std::string::npos);
    CHECK(what.find("11") != std::string::npos);
    CHECK(what.find("(10)") != std::string::npos);
  }
  CHECK_FALSE(fb.pending());
  fb.commit();
  CHECK(same_bits(e0, fb.committed(i).e));
}

TEST_CASE("staged_feedback: restore gives picks back to the staged state only") {
  compressor_t c;
  gradcomp::detail::staged_feedback<compressor_t> fb;
  const std::size_t n = 101;
  const std::size_t i = fb.add(c, n);
  const compress_context ctx{0.1, {}};
  payload p;
  const std::vector<float> g = odd_gradient(n, 8);
  fb.compress(c, i, g, ctx, p);
  std::vector<float> values(p.count);
  c.decode_values(p, values);
  const std::vector<std::uint32_t> idx(p.indices.begin(), p.indices.begin() + p.count);
  CHECK(fb.restore(c, i, idx, values) == idx.size());
  // Not committed yet: the committed state is still zeros.
  for (const float v : fb.committed(i).e) CHECK(v == 0.0f);
  fb.commit();
  // Every pick given back: the residual is e + g (here 0 + g: equal to g, -0 read as +0).
  const auto& e = fb.committed(i).e;
  bool equal = e.size() == n;
  for (std::size_t j = 0; equal && j < n; ++j) equal = e[j] == g[j];
  CHECK(equal);
}
