// gradcomp/comm/nccl.hpp: a communicator over an NCCL communicator and a CUDA stream. Its
// device API works on device memory (device_span, device_buffer), asynchronously on the
// stream; its host API stages through device buffers and models gradcomp::communicator, so
// that every exchange runs over NCCL unchanged. NCCL has no allgatherv or alltoallv: the
// counts are exchanged first, then grouped ncclBroadcast / ncclSend+ncclRecv move exactly
// the data, with no padding. Bootstrapped through MPI (from_mpi: rank 0's ncclUniqueId is
// broadcast), or from an ncclUniqueId the caller hands to every rank (from_unique_id: threads
// of one process, one per GPU, or any other channel). Needs the CUDA runtime and NCCL (link
// CUDA::cudart and libnccl); MPI only where the caller bootstraps through mpi_comm (it includes
// comm/mpi.hpp itself: this header includes no other communicator's).
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <gradcomp/cuda/memory.cuh>
#include <gradcomp/concepts.hpp>
#include <gradcomp/detail/comm_common.hpp>
#include <gradcomp/detail/float16.hpp>
#include <gradcomp/error.hpp>

namespace gradcomp {

namespace detail {

inline void nccl_check(ncclResult_t rc, const char* call, ncclComm_t comm = nullptr) {
  if (rc != ncclSuccess && rc != ncclInProgress) {
    const char* last = comm ? ncclGetLastError(comm) : nullptr;
    throw communicator_error(concat("gradcomp::nccl: ", call, " failed: ", ncclGetErrorString(rc),
                                    last && *last ? concat(" (", last, ")") : std::string()));
  }
}

template <class T>
concept nccl_element = std::is_trivially_copyable_v<T> && !std::same_as<T, bool>;

// Types NCCL can reduce (gradcomp::half and bfloat16 are bit-compatible with its 16-bit types).
template <class T>
inline constexpr bool nccl_reducible =
    std::same_as<T, float> || std::same_as<T, double> || std::same_as<T, half> ||
    std::same_as<T, bfloat16> || std::same_as<T, std::int8_t> || std::same_as<T, std::uint8_t> ||
    std::same_as<T, std::int32_t> || std::same_as<T, std::uint32_t> ||
    std::same_as<T, std::int64_t> || std::same_as<T, std::uint64_t>;

template <class T>
ncclDataType_t nccl_type() {
  if constexpr (std::same_as<T, float>) return ncclFloat32;
  else if constexpr (std::same_as<T, double>) return ncclFloat64;
  else if constexpr (std::same_as<T, half>) return ncclFloat16;
  else if constexpr (std::same_as<T, bfloat16>) return ncclBfloat16;
  else if constexpr (std::same_as<T, std::int8_t>) return ncclInt8;
  else if constexpr (std::same_as<T, std::uint8_t>) return ncclUint8;
  else if constexpr (std::same_as<T, std::int32_t>) return ncclInt32;
  else if constexpr (std::same_as<T, std::uint32_t>) return ncclUint32;
  else if constexpr (std::same_as<T, std::int64_t>) return ncclInt64;
  else return ncclUint64;
}

inline ncclRedOp_t nccl_op(reduce_op op) {
  return op == reduce_op::sum ? ncclSum : op == reduce_op::max ? ncclMax : ncclMin;
}

}  // namespace detail

// One rank of an NCCL communicator with the stream its collectives run on.
//
// Device API: collectives on device memory, enqueued on stream() and asynchronous (call
// synchronize() before reading results on the host), except that allgatherv and alltoallv
// wait once for the counts, which the host needs to size the receive buffer.
//
// Host API (the gradcomp::communicator concept): the same collectives on host memory, staged
// through device buffers and blocking. Sums are NCCL's: bit-identical on every rank, but added
// in NCCL's order, not in rank order, so they may differ in the last bits from
// in_process_comm; everything else moves bytes and is exact.
class nccl_comm {
 public:
  // Wraps an existing communicator; with owns = true it is destroyed with this object.
  nccl_comm(ncclComm_t comm, cudaStream_t stream, bool owns = false)
      : comm_(comm), stream_(stream), owns_(owns) {
    detail::nccl_check(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank", comm_);
    detail::nccl_check(ncclCommCount(comm_, &size_), "ncclCommCount", comm_);
  }

  // Creates the NCCL communicator of the ranks of `mpi` on the current CUDA device (select it
  // with cudaSetDevice first; one device per rank): rank 0's ncclUniqueId is broadcast. Any
  // gradcomp communicator that broadcasts bytes serves (mpi_comm from comm/mpi.hpp, which the
  // caller includes; in_process_comm for threads of one process).
  template <class BootstrapComm>
    requires requires(BootstrapComm& c, std::span<std::byte> b) {
      c.broadcast(b, 0);
      { c.rank() } -> std::convertible_to<int>;
      { c.size() } -> std::convertible_to<int>;
    }
  static nccl_comm from_mpi(BootstrapComm& mpi, cudaStream_t stream) {
    ncclUniqueId id{};
    if (mpi.rank() == 0) detail::nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    mpi.broadcast(std::span<std::byte>(reinterpret_cast<std::byte*>(&id), sizeof(id)), 0);
    return from_unique_id(id, mpi.size(), mpi.rank(), stream);
  }

  // Rank `rank` of `size` ranks that share `id` (from one ncclGetUniqueId call, handed to every
  // rank by the caller), on the current CUDA device. Every rank must call it, concurrently
  // (ncclCommInitRank blocks until all have joined): from its own thread or process. Checks
  // size >= 1 and 0 <= rank < size before NCCL sees them.
  static nccl_comm from_unique_id(const ncclUniqueId& id, int size, int rank, cudaStream_t stream) {
    if (size < 1) {
      detail::throw_invalid_argument("nccl_comm::from_unique_id", "size", size, "size >= 1");
    }
    if (rank < 0 || rank >= size) {
      detail::throw_invalid_argument("nccl_comm::from_unique_id", "rank", rank,
                                     detail::concat("0 <= rank < size = ", size));
    }
    ncclComm_t comm = nullptr;
    detail::nccl_check(ncclCommInitRank(&comm, size, id, rank), "ncclCommInitRank");
    return nccl_comm(comm, stream, /*owns=*/true);
  }

  nccl_comm(const nccl_comm&) = delete;
  nccl_comm& operator=(const nccl_comm&) = delete;
  nccl_comm(nccl_comm&& o) noexcept
      : comm_(std::exchange(o.comm_, nullptr)), stream_(o.stream_), owns_(std::exchange(o.owns_, false)),
        rank_(o.rank_), size_(o.size_), counts_(std::move(o.counts_)), staging_(std::move(o.staging_)) {}
  nccl_comm& operator=(nccl_comm&&) = delete;
  ~nccl_comm() {
    if (owns_ && comm_) ncclCommDestroy(comm_);
  }

  // The device API's collectives, but gather_counts, allgatherv and alltoallv (which wait for
  // the counts), only queue work on stream(): they can be captured in a CUDA graph
  // (device_sparsified_sgd::graph_step captures its whole step).
  static constexpr bool graph_capturable = true;

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] ncclComm_t native() const noexcept { return comm_; }
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_; }

  void synchronize() { detail::cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }

  // ---- device API ----------------------------------------------------------------------

  template <detail::nccl_element T>
    requires detail::nccl_reducible<T>
  void allreduce(device_span<T> data, reduce_op op = reduce_op::sum) {
    if (data.empty()) return;
    detail::nccl_check(ncclAllReduce(data.data(), data.data(), data.size(), detail::nccl_type<T>(),
                                     detail::nccl_op(op), comm_, stream_),
                       "ncclAllReduce", comm_);
  }

  // recv is resized to the total and gets rank 0's elements, then rank 1's, ...; built from
  // one ncclAllGather of the counts and one group of ncclBroadcast, one per rank that sends.
  template <detail::nccl_element T>
  void allgatherv(device_span<const T> send, device_buffer<T>& recv,
                  std::vector<std::size_t>& recv_counts) {
    const auto p = static_cast<std::size_t>(size_);
    const std::uint64_t mine[] = {send.size()};
    gather_counts(mine, recv_counts);
    std::vector<std::size_t> at(p + 1, 0);
    for (std::size_t r = 0; r < p; ++r) at[r + 1] = at[r] + recv_counts[r];
    recv.resize(at[p]);
    detail::nccl_check(ncclGroupStart(), "ncclGroupStart");
    for (std::size_t r = 0; r < p; ++r) {
      if (recv_counts[r] == 0) continue;  // every rank skips the same roots
      const void* from = static_cast<int>(r) == rank_ ? static_cast<const void*>(send.data()) : nullptr;
      detail::nccl_check(ncclBroadcast(from, recv.data() + at[r], recv_counts[r] * sizeof(T), ncclUint8,
                                       static_cast<int>(r), comm_, stream_),
                         "ncclBroadcast", comm_);
    }
    detail::nccl_check(ncclGroupEnd(), "ncclGroupEnd", comm_);
  }

  // recv gets rank 0's counts[0] elements, then rank 1's, ...: an allgatherv whose counts
  // every rank already holds (from gather_counts, checked by the caller), so nothing is sized
  // by what a peer announces here. send.size() must be counts[rank()], recv.size() their sum.
  // One group of ncclBroadcast, one per rank with a non-empty block (one ncclAllGather where
  // every block has the same size); asynchronous.
  template <detail::nccl_element T>
  void allgatherv_known(device_span<const T> send, device_span<T> recv,
                        std::span<const std::size_t> counts) {
    const auto p = static_cast<std::size_t>(size_);
    detail::check_block_counts("nccl_comm::allgatherv_known", "counts", counts, p, "recv",
                               recv.size());
    if (send.size() != counts[static_cast<std::size_t>(rank_)]) {
      detail::throw_invalid_argument("nccl_comm::allgatherv_known", "send.size()", send.size(),
                                     detail::concat("counts[rank()] = ", counts[static_cast<std::size_t>(rank_)]));
    }
    // Every rank's block of one size (a fixed k): one ncclAllGather.
    if (std::all_of(counts.begin(), counts.end(), [&](std::size_t c) { return c == counts[0]; })) {
      if (counts[0] == 0) return;
      detail::nccl_check(ncclAllGather(send.data(), recv.data(), counts[0] * sizeof(T), ncclUint8,
                                       comm_, stream_),
                         "ncclAllGather", comm_);
      return;
    }
    detail::nccl_check(ncclGroupStart(), "ncclGroupStart");
    for (std::size_t r = 0, at = 0; r < p; at += counts[r], ++r) {
      if (counts[r] == 0) continue;
      const void* from = static_cast<int>(r) == rank_ ? static_cast<const void*>(send.data()) : nullptr;
      detail::nccl_check(ncclBroadcast(from, recv.data() + at, counts[r] * sizeof(T), ncclUint8,
                                       static_cast<int>(r), comm_, stream_),
                         "ncclBroadcast", comm_);
    }
    detail::nccl_check(ncclGroupEnd(), "ncclGroupEnd", comm_);
  }

  // out[r * mine.size() + j] = rank r's mine[j], for every rank; waits for the result.
  void gather_counts(std::span<const std::uint64_t> mine, std::vector<std::size_t>& out) {
    const auto p = static_cast<std::size_t>(size_);
    const std::size_t m = mine.size();
    counts_.resize(m * (p + 1));
    std::uint64_t* send = counts_.data() + m * p;
    detail::cuda_check(cudaMemcpyAsync(send, mine.data(), m * sizeof(std::uint64_t),
                                       cudaMemcpyHostToDevice, stream_),
                       "cudaMemcpyAsync");
    detail::nccl_check(ncclAllGather(send, counts_.data(), m, ncclUint64, comm_, stream_),
                       "ncclAllGather (counts)", comm_);
    std::vector<std::uint64_t> host(m * p);
    detail::cuda_check(cudaMemcpyAsync(host.data(), counts_.data(), m * p * sizeof(std::uint64_t),
                                       cudaMemcpyDeviceToHost, stream_),
                       "cudaMemcpyAsync");
    synchronize();
    out.assign(host.begin(), host.end());
  }

  // send holds the blocks for rank 0, 1, ... (send_counts[s] elements for rank s); recv is
  // resized and gets the blocks for this rank in source order. The count matrix is gathered
  // first, then alltoallv_known moves the blocks.
  template <detail::nccl_element T>
  void alltoallv(device_span<const T> send, std::span<const std::size_t> send_counts,
                 device_buffer<T>& recv, std::vector<std::size_t>& recv_counts) {
    const auto p = static_cast<std::size_t>(size_);
    const auto me = static_cast<std::size_t>(rank_);
    detail::check_block_counts("nccl_comm::alltoallv", "send_counts", send_counts, p, "send",
                               send.size());
    std::vector<std::uint64_t> mine(send_counts.begin(), send_counts.end());
    std::vector<std::size_t> matrix;  // matrix[s * p + d]: what s sends to d
    gather_counts(mine, matrix);
    recv_counts.assign(p, 0);
    std::size_t total = 0;
    for (std::size_t s = 0; s < p; ++s) {
      recv_counts[s] = matrix[s * p + me];
      total += recv_counts[s];
    }
    recv.resize(total);
    (void)alltoallv_known(send, send_counts, device_span<T>(recv.data(), total),
                          std::span<const std::size_t>(recv_counts));
  }

  // An alltoallv whose counts every rank already holds (the device step's topk_a2a gathers
  // and checks its count matrix first), so nothing is sized by what a peer announces here:
  // send holds the blocks for rank 0, 1, ... (send_counts[d] elements for rank d), recv gets
  // recv_counts[s] elements from each rank s, in source order. This rank's own block is a
  // device copy; one group of ncclSend/ncclRecv moves the other non-empty blocks;
  // asynchronous. Returns -1: the sizes are trusted (NCCL does not check that a send and its
  // receive match; the caller makes them equal on both sides). block_limit (the most elements
  // a rank may send another, cuda::staged_comm's bound for its host communicator) is not
  // needed: nothing is sized here.
  template <detail::nccl_element T>
  int alltoallv_known(device_span<const T> send, std::span<const std::size_t> send_counts,
                      device_span<T> recv, std::span<const std::size_t> recv_counts,
                      std::size_t block_limit = 0) {
    (void)block_limit;
    const auto p = static_cast<std::size_t>(size_);
    const auto me = static_cast<std::size_t>(rank_);
    constexpr std::string_view where = "nccl_comm::alltoallv_known";
    detail::check_block_counts(where, "send_counts", send_counts, p, "send", send.size());
    detail::check_block_counts(where, "recv_counts", recv_counts, p, "recv", recv.size());
    std::vector<std::size_t> rat(p + 1, 0), sat(p + 1, 0);
    for (std::size_t s = 0; s < p; ++s) {
      rat[s + 1] = rat[s] + recv_counts[s];
      sat[s + 1] = sat[s] + send_counts[s];
    }
    if (send_counts[me] != recv_counts[me]) {
      detail::throw_invalid_argument(where, "recv_counts[rank()]",
                                     recv_counts[me],
                                     detail::concat("send_counts[rank()] = ", send_counts[me]));
    }
    if (send_counts[me]) {
      detail::cuda_check(cudaMemcpyAsync(recv.data() + rat[me], send.data() + sat[me],
                                         send_counts[me] * sizeof(T), cudaMemcpyDeviceToDevice, stream_),
                         "cudaMemcpyAsync");
    }
    detail::nccl_check(ncclGroupStart(), "ncclGroupStart");
    for (std::size_t q = 0; q < p; ++q) {
      if (q == me) continue;
      if (send_counts[q]) {
        detail::nccl_check(ncclSend(send.data() + sat[q], send_counts[q] * sizeof(T), ncclUint8,
                                    static_cast<int>(q), comm_, stream_),
                           "ncclSend", comm_);
      }
      if (recv_counts[q]) {
        detail::nccl_check(ncclRecv(recv.data() + rat[q], recv_counts[q] * sizeof(T), ncclUint8,
                                    static_cast<int>(q), comm_, stream_),
                           "ncclRecv", comm_);
      }
    }
    detail::nccl_check(ncclGroupEnd(), "ncclGroupEnd", comm_);
    return -1;
  }

  template <detail::nccl_element T>
  void broadcast(device_span<T> data, int root) {
    check_root(root);
    if (data.empty()) return;
    detail::nccl_check(ncclBroadcast(data.data(), data.data(), data.size_bytes(), ncclUint8, root,
                                     comm_, stream_),
                       "ncclBroadcast", comm_);
  }

  // Sends send to dest and receives recv.size() elements from source (-1: none): sizes both
  // sides know, so one ncclSend/ncclRecv group, asynchronous (gtopk's tree on the device).
  // Returns true: the sizes are trusted (NCCL does not check that a send and its receive
  // match; the caller makes them equal on both sides).
  template <detail::nccl_element T>
  bool sendrecv_known(device_span<const T> send, int dest, device_span<T> recv, int source) {
    check_peer(dest);
    check_peer(source);
    pair_group(dest, send.data(), source, recv.data(), send.size_bytes(), recv.size_bytes());
    return true;
  }

  // Sends to dest and receives from source (-1: none); the size travels first.
  template <detail::nccl_element T>
  void sendrecv(device_span<const T> send, int dest, device_buffer<T>& recv, int source) {
    check_peer(dest);
    check_peer(source);
    std::uint64_t out_count = send.size(), in_count = 0;
    counts_.resize(2);
    detail::cuda_check(cudaMemcpyAsync(counts_.data(), &out_count, sizeof(out_count),
                                       cudaMemcpyHostToDevice, stream_),
                       "cudaMemcpyAsync");
    pair_group(dest, counts_.data(), source, counts_.data() + 1, sizeof(std::uint64_t),
               sizeof(std::uint64_t));
    if (source >= 0) {
      detail::cuda_check(cudaMemcpyAsync(&in_count, counts_.data() + 1, sizeof(in_count),
                                         cudaMemcpyDeviceToHost, stream_),
                         "cudaMemcpyAsync");
    }
    synchronize();
    recv.resize(static_cast<std::size_t>(in_count));
    pair_group(dest, send.data(), source, recv.data(), send.size_bytes(), recv.size() * sizeof(T));
  }

  // ---- host API: the communicator concept ----------------------------------------------

  template <detail::nccl_element T>
    requires detail::nccl_reducible<T>
  void allreduce(std::span<T> data, reduce_op op = reduce_op::sum) {
    auto dev = stage_in<T>(std::span<const T>(data));
    allreduce(dev, op);
    stage_out(dev, data);
  }

  template <detail::nccl_element T>
  void allgatherv(std::span<const std::type_identity_t<T>> send, std::vector<T>& recv,
                  std::vector<std::size_t>& recv_counts) {
    auto dev = stage_in<T>(send);
    device_buffer<T> out;
    allgatherv(device_span<const T>(dev), out, recv_counts);
    recv.resize(out.size());
    stage_out(out.span(), std::span<T>(recv));
  }

  template <detail::nccl_element T>
  void alltoallv(std::span<const std::type_identity_t<T>> send,
                 std::span<const std::size_t> send_counts, std::vector<T>& recv,
                 std::vector<std::size_t>& recv_counts) {
    auto dev = stage_in<T>(send);
    device_buffer<T> out;
    alltoallv(device_span<const T>(dev), send_counts, out, recv_counts);
    recv.resize(out.size());
    stage_out(out.span(), std::span<T>(recv));
  }

  template <detail::nccl_element T>
  void broadcast(std::span<T> data, int root) {
    auto dev = stage_in<T>(std::span<const T>(data));
    broadcast(dev, root);
    stage_out(dev, data);
  }

  template <detail::nccl_element T>
  void sendrecv(std::span<const std::type_identity_t<T>> send, int dest, std::vector<T>& recv,
                int source) {
    auto dev = stage_in<T>(send);
    device_buffer<T> out;
    sendrecv(device_span<const T>(dev), dest, out, source);
    recv.resize(out.size());
    stage_out(out.span(), std::span<T>(recv));
  }

  void barrier() {
    counts_.resize(1);
    detail::nccl_check(ncclAllReduce(counts_.data(), counts_.data(), 1, ncclUint64, ncclSum, comm_, stream_),
                       "ncclAllReduce (barrier)", comm_);
    synchronize();
  }

 private:
  void check_root(int root) const {
    if (root < 0 || root >= size_) {
      detail::throw_invalid_argument("nccl_comm::broadcast", "root", root,
                                     detail::concat("0 <= root < size() = ", size_));
    }
  }
  void check_peer(int peer) const {
    if (peer < -1 || peer >= size_) {
      detail::throw_invalid_argument("nccl_comm::sendrecv", "peer", peer,
                                     detail::concat("-1 (none) or 0 <= rank < size() = ", size_));
    }
  }

  void pair_group(int dest, const void* send, int source, void* recv, std::size_t send_bytes,
                  std::size_t recv_bytes) {
    detail::nccl_check(ncclGroupStart(), "ncclGroupStart");
    if (dest >= 0 && send_bytes) {
      detail::nccl_check(ncclSend(send, send_bytes, ncclUint8, dest, comm_, stream_), "ncclSend", comm_);
    }
    if (source >= 0 && recv_bytes) {
      detail::nccl_check(ncclRecv(recv, recv_bytes, ncclUint8, source, comm_, stream_), "ncclRecv", comm_);
    }
    detail::nccl_check(ncclGroupEnd(), "ncclGroupEnd", comm_);
  }

  // Host data into the staging buffer (the host API runs one collective at a time).
  template <class T>
  device_span<T> stage_in(std::span<const T> host) {
    staging_.resize(host.size_bytes());
    if (!host.empty()) {
      detail::cuda_check(cudaMemcpyAsync(staging_.data(), host.data(), host.size_bytes(),
                                         cudaMemcpyHostToDevice, stream_),
                         "cudaMemcpyAsync");
    }
    return {reinterpret_cast<T*>(staging_.data()), host.size()};
  }

  template <class T>
  void stage_out(device_span<T> dev, std::span<T> host) {
    if (!host.empty()) {
      detail::cuda_check(cudaMemcpyAsync(host.data(), dev.data(), host.size_bytes(),
                                         cudaMemcpyDeviceToHost, stream_),
                         "cudaMemcpyAsync");
    }
    synchronize();
  }

  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  bool owns_ = false;
  int rank_ = 0;
  int size_ = 1;
  device_buffer<std::uint64_t> counts_;
  device_buffer<std::byte> staging_;
};

static_assert(communicator<nccl_comm>);

}  // namespace gradcomp
