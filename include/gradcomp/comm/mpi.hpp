// gradcomp/comm/mpi.hpp: a communicator over an MPI communicator (Open MPI, MPICH), with the
// semantics of in_process_comm: by default allreduce folds in rank order, so every rank gets
// sums bit-identical to a sequential loop over ranks. Every collective also has a
// non-blocking form returning an mpi_request, so that exchanges can overlap with computation.
// Only this header needs <mpi.h>; link MPI::MPI_CXX.
#pragma once

// gradcomp uses the C API only; the deprecated C++ bindings do not compile warning-free.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <algorithm>
#include <any>
#include <array>
#include <chrono>
#include <climits>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <gradcomp/comm/in_process.hpp>  // detail::combine and detail::share_begin: one fold rule
#include <gradcomp/concepts.hpp>
#include <gradcomp/error.hpp>

namespace gradcomp {

namespace detail {

template <class T>
concept mpi_element = std::is_trivially_copyable_v<T> && std::copyable<T> && !std::same_as<T, bool>;

template <class T>
concept mpi_reducible = mpi_element<T> && requires(const T& a, const T& b) {
  { a + b } -> std::convertible_to<T>;
  { a < b } -> std::convertible_to<bool>;
};

inline std::string mpi_error_text(int rc) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) return concat("MPI error ", rc);
  return std::string(text, static_cast<std::size_t>(len));
}

inline void mpi_check(int rc, const char* call) {
  if (rc != MPI_SUCCESS) {
    throw communicator_error(concat("gradcomp::mpi: ", call, " failed: ", mpi_error_text(rc)));
  }
}

// A send still in flight when what came after it failed: its buffer is about to go, so the
// send must complete first. The peer, which runs the same exchange, receives it; if it has not
// within `patience` (it failed too), waiting longer would hang the job and returning would let
// MPI read freed memory, so the job is aborted with both causes.
inline void finish_send_or_abort(MPI_Request& request, MPI_Comm comm, std::string_view cause,
                                 std::chrono::seconds patience = std::chrono::seconds(60)) {
  if (request == MPI_REQUEST_NULL) return;
  const auto deadline = std::chrono::steady_clock::now() + patience;
  for (;;) {
    int done = 0;
    if (MPI_Test(&request, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || done) return;
    if (std::chrono::steady_clock::now() > deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  int rank = -1;
  MPI_Comm_rank(comm, &rank);
  std::fprintf(stderr,
               "gradcomp: rank %d: a send was still in flight after %lld s when a failure had to "
               "unwind it (%.*s); aborting the job, since MPI would read a freed buffer\n",
               rank, static_cast<long long>(patience.count()), static_cast<int>(cause.size()),
               cause.data());
  MPI_Abort(comm, 1);
}

// Fault injection for tests: a function called at the named points of the MPI communicator
// where a failure must leave nothing behind (a request in flight, a matched message). Empty
// (the default) costs one test of a global.
inline std::function<void(std::string_view)>& fault_hook() {
  static std::function<void(std::string_view)> hook;
  return hook;
}
inline void fault_point(std::string_view where) {
  if (auto& hook = fault_hook()) hook(where);
}

// The predefined datatype of T when MPI has one whose reductions match C++'s operators.
template <class T>
MPI_Datatype mpi_builtin_type() {
  if constexpr (std::same_as<T, float>) return MPI_FLOAT;
  else if constexpr (std::same_as<T, double>) return MPI_DOUBLE;
  else if constexpr (std::same_as<T, std::int8_t>) return MPI_INT8_T;
  else if constexpr (std::same_as<T, std::uint8_t>) return MPI_UINT8_T;
  else if constexpr (std::same_as<T, std::int16_t>) return MPI_INT16_T;
  else if constexpr (std::same_as<T, std::uint16_t>) return MPI_UINT16_T;
  else if constexpr (std::same_as<T, std::int32_t>) return MPI_INT32_T;
  else if constexpr (std::same_as<T, std::uint32_t>) return MPI_UINT32_T;
  else if constexpr (std::same_as<T, std::int64_t>) return MPI_INT64_T;
  else if constexpr (std::same_as<T, std::uint64_t>) return MPI_UINT64_T;
  else static_assert(sizeof(T) == 0, "no predefined MPI datatype");
}

template <class T>
inline constexpr bool mpi_has_builtin =
    std::same_as<T, float> || std::same_as<T, double> || std::same_as<T, std::int8_t> ||
    std::same_as<T, std::uint8_t> || std::same_as<T, std::int16_t> ||
    std::same_as<T, std::uint16_t> || std::same_as<T, std::int32_t> ||
    std::same_as<T, std::uint32_t> || std::same_as<T, std::int64_t> ||
    std::same_as<T, std::uint64_t>;

// MPI user reductions for types without a predefined datatype (gradcomp::half, bfloat16, user
// types): inout = in op inout with the same operators the rank-order fold uses.
template <class T, reduce_op Op>
void mpi_user_reduce(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const T*>(in);
  auto* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    T x, y;
    std::memcpy(&x, a + i, sizeof(T));
    std::memcpy(&y, b + i, sizeof(T));
    if constexpr (Op == reduce_op::sum) {
      y = static_cast<T>(x + y);
    } else if constexpr (Op == reduce_op::max) {
      if (y < x) y = x;
    } else {
      if (x < y) y = x;
    }
    std::memcpy(b + i, &y, sizeof(T));
  }
}

// Counts and displacements in MPI-3 are int.
inline int mpi_int(std::size_t v, const char* what) {
  if (v > static_cast<std::size_t>(INT_MAX)) {
    throw invalid_argument(concat("gradcomp::mpi: ", what, " = ", v,
                                  " elements is out of range; allowed: <= 2^31 - 1 (MPI counts "
                                  "and displacements are int): split the collective"));
  }
  return static_cast<int>(v);
}

}  // namespace detail

// MPI_Init_thread for the lifetime of the object, unless MPI is already initialised (then it
// neither initialises nor finalises). Declare it first in main(), before any mpi_comm.
class mpi_environment {
 public:
  mpi_environment() : mpi_environment(nullptr, nullptr) {}
  mpi_environment(int& argc, char**& argv, int required = MPI_THREAD_FUNNELED)
      : mpi_environment(&argc, &argv, required) {}

  mpi_environment(const mpi_environment&) = delete;
  mpi_environment& operator=(const mpi_environment&) = delete;

  ~mpi_environment() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owns_ && !finalized) MPI_Finalize();
  }

  // The thread support level MPI granted.
  [[nodiscard]] int provided() const noexcept { return provided_; }

 private:
  mpi_environment(int* argc, char*** argv, int required = MPI_THREAD_FUNNELED) {
    int initialized = 0;
    detail::mpi_check(MPI_Initialized(&initialized), "MPI_Initialized");
    if (initialized) {
      detail::mpi_check(MPI_Query_thread(&provided_), "MPI_Query_thread");
      return;
    }
    detail::mpi_check(MPI_Init_thread(argc, argv, required, &provided_), "MPI_Init_thread");
    owns_ = true;
  }

  bool owns_ = false;
  int provided_ = MPI_THREAD_SINGLE;
};

// A collective in flight. It may have several phases (sizes first, then data; or reduce, then
// gather), which test() and wait() start one after the other. The buffers passed to the
// collective must stay alive and untouched until done() is true; a vector passed to receive
// is resized when its phase starts. Destroying a pending request waits for it, since MPI may
// still write into the buffers; a failure at that point is lost, so wait() explicitly where
// errors matter. The mpi_comm must outlive its requests.
class mpi_request {
 public:
  mpi_request() = default;
  mpi_request(mpi_request&&) noexcept = default;
  mpi_request& operator=(mpi_request&& o) noexcept {
    if (this != &o) {
      finish_quietly();
      st_ = std::move(o.st_);
    }
    return *this;
  }
  mpi_request(const mpi_request&) = delete;
  mpi_request& operator=(const mpi_request&) = delete;
  ~mpi_request() { finish_quietly(); }

  [[nodiscard]] bool done() const noexcept { return !st_ || st_->finished; }

  // Blocks until every phase has completed.
  void wait() {
    if (st_) wait(*st_);
  }

  // Progresses the collective without blocking; true once it has completed. Open MPI moves a
  // non-blocking collective forward only inside MPI calls, so call this now and then while
  // computing.
  bool test() {
    while (!done()) {
      auto& reqs = st_->reqs;
      int flag = 0;
      const int rc =
          MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &flag, MPI_STATUSES_IGNORE);
      if (rc != MPI_SUCCESS) {
        st_->finished = true;
        detail::mpi_check(rc, "MPI_Testall");
      }
      if (!flag) return false;
      reqs.clear();
      advance(*st_);
    }
    return true;
  }

 private:
  friend class mpi_comm;

  // post(reqs, phase, comm) starts phase `phase` on comm by appending requests; it returns
  // false when there is no such phase (the collective is complete).
  using poster = std::function<bool(std::vector<MPI_Request>&, int, MPI_Comm)>;

  struct state {
    MPI_Comm comm = MPI_COMM_NULL;
    std::vector<MPI_Request> reqs;
    poster post;
    int phase = -1;
    bool finished = false;
  };

  explicit mpi_request(std::shared_ptr<state> st) : st_(std::move(st)) { advance(*st_); }

  static void wait(state& st) {
    while (!st.finished) {
      const int rc =
          MPI_Waitall(static_cast<int>(st.reqs.size()), st.reqs.data(), MPI_STATUSES_IGNORE);
      st.reqs.clear();
      if (rc != MPI_SUCCESS) {
        st.finished = true;
        detail::mpi_check(rc, "MPI_Waitall");
      }
      advance(st);
    }
  }

  // Starts phases until one has something in flight or none is left. A phase that throws
  // (bad sizes found once counts are known, out of memory) ends the request.
  static void advance(state& st) {
    while (!st.finished && st.reqs.empty()) {
      ++st.phase;
      bool more = false;
      try {
        more = st.post(st.reqs, st.phase, st.comm);
      } catch (...) {
        if (!st.reqs.empty()) {  // MPI must stop touching the buffers before we leave
          MPI_Waitall(static_cast<int>(st.reqs.size()), st.reqs.data(), MPI_STATUSES_IGNORE);
          st.reqs.clear();
        }
        st.finished = true;
        throw;
      }
      if (!more) st.finished = true;
    }
  }

  static void finish_quietly(state& st) noexcept {
    if (st.finished) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    try {
      wait(st);
    } catch (...) {  // destructor: nothing sensible to do with it
    }
  }

  void finish_quietly() noexcept {
    if (st_) finish_quietly(*st_);
  }

  std::shared_ptr<state> st_;
};

// How allreduce combines the ranks' values.
enum class mpi_reduction {
  // Every rank folds its 1/P share of the elements in rank order, ((x0 + x1) + x2) + ...,
  // (an alltoallv of the shares), then the shares are allgathered: bit-identical to
  // in_process_comm and to a sequential loop over ranks, for any type with operator+ and
  // operator<. Bandwidth-optimal, like a ring; 2 (P-1) messages per rank.
  rank_order,
  // MPI_Allreduce with MPI's own algorithm (predefined datatypes and ops where they exist,
  // commutative user ops otherwise). Identical on every rank in practice, but the order of the
  // additions is MPI's, so sums may differ in the last bits from a rank-order loop; max and min
  // follow MPI_MAX / MPI_MIN, whose NaN handling is MPI's.
  native,
};

struct mpi_options {
  mpi_reduction reduction = mpi_reduction::rank_order;
  // Elements per round of the rank-order allreduce; bounds its scratch memory (P shares of this
  // many elements / P; the mpi_comm keeps up to four such buffers per element type between
  // calls, one per request in flight, freed with it) and keeps every MPI count within int.
  std::size_t chunk_elements = std::size_t{1} << 24;
};

// A rank of an MPI communicator. The constructor duplicates the communicator (so gradcomp's
// messages never match the application's) and sets MPI_ERRORS_RETURN on the duplicate, so that
// MPI failures become gradcomp::communicator_error exceptions. The mpi_comm must be destroyed
// before MPI_Finalize, and must outlive its requests.
//
// Like in_process_comm, every collective must be called by all ranks in the same order, with
// counts that agree where the collective needs them to (allreduce, broadcast). MPI itself
// cannot tell when they do not (it may hang or report a truncation), so gradcomp's exchanges
// first agree on a small header (exchange/agreement.hpp). A bad argument (a root out of range,
// send_counts that do not add up) throws invalid_argument on the rank that passed it; the other
// ranks then wait for it until the process exits (mpirun then ends the job).
class mpi_comm {
 public:
  explicit mpi_comm(MPI_Comm comm = MPI_COMM_WORLD, mpi_options options = {}) : options_(options) {
    int initialized = 0;
    detail::mpi_check(MPI_Initialized(&initialized), "MPI_Initialized");
    if (!initialized) {
      throw error(
          "gradcomp::mpi_comm: MPI is not initialised; create a gradcomp::mpi_environment (or "
          "call MPI_Init) before the first mpi_comm");
    }
    if (options_.chunk_elements == 0) {
      detail::throw_invalid_argument("mpi_comm", "options.chunk_elements", 0, ">= 1");
    }
    detail::mpi_check(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    // The non-blocking collectives' communicators, duplicated now: MPI_Comm_dup is itself a
    // blocking collective, and inside start() it would block a rank that posts a non-blocking
    // collective until every rank got there, so that a rank which then waits on a peer for
    // something else could deadlock. (Every rank constructs its mpi_comm collectively anyway.)
    for (auto& slot : slots_) {
      const int rc = MPI_Comm_dup(comm_, &slot);
      if (rc != MPI_SUCCESS) {
        for (auto& made : slots_) {
          if (made != MPI_COMM_NULL) MPI_Comm_free(&made);
        }
        MPI_Comm_free(&comm_);
        detail::mpi_check(rc, "MPI_Comm_dup");
      }
      MPI_Comm_set_errhandler(slot, MPI_ERRORS_RETURN);
    }
  }

  mpi_comm(const mpi_comm&) = delete;
  mpi_comm& operator=(const mpi_comm&) = delete;
  mpi_comm(mpi_comm&& o) noexcept
      : comm_(std::exchange(o.comm_, MPI_COMM_NULL)), rank_(o.rank_), size_(o.size_),
        options_(o.options_), slots_(o.slots_), slot_owner_(std::move(o.slot_owner_)),
        next_slot_(o.next_slot_), types_(std::move(o.types_)), ops_(std::move(o.ops_)),
        scratch_(o.scratch_) {
    o.slots_.fill(MPI_COMM_NULL);
    o.slot_owner_ = {};
    o.types_.clear();
    o.ops_.clear();
  }
  mpi_comm& operator=(mpi_comm&&) = delete;

  ~mpi_comm() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    for (auto& owner : slot_owner_) {
      if (owner) mpi_request::finish_quietly(*owner);
    }
    for (auto& c : slots_) {
      if (c != MPI_COMM_NULL) MPI_Comm_free(&c);
    }
    for (auto& t : types_) MPI_Type_free(&t.type);
    for (auto& o : ops_) MPI_Op_free(&o.op);
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  // The duplicated communicator (for the application's own MPI calls beside gradcomp's).
  [[nodiscard]] MPI_Comm native() const noexcept { return comm_; }
  [[nodiscard]] const mpi_options& options() const noexcept { return options_; }

  // For a driver that calls this communicator from a thread of its own (layerwise_sgd's
  // communication thread): MPI must have been initialised with MPI_THREAD_SERIALIZED or more.
  void require_thread_support(std::string_view who) const {
    int provided = MPI_THREAD_SINGLE;
    detail::mpi_check(MPI_Query_thread(&provided), "MPI_Query_thread");
    if (provided < MPI_THREAD_SERIALIZED) {
      throw communicator_error(detail::concat(
          "gradcomp::", who, " calls MPI from a communication thread of its own, which needs "
          "MPI_THREAD_SERIALIZED, but MPI was initialised with ", thread_level_name(provided),
          "; initialise it with gradcomp::mpi_environment env(argc, argv, "
          "MPI_THREAD_SERIALIZED)"));
    }
  }

  // ---- blocking collectives: the non-blocking ones, waited for --------------------------

  template <detail::mpi_reducible T>
  void allreduce(std::span<T> data, reduce_op op = reduce_op::sum) {
    iallreduce(data, op).wait();
  }

  template <detail::mpi_element T>
  void allgatherv(std::span<const std::type_identity_t<T>> send, std::vector<T>& recv,
                  std::vector<std::size_t>& recv_counts) {
    iallgatherv<T>(send, recv, recv_counts).wait();
  }

  template <detail::mpi_element T>
  void allgather(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    iallgather<T>(send, recv).wait();
  }

  template <detail::mpi_element T>
  void alltoallv(std::span<const std::type_identity_t<T>> send,
                 std::span<const std::size_t> send_counts, std::vector<T>& recv,
                 std::vector<std::size_t>& recv_counts) {
    ialltoallv<T>(send, send_counts, recv, recv_counts).wait();
  }

  template <detail::mpi_element T>
  void broadcast(std::span<T> data, int root) {
    ibroadcast(data, root).wait();
  }

  void barrier() { ibarrier().wait(); }

  // ---- non-blocking collectives ------------------------------------------------------------

  // Element-wise reduction in place. With mpi_reduction::rank_order (the default) the result
  // is the rank-order fold, bit for bit; see mpi_reduction for native.
  template <detail::mpi_reducible T>
  [[nodiscard]] mpi_request iallreduce(std::span<T> data, reduce_op op = reduce_op::sum) {
    if (size_ == 1 || data.empty()) return {};
    if (options_.reduction == mpi_reduction::native) return native_allreduce(data, op);
    return rank_order_allreduce(data, op);
  }

  // recv is resized to the total and receives rank 0's elements, then rank 1's, ...;
  // recv_counts[r] is rank r's count in elements. Counts may differ and be zero.
  template <detail::mpi_element T>
  [[nodiscard]] mpi_request iallgatherv(std::span<const std::type_identity_t<T>> send,
                                        std::vector<T>& recv, std::vector<std::size_t>& recv_counts) {
    struct data {
      std::vector<T> own;  // send, when it lives in recv
      std::uint64_t mine = 0;
      std::vector<std::uint64_t> counts;
      std::vector<int> icounts, idispls;
    };
    auto d = std::make_shared<data>();
    if (overlaps(send, recv)) {
      d->own.assign(send.begin(), send.end());
      send = d->own;
    }
    d->mine = send.size();
    d->counts.resize(static_cast<std::size_t>(size_));
    const MPI_Datatype type = bytes_type(sizeof(T));
    return start([d, send, &recv, &recv_counts, type](std::vector<MPI_Request>& reqs,
                                                                  int phase, MPI_Comm c) {
      if (phase == 0) {
        reqs.emplace_back();
        detail::mpi_check(MPI_Iallgather(&d->mine, 1, MPI_UINT64_T, d->counts.data(), 1,
                                         MPI_UINT64_T, c, &reqs.back()),
                          "MPI_Iallgather (counts)");
        return true;
      }
      if (phase == 1) {
        // Every rank sees the same counts, so a size error is thrown on every rank alike.
        std::size_t total = 0;
        d->icounts.resize(d->counts.size());
        d->idispls.resize(d->counts.size());
        for (std::size_t r = 0; r < d->counts.size(); ++r) {
          d->idispls[r] = detail::mpi_int(total, "allgatherv displacement");
          d->icounts[r] = detail::mpi_int(static_cast<std::size_t>(d->counts[r]), "allgatherv count");
          total += static_cast<std::size_t>(d->counts[r]);
        }
        (void)detail::mpi_int(total, "allgatherv total");
        recv.resize(total);
        recv_counts.assign(d->counts.begin(), d->counts.end());
        reqs.emplace_back();
        detail::mpi_check(MPI_Iallgatherv(send.data(), static_cast<int>(send.size()), type,
                                          recv.data(), d->icounts.data(), d->idispls.data(), type,
                                          c, &reqs.back()),
                          "MPI_Iallgatherv");
        return true;
      }
      return false;
    });
  }

  // The same count on every rank into a caller-sized buffer: recv.size() == size() * send.size().
  template <detail::mpi_element T>
  [[nodiscard]] mpi_request iallgather(std::span<const std::type_identity_t<T>> send,
                                       std::span<T> recv) {
    const auto p = static_cast<std::size_t>(size_);
    if (recv.size() != p * send.size()) {
      detail::throw_invalid_argument(
          "mpi_comm::allgather", "recv.size()", recv.size(),
          detail::concat("size() * send.size() = ", p, " * ", send.size()));
    }
    const int count = detail::mpi_int(send.size(), "allgather count");
    (void)detail::mpi_int(recv.size(), "allgather total");
    const MPI_Datatype type = bytes_type(sizeof(T));
    auto own = std::make_shared<std::vector<T>>();
    if (bytes_overlap(send.data(), send.size_bytes(), recv.data(), recv.size_bytes())) {
      own->assign(send.begin(), send.end());
      send = *own;
    }
    return start([own, send, recv, count, type](std::vector<MPI_Request>& reqs,
                                                            int phase, MPI_Comm c) {
      if (phase > 0) return false;
      reqs.emplace_back();
      detail::mpi_check(MPI_Iallgather(send.data(), count, type, recv.data(), count, type, c,
                                       &reqs.back()),
                        "MPI_Iallgather");
      return true;
    });
  }

  // send holds the blocks for rank 0, 1, ... back to back (send_counts[s] elements for rank s,
  // summing to send.size()); recv is resized and receives the blocks addressed to this rank in
  // source rank order, recv_counts[s] from rank s.
  template <detail::mpi_element T>
  [[nodiscard]] mpi_request ialltoallv(std::span<const std::type_identity_t<T>> send,
                                       std::span<const std::size_t> send_counts,
                                       std::vector<T>& recv, std::vector<std::size_t>& recv_counts) {
    const auto p = static_cast<std::size_t>(size_);
    if (send_counts.size() != p) {
      detail::throw_invalid_argument("mpi_comm::alltoallv", "send_counts.size()",
                                     send_counts.size(), detail::concat("size() = ", p));
    }
    struct data {
      std::vector<T> own;
      std::vector<std::uint64_t> sc, rc;
      std::vector<int> isc, isd, irc, ird;
    };
    auto d = std::make_shared<data>();
    d->sc.resize(p);
    d->rc.resize(p);
    d->isc.resize(p);
    d->isd.resize(p);
    detail::check_send_counts("mpi_comm::alltoallv", send_counts, send.size());
    for (std::size_t s = 0, at = 0; s < p; at += send_counts[s], ++s) {
      d->sc[s] = send_counts[s];
      d->isd[s] = detail::mpi_int(at, "alltoallv send displacement");
      d->isc[s] = detail::mpi_int(send_counts[s], "alltoallv send count");
    }
    if (overlaps(send, recv)) {
      d->own.assign(send.begin(), send.end());
      send = d->own;
    }
    const MPI_Datatype type = bytes_type(sizeof(T));
    return start([d, send, &recv, &recv_counts, type, p](std::vector<MPI_Request>& reqs,
                                                                     int phase, MPI_Comm c) {
      if (phase == 0) {
        reqs.emplace_back();
        detail::mpi_check(MPI_Ialltoall(d->sc.data(), 1, MPI_UINT64_T, d->rc.data(), 1,
                                        MPI_UINT64_T, c, &reqs.back()),
                          "MPI_Ialltoall (counts)");
        return true;
      }
      if (phase == 1) {
        d->irc.resize(p);
        d->ird.resize(p);
        std::size_t at = 0;
        for (std::size_t s = 0; s < p; ++s) {
          d->ird[s] = detail::mpi_int(at, "alltoallv receive displacement");
          d->irc[s] = detail::mpi_int(static_cast<std::size_t>(d->rc[s]), "alltoallv receive count");
          at += static_cast<std::size_t>(d->rc[s]);
        }
        recv.resize(at);
        recv_counts.assign(d->rc.begin(), d->rc.end());
        reqs.emplace_back();
        detail::mpi_check(MPI_Ialltoallv(send.data(), d->isc.data(), d->isd.data(), type,
                                         recv.data(), d->irc.data(), d->ird.data(), type, c,
                                         &reqs.back()),
                          "MPI_Ialltoallv");
        return true;
      }
      return false;
    });
  }

  // Copies root's data into every other rank's data; counts must agree.
  template <detail::mpi_element T>
  [[nodiscard]] mpi_request ibroadcast(std::span<T> data, int root) {
    if (root < 0 || root >= size_) {
      detail::throw_invalid_argument("mpi_comm::broadcast", "root", root,
                                     detail::concat("0 <= root < size() = ", size_));
    }
    const MPI_Datatype type = bytes_type(sizeof(T));
    return start([data, root, type](std::vector<MPI_Request>& reqs, int phase, MPI_Comm c) {
      if (phase > 0) return false;
      for (std::size_t at = 0; at < data.size(); at += INT_MAX) {
        const auto len = static_cast<int>(std::min<std::size_t>(INT_MAX, data.size() - at));
        reqs.emplace_back();
        detail::mpi_check(MPI_Ibcast(data.data() + at, len, type, root, c, &reqs.back()),
                          "MPI_Ibcast");
      }
      return !reqs.empty();
    });
  }

  [[nodiscard]] mpi_request ibarrier() {
    return start([](std::vector<MPI_Request>& reqs, int phase, MPI_Comm c) {
      if (phase > 0) return false;
      reqs.emplace_back();
      detail::mpi_check(MPI_Ibarrier(c, &reqs.back()), "MPI_Ibarrier");
      return true;
    });
  }

  // ---- point to point ----------------------------------------------------------------------

  // Sends `send` to rank dest and receives into recv (resized) from rank source, at once; -1
  // for either side means none. One message each way: the receiver learns the size by probing.
  // Pairwise algorithms (gtopk's merge tree, the ping-pong that measures the link) use it when
  // a communicator offers it.
  template <detail::mpi_element T>
  void sendrecv(std::span<const std::type_identity_t<T>> send, int dest, std::vector<T>& recv,
                int source) {
    check_peer("dest", dest);
    check_peer("source", source);
    const MPI_Datatype type = bytes_type(sizeof(T));
    std::vector<T> own;
    if (overlaps(send, recv)) {
      own.assign(send.begin(), send.end());
      send = own;
    }
    MPI_Request out = MPI_REQUEST_NULL;
    if (dest >= 0) {
      detail::mpi_check(MPI_Isend(send.data(), detail::mpi_int(send.size(), "sendrecv count"),
                                  type, dest, tag_p2p, comm_, &out),
                        "MPI_Isend");
    }
    try {
      detail::fault_point("mpi_comm::sendrecv: send posted");
      if (source >= 0) {
        // Probe, size, then receive: a failure before the receive (out of memory for recv)
        // leaves the message where it is, whole, for a later receive. (Receiving it into a
        // buffer that is too short is no way out: Open MPI 4.1's shared-memory transport writes
        // past such a buffer.) One thread at a time uses an mpi_comm, so nothing else can take
        // the probed message first.
        MPI_Status status;
        int count = 0;
        detail::mpi_check(MPI_Probe(source, tag_p2p, comm_, &status), "MPI_Probe");
        detail::mpi_check(MPI_Get_count(&status, type, &count), "MPI_Get_count");
        detail::fault_point("mpi_comm::sendrecv: size known");
        recv.resize(static_cast<std::size_t>(count));
        detail::mpi_check(MPI_Recv(recv.data(), count, type, source, tag_p2p, comm_, MPI_STATUS_IGNORE),
                          "MPI_Recv");
      } else {
        recv.clear();
      }
    } catch (...) {
      // MPI may still read `send` (or `own`, destroyed as this unwinds): finish the send first.
      detail::finish_send_or_abort(out, comm_, detail::describe(std::current_exception()));
      throw;
    }
    detail::mpi_check(MPI_Wait(&out, MPI_STATUS_IGNORE), "MPI_Wait (send)");
  }

 private:
  static constexpr int tag_p2p = 7301;

  static const char* thread_level_name(int level) noexcept {
    switch (level) {
      case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
      case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
      case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
      case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
    }
    return "an unknown thread level";
  }

  struct cached_type {
    std::size_t size;
    MPI_Datatype type;
  };
  struct cached_op {
    const void* key;
    MPI_Op op;
  };

  void check_peer(const char* what, int peer) const {
    if (peer < -1 || peer >= size_) {
      detail::throw_invalid_argument("mpi_comm::sendrecv", what, peer,
                                     detail::concat("-1 (none) or 0 <= rank < size() = ", size_));
    }
  }

  static bool bytes_overlap(const void* a, std::size_t na, const void* b, std::size_t nb) {
    return detail::bytes_overlap(a, na, b, nb);
  }
  template <class T, class U>
  static bool overlaps(std::span<const T> send, const std::vector<U>& v) {
    return detail::bytes_overlap(send.data(), send.size_bytes(), v.data(), v.capacity() * sizeof(U));
  }

  // A datatype of `size` contiguous bytes, so that counts are in elements (2^31 elements, not
  // 2^31 bytes, before int runs out). Created once per size and communicator.
  MPI_Datatype bytes_type(std::size_t size) {
    if (size == 1) return MPI_BYTE;
    for (const auto& t : types_) {
      if (t.size == size) return t.type;
    }
    MPI_Datatype t;
    detail::mpi_check(MPI_Type_contiguous(static_cast<int>(size), MPI_BYTE, &t), "MPI_Type_contiguous");
    detail::mpi_check(MPI_Type_commit(&t), "MPI_Type_commit");
    types_.push_back({size, t});
    return t;
  }

  template <class T, reduce_op Op>
  MPI_Op user_op() {
    static constexpr char key = 0;
    for (const auto& o : ops_) {
      if (o.key == &key) return o.op;
    }
    MPI_Op op;
    detail::mpi_check(MPI_Op_create(&detail::mpi_user_reduce<T, Op>, /*commute=*/1, &op),
                      "MPI_Op_create");
    ops_.push_back({&key, op});
    return op;
  }

  template <class T>
  mpi_request native_allreduce(std::span<T> data, reduce_op op) {
    MPI_Datatype type;
    MPI_Op mop;
    if constexpr (detail::mpi_has_builtin<T>) {
      type = detail::mpi_builtin_type<T>();
      mop = op == reduce_op::sum ? MPI_SUM : op == reduce_op::max ? MPI_MAX : MPI_MIN;
    } else {
      type = bytes_type(sizeof(T));
      mop = op == reduce_op::sum   ? user_op<T, reduce_op::sum>()
            : op == reduce_op::max ? user_op<T, reduce_op::max>()
                                   : user_op<T, reduce_op::min>();
    }
    return start([data, type, mop](std::vector<MPI_Request>& reqs, int phase, MPI_Comm c) {
      if (phase > 0) return false;
      for (std::size_t at = 0; at < data.size(); at += INT_MAX) {
        const auto len = static_cast<int>(std::min<std::size_t>(INT_MAX, data.size() - at));
        reqs.emplace_back();
        detail::mpi_check(MPI_Iallreduce(MPI_IN_PLACE, data.data() + at, len, type, mop, c,
                                         &reqs.back()),
                          "MPI_Iallreduce");
      }
      return true;
    });
  }

  // Scratch buffers of the rank-order allreduce, kept between calls: a fresh one per call (P
  // shares of a chunk, up to chunk_elements values: 64 MB of floats) is mapped anew each time
  // and costs a page fault per page, more than the fold itself. A request takes the largest
  // free buffer of its element type at its first chunk and gives it back when its last chunk is
  // gathered (or when its state is destroyed), so the pool holds, per element type, one buffer
  // per request in flight at once (at most four: start() keeps four slots), each as large as
  // the largest chunk it served. They are freed with the mpi_comm.
  struct scratch_pool {
    std::mutex mutex;
    std::vector<std::any> free;  // each a std::vector<T>
  };
  template <class T>
  struct scratch_lease {
    std::shared_ptr<scratch_pool> pool;
    std::vector<T> buf;
    bool held = false;
    scratch_lease() = default;
    scratch_lease(const scratch_lease&) = delete;
    scratch_lease& operator=(const scratch_lease&) = delete;
    ~scratch_lease() { give_back(); }
    // At least `n` elements at data(): a buffer from the pool on first use, grown (never
    // shrunk, so no pass re-fills what it already holds) when too small.
    void reserve(std::size_t n) {
      if (!held && pool) {
        const std::lock_guard lock(pool->mutex);
        auto& f = pool->free;
        auto best = f.end();
        std::size_t best_size = 0;
        for (auto it = f.begin(); it != f.end(); ++it) {
          const auto* v = std::any_cast<std::vector<T>>(&*it);
          if (v && (best == f.end() || v->size() > best_size)) {
            best = it;
            best_size = v->size();
          }
        }
        if (best != f.end()) {
          buf = std::move(*std::any_cast<std::vector<T>>(&*best));
          f.erase(best);
        }
      }
      held = true;
      if (buf.size() < n) {
        buf.clear();  // nothing to keep: skip the copy of the old contents
        buf.resize(n);
      }
    }
    T* data() noexcept { return buf.data(); }
    void give_back() noexcept {
      if (!held || !pool) return;
      held = false;
      try {
        const std::lock_guard lock(pool->mutex);
        pool->free.emplace_back(std::move(buf));
      } catch (...) {
        // No memory for the pool's entry: the buffer is freed instead, as it was before.
      }
      buf = {};
    }
  };

  // Per chunk of the buffer: an alltoallv hands every rank its share of every rank's chunk,
  // the rank folds them in rank order, and an in-place allgatherv spreads the folded shares.
  template <class T>
  mpi_request rank_order_allreduce(std::span<T> data, reduce_op op) {
    struct state_data {
      scratch_lease<T> shares;  // P blocks of this rank's share of the current chunk
      std::vector<int> sc, sd, rc, rd, gc, gd;
      std::size_t chunk_at = 0, chunk_len = 0;
    };
    const auto p = static_cast<std::size_t>(size_);
    const auto r = static_cast<std::size_t>(rank_);
    const std::size_t chunk = std::min(options_.chunk_elements, static_cast<std::size_t>(INT_MAX));
    auto d = std::make_shared<state_data>();
    d->shares.pool = scratch_;
    for (auto* v : {&d->sc, &d->sd, &d->rc, &d->rd, &d->gc, &d->gd}) v->resize(p);
    const MPI_Datatype type = bytes_type(sizeof(T));
    return start([d, data, op, p, r, chunk, type](std::vector<MPI_Request>& reqs,
                                                              int phase, MPI_Comm c) {
      // Even phases scatter chunk phase/2, odd phases gather it.
      const std::size_t round = static_cast<std::size_t>(phase) / 2;
      if (phase % 2 == 0) {
        if (round * chunk >= data.size()) {
          d->shares.give_back();  // the last chunk is folded and gathered
          return false;
        }
        d->chunk_at = round * chunk;
        d->chunk_len = std::min(chunk, data.size() - d->chunk_at);
        const std::size_t n = d->chunk_len;
        const std::size_t mine = detail::share_begin(n, p, r + 1) - detail::share_begin(n, p, r);
        d->shares.reserve(p * mine);
        for (std::size_t s = 0; s < p; ++s) {
          d->sd[s] = static_cast<int>(detail::share_begin(n, p, s));
          d->sc[s] = static_cast<int>(detail::share_begin(n, p, s + 1)) - d->sd[s];
          d->rc[s] = static_cast<int>(mine);
          d->rd[s] = static_cast<int>(s * mine);
        }
        reqs.emplace_back();
        detail::mpi_check(MPI_Ialltoallv(data.data() + d->chunk_at, d->sc.data(), d->sd.data(),
                                         type, d->shares.data(), d->rc.data(), d->rd.data(), type,
                                         c, &reqs.back()),
                          "MPI_Ialltoallv (allreduce shares)");
        return true;
      }
      const std::size_t n = d->chunk_len;
      const std::size_t begin = detail::share_begin(n, p, r);
      const std::size_t mine = detail::share_begin(n, p, r + 1) - begin;
      T* acc = d->shares.data();  // block of rank 0
      for (std::size_t s = 1; s < p; ++s) detail::combine(acc, acc + s * mine, mine, op);
      std::copy_n(acc, mine, data.data() + d->chunk_at + begin);
      reqs.emplace_back();
      detail::mpi_check(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL,
                                        data.data() + d->chunk_at, d->sc.data(), d->sd.data(),
                                        type, c, &reqs.back()),
                        "MPI_Iallgatherv (allreduce shares)");
      return true;
    });
  }

  // Non-blocking collectives are matched by the order in which ranks start them, but a
  // request starts its later phases whenever test() or wait() finds the earlier one done, which
  // differs between ranks. So each request runs on a communicator of its own for its whole
  // life: request i (counted in program order, the same on every rank) takes slot i % slot_count,
  // after finishing whatever request held that slot before.
  mpi_request start(mpi_request::poster post) {
    const std::size_t s = next_slot_++ % slot_count;
    if (slot_owner_[s]) {
      mpi_request::wait(*slot_owner_[s]);
      slot_owner_[s].reset();
    }
    detail::check_invariant(slots_[s] != MPI_COMM_NULL,
                            "mpi_comm: a request slot has no communicator (moved-from mpi_comm?)");
    auto st = std::make_shared<mpi_request::state>();
    st->comm = slots_[s];
    st->post = std::move(post);
    slot_owner_[s] = st;
    return mpi_request(std::move(st));
  }

  static constexpr std::size_t slot_count = 4;

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  mpi_options options_;
  std::array<MPI_Comm, slot_count> slots_ = {MPI_COMM_NULL, MPI_COMM_NULL, MPI_COMM_NULL, MPI_COMM_NULL};
  std::array<std::shared_ptr<mpi_request::state>, slot_count> slot_owner_{};
  std::size_t next_slot_ = 0;
  std::vector<cached_type> types_;
  std::vector<cached_op> ops_;
  std::shared_ptr<scratch_pool> scratch_ = std::make_shared<scratch_pool>();
};

static_assert(communicator<mpi_comm>);

}  // namespace gradcomp
