// The quantizers' shared arithmetic (detail/quantize_math.hpp): the summation tree against an
// independent recursive reference and against the level walk the device kernels do, the
// order-free maximum against a plain float loop, side-value edge cases (NaN, Inf, overflow),
// and the per-value codes against their definitions.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <gradcomp/detail/bitpack.hpp>
#include <gradcomp/detail/quantize_codec.hpp>
#include <gradcomp/detail/quantize_math.hpp>
#include <gradcomp/detail/random.hpp>
#include <gradcomp/quantize.hpp>

#include "../support/data.hpp"

namespace gd = gradcomp::detail;

namespace {

// chain4 written out as the host encoders did before the tree existed: four partial sums,
// leftovers into the first, (s0 + s1) + (s2 + s3).
template <class T, class F>
double reference_chain4(const T* p, std::size_t n, F term) {
  double s[4] = {0.0, 0.0, 0.0, 0.0};
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (std::size_t j = 0; j < 4; ++j) s[j] += term(p[i + j]);
  }
  for (; i < n; ++i) s[0] += term(p[i]);
  return (s[0] + s[1]) + (s[2] + s[3]);
}

// The tree by its recursive definition, with fresh vectors at every level.
double reference_tree(const std::vector<double>& terms) {
  if (terms.size() <= gd::stat_block) {
    return reference_chain4(terms.data(), terms.size(), [](double x) { return x; });
  }
  std::vector<double> up;
  for (std::size_t first = 0; first < terms.size(); first += gd::stat_block) {
    const std::size_t len = std::min(gd::stat_block, terms.size() - first);
    up.push_back(reference_chain4(terms.data() + first, len, [](double x) { return x; }));
  }
  return reference_tree(up);
}

// What one lane of stat_runs_kernel computes for its run: chunks of 32 values staged in a
// row (garbage beyond the run, as in the kernel's shared tile), reduced by reduce_chunk32.
template <class Reducer, class In>
typename Reducer::acc lane_reduce(const In* p, std::size_t count) {
  typename Reducer::state st{};
  In row[33];
  for (std::size_t c = 0; c < count; c += 32) {
    for (auto& x : row) x = static_cast<In>(0x7f7f7f7f);  // garbage, must not be read
    for (std::size_t j = 0; j < 32 && c + j < count; ++j) row[j] = p[c + j];
    gd::reduce_chunk32<Reducer>(st, row, c, count);
  }
  return Reducer::result(st);
}

// The device's walk (gradcomp/cuda/dispatch/quantize.cuh, launch_stats): levels over all buckets at
// once, one node at a time, then one reduction per bucket.
template <class Reducer>
std::vector<typename Reducer::acc> device_walk(const std::vector<float>& v, std::size_t bucket) {
  using acc = typename Reducer::acc;
  gd::stat_level l{v.size(), bucket};
  const std::size_t buckets = gd::level_buckets(l);
  std::vector<acc> out(buckets);
  if (buckets == 0) return out;
  if (l.seg <= gd::stat_block) {
    for (std::size_t b = 0; b < buckets; ++b) {
      const auto run = gd::level_bucket(l, b);
      out[b] = lane_reduce<Reducer>(v.data() + run.first, run.count);
    }
    return out;
  }
  gd::stat_level up = gd::level_above(l);
  std::vector<acc> cur(up.len);
  for (std::size_t o = 0; o < up.len; ++o) {
    const auto run = gd::node_inputs(l, o);
    REQUIRE(run.count >= 1);
    REQUIRE(run.first + run.count <= l.len);
    cur[o] = lane_reduce<Reducer>(v.data() + run.first, run.count);
  }
  l = up;
  REQUIRE(gd::level_buckets(l) == buckets);
  while (l.seg > gd::stat_block) {
    up = gd::level_above(l);
    std::vector<acc> next(up.len);
    for (std::size_t o = 0; o < up.len; ++o) {
      const auto run = gd::node_inputs(l, o);
      REQUIRE(run.count >= 1);
      REQUIRE(run.first + run.count <= l.len);
      next[o] = lane_reduce<Reducer>(cur.data() + run.first, run.count);
    }
    cur.swap(next);
    l = up;
    REQUIRE(gd::level_buckets(l) == buckets);
  }
  for (std::size_t b = 0; b < buckets; ++b) {
    const auto run = gd::level_bucket(l, b);
    out[b] = lane_reduce<Reducer>(cur.data() + run.first, run.count);
  }
  return out;
}

std::uint64_t bits_of(double x) { return std::bit_cast<std::uint64_t>(x); }

float old_terngrad_max(const float* v, std::size_t n) {
  float m = 0.0f;
  bool finite = true;
  for (std::size_t i = 0; i < n; ++i) {
    const float a = std::fabs(v[i]);
    finite = finite && a <= std::numeric_limits<float>::max();
    m = a > m ? a : m;
  }
  return finite ? m : 0.0f;
}

}  // namespace

TEST_CASE("quantize_math: buckets up to stat_block sum in the four-partial order") {
  for (const std::size_t n :
       {std::size_t{0}, std::size_t{1}, std::size_t{3}, std::size_t{4}, std::size_t{5},
        std::size_t{511}, std::size_t{512}, std::size_t{2047}, std::size_t{2048}}) {
    for (const auto d : gradcomp_test::all_dists) {
      CAPTURE(n);
      const auto v = gradcomp_test::make_input<float>(d, n, 7 + n);
      const double sq = reference_chain4(
          v.data(), n, [](float x) { return static_cast<double>(x) * static_cast<double>(x); });
      const double ab =
          reference_chain4(v.data(), n, [](float x) { return std::fabs(static_cast<double>(x)); });
      REQUIRE(bits_of(gd::sum_of_squares(v.data(), n)) == bits_of(sq));
      REQUIRE(bits_of(gd::sum_of_abs(v.data(), n)) == bits_of(ab));
    }
  }
}

TEST_CASE("quantize_math: a run fed 32 values at a time gives the whole-run bits") {
  const auto v = gradcomp_test::make_input<float>(gradcomp_test::dist::student_t2, 2048, 4);
  std::vector<double> d(v.begin(), v.end());
  for (auto& x : d) x = x * x;
  std::vector<std::uint32_t> u(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) u[i] = gd::abs_bits(v[i]);
  for (std::size_t count = 0; count <= 2048; ++count) {
    CAPTURE(count);
    REQUIRE(bits_of(lane_reduce<gd::sum_squares_reducer>(v.data(), count)) ==
            bits_of(gd::sum_squares_reducer{}(v.data(), count)));
    REQUIRE(bits_of(lane_reduce<gd::sum_abs_reducer>(v.data(), count)) ==
            bits_of(gd::sum_abs_reducer{}(v.data(), count)));
    REQUIRE(bits_of(lane_reduce<gd::sum_abs_reducer>(d.data(), count)) ==
            bits_of(gd::sum_abs_reducer{}(d.data(), count)));
    REQUIRE(lane_reduce<gd::max_abs_reducer>(v.data(), count) ==
            gd::max_abs_reducer{}(v.data(), count));
    REQUIRE(lane_reduce<gd::max_abs_reducer>(u.data(), count) ==
            gd::max_abs_reducer{}(u.data(), count));
  }
}

TEST_CASE("quantize_math: larger buckets follow the 2048-ary tree, close to the exact sum") {
  for (const std::size_t n : {std::size_t{2049}, std::size_t{4096}, std::size_t{4097},
                              std::size_t{100'000}, gd::stat_block * gd::stat_block + 3}) {
    CAPTURE(n);
    const auto v = gradcomp_test::make_input<float>(gradcomp_test::dist::student_t2, n, n);
    std::vector<double> sq(n), ab(n);
    long double exact_sq = 0.0L;
    for (std::size_t i = 0; i < n; ++i) {
      sq[i] = static_cast<double>(v[i]) * static_cast<double>(v[i]);
      ab[i] = std::fabs(static_cast<double>(v[i]));
      exact_sq += static_cast<long double>(sq[i]);
    }
    const double got = gd::sum_of_squares(v.data(), n);
    REQUIRE(bits_of(got) == bits_of(reference_tree(sq)));
    REQUIRE(bits_of(gd::sum_of_abs(v.data(), n)) == bits_of(reference_tree(ab)));
    REQUIRE(std::fabs(static_cast<long double>(got) - exact_sq) <= 1e-12L * exact_sq);
  }
}

TEST_CASE(
    "quantize_math: the device's level walk gives the host's bucket statistics, bit for bit") {
  const std::size_t big = gd::stat_block * gd::stat_block + 5;  // three levels for one bucket
  struct shape {
    std::size_t n, bucket;
  };
  const shape shapes[] = {{0, 512},
                          {1, 512},
                          {1, 1},
                          {100, 1u << 24},
                          {7, 3},
                          {512, 512},
                          {513, 512},
                          {1000, 2048},
                          {5000, 2048},
                          {5000, 2049},
                          {10000, 4097},
                          {70000, 0},
                          {3 * 4096 + 1, 4096},
                          {100'000, 30'000},
                          {big, 0},
                          {big + 100, big - 7}};
  for (const auto [n, bucket_param] : shapes) {
    const std::size_t bucket = bucket_param == 0 ? std::max<std::size_t>(n, 1) : bucket_param;
    CAPTURE(n);
    CAPTURE(bucket);
    for (const auto d : {gradcomp_test::dist::normal, gradcomp_test::dist::zeros90,
                         gradcomp_test::dist::outliers}) {
      auto v = gradcomp_test::make_input<float>(d, n, n * 3 + bucket);
      if (n > 10) v[n / 2] = std::numeric_limits<float>::infinity();  // one non-finite bucket
      const auto sq = device_walk<gd::sum_squares_reducer>(v, bucket);
      const auto ab = device_walk<gd::sum_abs_reducer>(v, bucket);
      const auto mx = device_walk<gd::max_abs_reducer>(v, bucket);
      REQUIRE(sq.size() == (n + bucket - 1) / bucket);
      for (std::size_t b = 0; b < sq.size(); ++b) {
        const std::size_t first = b * bucket;
        const std::size_t len = std::min(bucket, n - first);
        REQUIRE(bits_of(sq[b]) == bits_of(gd::sum_of_squares(v.data() + first, len)));
        REQUIRE(bits_of(ab[b]) == bits_of(gd::sum_of_abs(v.data() + first, len)));
        REQUIRE(std::bit_cast<std::uint32_t>(gd::terngrad_max_from_bits(mx[b])) ==
                std::bit_cast<std::uint32_t>(old_terngrad_max(v.data() + first, len)));
      }
    }
  }
}

TEST_CASE("quantize_math: max|v| from bits equals the float loop, NaN, Inf and -0 included") {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<std::vector<float>> cases = {
      {},
      {-0.0f},
      {0.0f, -0.0f},
      {1.0f, -2.0f, 0.5f},
      {std::numeric_limits<float>::denorm_min(), -std::numeric_limits<float>::denorm_min()},
      {3.0f, -std::numeric_limits<float>::max()},
      {1.0f, inf},
      {-inf},
      {2.0f, nan, -3.0f},
      {-nan}};
  for (const auto& v : cases) {
    const float got = gd::terngrad_max_from_bits(gd::max_abs_bits(v.data(), v.size()));
    REQUIRE(std::bit_cast<std::uint32_t>(got) ==
            std::bit_cast<std::uint32_t>(old_terngrad_max(v.data(), v.size())));
  }
  std::mt19937 rng(5);
  for (int rep = 0; rep < 200; ++rep) {
    std::vector<float> v(1 + rng() % 300);
    for (auto& x : v) x = std::bit_cast<float>(static_cast<std::uint32_t>(rng()));
    const float got = gd::terngrad_max_from_bits(gd::max_abs_bits(v.data(), v.size()));
    REQUIRE(std::bit_cast<std::uint32_t>(got) ==
            std::bit_cast<std::uint32_t>(old_terngrad_max(v.data(), v.size())));
  }
}

TEST_CASE("quantize_math: side values from the statistics") {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  CHECK(gd::qsgd_norm_from_sum(0.0) == 0.0f);
  CHECK(gd::qsgd_norm_from_sum(4.0) == 2.0f);
  CHECK(gd::qsgd_norm_from_sum(inf) == 0.0f);
  CHECK(gd::qsgd_norm_from_sum(nan) == 0.0f);
  const float fmax = std::numeric_limits<float>::max();
  // Two values of FLT_MAX: the norm overflows float and saturates.
  const double two_max = 2.0 * static_cast<double>(fmax) * static_cast<double>(fmax);
  CHECK(gd::qsgd_norm_from_sum(two_max) == fmax);
  // The norm is never below |v|: sqrt(v^2) rounds back to |v| for every float.
  std::mt19937 rng(9);
  for (int rep = 0; rep < 10000; ++rep) {
    const float v = std::fabs(std::bit_cast<float>(static_cast<std::uint32_t>(rng())));
    if (!std::isfinite(v)) continue;
    const std::vector<float> one = {v};
    REQUIRE(gd::qsgd_norm_from_sum(gd::sum_of_squares(one.data(), 1)) >= v);
  }
  CHECK(gd::scaled_sign_mean_from_sum(6.0, 4) == 1.5f);
  CHECK(gd::scaled_sign_mean_from_sum(inf, 4) == 0.0f);
  CHECK(gd::scaled_sign_mean_from_sum(nan, 4) == 0.0f);
  CHECK(gd::terngrad_max_from_bits(0x7f800000u) == 0.0f);
  CHECK(gd::terngrad_max_from_bits(0x3f800000u) == 1.0f);
}

TEST_CASE("quantize_math: codes and values") {
  // QSGD with s = 4, norm 2: v = 1 gives r = 2 exactly, always level 2.
  CHECK(gd::qsgd_code(1.0f, 2.0f, 4, 0.999f) == 6u);
  CHECK(gd::qsgd_code(-1.0f, 2.0f, 4, 0.0f) == 2u);
  // r = 1.5: level 1 when u >= 0.5, level 2 when u < 0.5.
  CHECK(gd::qsgd_code(0.75f, 2.0f, 4, 0.5f) == 5u);
  CHECK(gd::qsgd_code(0.75f, 2.0f, 4, 0.25f) == 6u);
  CHECK(gd::qsgd_code(-0.75f, 2.0f, 4, 0.25f) == 2u);
  // Norm 0 (empty or non-finite bucket) and a defensive r > s.
  CHECK(gd::qsgd_code(5.0f, 0.0f, 4, 0.0f) == 4u);
  CHECK(gd::qsgd_code(std::numeric_limits<float>::quiet_NaN(), 1.0f, 4, 0.0f) == 8u);
  CHECK(gd::qsgd_code(-3.0f, 1.0f, 4, 0.0f) == 0u);
  for (std::uint32_t c = 0; c <= 8; ++c) {
    const float v = gd::qsgd_value(2.0f, c, 4, 0.25f);
    CHECK(v == 2.0f * ((static_cast<float>(c) - 4.0f) * 0.25f));
  }
  // TernGrad: hit probability |v| / max.
  CHECK(gd::terngrad_code(1.0f, 2.0f, 0.49f) == 1u);
  CHECK(gd::terngrad_code(1.0f, 2.0f, 0.5f) == 0u);
  CHECK(gd::terngrad_code(-1.0f, 2.0f, 0.0f) == 2u);
  CHECK(gd::terngrad_code(-2.0f, 2.0f, 0.999f) == 2u);
  CHECK(gd::terngrad_code(1.0f, 0.0f, 0.0f) == 0u);
  CHECK(gd::terngrad_value(0, 3.0f) == 0.0f);
  CHECK(gd::terngrad_value(1, 3.0f) == 3.0f);
  CHECK(gd::terngrad_value(2, 3.0f) == -3.0f);
  // Scaled sign: -0 and NaN are non-negative.
  CHECK(gd::scaled_sign_code(-1e-30f) == 1u);
  CHECK(gd::scaled_sign_code(-0.0f) == 0u);
  CHECK(gd::scaled_sign_code(std::numeric_limits<float>::quiet_NaN()) == 0u);
  CHECK(gd::scaled_sign_code(2.0f) == 0u);
  CHECK(gd::scaled_sign_value(0, 1.5f) == 1.5f);
  CHECK(gd::scaled_sign_value(1, 1.5f) == -1.5f);
}

namespace {

// The device encoder's work split replayed on the host: statistics by the level walk, then
// codes group by group (detail::pack_group, one group per device thread) in reverse order
// into a garbage-filled buffer; decode value by value (detail::code_at).
template <class Reducer, class Side, class Codec>
void replay_encode(const std::vector<float>& v, std::size_t bucket, unsigned bits, Side side_of,
                   Codec codec, std::vector<float>& side, std::vector<std::byte>& packed) {
  const std::size_t n = v.size();
  side.clear();
  if (bucket > 0) {
    const auto stats = device_walk<Reducer>(v, bucket);
    for (std::size_t b = 0; b < stats.size(); ++b) {
      side.push_back(side_of(stats[b], gd::level_bucket(gd::stat_level{n, bucket}, b).count));
    }
  }
  packed.assign(static_cast<std::size_t>(gd::packed_size(n, bits)), std::byte{0xa5});
  const std::size_t per_group = gd::codes_per_group(bits);
  const std::size_t groups = (n + per_group - 1) / per_group;
  const gd::code_of_value<Codec> code_of{v.data(), side.data(), codec};
  for (std::size_t g = groups; g-- > 0;) gd::pack_group(packed.data(), n, bits, g, code_of);
}

template <class Codec>
std::vector<float> replay_decode(const std::vector<std::byte>& packed, std::size_t n, unsigned bits,
                                 const std::vector<float>& side, Codec codec) {
  std::vector<float> out(n);
  for (std::size_t i = 0; i < n; ++i)
    out[i] = codec.value(gd::code_at(packed.data(), i, bits), i, side.data());
  return out;
}

std::vector<std::uint32_t> bits_of(const std::vector<float>& v) {
  std::vector<std::uint32_t> b(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) b[i] = std::bit_cast<std::uint32_t>(v[i]);
  return b;
}

template <class Q, class Reducer, class Side, class Codec>
void check_replay(const Q& q, const std::vector<float>& v, const gradcomp::call_id& call,
                  std::size_t bucket, Side side_of, Codec codec) {
  gradcomp::payload p;
  p.count = static_cast<std::uint32_t>(v.size());
  p.dense_size = v.size();
  p.layout = gradcomp::index_layout::dense;
  q.encode(v, call, p);
  std::vector<float> host_decoded(v.size());
  q.decode(p, host_decoded);
  std::vector<float> side;
  std::vector<std::byte> packed;
  replay_encode<Reducer>(v, bucket, q.bits_per_value(), side_of, codec, side, packed);
  REQUIRE(packed == p.values);
  REQUIRE(bits_of(side) == bits_of(p.side));
  REQUIRE(bits_of(replay_decode(packed, v.size(), q.bits_per_value(), side, codec)) ==
          bits_of(host_decoded));
}

std::size_t effective(std::uint32_t bucket, std::size_t n) {
  return bucket != 0 ? bucket : std::max<std::size_t>(n, 1);
}

}  // namespace

TEST_CASE("quantize_math: the device kernels' work split reproduces every host encoder") {
  const gradcomp::call_id call{3, 14, 15};
  const gd::counter_rng rng{gd::stream_key(call, gd::stream_tag::quantize)};
  for (const std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{5}, std::size_t{9},
                              std::size_t{513}, std::size_t{4100}, std::size_t{70001}}) {
    for (const auto d : gradcomp_test::all_dists) {
      CAPTURE(n);
      auto v = gradcomp_test::make_input<float>(d, n, n + 99);
      if (n > 600) {
        v[600] = std::numeric_limits<float>::quiet_NaN();
        v[7] = -std::numeric_limits<float>::infinity();
        v[8] = -0.0f;
      }
      check_replay<gradcomp::fp16, gd::sum_abs_reducer>(gradcomp::fp16{}, v, call, 0,
                                                        gd::scaled_sign_side{}, gd::fp16_codec{});
      check_replay<gradcomp::bf16, gd::sum_abs_reducer>(gradcomp::bf16{}, v, call, 0,
                                                        gd::scaled_sign_side{}, gd::bf16_codec{});
      for (const auto& q : {gradcomp::qsgd{}, gradcomp::qsgd(1, 3), gradcomp::qsgd(100, 2049),
                            gradcomp::qsgd(32767, 1u << 24)}) {
        check_replay<gradcomp::qsgd, gd::sum_squares_reducer>(
            q, v, call, q.bucket_size(), gd::qsgd_side{},
            gd::qsgd_codec{rng, q.levels(), 1.0f / static_cast<float>(q.levels()),
                           q.bucket_size()});
      }
      for (const std::uint32_t b : {0u, 1u, 300u, 5000u}) {
        const std::size_t eb = effective(b, n);
        check_replay<gradcomp::terngrad, gd::max_abs_reducer>(
            gradcomp::terngrad(b), v, call, eb, gd::terngrad_side{}, gd::terngrad_codec{rng, eb});
        check_replay<gradcomp::scaled_sign, gd::sum_abs_reducer>(gradcomp::scaled_sign(b), v, call,
                                                                 eb, gd::scaled_sign_side{},
                                                                 gd::scaled_sign_codec{eb});
      }
    }
  }
}
