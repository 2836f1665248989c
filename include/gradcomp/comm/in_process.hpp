// gradcomp/comm/in_process.hpp: a communicator whose ranks are threads of one process, for
// tests and one-machine simulation of data-parallel training. run_in_process(P, f) runs f on
// P ranks; collectives check that every rank called the same one, and a failing rank ends
// the whole run with its own exception instead of leaving the others blocked.
#pragma once

#include <algorithm>
#include <concepts>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <gradcomp/comm/in_process_world.hpp>
#include <gradcomp/concepts.hpp>
#include <gradcomp/detail/comm_common.hpp>
#include <gradcomp/error.hpp>

namespace gradcomp {

// One rank's handle on an in_process_world: a pointer and a rank, cheap to copy.
//
// Every collective is blocking and must be called by all ranks in the same order. Each rank
// must pass its own buffers (buffers shared between ranks are not detected). A rank's send
// buffer may overlap its own receive buffer: it is then copied first.
//
// Misuse is reported, never silently mixed up:
//  - ranks calling different collectives, or (allreduce, broadcast, allgather) different
//    element counts, different element types, reduce ops or roots: every rank throws the same
//    communicator_error naming the collective, the lowest disagreeing rank and rank 0, e.g.
//    "allreduce: rank 2 passed 10 elements, rank 0 passed 12"; the world stays usable;
//  - a bad argument on one rank (root out of range, send_counts of the wrong size or sum,
//    recv of the wrong size): that rank throws invalid_argument and fails the world, so the
//    others throw communicator_error rather than wait for it;
//  - an exception while copying or combining on one rank (bad_alloc, a throwing operator+):
//    that rank rethrows it and fails the world, all others throw communicator_error, so no
//    rank is left with a partial result it takes for complete.
class in_process_comm {
 public:
  in_process_comm(in_process_world& world, int rank) : world_(&world), rank_(rank) {
    if (rank < 0 || rank >= world.size()) {
      detail::throw_invalid_argument(
          "in_process_comm", "rank", rank,
          detail::concat("0 <= rank < size() (size() = ", world.size(), ")"));
    }
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return world_->size(); }

  // Element-wise reduction in place. Every element is folded in rank order,
  // ((x0 + x1) + x2) + ... + x(P-1), exactly once, and that single result is copied to every
  // rank: all ranks get bit-identical values, equal to a sequential loop over ranks. max and
  // min use only operator<: a later rank's value replaces the running one when
  // running < value (max) or value < running (min), so NaN handling is deterministic too.
  //
  // Each rank folds its 1/P share of the elements straight from the others' buffers into its
  // own, then copies the other shares from their owners: O(n) work per rank and no buffer
  // the size of data.
  template <detail::in_process_reducible T>
  void allreduce(std::span<T> data, reduce_op op = reduce_op::sum) {
    constexpr auto kind = detail::collective::allreduce;
    const auto p = static_cast<std::size_t>(size());
    const auto r = static_cast<std::size_t>(rank_);
    const std::size_t n = data.size();

    // Allocated before publishing: once others may read our buffer we must not throw out.
    constexpr std::size_t tile_elems = 4096;  // the running result stays in L1
    std::vector<T> tile;
    tile.reserve(std::min(tile_elems, n / p + 1));
    std::vector<const T*> src(p);

    auto& mine = world_->slot(rank_);
    mine = slot_for<T>(kind, n, data.data());
    mine.op = op;
    agree_and_run(kind, [&] {
      for (std::size_t s = 0; s < p; ++s) src[s] = static_cast<const T*>(peer(s).data);
      // Reads: this rank's share of every rank's buffer. Writes: that share of ours only.
      const std::size_t end = detail::share_begin(n, p, r + 1);
      for (std::size_t i = detail::share_begin(n, p, r); i < end; i += tile_elems) {
        const std::size_t len = std::min(tile_elems, end - i);
        tile.assign(src[0] + i, src[0] + i + len);
        for (std::size_t s = 1; s < p; ++s) detail::combine(tile.data(), src[s] + i, len, op);
        std::copy_n(tile.data(), len, data.data() + i);
      }
    });
    // Reads: share s of rank s. Writes: the other shares of ours.
    for (std::size_t s = 0; s < p; ++s) {
      if (s == r) continue;
      const std::size_t begin = detail::share_begin(n, p, s);
      std::copy_n(src[s] + begin, detail::share_begin(n, p, s + 1) - begin, data.data() + begin);
    }
    world_->wait_release(false);  // our share must stay put until everyone has copied it
  }

  // Every rank gets every rank's elements: recv is resized to the total and holds rank 0's
  // elements, then rank 1's, ...; recv_counts[r] is rank r's count in elements. Counts may
  // differ (and be zero); element types must agree.
  template <detail::in_process_element T>
  void allgatherv(std::span<const std::type_identity_t<T>> send, std::vector<T>& recv,
                  std::vector<std::size_t>& recv_counts) {
    static_assert(!std::same_as<T, bool>,
                  "in_process allgatherv: std::vector<bool> has no contiguous storage; use "
                  "std::uint8_t elements");
    constexpr auto kind = detail::collective::allgatherv;
    const auto p = static_cast<std::size_t>(size());

    std::vector<T> own;
    if (overlaps_vector(send, recv) || overlaps_vector(send, recv_counts)) {
      own.assign(send.begin(), send.end());  // resizing recv would move our send buffer
      send = own;
    }

    world_->slot(rank_) = slot_for<T>(kind, send.size(), send.data());
    agree_and_run(kind, [&] {
      recv_counts.assign(p, 0);
      std::size_t total = 0;
      for (std::size_t s = 0; s < p; ++s) {
        recv_counts[s] = peer(s).count;
        total += recv_counts[s];
      }
      recv.resize(total);
      std::size_t at = 0;
      for (std::size_t s = 0; s < p; ++s) {
        std::copy_n(static_cast<const T*>(peer(s).data), recv_counts[s], recv.data() + at);
        at += recv_counts[s];
      }
    });
  }

  // allgatherv with the same count on every rank into a caller-sized buffer:
  // recv.size() must be size() * send.size(); block r of recv receives rank r's send.
  template <detail::in_process_element T>
  void allgather(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    constexpr auto kind = detail::collective::allgather;
    const auto p = static_cast<std::size_t>(size());
    const std::size_t n = send.size();
    if (recv.size() % p != 0 || recv.size() / p != n) {
      fail_argument(kind, "recv.size()", recv.size(),
                    detail::concat("recv.size() == size() * send.size() = ", p, " * ", n));
    }

    std::vector<T> own;
    if (detail::bytes_overlap(send.data(), send.size_bytes(), recv.data(), recv.size_bytes())) {
      own.assign(send.begin(), send.end());  // in-place use: send is our block of recv
      send = own;
    }

    world_->slot(rank_) = slot_for<T>(kind, n, send.data());
    agree_and_run(kind, [&] {
      for (std::size_t s = 0; s < p; ++s) {
        std::copy_n(static_cast<const T*>(peer(s).data), n, recv.data() + s * n);
      }
    });
  }

  // Personalised exchange. send holds the blocks for rank 0, 1, ... back to back, of
  // send_counts[0], send_counts[1], ... elements (send_counts.size() == size(), their sum ==
  // send.size()). recv is resized and receives the blocks addressed to this rank in source
  // rank order; recv_counts[s] is the count rank s sent here.
  template <detail::in_process_element T>
  void alltoallv(std::span<const std::type_identity_t<T>> send,
                 std::span<const std::size_t> send_counts, std::vector<T>& recv,
                 std::vector<std::size_t>& recv_counts) {
    static_assert(!std::same_as<T, bool>,
                  "in_process alltoallv: std::vector<bool> has no contiguous storage; use "
                  "std::uint8_t elements");
    constexpr auto kind = detail::collective::alltoallv;
    const auto p = static_cast<std::size_t>(size());
    const auto r = static_cast<std::size_t>(rank_);
    if (send_counts.size() != p) {
      fail_argument(kind, "send_counts.size()", send_counts.size(),
                    detail::concat("send_counts.size() == size() = ", p));
    }
    // Prefix sums, taken before anything is resized: send_counts may view recv_counts.
    std::vector<std::size_t> offsets(p + 1, 0);
    bool sum_ok = true;
    for (std::size_t s = 0; s < p && sum_ok; ++s) {
      sum_ok = send_counts[s] <= send.size() - offsets[s];  // cannot wrap
      offsets[s + 1] = offsets[s] + (sum_ok ? send_counts[s] : 0);
    }
    if (!sum_ok || offsets[p] != send.size()) {
      fail_argument(kind, "sum of send_counts", sum_of(send_counts),
                    detail::concat("sum of send_counts == send.size() = ", send.size()));
    }

    std::vector<T> own;
    if (overlaps_vector(send, recv) || overlaps_vector(send, recv_counts)) {
      own.assign(send.begin(), send.end());  // resizing recv would move our send buffer
      send = own;
    }

    auto& mine = world_->slot(rank_);
    mine = slot_for<T>(kind, send.size(), send.data());
    mine.offsets = offsets.data();
    agree_and_run(kind, [&] {
      recv_counts.assign(p, 0);
      std::size_t total = 0;
      for (std::size_t s = 0; s < p; ++s) {
        recv_counts[s] = peer(s).offsets[r + 1] - peer(s).offsets[r];
        total += recv_counts[s];
      }
      recv.resize(total);
      std::size_t at = 0;
      for (std::size_t s = 0; s < p; ++s) {
        std::copy_n(static_cast<const T*>(peer(s).data) + peer(s).offsets[r], recv_counts[s],
                    recv.data() + at);
        at += recv_counts[s];
      }
    });
  }

  // Copies root's data into every other rank's data; counts, types and root must agree.
  template <detail::in_process_element T>
  void broadcast(std::span<T> data, int root) {
    constexpr auto kind = detail::collective::broadcast;
    if (root < 0 || root >= size()) {
      fail_argument(kind, "root", root, detail::concat("0 <= root < size() = ", size()));
    }
    auto& mine = world_->slot(rank_);
    mine = slot_for<T>(kind, data.size(), data.data());
    mine.root = root;
    agree_and_run(kind, [&] {
      if (root == rank_) return;
      std::copy_n(static_cast<const T*>(peer(static_cast<std::size_t>(root)).data), data.size(),
                  data.data());
    });
  }

  // No rank leaves before every rank has entered.
  void barrier() {
    world_->slot(rank_) = detail::in_process_slot{.kind = detail::collective::barrier};
    agree_and_run(detail::collective::barrier, [] {});
  }

 private:
  const detail::in_process_slot& peer(std::size_t s) const {
    return world_->slot(static_cast<int>(s));
  }

  // The skeleton of every collective, once this rank's slot is published: wait for all
  // slots, check that the ranks agree, run `work` (the reads of others' buffers) and wait
  // again so that no rank reuses a buffer or slot another still reads. All ranks see the same
  // slots, so on disagreement all throw the same message. If `work` throws on one rank (a
  // bad_alloc, a throwing operator+), that rank fails the world and rethrows, and all others
  // throw communicator_error: a result is complete on every rank or on none.
  template <class Work>
  void agree_and_run(detail::collective kind, Work&& work) {
    world_->wait_entry(rank_, kind);
    std::string mismatch;
    std::exception_ptr failure;
    try {
      mismatch = find_mismatch();
      if (mismatch.empty()) work();
    } catch (...) {
      failure = std::current_exception();
      try {
        world_->abort(rank_, detail::describe(failure));
      } catch (...) {  // out of memory for the message: the release wait still tells everyone
      }
    }
    const bool any_failed = world_->wait_release(failure != nullptr);
    if (failure) std::rethrow_exception(failure);
    if (!mismatch.empty()) throw communicator_error(mismatch);
    if (any_failed) {
      std::string why = world_->failure();
      if (why.empty()) why = "another rank failed";
      throw communicator_error(detail::concat(why, " (in ", detail::collective_name(kind), ")"));
    }
  }

  template <class T>
  static detail::in_process_slot slot_for(detail::collective kind, std::size_t count,
                                          const T* data) {
    detail::in_process_slot s;
    s.kind = kind;
    s.type = &detail::type_tag<T>::id;
    s.elem_size = sizeof(T);
    s.count = count;
    s.data = data;
    return s;
  }

  template <class T, class U>
  static bool overlaps_vector(std::span<const T> send, const std::vector<U>& v) {
    return detail::bytes_overlap(send.data(), send.size_bytes(), v.data(),
                                 v.capacity() * sizeof(U));
  }

  static std::size_t sum_of(std::span<const std::size_t> counts) {
    std::size_t total = 0;
    for (const std::size_t c : counts) total += c;  // only for the message; may wrap
    return total;
  }

  // Compares every rank's slot with rank 0's; the first difference found is the message.
  std::string find_mismatch() const {
    const auto& first = world_->slot(0);
    // Judged by rank 0's collective, not ours, so that the verdict is the same everywhere.
    const detail::collective kind = first.kind;
    const bool same_count = kind == detail::collective::allreduce ||
                            kind == detail::collective::allgather ||
                            kind == detail::collective::broadcast;
    const char* name = detail::collective_name(kind);
    for (int s = 1; s < size(); ++s) {
      const auto& other = world_->slot(s);
      if (other.kind != first.kind) {
        return detail::concat("gradcomp::in_process: collective mismatch: rank ", s, " called ",
                              detail::collective_name(other.kind), ", rank 0 called ",
                              detail::collective_name(first.kind));
      }
      if (kind == detail::collective::barrier) continue;
      if (other.type != first.type) {
        return detail::concat("gradcomp::in_process: ", name, ": rank ", s,
                              " passed a different element type than rank 0 (", other.elem_size,
                              "-byte vs ", first.elem_size, "-byte elements)");
      }
      if (same_count && other.count != first.count) {
        return detail::concat("gradcomp::in_process: ", name, ": rank ", s, " passed ", other.count,
                              " elements, rank 0 passed ", first.count);
      }
      if (kind == detail::collective::allreduce && other.op != first.op) {
        return detail::concat("gradcomp::in_process: ", name, ": rank ", s, " passed ",
                              detail::reduce_op_name(other.op), ", rank 0 passed ",
                              detail::reduce_op_name(first.op));
      }
      if (kind == detail::collective::broadcast && other.root != first.root) {
        return detail::concat("gradcomp::in_process: ", name, ": rank ", s, " passed root ",
                              other.root, ", rank 0 passed root ", first.root);
      }
    }
    return {};
  }

  // The other ranks may already wait in this collective for us: fail the world so that they
  // throw communicator_error instead of waiting forever, then report the argument here.
  template <class Value>
  [[noreturn]] void fail_argument(detail::collective kind, std::string_view arg, const Value& value,
                                  std::string_view allowed) {
    std::string message =
        detail::concat("gradcomp::in_process ", detail::collective_name(kind), ": argument '", arg,
                       "' = ", value, " is out of range; allowed: ", allowed);
    world_->abort(rank_, message);
    throw invalid_argument(std::move(message));
  }

  in_process_world* world_;
  int rank_;
};

static_assert(communicator<in_process_comm>);

inline in_process_comm in_process_world::comm(int rank) { return in_process_comm(*this, rank); }

// Runs f(comm) on `ranks` ranks, each on its own new std::thread (the calling thread only
// waits), and returns when all have finished. f is shared by all ranks and called
// concurrently as an lvalue, so it must be safe to call from several threads at once.
//
// If any rank throws, the world is failed at once: ranks blocked in (or later entering) a
// collective throw communicator_error("gradcomp::in_process: rank R failed: <what>"). After
// all threads are joined, run_in_process rethrows the exception of the rank that failed
// first in time, as that rank threw it; the communicator_errors the others saw as a
// consequence are dropped. A rank that returns while others wait in a collective for it also
// fails the run (communicator_error naming both ranks).
template <class F>
  requires std::invocable<F&, in_process_comm&>
void run_in_process(int ranks, F&& f) {
  in_process_world world(ranks);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(ranks));
  auto body = [&world, &errors, &f](int rank) {
    in_process_comm comm = world.comm(rank);
    try {
      std::invoke(f, comm);
      world.rank_done(rank);
    } catch (...) {
      auto& error = errors[static_cast<std::size_t>(rank)];
      error = std::current_exception();
      world.abort(rank, detail::describe(error));
    }
  };

  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(ranks));
  try {
    for (int rank = 0; rank < ranks; ++rank) threads.emplace_back(body, rank);
  } catch (...) {
    // The ranks already started would wait for the missing one forever.
    world.abort(static_cast<int>(threads.size()), "could not start its thread");
    for (auto& t : threads) t.join();
    throw;
  }
  for (auto& t : threads) t.join();

  const int failed = world.failed_rank();
  if (failed >= 0 && errors[static_cast<std::size_t>(failed)]) {
    std::rethrow_exception(errors[static_cast<std::size_t>(failed)]);
  }
  // The failing rank swallowed its own exception; report what another rank saw, or the cause.
  for (const auto& error : errors) {
    if (error) std::rethrow_exception(error);
  }
  if (failed >= 0) throw communicator_error(world.failure());
}

}  // namespace gradcomp
