// A peer that lies about counts: what the tests of every communicator that bounds what its
// peers announce (bounds_receives) check, whatever makes the lie. A tamperer sits under the
// communicator (a c10d::ProcessGroup wrapper, an MPI_Iallgather in front of MPI's) and offers:
//   lie(value, skip)  arm it: this rank announces `value` in its (skip + 1)-th message of counts
//                     from now on (skip = -1: lie in none, only count them)
//   lied()            whether it lied since it was armed
//   seen()            the messages of counts it let through since it was armed
//   disarm()
#pragma once

#include <doctest/doctest.h>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include <gradcomp/error.hpp>
#include <gradcomp/runtime/bucket_engine.hpp>

#include "data.hpp"
#include "exchange_reference.hpp"

namespace gradcomp_test::lying_peer {

template <class T>
concept tamperer = requires(T& t, const T& ct, std::uint64_t v, int skip) {
  t.lie(v, skip);
  { ct.lied() } -> std::convertible_to<bool>;
  { ct.seen() } -> std::convertible_to<int>;
  t.disarm();
};

// Every rank runs `f` while the last rank lies (`lie` elements) in its (skip + 1)-th message of
// counts: every rank must throw communicator_error naming the liar and with `needle` in it,
// before any buffer is sized by the lie, and the ranks must still be in step afterwards.
template <class Comm, tamperer Tamperer>
void refused_everywhere(Comm& comm, Tamperer& t, std::uint64_t lie, int skip,
                        const std::function<void()>& f, const std::string& needle) {
  const int liar = comm.size() - 1;
  if (comm.rank() == liar) t.lie(lie, skip);
  std::string what;
  bool right_type = false;
  try {
    f();
  } catch (const gradcomp::communicator_error& e) {
    right_type = true;
    what = e.what();
  } catch (const std::exception& e) {
    what = e.what();
  }
  const bool lied = comm.rank() != liar || t.lied();
  t.disarm();
  CAPTURE(what);
  CHECK(lied);
  CHECK(right_type);
  CHECK(what.find(needle) != std::string::npos);
  CHECK(what.find("rank " + std::to_string(liar)) != std::string::npos);
  // Still in step: a clean allgatherv returns every rank's own number.
  const std::vector<int> mine{comm.rank(), 7};
  std::vector<std::byte> all;
  std::vector<std::size_t> counts;
  comm.allgatherv(std::as_bytes(std::span<const int>(mine)), all, counts);
  REQUIRE(all.size() == static_cast<std::size_t>(comm.size()) * sizeof(int) * 2);
  for (int r = 0; r < comm.size(); ++r) {
    int got = -1;
    std::memcpy(&got, all.data() + static_cast<std::size_t>(r) * 2 * sizeof(int), sizeof(int));
    CHECK(got == r);
  }
}

// The engine with every exchange (allreduce, allgather, gtopk, a2a, auto): the liar lies
// (`lie` elements) in each of a step's messages of counts in turn, the bucket's agreement's
// and the exchange's. Every rank throws naming it (`needle`), the ranks stay in step, and the
// failed steps change nothing: the step retried equals a step of an engine that never failed.
// allgatherv and alltoallv while the last rank lies in its message of counts: `limited` elements
// where the protocol's limit is passed (the limit must refuse it), `unlimited` where none is
// (the size of a message still bounds). Every rank refuses, naming the liar, and nothing is
// received into the buffers.
template <class Comm, tamperer Tamperer>
void collectives_refused(Comm& comm, Tamperer& t, std::uint64_t limited, std::uint64_t unlimited) {
  using gradcomp::index_value;
  using gradcomp::receive_limit;
  const auto announced = [](std::uint64_t n) { return "announced " + std::to_string(n) + " elements"; };
  const std::vector<std::byte> bytes(40);
  const std::vector<float> floats(10, 1.0f);
  const auto p = static_cast<std::size_t>(comm.size());
  const std::vector<index_value> pairs(p, index_value{1, 1.0f});
  const std::vector<std::size_t> each(p, 1);
  std::vector<std::byte> recv_bytes;
  std::vector<float> recv_floats;
  std::vector<index_value> recv_pairs;
  std::vector<std::size_t> counts;
  refused_everywhere(comm, t, limited, 0, [&] {
    comm.allgatherv(std::span<const std::byte>(bytes), recv_bytes, counts, receive_limit{64});
  }, announced(limited));
  refused_everywhere(comm, t, unlimited, 0, [&] {
    comm.allgatherv(std::span<const float>(floats), recv_floats, counts);
  }, announced(unlimited));
  // alltoallv: the lie is in one entry of the liar's row, which every rank sees.
  refused_everywhere(comm, t, limited, 0, [&] {
    comm.alltoallv(std::span<const index_value>(pairs), std::span<const std::size_t>(each),
                   recv_pairs, counts, receive_limit{100});
  }, announced(limited));
  refused_everywhere(comm, t, unlimited, 0, [&] {
    comm.alltoallv(std::span<const index_value>(pairs), std::span<const std::size_t>(each),
                   recv_pairs, counts);
  }, announced(unlimited));
  CHECK(recv_bytes.empty());
  CHECK(recv_floats.empty());
  CHECK(recv_pairs.empty());
}

template <class Comm, tamperer Tamperer>
void every_counts_message_refused(Comm& comm, Tamperer& t, std::uint64_t lie,
                                  const std::string& needle) {
  namespace rt = gradcomp::runtime;
  const std::size_t n = 5003;
  for (const std::string ex : {"allreduce", "allgather", "gtopk", "a2a", "auto"}) {
    rt::engine_config c;
    c.exchange = ex;
    c.selector = ex == "allreduce" ? "randomk" : "topk";
    CAPTURE(ex);
    rt::bucket_engine<Comm> engine(comm, c);
    // The exchange each step ran ('auto': the one it chose), engine's and clean's.
    std::vector<std::string> ran, ran_clean;
    auto step = [&](rt::bucket_engine<Comm>& e, std::uint64_t s) {
      auto g = make_input<float>(dist::laplace, n, static_cast<std::uint64_t>(comm.rank()) + 10 * s);
      const auto st = e.run(3, std::span<float>(g), s, 0.01);
      e.commit();
      (&e == &engine ? ran : ran_clean).emplace_back(st.exchange);
      return g;
    };
    // How many messages of counts a rank sends in one step (the same on every rank; the
    // first step calibrates 'auto', so count on the second).
    (void)step(engine, 0);
    t.lie(0, -1);
    (void)step(engine, 1);
    const int messages = t.seen();
    t.disarm();
    CAPTURE(messages);
    CHECK(messages >= 2);  // the bucket's agreement and at least one exchange message
    for (int k = 0; k < messages; ++k) {
      CAPTURE(k);
      refused_everywhere(comm, t, lie, k, [&] { (void)step(engine, 2); }, needle);
    }
    const auto got = step(engine, 2);
    const std::string ran_s = joined(ran);
    CAPTURE(ran_s);
    // A clean engine runs the same steps unfaulted, with the exchange engine ran, by name
    // (registry_exchange_name: 'auto' would measure its link again and might choose another).
    rt::engine_config reference = c;
    reference.exchange = registry_exchange_name(ran);
    rt::bucket_engine<Comm> clean(comm, reference);
    (void)step(clean, 0);
    (void)step(clean, 1);
    const auto want = step(clean, 2);
    CHECK(ran_clean == std::vector<std::string>(3, ran.front()));
    CHECK(same_bits(got, want));
  }
}

}  // namespace gradcomp_test::lying_peer
