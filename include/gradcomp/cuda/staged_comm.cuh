// gradcomp/cuda/staged_comm.cuh: the device API the device-resident step needs
// (device_communicator and, for dense_allreduce, device_allreduce_communicator,
// cuda/sparsified_sgd.cuh), over any host gradcomp::communicator: device
// payloads are copied to host memory, moved by the host communicator, and copied back. For
// ranks that share one GPU (NCCL refuses two ranks on one device), for threads of one process
// (in_process_comm) and for MPI ranks without NCCL; nccl_comm offers the same calls on device
// memory directly (and gtopk's tree on the device needs sendrecv_known and broadcast, which
// both have). Every call runs on the stream it was given and returns after the host
// communicator has finished (the counts, which the host needs, and the data: the copies wait).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>
#include <vector>

#include <gradcomp/concepts.hpp>
#include <gradcomp/cuda/memory.cuh>
#include <gradcomp/detail/comm_common.hpp>
#include <gradcomp/detail/exchange_common.hpp>
#include <gradcomp/device.hpp>
#include <gradcomp/error.hpp>

namespace gradcomp::cuda {

template <class HostComm>
class staged_comm {
 public:
  staged_comm(HostComm& host, cudaStream_t stream) : host_(&host), stream_(stream) {}

  [[nodiscard]] int rank() const { return host_->rank(); }
  [[nodiscard]] int size() const { return host_->size(); }
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_; }
  [[nodiscard]] HostComm& host() noexcept { return *host_; }
  // The host communicator's check that it may be called from another thread than the one
  // that made it (mpi_comm: MPI_THREAD_SERIALIZED), where it has one (device_layerwise_sgd).
  void require_thread_support(std::string_view who) const
    requires checks_thread_support<HostComm>
  {
    host_->require_thread_support(who);
  }

  // out[r * mine.size() + j] = rank r's mine[j], for every rank (mine.size() the same on every
  // rank: a rank that sends another number of counts is refused on every rank, naming it).
  void gather_counts(std::span<const std::uint64_t> mine, std::vector<std::size_t>& out) {
    const std::size_t m = mine.size();
    send_.resize(m * sizeof(std::uint64_t));
    if (m) std::memcpy(send_.data(), mine.data(), send_.size());
    detail::allgatherv_within(*host_, std::span<const std::byte>(send_), recv_, recv_counts_,
                              receive_limit{send_.size()}, "staged_comm::gather_counts");
    for (std::size_t r = 0; r < recv_counts_.size(); ++r) {
      if (recv_counts_[r] != send_.size()) {
        throw communicator_error(detail::concat(
            "gradcomp::cuda::staged_comm::gather_counts: rank ", r, " sent ", recv_counts_[r],
            " bytes of counts; every rank sends ", send_.size(), " (", m, " counts)"));
      }
    }
    out.resize(recv_.size() / sizeof(std::uint64_t));
    for (std::size_t i = 0; i < out.size(); ++i) {
      std::uint64_t c = 0;
      std::memcpy(&c, recv_.data() + i * sizeof(c), sizeof(c));
      out[i] = static_cast<std::size_t>(c);
    }
  }

  // recv gets rank 0's counts[0] elements, then rank 1's, ...: counts every rank already holds
  // (from gather_counts, checked by the caller); a rank whose block has another size is
  // refused on every rank before recv is written. send.size() must be counts[rank()], recv.size()
  // their sum.
  template <class T>
  void allgatherv_known(device_span<const T> send, device_span<T> recv,
                        std::span<const std::size_t> counts) {
    const auto p = static_cast<std::size_t>(size());
    const auto me = static_cast<std::size_t>(rank());
    constexpr std::string_view where = "cuda::staged_comm::allgatherv_known";
    const std::size_t most = detail::check_block_counts(where, "counts", counts, p, "recv", recv.size());
    if (send.size() != counts[me]) {
      detail::throw_invalid_argument(where, "send.size()", send.size(),
                                     detail::concat("counts[rank()] = ", counts[me]));
    }
    send_.resize(send.size() * sizeof(T));
    if (!send_.empty()) {
      detail::cuda_check(cudaMemcpyAsync(send_.data(), send.data(), send_.size(),
                                         cudaMemcpyDeviceToHost, stream_),
                         "cudaMemcpyAsync (staged_comm, device to host)");
    }
    detail::cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    detail::allgatherv_within(*host_, std::span<const std::byte>(send_), recv_, recv_counts_,
                              receive_limit{most * sizeof(T)}, "staged_comm::allgatherv_known");
    for (std::size_t r = 0; r < p; ++r) {
      if (recv_counts_[r] != counts[r] * sizeof(T)) {
        throw communicator_error(detail::concat(
            "gradcomp::cuda::staged_comm::allgatherv_known: rank ", r, " sent ", recv_counts_[r],
            " bytes; it announced ", counts[r], " elements of ", sizeof(T), " bytes"));
      }
    }
    if (!recv_.empty()) {
      detail::cuda_check(cudaMemcpyAsync(recv.data(), recv_.data(), recv_.size(),
                                         cudaMemcpyHostToDevice, stream_),
                         "cudaMemcpyAsync (staged_comm, host to device)");
    }
    // recv_ is reused by the next call: the copy out of it has to be done.
    detail::cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

  // Sends send to rank dest and receives recv.size() elements from rank source (-1: none),
  // sizes both sides know (gtopk's tree on the device: every rank calls it every round).
  // Returns false, recv unwritten, where source sent another number of bytes: the caller
  // refuses that message in its protocol, so that every rank learns of it (a throw here would
  // fail this rank alone and leave the others waiting).
  template <class T>
  bool sendrecv_known(device_span<const T> send, int dest, device_span<T> recv, int source) {
    constexpr std::string_view where = "cuda::staged_comm::sendrecv_known";
    check_peer(where, "dest", dest);
    check_peer(where, "source", source);
    send_.resize(dest >= 0 ? send.size_bytes() : 0);
    if (!send_.empty()) {
      detail::cuda_check(cudaMemcpyAsync(send_.data(), send.data(), send_.size(),
                                         cudaMemcpyDeviceToHost, stream_),
                         "cudaMemcpyAsync (staged_comm, device to host)");
    }
    detail::cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    const std::size_t want = source >= 0 ? recv.size_bytes() : 0;
    detail::pairwise(*host_, std::span<const std::byte>(send_), dest, recv_, source,
                     receive_limit{want});
    if (source < 0) return true;
    if (recv_.size() != want) return false;
    if (want) {
      detail::cuda_check(cudaMemcpyAsync(recv.data(), recv_.data(), want, cudaMemcpyHostToDevice,
                                         stream_),
                         "cudaMemcpyAsync (staged_comm, host to device)");
    }
    detail::cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    return true;
  }

  // An alltoallv whose counts every rank already holds (the device step's topk_a2a gathers
  // and checks its count matrix first): send holds the blocks for rank 0, 1, ...
  // (send_counts[d] elements for rank d), recv gets recv_counts[s] elements from each rank s,
  // in source order. block_limit: the most elements any rank may send another, the same on
  // every rank (a host communicator that checks every rank's counts against it, as mpi_comm
  // does, then refuses alike on every rank; a limit that differed between ranks would let one
  // rank throw while another waits). Returns -1, or the first rank whose block had another
  // size (recv then unwritten): the caller refuses that block in its protocol, so that every
  // rank learns of it (a throw here would fail this rank alone and leave the others waiting).
  template <class T>
  int alltoallv_known(device_span<const T> send, std::span<const std::size_t> send_counts,
                      device_span<T> recv, std::span<const std::size_t> recv_counts,
                      std::size_t block_limit) {
    constexpr std::string_view where = "cuda::staged_comm::alltoallv_known";
    const auto p = static_cast<std::size_t>(size());
    detail::check_block_counts(where, "send_counts", send_counts, p, "send", send.size());
    detail::check_block_counts(where, "recv_counts", recv_counts, p, "recv", recv.size());
    send_.resize(send.size_bytes());
    if (!send_.empty()) {
      detail::cuda_check(cudaMemcpyAsync(send_.data(), send.data(), send_.size(),
                                         cudaMemcpyDeviceToHost, stream_),
                         "cudaMemcpyAsync (staged_comm, device to host)");
    }
    detail::cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    send_bytes_.resize(send_counts.size());
    for (std::size_t d = 0; d < send_counts.size(); ++d) send_bytes_[d] = send_counts[d] * sizeof(T);
    detail::alltoallv_within(*host_, std::span<const std::byte>(send_),
                             std::span<const std::size_t>(send_bytes_), recv_, recv_counts_,
                             receive_limit{block_limit * sizeof(T)});
    for (std::size_t s = 0; s < recv_counts.size(); ++s) {
      if (s >= recv_counts_.size() || recv_counts_[s] != recv_counts[s] * sizeof(T)) {
        return static_cast<int>(s);
      }
    }
    if (!recv_.empty()) {
      detail::cuda_check(cudaMemcpyAsync(recv.data(), recv_.data(), recv_.size(),
                                         cudaMemcpyHostToDevice, stream_),
                         "cudaMemcpyAsync (staged_comm, host to device)");
    }
    // recv_ is reused by the next call: the copy out of it has to be done.
    detail::cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    return -1;
  }

  // data = root's data on every rank (the host communicator's broadcast). data.size() must be
  // the same on every rank.
  template <class T>
  void broadcast(device_span<T> data, int root) {
    send_.resize(data.size_bytes());
    if (!send_.empty() && rank() == root) {
      detail::cuda_check(cudaMemcpyAsync(send_.data(), data.data(), send_.size(),
                                         cudaMemcpyDeviceToHost, stream_),
                         "cudaMemcpyAsync (staged_comm, device to host)");
    }
    detail::cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    host_->broadcast(std::span<std::byte>(send_), root);
    if (!send_.empty()) {
      detail::cuda_check(cudaMemcpyAsync(data.data(), send_.data(), send_.size(),
                                         cudaMemcpyHostToDevice, stream_),
                         "cudaMemcpyAsync (staged_comm, host to device)");
    }
    detail::cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

  // data = the elementwise op (sum) of every rank's data, in place: the host communicator's
  // allreduce, so its order of addition (the host step's bits). data.size() must be the same on
  // every rank (the caller agrees on it first: device_sparsified_sgd's counts).
  template <class T>
  void allreduce(device_span<T> data, reduce_op op = reduce_op::sum) {
    std::vector<T> host(data.size());
    if (!host.empty()) {
      detail::cuda_check(cudaMemcpyAsync(host.data(), data.data(), data.size_bytes(),
                                         cudaMemcpyDeviceToHost, stream_),
                         "cudaMemcpyAsync (staged_comm, device to host)");
    }
    detail::cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    host_->allreduce(std::span<T>(host), op);
    if (!host.empty()) {
      detail::cuda_check(cudaMemcpyAsync(data.data(), host.data(), data.size_bytes(),
                                         cudaMemcpyHostToDevice, stream_),
                         "cudaMemcpyAsync (staged_comm, host to device)");
    }
    // host is freed on return: the copy out of it has to be done.
    detail::cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

 private:
  void check_peer(std::string_view where, const char* what, int peer) const {
    if (peer < -1 || peer >= size() || peer == rank()) {
      detail::throw_invalid_argument(where, what, peer,
                                     detail::concat("-1 (none) or another rank in [0, ", size(), ")"));
    }
  }

  HostComm* host_;
  cudaStream_t stream_;
  std::vector<std::byte> send_;
  std::vector<std::byte> recv_;
  std::vector<std::size_t> recv_counts_;
  std::vector<std::size_t> send_bytes_;
};

}  // namespace gradcomp::cuda
