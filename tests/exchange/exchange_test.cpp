// A P-rank in-process exchange equals the single-process reference: the mean, in rank
// order, of the P decoded payloads. Bit for bit, since both add in the same order.
#include <doctest/doctest.h>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include <gradcomp/comm/in_process.hpp>
#include <gradcomp/exchange.hpp>
#include <gradcomp/feedback.hpp>
#include <gradcomp/quantize.hpp>
#include <gradcomp/select.hpp>
#include <gradcomp/step.hpp>

#include "../support/data.hpp"

namespace {

using namespace gradcomp;

constexpr int rank_counts[] = {1, 2, 3, 4, 8};

template <class C>
payload compress_for_rank(C& c, int rank, std::size_t n, double density, std::uint64_t step) {
  auto st = c.make_state(n);
  const auto g = gradcomp_test::make_input<typename C::value_type>(
      rank % 2 ? gradcomp_test::dist::laplace : gradcomp_test::dist::normal, n,
      100 * step + static_cast<std::uint64_t>(rank));
  payload p;
  c.compress(g, st, compress_context{density, call_id{42, step, 9}}, p);
  return p;
}

template <class C>
std::vector<typename C::value_type> reference_mean(const C& proto, int ranks, std::size_t n, double density) {
  using T = typename C::value_type;
  std::vector<T> sum(n, T(0));
  for (int r = 0; r < ranks; ++r) {
    C c = proto;
    const payload p = compress_for_rank(c, r, n, density, 0);
    c.decompress(p, sum, decompress_mode::accumulate);
  }
  for (T& x : sum) x /= static_cast<T>(ranks);
  return sum;
}

// The reference of dense_allreduce: the wire values (sum_type) added in rank order in the
// wire type, then divided by P.
template <class C>
std::vector<typename C::value_type> reference_wire_sum_mean(const C& proto, int ranks, std::size_t n,
                                                            double density) {
  using T = typename C::value_type;
  std::vector<float> sum(n, 0.0f);
  for (int r = 0; r < ranks; ++r) {
    C c = proto;
    const payload p = compress_for_rank(c, r, n, density, 0);
    std::vector<float> v(p.count);
    c.decode_values(p, v);
    for (std::size_t j = 0; j < p.count; ++j) sum[p.index(j)] += v[j];
  }
  std::vector<T> mean(n);
  for (std::size_t i = 0; i < n; ++i) mean[i] = static_cast<T>(sum[i]) / static_cast<T>(ranks);
  return mean;
}

template <class X, class C>
void check_against_reference(const C& proto, std::size_t n, double density) {
  using T = typename C::value_type;
  for (int ranks : rank_counts) {
    CAPTURE(ranks);
    std::vector<std::vector<T>> got(static_cast<std::size_t>(ranks));
    std::vector<exchange_stats> stats(static_cast<std::size_t>(ranks));
    run_in_process(ranks, [&](in_process_comm& comm) {
      C c = proto;
      X x;
      const payload p = compress_for_rank(c, comm.rank(), n, density, 0);
      std::vector<T> out(n, T(123));
      stats[static_cast<std::size_t>(comm.rank())] = x.exchange(comm, c, p, std::span<T>(out));
      got[static_cast<std::size_t>(comm.rank())] = std::move(out);
    });
    const auto ref = std::is_same_v<X, dense_allreduce> ? reference_wire_sum_mean(proto, ranks, n, density)
                                                        : reference_mean(proto, ranks, n, density);
    for (int r = 0; r < ranks; ++r) {
      const auto& o = got[static_cast<std::size_t>(r)];
      REQUIRE(o.size() == n);
      for (std::size_t i = 0; i < n; ++i) {
        REQUIRE(std::bit_cast<std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>>(o[i]) ==
                std::bit_cast<std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>>(ref[i]));
      }
      if (ranks > 1) CHECK(stats[static_cast<std::size_t>(r)].bytes_received > 0);
    }
  }
}

}  // namespace

TEST_CASE("sparse_allgather equals the reference mean for every quantizer, P in {1,2,3,4,8}") {
  const std::size_t n = 3001;
  auto run = [&](auto proto, double density) {
    check_against_reference<sparse_allgather>(proto, n, density);
  };
  SUBCASE("topk identity") { run(compressor<topk, identity, residual>{}, 0.01); }
  SUBCASE("topk fp16") { run(compressor<topk, fp16, residual>{}, 0.05); }
  SUBCASE("gaussiank qsgd") { run(compressor<gaussiank, qsgd, residual>{}, 0.02); }
  SUBCASE("randomk terngrad") { run(compressor<randomk, terngrad, residual>{}, 0.1); }
  SUBCASE("threshold scaled_sign") {
    run(compressor<threshold, scaled_sign, residual>(threshold{1.5}), 1.0);
  }
  SUBCASE("dense bf16 double") { run(compressor<dense, bf16, no_feedback, double>{}, 1.0); }
}

TEST_CASE("dense_allreduce equals the reference mean, P in {1,2,3,4,8}") {
  const std::size_t n = 2049;
  SUBCASE("dense identity (S-SGD)") {
    compressor<dense, identity, no_feedback> proto;
    check_against_reference<dense_allreduce>(proto, n, 1.0);
  }
  SUBCASE("randomk identity: shared indices, values added without indices") {
    compressor<randomk, identity, residual> proto;
    check_against_reference<dense_allreduce>(proto, n, 0.05);
  }
  SUBCASE("dense identity double") {
    compressor<dense, identity, no_feedback, double> proto;
    check_against_reference<dense_allreduce>(proto, n, 1.0);
  }
}

TEST_CASE("dense_allreduce of 16-bit payloads sums in the wire type, in rank order") {
  const std::size_t n = 513;
  for (int ranks : rank_counts) {
    CAPTURE(ranks);
    std::vector<std::vector<float>> got(static_cast<std::size_t>(ranks));
    run_in_process(ranks, [&](in_process_comm& comm) {
      compressor<dense, fp16, no_feedback> c;
      dense_allreduce x;
      const payload p = compress_for_rank(c, comm.rank(), n, 1.0, 0);
      std::vector<float> out(n);
      x.exchange(comm, c, p, std::span<float>(out));
      got[static_cast<std::size_t>(comm.rank())] = out;
    });
    // Reference: each rank's fp16 value divided by P (fp16 overflows), summed in fp16.
    std::vector<half> sum(n, half(0.0f));
    for (int r = 0; r < ranks; ++r) {
      compressor<dense, fp16, no_feedback> c;
      const payload p = compress_for_rank(c, r, n, 1.0, 0);
      std::vector<float> v(n);
      c.decode_values(p, v);
      for (std::size_t i = 0; i < n; ++i) {
        const half h(v[i] / static_cast<float>(ranks));
        sum[i] = r == 0 ? h : sum[i] + h;
      }
    }
    for (const auto& o : got) {
      for (std::size_t i = 0; i < n; ++i) REQUIRE(o[i] == static_cast<float>(sum[i]));
    }
  }
}

TEST_CASE("a payload for a tensor of another size fails on every rank") {
  std::mutex m;
  int failures = 0;
  CHECK_THROWS_AS(run_in_process(3, [&](in_process_comm& comm) {
    compressor<topk, identity, no_feedback> c;
    sparse_allgather x;
    const std::size_t n = comm.rank() == 1 ? 100 : 120;
    const payload p = compress_for_rank(c, comm.rank(), n, 0.1, 0);
    std::vector<float> out(120);
    try {
      x.exchange(comm, c, p, std::span<float>(out));
    } catch (const communicator_error&) {
      std::lock_guard lock(m);
      ++failures;
      throw;
    }
  }), communicator_error);
  CHECK(failures == 3);
}

TEST_CASE("sparse_allgather::combine: the reference mean from wire blocks; bad counts change nothing") {
  // combine() is the exchange's local work on its own (what gradcomp_bench measures): P
  // payloads' wire bytes in rank order give the reference mean, bit for bit. At density 0.05
  // the ranks' values fit in the output's size (region by region); at 0.5 and 3 or 16 ranks
  // they do not (each block decoded and added in turn).
  compressor<topk, qsgd, residual> proto(topk{}, qsgd::with_bits(4));
  for (const double density : {0.05, 0.5})
  for (int ranks : {1, 3, 16}) {
    // Up to an output beyond the streaming-store size (detail::rank_order_mean streams it).
    for (std::size_t n : {std::size_t{1}, std::size_t{1000}, std::size_t{4099},
                          (std::size_t{1} << 21) + 5}) {
      if (n > 4099 && (ranks > 3 || density > 0.1)) continue;
      CAPTURE(density);
      CAPTURE(ranks);
      CAPTURE(n);
      std::vector<std::byte> blocks;
      std::vector<std::size_t> counts;
      for (int r = 0; r < ranks; ++r) {
        auto c = proto;
        std::vector<std::byte> one;
        encode_wire(compress_for_rank(c, r, n, density, 0), one);
        blocks.insert(blocks.end(), one.begin(), one.end());
        counts.push_back(one.size());
      }
      sparse_allgather x;
      std::vector<float> out(n, 7.0f);
      x.combine(proto, std::span<const std::byte>(blocks), std::span<const std::size_t>(counts),
                std::span<float>(out));
      const auto ref = reference_mean(proto, ranks, n, density);
      for (std::size_t i = 0; i < n; ++i) {
        REQUIRE(std::bit_cast<std::uint32_t>(out[i]) == std::bit_cast<std::uint32_t>(ref[i]));
      }
      // Counts beyond the bytes, short of them, or none at all: refused before out changes.
      const auto before = out;
      auto more = counts;
      more.back() += 1;
      CHECK_THROWS_AS(x.combine(proto, std::span<const std::byte>(blocks),
                                std::span<const std::size_t>(more), std::span<float>(out)),
                      payload_error);
      auto fewer = counts;
      fewer.pop_back();
      if (!fewer.empty()) {
        CHECK_THROWS_AS(x.combine(proto, std::span<const std::byte>(blocks),
                                  std::span<const std::size_t>(fewer), std::span<float>(out)),
                        payload_error);
      }
      std::vector<std::size_t> huge(counts.size(), SIZE_MAX);
      CHECK_THROWS_AS(x.combine(proto, std::span<const std::byte>(blocks),
                                std::span<const std::size_t>(huge), std::span<float>(out)),
                      payload_error);
      CHECK_THROWS_AS(x.combine(proto, std::span<const std::byte>(blocks),
                                std::span<const std::size_t>(), std::span<float>(out)),
                      invalid_argument);
      CHECK(out == before);
      // The last rank's payload malformed (its second index repeats its first, or its first
      // 4-bit code is 15, more than QSGD's 7 levels allow): refused, naming the rank, before
      // any rank's values reach out.
      if (n > 1) {
        // Refused, naming the last rank, with out unchanged.
        auto refused = [&](const std::vector<std::byte>& bytes) {
          try {
            x.combine(proto, std::span<const std::byte>(bytes),
                      std::span<const std::size_t>(counts), std::span<float>(out));
            FAIL("no exception");
          } catch (const payload_error& e) {
            CHECK(std::string(e.what()).find(detail::concat("rank ", ranks - 1)) != std::string::npos);
          }
          CHECK(out == before);
        };
        const std::size_t last = blocks.size() - counts.back();
        const payload lastp = decode_wire(std::span<const std::byte>(blocks).subspan(last));
        auto bad_code = blocks;
        bad_code[last + wire_header_bytes + 4 * lastp.indices.size() + 4 * lastp.side.size()] |=
            std::byte{0x0f};
        refused(bad_code);
        auto bad = blocks;
        std::memcpy(bad.data() + last + wire_header_bytes + 4, bad.data() + last + wire_header_bytes, 4);
        refused(bad);
      }
    }
  }
}

TEST_CASE("exchanges model the exchange concept") {
  using C = compressor<topk, identity, residual>;
  using D = compressor<dense, identity, no_feedback>;
  static_assert(exchange<sparse_allgather, C, in_process_comm>);
  static_assert(exchange<dense_allreduce, D, in_process_comm>);
  static_assert(!C::summable);
  static_assert(D::summable);
  static_assert(compressor<randomk, bf16, residual>::summable);
  static_assert(!compressor<dense, qsgd, residual>::summable);
  CHECK(true);
}
