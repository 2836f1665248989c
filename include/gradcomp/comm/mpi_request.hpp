// gradcomp/comm/mpi_request.hpp: what mpi_comm (comm/mpi.hpp) is built on: MPI's error codes as
// exceptions, datatypes and user reductions, the environment (MPI_Init_thread for a scope),
// a collective in flight (mpi_request, with its phases), and the type caches a communicator
// keeps (its rank-order allreduce is comm/mpi_rank_order.hpp). Needs <mpi.h>; link MPI::MPI_CXX.
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
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <gradcomp/detail/comm_common.hpp>  // combine (the one fold rule), share_begin, ...
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
inline constexpr std::uint64_t most_int = INT_MAX;

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

namespace detail {
// post(reqs, phase, comm) starts phase `phase` of a collective on comm by appending requests;
// it returns false when there is no such phase (the collective is complete).
using mpi_poster = std::function<bool(std::vector<MPI_Request>&, int, MPI_Comm)>;
}  // namespace detail

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

  using poster = detail::mpi_poster;

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

namespace detail {

inline const char* mpi_thread_level_name(int level) noexcept {
  switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
  }
  return "an unknown thread level";
}

// The derived datatypes and user reductions of one mpi_comm, created once each and freed with
// it (release(), before MPI_Finalize).
class mpi_type_cache {
 public:
  mpi_type_cache() = default;
  mpi_type_cache(const mpi_type_cache&) = delete;
  mpi_type_cache& operator=(const mpi_type_cache&) = delete;
  mpi_type_cache(mpi_type_cache&& o) noexcept
      : types_(std::exchange(o.types_, {})), ops_(std::exchange(o.ops_, {})) {}
  mpi_type_cache& operator=(mpi_type_cache&&) = delete;
  ~mpi_type_cache() = default;  // release() frees the MPI objects while MPI is up

  void release() noexcept {
    for (auto& t : types_) MPI_Type_free(&t.type);
    for (auto& o : ops_) MPI_Op_free(&o.op);
    types_.clear();
    ops_.clear();
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

 private:
  struct cached_type {
    std::size_t size;
    MPI_Datatype type;
  };
  struct cached_op {
    const void* key;
    MPI_Op op;
  };
  std::vector<cached_type> types_;
  std::vector<cached_op> ops_;
};

}  // namespace detail

}  // namespace gradcomp
