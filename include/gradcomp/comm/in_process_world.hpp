// gradcomp/comm/in_process_world.hpp: the shared state of in_process_comm's ranks (threads of
// one process): one slot per rank for the collective in flight, and a generation-counted
// barrier that every wait inside a collective goes through. comm/in_process.hpp has the
// communicator itself and run_in_process().
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

#include <gradcomp/concepts.hpp>
#include <gradcomp/detail/comm_common.hpp>
#include <gradcomp/error.hpp>

namespace gradcomp {

class in_process_comm;

namespace detail {

enum class collective : unsigned char {
  allreduce,
  allgatherv,
  allgather,
  alltoallv,
  broadcast,
  barrier
};

inline const char* collective_name(collective c) noexcept {
  switch (c) {
    case collective::allreduce: return "allreduce";
    case collective::allgatherv: return "allgatherv";
    case collective::allgather: return "allgather";
    case collective::alltoallv: return "alltoallv";
    case collective::broadcast: return "broadcast";
    case collective::barrier: return "barrier";
  }
  return "collective";
}

inline const char* reduce_op_name(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum: return "reduce_op::sum";
    case reduce_op::max: return "reduce_op::max";
    case reduce_op::min: return "reduce_op::min";
  }
  return "reduce_op::?";
}

// One address per element type, so that ranks passing different types of the same size
// (float and int32) are caught too.
template <class T>
struct type_tag {
  static constexpr char id = 0;
};

// What one rank contributes to the current collective. Written by its owner before the first
// barrier of a collective and read by everyone until the last one.
struct in_process_slot {
  collective kind = collective::barrier;
  const void* type = nullptr;
  std::size_t elem_size = 0;
  std::size_t count = 0;
  const void* data = nullptr;
  const std::size_t* offsets = nullptr;  // alltoallv: size()+1 prefix sums of send_counts
  int root = 0;
  reduce_op op = reduce_op::sum;
};

}  // namespace detail

// Shared state of `size()` ranks: one slot per rank and a generation-counted barrier that
// every wait inside a collective goes through. Once a rank has failed, the world stays failed:
// every later wait throws communicator_error, as an MPI job would abort.
//
// run_in_process() owns a world for you. To drive ranks from your own threads instead, give
// each thread comm(r), call abort(r, what) when its work throws and rank_done(r) when it
// returns, so that ranks still waiting in a collective are released.
class in_process_world {
 public:
  explicit in_process_world(int ranks) {
    if (ranks < 1) detail::throw_invalid_argument("in_process_world", "ranks", ranks, "ranks >= 1");
    size_ = ranks;
    slots_.resize(static_cast<std::size_t>(ranks));
  }

  in_process_world(const in_process_world&) = delete;
  in_process_world& operator=(const in_process_world&) = delete;

  int size() const noexcept { return size_; }

  // The handle of rank `rank`; the world must outlive it.
  in_process_comm comm(int rank);

  // Marks the world failed because of rank `rank` and wakes every waiting rank. Only the
  // first call counts, so the reason reported is the original one, not a consequence.
  void abort(int rank, std::string_view what) {
    {
      const std::lock_guard lock(mu_);
      if (failed_rank_ >= 0) return;
      failed_rank_ = rank;
      failure_ = detail::concat("gradcomp::in_process: rank ", rank, " failed: ", what);
    }
    cv_.notify_all();
  }

  // Rank `rank` returned and will join no more collectives: a collective that still waits for
  // it can never complete, so waiting ranks throw instead of hanging.
  void rank_done(int rank) {
    {
      const std::lock_guard lock(mu_);
      if (done_rank_ < 0) done_rank_ = rank;
    }
    cv_.notify_all();
  }

  bool failed() const {
    const std::lock_guard lock(mu_);
    return failed_rank_ >= 0;
  }

  // The rank passed to the first abort(), or -1.
  int failed_rank() const {
    const std::lock_guard lock(mu_);
    return failed_rank_;
  }

  // "gradcomp::in_process: rank R failed: <what>", or empty when nothing failed.
  std::string failure() const {
    const std::lock_guard lock(mu_);
    return failure_;
  }

 private:
  friend class in_process_comm;

  detail::in_process_slot& slot(int rank) { return slots_[static_cast<std::size_t>(rank)]; }
  const detail::in_process_slot& slot(int rank) const {
    return slots_[static_cast<std::size_t>(rank)];
  }

  // Must be called with mu_ held.
  void throw_if_broken(int rank, detail::collective kind) const {
    if (failed_rank_ >= 0) throw communicator_error(failure_);
    if (done_rank_ >= 0) {
      throw communicator_error(
          detail::concat("gradcomp::in_process: rank ", done_rank_, " returned while rank ", rank,
                         " waits in ", detail::collective_name(kind),
                         " (every rank must call the same collectives in the same order)"));
    }
  }

  // Blocks until all ranks have arrived at the first wait of a collective. The generation
  // count tells a completed barrier from the next one, so a fast rank re-entering cannot be
  // mistaken for a late arrival. Throws instead when a rank has failed or returned, since
  // then the barrier can never complete.
  void wait_entry(int rank, detail::collective kind) {
    std::unique_lock lock(mu_);
    throw_if_broken(rank, kind);
    const std::uint64_t generation = generation_;
    if (arrive()) {
      lock.unlock();
      cv_.notify_all();
      return;
    }
    cv_.wait(lock,
             [&] { return generation_ != generation || failed_rank_ >= 0 || done_rank_ >= 0; });
    if (generation_ != generation) return;
    throw_if_broken(rank, kind);
  }

  // The later waits of a collective ignore failures: every rank has passed the entry wait and
  // only copies (catching what it throws) before arriving here, so all will arrive. Leaving
  // early could free a buffer another rank is still reading. Returns whether any rank
  // arrived with `failed` set, the same answer on every rank.
  bool wait_release(bool failed) {
    std::unique_lock lock(mu_);
    pending_failed_ = pending_failed_ || failed;
    const std::uint64_t generation = generation_;
    if (arrive()) {
      const bool any = last_failed_;
      lock.unlock();
      cv_.notify_all();
      return any;
    }
    cv_.wait(lock, [&] { return generation_ != generation; });
    // Only the next completion overwrites it, and that needs this rank to arrive again.
    return last_failed_;
  }

  // Counts this rank in; true when it completes the generation. Must be called with mu_ held.
  bool arrive() {
    if (++arrived_ < size_) return false;
    arrived_ = 0;
    ++generation_;
    last_failed_ = pending_failed_;
    pending_failed_ = false;
    return true;
  }

  int size_ = 0;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::uint64_t generation_ = 0;
  int arrived_ = 0;
  int failed_rank_ = -1;
  int done_rank_ = -1;
  bool pending_failed_ = false;  // of the generation being gathered
  bool last_failed_ = false;     // of the last completed generation
  std::string failure_;
  std::vector<detail::in_process_slot> slots_;
};

}  // namespace gradcomp
