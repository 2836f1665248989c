// The header agreement: ranks that disagree on the tensor size, the payload format version,
// the quantizer, the exchange or (for shared-index payloads) the indices all throw the same
// communicator_error, naming the ranks and values; a rank with bad arguments throws its own
// error while the others throw communicator_error, and nobody is left waiting.
#include <doctest/doctest.h>

#include <mutex>
#include <string>
#include <vector>

#include <gradcomp/comm/in_process.hpp>
#include <gradcomp/exchange.hpp>
#include <gradcomp/feedback.hpp>
#include <gradcomp/quantize.hpp>
#include <gradcomp/select.hpp>
#include <gradcomp/step.hpp>

#include "../support/exchange_reference.hpp"

namespace {

using namespace gradcomp;

// Runs f on `ranks` ranks and returns what each rank's exception said ("" if none).
template <class F>
std::vector<std::string> errors_of(int ranks, F f) {
  std::vector<std::string> what(static_cast<std::size_t>(ranks));
  try {
    run_in_process(ranks, [&](in_process_comm& comm) {
      try {
        f(comm);
      } catch (const std::exception& e) {
        what[static_cast<std::size_t>(comm.rank())] = e.what();
        throw;
      }
    });
  } catch (const std::exception&) {
  }
  return what;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("exchange_header survives its byte format") {
  payload p;
  p.dense_size = (std::uint64_t{1} << 32);
  p.layout = index_layout::sparse;
  p.quantizer = quantizer_id::qsgd;
  p.bits_per_value = 4;
  p.params = {7, 512};
  p.count = 3;
  p.indices = {1, 5, 9};
  const exchange_header h = header_of(p, exchange_id::topk_a2a, 8, true);
  std::byte bytes[exchange_header_bytes];
  detail::write_header(h, bytes);
  CHECK(detail::read_header(bytes) == h);
  CHECK(h.hash != 0);
  CHECK(h.format_version == wire_version);
}

TEST_CASE("ranks that disagree on a header field all throw, naming ranks and values") {
  payload p;
  p.dense_size = 100;
  p.count = 0;
  SUBCASE("format version") {
    const auto what = errors_of(3, [&](in_process_comm& comm) {
      exchange_header h = header_of(p, exchange_id::gtopk, 4);
      if (comm.rank() == 2) h.format_version = 2;  // a rank built with a later format
      std::vector<std::byte> scratch;
      agree_on_header(comm, "test", h, agree::dense_size, scratch);
    });
    for (const auto& w : what) {
      CHECK(contains(w, "payload format version: rank 2 has 2, rank 0 has 1"));
    }
  }
  SUBCASE("dense size, several ranks") {
    const auto what = errors_of(4, [&](in_process_comm& comm) {
      payload q = p;
      if (comm.rank() % 2) q.dense_size = 99;
      std::vector<std::byte> scratch;
      agree_on_header(comm, "test", header_of(q, exchange_id::gtopk, 4), agree::dense_size, scratch);
    });
    for (const auto& w : what) {
      CHECK(contains(w, "dense_size: rank 1 has 99, rank 3 has 99, rank 0 has 100"));
    }
  }
  SUBCASE("the exchange") {
    const auto what = errors_of(2, [&](in_process_comm& comm) {
      std::vector<std::byte> scratch;
      agree_on_header(comm, "test",
                      header_of(p, comm.rank() ? exchange_id::topk_a2a : exchange_id::gtopk, 4),
                      0, scratch);
    });
    for (const auto& w : what) CHECK(contains(w, "the exchange"));
  }
  SUBCASE("a rank running another collective is not parsed as a header") {
    const auto what = errors_of(2, [&](in_process_comm& comm) {
      std::vector<std::byte> scratch;
      std::vector<std::size_t> counts;
      if (comm.rank() == 1) {
        const std::vector<std::byte> junk(12, std::byte{1});
        comm.allgatherv(std::span<const std::byte>(junk), scratch, counts);
        throw communicator_error("rank 1 ran something else");
      }
      agree_on_header(comm, "test", header_of(p, exchange_id::gtopk, 4), 0, scratch);
    });
    CHECK(contains(what[0], "rank 1 sent 12 bytes that are not an exchange header"));
  }
  SUBCASE("a rank that announces more entries than its tensor has is refused on every rank") {
    // gtopk takes its k from the largest announced count: 2^32 - 1 from one header would have
    // made every rank size its buffers by it.
    const auto what = errors_of(3, [&](in_process_comm& comm) {
      exchange_header h = header_of(p, exchange_id::gtopk, 4);
      if (comm.rank() == 1) h.count = 0xffffffffu;
      std::vector<std::byte> scratch;
      agree_on_header(comm, "test", h, agree::dense_size, scratch);
    });
    REQUIRE(what.size() == 3);
    for (const auto& w : what) {
      CHECK(contains(w, "rank 1 announced a payload of 4294967295 entries for a tensor of 100 "
                        "elements; allowed: count <= dense_size"));
    }
  }
  SUBCASE("no disagreement: every rank gets every header") {
    run_in_process(3, [&](in_process_comm& comm) {
      payload q = p;
      q.count = static_cast<std::uint32_t>(comm.rank());
      std::vector<std::byte> scratch;
      const auto all = agree_on_header(comm, "test", header_of(q, exchange_id::gtopk, 4), agree::dense_size, scratch);
      REQUIRE(all.size() == 3);
      for (std::uint32_t r = 0; r < 3; ++r) CHECK(all[r].count == r);
    });
  }
}

TEST_CASE("every exchange: a tensor of another size on one rank fails on every rank") {
  auto run = [](auto x, auto c, bool summable) {
    const auto what = errors_of(3, [&](in_process_comm& comm) {
      auto xx = x;
      auto cc = c;  // a compressor belongs to one rank: it keeps decoding scratch
      const std::size_t n = comm.rank() == 1 ? 200 : 256;
      const payload p = gradcomp_test::payload_for_rank(cc, comm.rank(), n, summable ? 1.0 : 0.05);
      std::vector<float> out(n);
      xx.exchange(comm, cc, p, std::span<float>(out));
    });
    for (const auto& w : what) {
      CAPTURE(w);
      CHECK(!w.empty());
      CHECK((contains(w, "200") && contains(w, "256")));
    }
  };
  using S = compressor<topk, identity, residual>;
  using D = compressor<dense, identity, no_feedback>;
  SUBCASE("dense_allreduce") { run(dense_allreduce{}, D{}, true); }
  SUBCASE("sparse_allgather") { run(sparse_allgather{}, S{}, false); }
  SUBCASE("gtopk") { run(gtopk{}, S{}, false); }
  SUBCASE("topk_a2a") { run(topk_a2a{}, S{}, false); }
  SUBCASE("auto_exchange") {
    auto_options o;
    o.link = link_model{1e-5, 1e-9};
    run(auto_exchange(o), S{}, false);
  }
}

TEST_CASE("dense_allreduce of Random-k: a rank with another seed draws other indices, all fail") {
  const auto what = errors_of(3, [](in_process_comm& comm) {
    compressor<randomk, identity, residual> c;
    auto st = c.make_state(500);
    const auto g = gradcomp_test::make_input<float>(gradcomp_test::dist::normal, 500, 1);
    payload p;
    const std::uint64_t seed = comm.rank() == 2 ? 8 : 7;
    c.compress(g, st, compress_context{0.1, call_id{seed, 0, 0}}, p);
    std::vector<float> out(500);
    dense_allreduce{}.exchange(comm, c, p, std::span<float>(out));
  });
  for (const auto& w : what) CHECK(contains(w, "selected indices"));
}

TEST_CASE("a rank with bad arguments throws them; the others throw communicator_error") {
  std::mutex m;
  std::vector<std::string> kinds(3);
  try {
    run_in_process(3, [&](in_process_comm& comm) {
      compressor<topk, identity, residual> c;
      const payload p = gradcomp_test::payload_for_rank(c, comm.rank(), 100, 0.1);
      std::vector<float> out(comm.rank() == 0 ? 99 : 100);  // rank 0's output is too short
      topk_a2a x;
      try {
        x.exchange(comm, c, p, std::span<float>(out));
      } catch (const invalid_argument&) {
        const std::lock_guard lock(m);
        kinds[static_cast<std::size_t>(comm.rank())] = "invalid_argument";
        throw;
      } catch (const communicator_error& e) {
        const std::lock_guard lock(m);
        kinds[static_cast<std::size_t>(comm.rank())] =
            contains(e.what(), "rank 0 passed bad arguments") ? "communicator_error" : e.what();
        throw;
      }
    });
  } catch (const std::exception&) {
  }
  CHECK(kinds == std::vector<std::string>{"invalid_argument", "communicator_error", "communicator_error"});
}

TEST_CASE("dense_allreduce{.check_agreement = false} skips the header") {
  run_in_process(2, [](in_process_comm& comm) {
    compressor<dense, identity, no_feedback> c;
    const payload p = gradcomp_test::payload_for_rank(c, comm.rank(), 64, 1.0);
    std::vector<float> a(64), b(64);
    const auto checked = dense_allreduce{}.exchange(comm, c, p, std::span<float>(a));
    const auto unchecked = dense_allreduce{.check_agreement = false}.exchange(comm, c, p, std::span<float>(b));
    CHECK(a == b);
    CHECK(checked.bytes_sent == unchecked.bytes_sent + exchange_header_bytes);
  });
}
