// Tests of the in-process communicator: every collective against a sequential reference over
// 1..8 ranks, misuse detection, and that a failing rank ends the run promptly with its own
// exception. Ranks only record what they saw; all checks run on the test thread.
#include <gradcomp/comm/in_process.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using gradcomp::communicator_error;
using gradcomp::in_process_comm;
using gradcomp::reduce_op;
using gradcomp::run_in_process;

constexpr int rank_counts[] = {1, 2, 3, 4, 8};

// A hang is the failure these tests look for, so a run that does not finish in time ends the
// test binary with a message instead of blocking it.
template <class Fn>
void within_deadline(Fn&& fn) {
  auto done = std::async(std::launch::async, std::forward<Fn>(fn));
  if (done.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    std::fprintf(stderr, "in_process_test: a run did not finish within 10 s (deadlock)\n");
    std::fflush(stderr);
    std::_Exit(1);
  }
  done.get();
}

template <class T>
std::vector<T> random_values(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::vector<T> v(n);
  if constexpr (std::is_floating_point_v<T>) {
    std::uniform_real_distribution<T> dist(T(-1), T(1));
    for (auto& x : v) x = dist(gen);
  } else {
    std::uniform_int_distribution<T> dist(-1000000, 1000000);
    for (auto& x : v) x = dist(gen);
  }
  return v;
}

template <class T>
bool bit_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// What allreduce must produce: the fold over ranks in rank order, element by element.
template <class T>
std::vector<T> reference_reduce(const std::vector<std::vector<T>>& in, reduce_op op) {
  std::vector<T> out = in[0];
  for (std::size_t r = 1; r < in.size(); ++r) {
    for (std::size_t i = 0; i < out.size(); ++i) {
      const T x = in[r][i];
      switch (op) {
        case reduce_op::sum: out[i] = out[i] + x; break;
        case reduce_op::max: out[i] = out[i] < x ? x : out[i]; break;
        case reduce_op::min: out[i] = x < out[i] ? x : out[i]; break;
      }
    }
  }
  return out;
}

template <class T>
void check_allreduce(int p, std::size_t n, reduce_op op) {
  std::vector<std::vector<T>> in(static_cast<std::size_t>(p));
  for (int r = 0; r < p; ++r) in[static_cast<std::size_t>(r)] = random_values<T>(n, 1000u * n + r);
  const auto expected = reference_reduce(in, op);

  auto out = in;
  within_deadline([&] {
    run_in_process(p, [&](in_process_comm& c) {
      c.allreduce(std::span<T>(out[static_cast<std::size_t>(c.rank())]), op);
    });
  });
  for (int r = 0; r < p; ++r) {
    CAPTURE(r);
    CHECK(bit_equal(out[static_cast<std::size_t>(r)], expected));
  }
}

// A user-defined element: allreduce needs only +, < and trivial copies.
struct fixed_point {
  std::int32_t raw;
  friend fixed_point operator+(fixed_point a, fixed_point b) { return {a.raw + b.raw}; }
  friend bool operator<(fixed_point a, fixed_point b) { return a.raw < b.raw; }
};

// An element whose + throws on a marked value, to fail a rank in the middle of an allreduce.
struct fragile_value {
  std::int32_t raw;
  friend fragile_value operator+(fragile_value a, fragile_value b) {
    if (b.raw < 0) throw std::domain_error("fragile_value: negative operand");
    return {a.raw + b.raw};
  }
  friend bool operator<(fragile_value a, fragile_value b) { return a.raw < b.raw; }
};

struct not_a_communicator {
  int rank() const { return 0; }
};

static_assert(gradcomp::communicator<in_process_comm>);
static_assert(!gradcomp::communicator<not_a_communicator>);

// Runs f on p ranks where each rank is expected to throw; returns what each one threw.
template <class F>
std::vector<std::string> messages_of_each_rank(int p, F f) {
  std::vector<std::string> what(static_cast<std::size_t>(p));
  within_deadline([&] {
    run_in_process(p, [&](in_process_comm& c) {
      try {
        f(c);
      } catch (const communicator_error& e) {
        what[static_cast<std::size_t>(c.rank())] = e.what();
      }
    });
  });
  return what;
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("in_process: world and run_in_process reject a rank count below 1") {
  CHECK_THROWS_AS(gradcomp::in_process_world(0), gradcomp::invalid_argument);
  CHECK_THROWS_WITH_AS(run_in_process(-1, [](in_process_comm&) {}), doctest::Contains("'ranks'"),
                       gradcomp::invalid_argument);
  try {
    gradcomp::in_process_world w(0);
  } catch (const gradcomp::invalid_argument& e) {
    CHECK(contains(e.what(), "ranks >= 1"));
  }
  gradcomp::in_process_world w(2);
  CHECK_THROWS_AS(w.comm(2), gradcomp::invalid_argument);
  CHECK_THROWS_AS(w.comm(-1), gradcomp::invalid_argument);
}

TEST_CASE("in_process: each rank sees its rank and the size") {
  for (int p : rank_counts) {
    std::vector<int> seen(static_cast<std::size_t>(p), -1);
    std::vector<int> sizes(static_cast<std::size_t>(p), -1);
    within_deadline([&] {
      run_in_process(p, [&](auto& c) {  // a generic callable works too
        seen[static_cast<std::size_t>(c.rank())] = c.rank();
        sizes[static_cast<std::size_t>(c.rank())] = c.size();
      });
    });
    for (int r = 0; r < p; ++r) {
      CHECK(seen[static_cast<std::size_t>(r)] == r);
      CHECK(sizes[static_cast<std::size_t>(r)] == p);
    }
  }
}

TEST_CASE("in_process: allreduce equals the rank-order sequential reduction, bit for bit") {
  for (int p : rank_counts) {
    for (std::size_t n :
         {std::size_t{0}, std::size_t{1}, std::size_t{5}, std::size_t{4097}, std::size_t{10007}}) {
      for (reduce_op op : {reduce_op::sum, reduce_op::max, reduce_op::min}) {
        CAPTURE(p);
        CAPTURE(n);
        CAPTURE(static_cast<int>(op));
        check_allreduce<float>(p, n, op);
        check_allreduce<double>(p, n, op);
        check_allreduce<std::int64_t>(p, n, op);
      }
    }
  }
}

TEST_CASE("in_process: allreduce of a user type with + and <") {
  std::vector<std::vector<fixed_point>> out(3, std::vector<fixed_point>(4));
  within_deadline([&] {
    run_in_process(3, [&](in_process_comm& c) {
      auto& mine = out[static_cast<std::size_t>(c.rank())];
      for (std::size_t i = 0; i < mine.size(); ++i) {
        mine[i].raw = (c.rank() + 1) * static_cast<std::int32_t>(i);
      }
      c.allreduce(std::span<fixed_point>(mine));
    });
  });
  for (const auto& v : out) {
    for (std::size_t i = 0; i < v.size(); ++i) CHECK(v[i].raw == 6 * static_cast<int>(i));
  }
}

TEST_CASE("in_process: allgatherv concatenates in rank order, zero counts included") {
  std::mt19937 gen(7);
  for (int p : rank_counts) {
    CAPTURE(p);
    const auto ps = static_cast<std::size_t>(p);
    std::vector<std::vector<double>> send(ps);
    std::vector<std::size_t> counts(ps);
    std::vector<double> expected;
    for (std::size_t r = 0; r < ps; ++r) {
      counts[r] = (r % 3 == 1) ? 0 : gen() % 50;  // every third rank sends nothing
      send[r] = random_values<double>(counts[r], 77 + r);
      expected.insert(expected.end(), send[r].begin(), send[r].end());
    }
    std::vector<std::vector<double>> recv(ps, std::vector<double>(3, -1.0));  // stale content
    std::vector<std::vector<std::size_t>> recv_counts(ps);
    within_deadline([&] {
      run_in_process(p, [&](in_process_comm& c) {
        const auto r = static_cast<std::size_t>(c.rank());
        c.allgatherv(std::span<const double>(send[r]), recv[r], recv_counts[r]);
      });
    });
    for (std::size_t r = 0; r < ps; ++r) {
      CHECK(bit_equal(recv[r], expected));
      CHECK(recv_counts[r] == counts);
    }
  }
}

TEST_CASE("in_process: allgatherv of bytes, as the communicator concept calls it") {
  std::vector<std::vector<std::byte>> recv(4);
  std::vector<std::vector<std::size_t>> counts(4);
  within_deadline([&] {
    run_in_process(4, [&](in_process_comm& c) {
      const auto r = static_cast<std::size_t>(c.rank());
      std::vector<std::byte> mine(r, std::byte{static_cast<unsigned char>(r)});
      c.allgatherv(std::span<const std::byte>(mine), recv[r], counts[r]);
    });
  });
  const std::vector<std::byte> expected = {std::byte{1}, std::byte{2}, std::byte{2},
                                           std::byte{3}, std::byte{3}, std::byte{3}};
  for (std::size_t r = 0; r < 4; ++r) {
    CHECK(recv[r] == expected);
    CHECK(counts[r] == std::vector<std::size_t>{0, 1, 2, 3});
  }
}

TEST_CASE("in_process: allgatherv may send from its own receive vector") {
  std::vector<std::vector<int>> recv(3);
  std::vector<std::vector<std::size_t>> counts(3);
  within_deadline([&] {
    run_in_process(3, [&](in_process_comm& c) {
      auto& mine = recv[static_cast<std::size_t>(c.rank())];
      mine.assign(static_cast<std::size_t>(c.rank()) + 1, c.rank());
      c.allgatherv(std::span<const int>(mine), mine, counts[static_cast<std::size_t>(c.rank())]);
    });
  });
  for (const auto& v : recv) CHECK(v == std::vector<int>{0, 1, 1, 2, 2, 2});
}

TEST_CASE("in_process: allgather places rank r's block at r, also in place") {
  for (int p : rank_counts) {
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{33}}) {
      CAPTURE(p);
      CAPTURE(n);
      const auto ps = static_cast<std::size_t>(p);
      std::vector<std::vector<float>> send(ps);
      std::vector<float> expected;
      for (std::size_t r = 0; r < ps; ++r) {
        send[r] = random_values<float>(n, 500 + r);
        expected.insert(expected.end(), send[r].begin(), send[r].end());
      }
      std::vector<std::vector<float>> recv(ps, std::vector<float>(ps * n, -1.0f));
      std::vector<std::vector<float>> in_place(ps, std::vector<float>(ps * n, -1.0f));
      within_deadline([&] {
        run_in_process(p, [&](in_process_comm& c) {
          const auto r = static_cast<std::size_t>(c.rank());
          c.allgather(std::span<const float>(send[r]), std::span<float>(recv[r]));
          // MPI_IN_PLACE style: the send block is this rank's block of recv.
          std::copy(send[r].begin(), send[r].end(),
                    in_place[r].begin() + static_cast<std::ptrdiff_t>(r * n));
          std::span<float> all(in_place[r]);
          c.allgather(all.subspan(r * n, n), all);
        });
      });
      for (std::size_t r = 0; r < ps; ++r) {
        CHECK(bit_equal(recv[r], expected));
        CHECK(bit_equal(in_place[r], expected));
      }
    }
  }
}

TEST_CASE("in_process: alltoallv equals the reference transposition, zero blocks included") {
  std::mt19937 gen(11);
  for (int p : rank_counts) {
    for (int trial = 0; trial < 3; ++trial) {
      CAPTURE(p);
      CAPTURE(trial);
      const auto ps = static_cast<std::size_t>(p);
      // count[s][d]: elements rank s sends to rank d; about a third are zero.
      std::vector<std::vector<std::size_t>> count(ps, std::vector<std::size_t>(ps));
      std::vector<std::vector<std::int64_t>> send(ps);
      for (std::size_t s = 0; s < ps; ++s) {
        for (std::size_t d = 0; d < ps; ++d) count[s][d] = (gen() % 3 == 0) ? 0 : gen() % 20;
        for (std::size_t d = 0; d < ps; ++d) {
          for (std::size_t k = 0; k < count[s][d]; ++k) {
            send[s].push_back(static_cast<std::int64_t>(s * 1000000 + d * 1000 + k));
          }
        }
      }
      std::vector<std::vector<std::int64_t>> recv(ps);
      std::vector<std::vector<std::size_t>> recv_counts(ps);
      within_deadline([&] {
        run_in_process(p, [&](in_process_comm& c) {
          const auto r = static_cast<std::size_t>(c.rank());
          c.alltoallv(std::span<const std::int64_t>(send[r]),
                      std::span<const std::size_t>(count[r]), recv[r], recv_counts[r]);
        });
      });
      for (std::size_t d = 0; d < ps; ++d) {
        std::vector<std::int64_t> expected;
        std::vector<std::size_t> expected_counts;
        for (std::size_t s = 0; s < ps; ++s) {
          expected_counts.push_back(count[s][d]);
          for (std::size_t k = 0; k < count[s][d]; ++k) {
            expected.push_back(static_cast<std::int64_t>(s * 1000000 + d * 1000 + k));
          }
        }
        CHECK(recv[d] == expected);
        CHECK(recv_counts[d] == expected_counts);
      }
    }
  }
}

TEST_CASE("in_process: alltoallv whose send_counts view its own recv_counts") {
  // A common pattern: exchange counts first, then reuse the vector for the data exchange.
  std::vector<std::vector<std::size_t>> counts(3, std::vector<std::size_t>(3, 1));
  std::vector<std::vector<std::size_t>> recv(3);
  within_deadline([&] {
    run_in_process(3, [&](in_process_comm& c) {
      const auto r = static_cast<std::size_t>(c.rank());
      const std::vector<std::size_t> send = {r, r, r};
      c.alltoallv(std::span<const std::size_t>(send), std::span<const std::size_t>(counts[r]),
                  recv[r], counts[r]);
    });
  });
  for (std::size_t r = 0; r < 3; ++r) {
    CHECK(recv[r] == std::vector<std::size_t>{0, 1, 2});
    CHECK(counts[r] == std::vector<std::size_t>{1, 1, 1});
  }
}

TEST_CASE("in_process: broadcast from every root") {
  for (int p : rank_counts) {
    const auto ps = static_cast<std::size_t>(p);
    for (int root = 0; root < p; ++root) {
      for (std::size_t n : {std::size_t{0}, std::size_t{17}}) {
        CAPTURE(p);
        CAPTURE(root);
        CAPTURE(n);
        std::vector<std::vector<double>> data(ps);
        for (std::size_t r = 0; r < ps; ++r) data[r] = random_values<double>(n, 900 + r);
        const auto expected = data[static_cast<std::size_t>(root)];
        within_deadline([&] {
          run_in_process(p, [&](in_process_comm& c) {
            c.broadcast(std::span<double>(data[static_cast<std::size_t>(c.rank())]), root);
          });
        });
        for (std::size_t r = 0; r < ps; ++r) CHECK(bit_equal(data[r], expected));
      }
    }
  }
}

TEST_CASE("in_process: nobody leaves a barrier before everyone has entered it") {
  for (int p : rank_counts) {
    CAPTURE(p);
    std::atomic<int> entered{0};
    std::vector<int> short_by(static_cast<std::size_t>(p), 0);
    within_deadline([&] {
      run_in_process(p, [&](in_process_comm& c) {
        for (int round = 1; round <= 50; ++round) {
          entered.fetch_add(1);
          c.barrier();
          // Faster ranks may already count the next round, never fewer than this one.
          if (entered.load() < round * p) ++short_by[static_cast<std::size_t>(c.rank())];
        }
      });
    });
    for (int s : short_by) CHECK(s == 0);
  }
}

TEST_CASE("in_process: 1000 rounds of small allreduces stay correct") {
  for (int p : {2, 4, 8}) {
    CAPTURE(p);
    std::vector<int> wrong(static_cast<std::size_t>(p), 0);
    within_deadline([&] {
      run_in_process(p, [&](in_process_comm& c) {
        for (int round = 0; round < 1000; ++round) {
          std::int64_t v[3] = {c.rank() + 1, round, c.rank() == round % p ? 1 : 0};
          c.allreduce(std::span<std::int64_t>(v));
          const std::int64_t p64 = p;
          if (v[0] != p64 * (p64 + 1) / 2 || v[1] != p64 * round || v[2] != 1) {
            ++wrong[static_cast<std::size_t>(c.rank())];
          }
        }
      });
    });
    for (int w : wrong) CHECK(w == 0);
  }
}

TEST_CASE("in_process: zero-length buffers and a single rank") {
  for (int p : {1, 3}) {
    CAPTURE(p);
    std::vector<int> done(static_cast<std::size_t>(p), 0);
    within_deadline([&] {
      run_in_process(p, [&](in_process_comm& c) {
        std::span<float> none;
        c.allreduce(none);
        c.allreduce(none, reduce_op::max);
        c.broadcast(none, p - 1);
        c.allgather(std::span<const float>(), none);
        std::vector<float> recv{1.0f};
        std::vector<std::size_t> counts;
        c.allgatherv(std::span<const float>(), recv, counts);
        const bool gathered =
            recv.empty() && counts == std::vector<std::size_t>(static_cast<std::size_t>(p), 0);
        const std::vector<std::size_t> zeros(static_cast<std::size_t>(p), 0);
        c.alltoallv(std::span<const float>(), std::span<const std::size_t>(zeros), recv, counts);
        const bool exchanged = recv.empty() && counts == zeros;
        c.barrier();
        if (gathered && exchanged) done[static_cast<std::size_t>(c.rank())] = 1;
      });
    });
    for (int d : done) CHECK(d == 1);
  }
  // One rank: every collective is a copy or nothing.
  within_deadline([] {
    run_in_process(1, [](in_process_comm& c) {
      std::vector<double> x = {1.5, -2.0};
      c.allreduce(std::span<double>(x));
      c.broadcast(std::span<double>(x), 0);
      std::vector<double> all(2);
      c.allgather(std::span<const double>(x), std::span<double>(all));
      std::vector<double> recv;
      std::vector<std::size_t> counts;
      const std::size_t send_counts[] = {2};
      c.alltoallv(std::span<const double>(x), std::span<const std::size_t>(send_counts), recv,
                  counts);
      if (x != std::vector<double>{1.5, -2.0} || all != x || recv != x || counts[0] != 2) {
        throw std::logic_error("single-rank collectives changed the data");
      }
    });
  });
}

TEST_CASE("in_process: allreduce of 10^7 floats on 4 ranks is fast") {
  const std::size_t n = 10'000'000;
  std::vector<std::vector<float>> data(4, std::vector<float>(n, 0.25f));
  const auto start = std::chrono::steady_clock::now();
  within_deadline([&] {
    run_in_process(4, [&](in_process_comm& c) {
      c.allreduce(std::span<float>(data[static_cast<std::size_t>(c.rank())]));
    });
  });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  MESSAGE("allreduce of 10^7 floats on 4 ranks: " << seconds << " s");
  for (const auto& v : data) {
    CHECK(v.front() == 1.0f);
    CHECK(v.back() == 1.0f);
    CHECK(v[n / 2] == 1.0f);
  }
#if defined(__OPTIMIZE__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
  CHECK(seconds < 1.0);
#endif
}

TEST_CASE("in_process: mismatched collectives throw the same error on every rank") {
  SUBCASE("sizes") {
    const auto what = messages_of_each_rank(4, [](in_process_comm& c) {
      std::vector<float> v(c.rank() == 2 ? 10 : 12);
      c.allreduce(std::span<float>(v));
    });
    for (const auto& w : what) {
      CHECK(contains(w, "allreduce: rank 2 passed 10 elements, rank 0 passed 12"));
    }
  }
  SUBCASE("kinds") {
    const auto what = messages_of_each_rank(3, [](in_process_comm& c) {
      std::vector<double> v(4);
      if (c.rank() == 1) {
        c.barrier();
      } else {
        c.allreduce(std::span<double>(v));
      }
    });
    for (const auto& w : what) CHECK(contains(w, "rank 1 called barrier, rank 0 called allreduce"));
  }
  SUBCASE("element types of the same size") {
    const auto what = messages_of_each_rank(2, [](in_process_comm& c) {
      std::vector<float> f(3);
      std::vector<std::int32_t> i(3);
      if (c.rank() == 0) {
        c.broadcast(std::span<float>(f), 0);
      } else {
        c.broadcast(std::span<std::int32_t>(i), 0);
      }
    });
    for (const auto& w : what)
      CHECK(contains(w, "broadcast: rank 1 passed a different element type"));
  }
  SUBCASE("reduce ops") {
    const auto what = messages_of_each_rank(3, [](in_process_comm& c) {
      std::vector<double> v(2);
      c.allreduce(std::span<double>(v), c.rank() == 2 ? reduce_op::max : reduce_op::sum);
    });
    for (const auto& w : what) CHECK(contains(w, "rank 2 passed reduce_op::max"));
  }
  SUBCASE("roots") {
    const auto what = messages_of_each_rank(3, [](in_process_comm& c) {
      std::vector<double> v(2);
      c.broadcast(std::span<double>(v), c.rank() == 1 ? 1 : 0);
    });
    for (const auto& w : what)
      CHECK(contains(w, "broadcast: rank 1 passed root 1, rank 0 passed root 0"));
  }
  SUBCASE("allgather counts") {
    const auto what = messages_of_each_rank(2, [](in_process_comm& c) {
      const std::size_t n = c.rank() == 0 ? 2 : 3;
      std::vector<float> send(n), recv(2 * n);
      c.allgather(std::span<const float>(send), std::span<float>(recv));
    });
    for (const auto& w : what)
      CHECK(contains(w, "allgather: rank 1 passed 3 elements, rank 0 passed 2"));
  }
  SUBCASE("the world stays usable after a mismatch") {
    std::vector<double> after(3, 0.0);
    const auto what = messages_of_each_rank(3, [&](in_process_comm& c) {
      std::vector<double> v(c.rank() == 0 ? 1 : 2, 1.0);
      try {
        c.allreduce(std::span<double>(v));
      } catch (const communicator_error&) {
        std::vector<double> w(1, 1.0);
        c.allreduce(std::span<double>(w));
        after[static_cast<std::size_t>(c.rank())] = w[0];
        throw;
      }
    });
    for (const auto& w : what) CHECK(contains(w, "rank 1 passed 2 elements, rank 0 passed 1"));
    for (double a : after) CHECK(a == 3.0);
  }
}

TEST_CASE("in_process: a rank that throws ends the run with its own exception, promptly") {
  for (int p : {2, 4, 8}) {
    CAPTURE(p);
    const int failing = p - 1;
    std::vector<std::string> others_saw(static_cast<std::size_t>(p));
    bool got_original = false;
    within_deadline([&] {
      try {
        run_in_process(p, [&](in_process_comm& c) {
          if (c.rank() == failing) throw std::runtime_error("boom");
          std::vector<float> v(100, 1.0f);
          try {
            c.allreduce(std::span<float>(v));  // blocks: the failing rank never arrives
          } catch (const communicator_error& e) {
            others_saw[static_cast<std::size_t>(c.rank())] = e.what();
            throw;
          }
        });
      } catch (const communicator_error&) {
        got_original = false;  // a secondary error must not replace the original
      } catch (const std::runtime_error& e) {
        got_original = std::string(e.what()) == "boom";
      }
    });
    CHECK(got_original);
    for (int r = 0; r < failing; ++r) {
      CHECK(contains(others_saw[static_cast<std::size_t>(r)],
                     "in_process: rank " + std::to_string(failing) + " failed: boom"));
    }
  }
}

TEST_CASE("in_process: a rank that fails after some collectives releases the others") {
  bool got_original = false;
  within_deadline([&] {
    try {
      run_in_process(4, [](in_process_comm& c) {
        std::vector<double> v(1000, 1.0);
        for (int round = 0; round < 20; ++round) {
          if (c.rank() == 2 && round == 13) throw 42;  // not even a std::exception
          c.allreduce(std::span<double>(v));
          c.barrier();
        }
      });
    } catch (int code) {
      got_original = code == 42;
    }
  });
  CHECK(got_original);
}

TEST_CASE("in_process: an element operation throwing mid-allreduce fails the run cleanly") {
  // Rank 2's element 0 is folded in by rank 0, which owns the first share; rank 0 throws
  // after the others have started reading its buffer, and no rank may keep going.
  std::vector<std::string> others_saw(4);
  std::string thrown;
  within_deadline([&] {
    try {
      run_in_process(4, [&](in_process_comm& c) {
        std::vector<fragile_value> v(64, fragile_value{1});
        if (c.rank() == 2) v[0].raw = -1;
        try {
          c.allreduce(std::span<fragile_value>(v));
        } catch (const communicator_error& e) {
          others_saw[static_cast<std::size_t>(c.rank())] = e.what();
          throw;
        }
        c.barrier();
      });
    } catch (const std::domain_error& e) {
      thrown = e.what();
    }
  });
  CHECK(contains(thrown, "negative operand"));
  for (std::size_t r = 1; r < 4; ++r) {
    CHECK(contains(others_saw[r], "rank 0 failed: fragile_value: negative operand"));
  }
}

TEST_CASE("in_process: a bad argument on one rank does not hang the others") {
  auto expect = [](int p, auto bad_call, const char* argument) {
    std::vector<std::string> others_saw(static_cast<std::size_t>(p));
    std::string thrown;
    within_deadline([&] {
      try {
        run_in_process(p, [&](in_process_comm& c) {
          try {
            bad_call(c);
          } catch (const communicator_error& e) {
            others_saw[static_cast<std::size_t>(c.rank())] = e.what();
            throw;
          }
        });
      } catch (const gradcomp::invalid_argument& e) {
        thrown = e.what();
      }
    });
    CAPTURE(thrown);
    CHECK(contains(thrown, std::string("'") + argument + "'"));
    CHECK(contains(thrown, "allowed"));
    for (int r = 0; r < p; ++r) {
      if (r == 1) continue;  // the rank that passed the bad argument
      CHECK(contains(others_saw[static_cast<std::size_t>(r)], "rank 1 failed"));
    }
  };
  SUBCASE("root out of range") {
    expect(
        3,
        [](in_process_comm& c) {
          std::vector<float> v(4);
          c.broadcast(std::span<float>(v), c.rank() == 1 ? 3 : 0);
        },
        "root");
  }
  SUBCASE("send_counts of the wrong size") {
    expect(
        3,
        [](in_process_comm& c) {
          std::vector<float> send(3), recv;
          std::vector<std::size_t> counts(c.rank() == 1 ? 2 : 3, 1), recv_counts;
          c.alltoallv(std::span<const float>(send), std::span<const std::size_t>(counts), recv,
                      recv_counts);
        },
        "send_counts.size()");
  }
  SUBCASE("send_counts of the wrong sum") {
    expect(
        4,
        [](in_process_comm& c) {
          std::vector<float> send(4), recv;
          std::vector<std::size_t> counts(4, c.rank() == 1 ? 2 : 1), recv_counts;
          c.alltoallv(std::span<const float>(send), std::span<const std::size_t>(counts), recv,
                      recv_counts);
        },
        "sum of send_counts");
  }
  SUBCASE("allgather recv of the wrong size") {
    expect(
        2,
        [](in_process_comm& c) {
          std::vector<float> send(2), recv(c.rank() == 1 ? 3 : 4);
          c.allgather(std::span<const float>(send), std::span<float>(recv));
        },
        "recv.size()");
  }
}

TEST_CASE("in_process: a rank that returns while others wait fails the run") {
  std::string thrown;
  within_deadline([&] {
    try {
      run_in_process(3, [](in_process_comm& c) {
        if (c.rank() == 0) return;  // skips the barrier the others call
        c.barrier();
      });
    } catch (const communicator_error& e) {
      thrown = e.what();
    }
  });
  CHECK(contains(thrown, "rank 0 returned while rank"));
  CHECK(contains(thrown, "barrier"));
}

TEST_CASE("check_announced: each count within the protocol's limit, the total within the transport's") {
  using gradcomp::receive_limit;
  using gradcomp::detail::check_announced;
  auto message = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const communicator_error& e) {
      return e.what();
    }
    return {};
  };
  const std::vector<std::uint64_t> fine{0, 48, 48};
  CHECK(message([&] { check_announced("x", fine, 1, receive_limit{48}, 1000); }).empty());
  CHECK(message([&] { check_announced("x", std::vector<std::uint64_t>{}, 1, receive_limit{}, 0); }).empty());
  // Rank 2 claims more than one rank may send: named with its count and the limit.
  const std::string over = message([] {
    check_announced("agree", std::vector<std::uint64_t>{48, 48, 0xffffffffu}, 1, receive_limit{48}, 1u << 30);
  });
  CHECK(over.find("gradcomp::agree: rank 2 announced 4294967295 elements; allowed: at most 48") != std::string::npos);
  CHECK(over.find("protocol") != std::string::npos);
  // Without a protocol limit, the transport's bound still holds, per rank and in total.
  const std::string huge = message([] {
    check_announced("x", std::vector<std::uint64_t>{1, std::uint64_t{1} << 62}, 1, receive_limit{}, 1u << 31);
  });
  CHECK(huge.find("rank 1 announced 4611686018427387904 elements; allowed: at most 2147483648") != std::string::npos);
  const std::string total = message([] {
    check_announced("x", std::vector<std::uint64_t>{1u << 30, 1u << 30, 1u << 30}, 1, receive_limit{}, 1u << 31);
  });
  CHECK(total.find("add up to 3221225472 elements or more") != std::string::npos);
  // An alltoallv matrix (3 ranks): entry 5 is row 1, so rank 1 lied.
  const std::string row = message([] {
    check_announced("a2a", std::vector<std::uint64_t>{0, 1, 2, 3, 4, 99, 6, 7, 8}, 3, receive_limit{10}, 1000);
  });
  CHECK(row.find("rank 1 announced 99 elements; allowed: at most 10") != std::string::npos);
}

TEST_CASE("in_process: a receive limit it cannot apply before the collective is checked after it") {
  // in_process_comm's peers are threads of this process: allgatherv_within and
  // alltoallv_within check its counts once received, naming the rank, on every rank alike.
  static_assert(!gradcomp::bounds_receives<in_process_comm, std::byte>);
  std::vector<std::string> seen(3);
  run_in_process(3, [&](in_process_comm& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    const std::vector<std::byte> mine(r == 2 ? 9 : 4);
    std::vector<std::byte> all;
    std::vector<std::size_t> counts;
    try {
      gradcomp::detail::allgatherv_within(c, std::span<const std::byte>(mine), all, counts,
                                          gradcomp::receive_limit{8}, "test");
    } catch (const communicator_error& e) {
      seen[r] = e.what();
    }
  });
  for (const auto& s : seen) CHECK(s == "gradcomp::test: rank 2 sent 9 elements; allowed: at most 8");
}
