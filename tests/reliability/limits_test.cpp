// What a payload can describe, and one compressor shared by threads.
//
// A payload's indices and count are 32-bit: a tensor of n <= 2^32 elements, at most 2^32 - 1
// of them sent. Every entry point refuses what lies beyond with invalid_argument naming the
// limit, before it allocates or writes anything. The tensors of 2^32 elements here are
// reserved address space (mmap without backing), never touched: the test allocates nothing
// near 16 GiB, and a refusal that came too late would read or write it and fail.
//
// The const members of compressor<> (decompress, decode_values) may run on several threads
// at once; TSan runs this file (label threads).
// ctest-labels: threads
#include <doctest/doctest.h>

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gradcomp/comm/in_process.hpp>
#include <gradcomp/compressor.hpp>
#include <gradcomp/exchange.hpp>
#include <gradcomp/feedback.hpp>
#include <gradcomp/quantize.hpp>
#include <gradcomp/schedule.hpp>
#include <gradcomp/select.hpp>
#include <gradcomp/sparsified_sgd.hpp>

#include "../support/solo_comm.hpp"
#include "support.hpp"

namespace {

using namespace gradcomp;

constexpr std::size_t two32 = std::size_t{1} << 32;

// 2^32 floats of address space that reads as zeros and was never allocated.
class reserved_floats {
 public:
  explicit reserved_floats(std::size_t n) : bytes_(n * sizeof(float)) {
    ptr_ = mmap(nullptr, bytes_, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    REQUIRE(ptr_ != MAP_FAILED);
  }
  reserved_floats(const reserved_floats&) = delete;
  reserved_floats& operator=(const reserved_floats&) = delete;
  ~reserved_floats() { munmap(ptr_, bytes_); }
  std::span<const float> span() const {
    return {static_cast<const float*>(ptr_), bytes_ / sizeof(float)};
  }

 private:
  std::size_t bytes_;
  void* ptr_;
};

bool mentions(const std::exception& e, const char* text) {
  return std::string(e.what()).find(text) != std::string::npos;
}

}  // namespace

TEST_CASE("limits: a tensor of exactly 2^32 elements with a selector that sends everything is "
          "refused by the compressor before anything is written") {
  const reserved_floats g(two32);
  compressor<dense, identity, no_feedback> c;
  auto st = c.make_state(two32);
  payload p;
  p.dense_size = 5;
  const auto before = reliability::bytes_of(p);
  try {
    c.compress(g.span(), st, {1.0, {}}, p);
    FAIL("compress accepted 2^32 coordinates");
  } catch (const invalid_argument& e) {
    CHECK(mentions(e, "2^32 - 1"));
    CHECK(mentions(e, "count is 32-bit"));
  }
  CHECK(reliability::bytes_of(p) == before);
}

TEST_CASE("limits: top-k of all 2^32 elements (density 1) is refused: k does not fit a count") {
  const reserved_floats g(two32);
  compressor<topk, identity, no_feedback> c;
  auto st = c.make_state(two32);
  payload p;
  try {
    c.compress(g.span(), st, {1.0, {}}, p);
    FAIL("compress accepted k = 2^32");
  } catch (const invalid_argument& e) {
    CHECK(mentions(e, "'k' = 4294967296"));
  }
  CHECK(p.count == 0);
  CHECK(p.values.empty());
}

TEST_CASE("limits: more than 2^32 elements is refused, whatever the selector") {
  const reserved_floats g(two32 + 1);
  compressor<topk, identity, no_feedback> c;
  auto st = c.make_state(two32 + 1);
  payload p;
  CHECK_THROWS_AS(c.compress(g.span(), st, {0.001, {}}, p), invalid_argument);
  CHECK(p.count == 0);
}

TEST_CASE("limits: the drivers refuse such tensors before allocating their buffers") {
  gradcomp_test::solo_comm comm;
  const tensor_spec exact[] = {{0, 100}, {1, two32}};
  const tensor_spec over[] = {{0, two32 + 1}};
  // 2^32 elements cannot be sent whole: a dense driver refuses (its buffers would be 16 GiB
  // each, so a refusal that came after them would not pass this test on a CI machine).
  try {
    sparsified_sgd<compressor<dense, identity, residual>, sparse_allgather, gradcomp_test::solo_comm>
        sgd(comm, std::span<const tensor_spec>(exact), {}, {}, {}, density_schedule::constant(1.0));
    FAIL("sparsified_sgd accepted a dense tensor of 2^32 elements");
  } catch (const invalid_argument& e) {
    CHECK(mentions(e, "size of tensor 1"));
    CHECK(mentions(e, "2^32 - 1"));
  }
  try {
    sparsified_sgd<compressor<topk, identity, residual>, sparse_allgather, gradcomp_test::solo_comm>
        sgd(comm, std::span<const tensor_spec>(over), {}, {}, {}, density_schedule::constant(0.01));
    FAIL("sparsified_sgd accepted a tensor of 2^32 + 1 elements");
  } catch (const invalid_argument& e) {
    CHECK(mentions(e, "size of tensor 0"));
    CHECK(mentions(e, "indices are 32-bit"));
  }
  try {
    periodic_averaging<identity, sparse_allgather, gradcomp_test::solo_comm> avg(
        comm, std::span<const tensor_spec>(exact));
    FAIL("periodic_averaging accepted a tensor of 2^32 elements");
  } catch (const invalid_argument& e) {
    CHECK(mentions(e, "size of tensor 1"));
  }
}

TEST_CASE("limits: the wire format and decompress refuse a dense payload of 2^32 coordinates") {
  // A dense payload must count every coordinate, which 32 bits cannot for 2^32 of them.
  payload p;
  p.dense_size = two32;
  p.layout = index_layout::dense;
  p.count = 0;
  std::vector<std::byte> bytes;
  CHECK_THROWS_AS(encode_wire(p, bytes), payload_error);
  CHECK(bytes.empty());
  CHECK_THROWS_AS(validate_indices("test", p), payload_error);
}

TEST_CASE("limits: one compressor shared by threads decompresses concurrently, as it would alone") {
  using C = compressor<topk, qsgd, residual>;
  const C c(topk{}, qsgd::with_bits(4));
  constexpr std::size_t n = 20000;
  constexpr int threads = 4;
  std::vector<payload> payloads(threads);
  std::vector<std::vector<float>> alone(threads, std::vector<float>(n));
  for (int t = 0; t < threads; ++t) {
    C mine(topk{}, qsgd::with_bits(4));
    auto st = mine.make_state(n);
    const auto g = reliability::gradient<float>(n, static_cast<std::uint64_t>(t) + 40);
    mine.compress(std::span<const float>(g), st, {0.05, call_id{1, 2, 3}}, payloads[static_cast<std::size_t>(t)]);
    c.decompress(payloads[static_cast<std::size_t>(t)], alone[static_cast<std::size_t>(t)]);
  }
  std::vector<std::vector<float>> together(threads, std::vector<float>(n));
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (int rep = 0; rep < 20; ++rep) {
        c.decompress(payloads[static_cast<std::size_t>(t)], together[static_cast<std::size_t>(t)],
                     decompress_mode::overwrite);
        std::vector<float> values(payloads[static_cast<std::size_t>(t)].count);
        c.decode_values(payloads[static_cast<std::size_t>(t)], values);
      }
    });
  }
  for (auto& th : pool) th.join();
  for (int t = 0; t < threads; ++t) {
    CHECK(reliability::bytes_of(std::span<const float>(together[static_cast<std::size_t>(t)])) ==
          reliability::bytes_of(std::span<const float>(alone[static_cast<std::size_t>(t)])));
  }
}
