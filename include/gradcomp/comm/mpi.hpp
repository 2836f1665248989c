// gradcomp/comm/mpi.hpp: a communicator over an MPI communicator (Open MPI, MPICH), with the
// semantics of in_process_comm: by default allreduce folds in rank order, so every rank gets
// sums bit-identical to a sequential loop over ranks. Every collective also has a
// non-blocking form returning an mpi_request, so that exchanges can overlap with computation.
// Only this header needs <mpi.h>; link MPI::MPI_CXX.
// The layer below (errors, datatypes, the environment, requests) is comm/mpi_request.hpp.
#pragma once

#include <algorithm>
#include <array>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <gradcomp/comm/mpi_rank_order.hpp>
#include <gradcomp/comm/mpi_request.hpp>
#include <gradcomp/concepts.hpp>
#include <gradcomp/detail/comm_common.hpp>  // combine (the one fold rule), share_begin, ...
#include <gradcomp/error.hpp>

namespace gradcomp {

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
        next_slot_(o.next_slot_), types_(std::move(o.types_)), scratch_(o.scratch_) {
    o.slots_.fill(MPI_COMM_NULL);
    o.slot_owner_ = {};
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
    types_.release();
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
          "MPI_THREAD_SERIALIZED, but MPI was initialised with ", detail::mpi_thread_level_name(provided),
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
                  std::vector<std::size_t>& recv_counts, receive_limit limit = {}) {
    iallgatherv<T>(send, recv, recv_counts, limit).wait();
  }

  template <detail::mpi_element T>
  void allgather(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    iallgather<T>(send, recv).wait();
  }

  template <detail::mpi_element T>
  void alltoallv(std::span<const std::type_identity_t<T>> send,
                 std::span<const std::size_t> send_counts, std::vector<T>& recv,
                 std::vector<std::size_t>& recv_counts, receive_limit limit = {}) {
    ialltoallv<T>(send, send_counts, recv, recv_counts, limit).wait();
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
  // recv_counts[r] is rank r's count in elements. Counts may differ and be zero. A count beyond
  // `limit` (see bounds_receives) makes every rank throw communicator_error before recv is
  // touched: every rank sees the same counts.
  template <detail::mpi_element T>
  [[nodiscard]] mpi_request iallgatherv(std::span<const std::type_identity_t<T>> send,
                                        std::vector<T>& recv, std::vector<std::size_t>& recv_counts,
                                        receive_limit limit = {}) {
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
    return start([d, send, &recv, &recv_counts, type, limit](std::vector<MPI_Request>& reqs,
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
        detail::check_announced("mpi_comm::allgatherv", d->counts, 1, limit, detail::most_int);
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
    if (detail::bytes_overlap(send.data(), send.size_bytes(), recv.data(), recv.size_bytes())) {
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
  // source rank order, recv_counts[s] from rank s. Every rank gathers every rank's row of
  // counts, so a count beyond `limit` (see bounds_receives) makes every rank throw the same
  // communicator_error before anything is allocated or received.
  template <detail::mpi_element T>
  [[nodiscard]] mpi_request ialltoallv(std::span<const std::type_identity_t<T>> send,
                                       std::span<const std::size_t> send_counts,
                                       std::vector<T>& recv, std::vector<std::size_t>& recv_counts,
                                       receive_limit limit = {}) {
    const auto p = static_cast<std::size_t>(size_);
    if (send_counts.size() != p) {
      detail::throw_invalid_argument("mpi_comm::alltoallv", "send_counts.size()",
                                     send_counts.size(), detail::concat("size() = ", p));
    }
    struct data {
      std::vector<T> own;
      std::vector<std::uint64_t> sc, matrix;
      std::vector<int> isc, isd, irc, ird;
    };
    auto d = std::make_shared<data>();
    d->sc.resize(p);
    d->matrix.resize(p * p);
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
    const auto me = static_cast<std::size_t>(rank_);
    return start([d, send, &recv, &recv_counts, type, p, me, limit](
                     std::vector<MPI_Request>& reqs, int phase, MPI_Comm c) {
      if (phase == 0) {
        // Row s of the matrix: what rank s sends to each rank.
        reqs.emplace_back();
        detail::mpi_check(MPI_Iallgather(d->sc.data(), static_cast<int>(p), MPI_UINT64_T,
                                         d->matrix.data(), static_cast<int>(p), MPI_UINT64_T, c,
                                         &reqs.back()),
                          "MPI_Iallgather (counts)");
        return true;
      }
      if (phase == 1) {
        detail::check_announced("mpi_comm::alltoallv", d->matrix, p, limit, detail::most_int);
        d->irc.resize(p);
        d->ird.resize(p);
        recv_counts.resize(p);
        std::size_t at = 0;
        for (std::size_t s = 0; s < p; ++s) {
          const auto in = static_cast<std::size_t>(d->matrix[s * p + me]);
          d->ird[s] = detail::mpi_int(at, "alltoallv receive displacement");
          d->irc[s] = detail::mpi_int(in, "alltoallv receive count");
          recv_counts[s] = in;
          at += in;
        }
        recv.resize(at);
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


  void check_peer(const char* what, int peer) const {
    if (peer < -1 || peer >= size_) {
      detail::throw_invalid_argument("mpi_comm::sendrecv", what, peer,
                                     detail::concat("-1 (none) or 0 <= rank < size() = ", size_));
    }
  }

  template <class T, class U>
  static bool overlaps(std::span<const T> send, const std::vector<U>& v) {
    return detail::bytes_overlap(send.data(), send.size_bytes(), v.data(), v.capacity() * sizeof(U));
  }

  MPI_Datatype bytes_type(std::size_t size) { return types_.bytes_type(size); }
  template <class T, reduce_op Op>
  MPI_Op user_op() {
    return types_.template user_op<T, Op>();
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

  // Per chunk: an alltoallv of shares, a fold in rank order, an allgatherv (comm/mpi_rank_order.hpp).
  template <class T>
  mpi_request rank_order_allreduce(std::span<T> data, reduce_op op) {
    return start(detail::mpi_rank_order_allreduce(
        data, op, size_, rank_, std::min(options_.chunk_elements, static_cast<std::size_t>(INT_MAX)),
        bytes_type(sizeof(T)), scratch_));
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
  detail::mpi_type_cache types_;
  std::shared_ptr<detail::mpi_scratch_pool> scratch_ = std::make_shared<detail::mpi_scratch_pool>();
};

static_assert(communicator<mpi_comm>);
static_assert(bounds_receives<mpi_comm, std::byte>);

}  // namespace gradcomp
