// gradcomp/torch/process_group.hpp: a gradcomp::communicator over a torch.distributed process
// group (c10d::ProcessGroup: gloo on CPU), so that every exchange (dense_allreduce,
// sparse_allgather, gtopk, topk_a2a, auto_exchange) runs over the group a PyTorch program
// already has. Same semantics as in_process_comm and mpi_comm's default: allreduce folds in
// rank order, so sums are bit-identical to a sequential loop over ranks on every rank.
//
// Everything moves as bytes through alltoall_base (an alltoallv), the one variable-size
// collective gloo in PyTorch 1.13 offers: _allgather_base is not implemented for gloo, the
// list form of allgather needs equal sizes and dies (SIGFPE) on zero-sized tensors, and the list
// form of alltoall is not implemented. alltoall_base takes uneven splits and zero-sized
// contributions, also from every rank at once, so a rank that selected nothing is an ordinary
// case here. The group's own timeout bounds every wait: a peer that died or never arrives
// makes each collective throw communicator_error on the others instead of hanging.
//
// One thread at a time may call a process_group_comm; its collectives must be called by every
// rank of the group in the same order, like any gradcomp communicator.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/types.h>

#include <gradcomp/detail/comm_common.hpp>  // combine (the one fold rule), share_begin, ...
#include <gradcomp/concepts.hpp>
#include <gradcomp/error.hpp>

namespace gradcomp {

namespace detail {

// What the collectives move and reduce: in_process_comm's element rules (bytes copied as they
// are; sum needs a + b, max and min need a < b), without bool (std::vector<bool> has no
// contiguous storage).
template <class T>
concept pg_element = in_process_element<T> && !std::same_as<T, bool>;

template <class T>
concept pg_reducible = pg_element<T> && in_process_reducible<T>;

// A uint8 tensor over [p, p + bytes) that torch neither owns nor frees.
inline at::Tensor byte_tensor(const void* p, std::size_t bytes) {
  if (bytes == 0) return at::empty({0}, at::TensorOptions().dtype(at::kByte));
  // gloo reads send buffers only; from_blob wants a mutable pointer.
  return at::from_blob(const_cast<void*>(p), {static_cast<std::int64_t>(bytes)},
                       at::TensorOptions().dtype(at::kByte));
}

}  // namespace detail

class process_group_comm {
 public:
  // `staging`: a CUDA device to stage the bytes through, for a backend that moves device
  // tensors only (NCCL); none (the default): CPU tensors, which gloo takes.
  explicit process_group_comm(c10::intrusive_ptr<c10d::ProcessGroup> group,
                              std::optional<c10::Device> staging = std::nullopt)
      : group_(std::move(group)), staging_device_(staging) {
    if (!group_) {
      throw invalid_argument(
          "gradcomp::process_group_comm: argument 'group' is null; allowed: a process group "
          "(torch.distributed's default group, or one from new_group())");
    }
    rank_ = group_->getRank();
    size_ = group_->getSize();
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] const c10::intrusive_ptr<c10d::ProcessGroup>& group() const noexcept {
    return group_;
  }
  // The backend's name ("gloo", "nccl", ...), for messages.
  [[nodiscard]] std::string backend() const { return group_->getBackendName(); }

  // Element-wise reduction in place: each rank folds its 1/P share of the elements in rank
  // order, ((x0 op x1) op x2) ..., then the folded shares go to every rank. Two alltoall_base
  // calls; bit-identical to in_process_comm and mpi_comm's rank_order reduction.
  template <detail::pg_reducible T>
  void allreduce(std::span<T> data, reduce_op op = reduce_op::sum) {
    if (size_ == 1 || data.empty()) return;
    const auto p = static_cast<std::size_t>(size_);
    const auto r = static_cast<std::size_t>(rank_);
    const std::size_t n = data.size();
    const std::size_t begin = detail::share_begin(n, p, r);
    const std::size_t mine = detail::share_begin(n, p, r + 1) - begin;
    std::vector<std::int64_t> to_each(p), from_each(p, bytes_of<T>(mine));
    for (std::size_t s = 0; s < p; ++s) {
      to_each[s] = bytes_of<T>(detail::share_begin(n, p, s + 1) - detail::share_begin(n, p, s));
    }
    // Scatter: rank s receives share s of every rank's data, rank 0's first.
    shares_.resize(p * mine * sizeof(T));
    alltoall_bytes(data.data(), n * sizeof(T), to_each, shares_.data(), shares_.size(), from_each,
                   "allreduce (shares)");
    std::vector<T> acc(mine);
    if (mine > 0) {
      std::memcpy(acc.data(), shares_.data(), mine * sizeof(T));
      std::vector<T> x(mine);
      for (std::size_t s = 1; s < p; ++s) {
        std::memcpy(x.data(), shares_.data() + s * mine * sizeof(T), mine * sizeof(T));
        detail::combine(acc.data(), x.data(), mine, op);
      }
    }
    // Gather: every rank receives every folded share, in place.
    stage_repeated(std::as_bytes(std::span<const T>(acc)), p);
    alltoall_bytes(staging_.data(), staging_.size(), from_each, data.data(), n * sizeof(T), to_each,
                   "allreduce (gather)");
  }

  // recv is resized to the total and receives rank 0's elements, then rank 1's, ...;
  // recv_counts[r] is rank r's count. Counts may differ, and be zero on any or every rank.
  // With a receive_limit, a rank that announces more than limit.per_rank elements makes every
  // rank throw communicator_error before recv is touched (every rank sees the same counts).
  template <detail::pg_element T>
  void allgatherv(std::span<const std::type_identity_t<T>> send, std::vector<T>& recv,
                  std::vector<std::size_t>& recv_counts, receive_limit limit = {}) {
    const auto p = static_cast<std::size_t>(size_);
    // Staged first: resizing recv may move a send buffer that lives inside it.
    stage_repeated(std::as_bytes(send), p);
    const std::uint64_t mine = send.size();
    const std::vector<std::uint64_t> counts =
        everyone_s(std::span<const std::uint64_t>(&mine, 1), "allgatherv (counts)");
    detail::check_announced("process_group_comm::allgatherv", counts, 1, limit, most_elements<T>());
    std::vector<std::int64_t> to_each(p, bytes_of<T>(send.size())), from_each(p);
    std::size_t total = 0;
    for (std::size_t s = 0; s < p; ++s) {
      from_each[s] = bytes_of<T>(static_cast<std::size_t>(counts[s]));
      total += static_cast<std::size_t>(counts[s]);
    }
    recv.resize(total);
    recv_counts.assign(counts.begin(), counts.end());
    if (total == 0) return;
    alltoall_bytes(staging_.data(), staging_.size(), to_each, recv.data(), total * sizeof(T),
                   from_each, "allgatherv");
  }

  // The same count on every rank into a caller-sized buffer: recv.size() == size() * send.size().
  template <detail::pg_element T>
  void allgather(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    const auto p = static_cast<std::size_t>(size_);
    if (recv.size() != p * send.size()) {
      detail::throw_invalid_argument("process_group_comm::allgather", "recv.size()", recv.size(),
                                     detail::concat("size() * send.size() = ", p, " * ", send.size()));
    }
    if (send.empty()) return;
    stage_repeated(std::as_bytes(send), p);
    const std::vector<std::int64_t> each(p, bytes_of<T>(send.size()));
    alltoall_bytes(staging_.data(), staging_.size(), each, recv.data(), recv.size_bytes(), each,
                   "allgather");
  }

  // send holds the blocks for rank 0, 1, ... back to back (send_counts[s] elements for rank s,
  // summing to send.size()); recv is resized and receives the blocks addressed to this rank in
  // source rank order, recv_counts[s] from rank s. Every rank announces its whole row of counts
  // to every rank, so all of them check the same matrix: a count beyond `limit` (or one whose
  // bytes do not fit a message) makes every rank throw the same communicator_error before
  // anything is allocated or received.
  template <detail::pg_element T>
  void alltoallv(std::span<const std::type_identity_t<T>> send,
                 std::span<const std::size_t> send_counts, std::vector<T>& recv,
                 std::vector<std::size_t>& recv_counts, receive_limit limit = {}) {
    const auto p = static_cast<std::size_t>(size_);
    const auto r = static_cast<std::size_t>(rank_);
    if (send_counts.size() != p) {
      detail::throw_invalid_argument("process_group_comm::alltoallv", "send_counts.size()",
                                     send_counts.size(), detail::concat("size() = ", p));
    }
    detail::check_send_counts("process_group_comm::alltoallv", send_counts, send.size());
    if (detail::bytes_overlap(send.data(), send.size_bytes(), recv.data(),
                              recv.capacity() * sizeof(T))) {
      const auto bytes = std::as_bytes(send);
      staging_.assign(bytes.begin(), bytes.end());
      send = std::span<const T>(reinterpret_cast<const T*>(staging_.data()), send.size());
    }
    // Counts first: row s of the matrix is what rank s sends to each rank.
    const std::vector<std::uint64_t> row(send_counts.begin(), send_counts.end());
    const std::vector<std::uint64_t> matrix = everyone_s(row, "alltoallv (counts)");
    detail::check_announced("process_group_comm::alltoallv", matrix, p, limit, most_elements<T>());
    std::vector<std::int64_t> to_each(p), from_each(p);
    std::size_t in_total = 0;
    for (std::size_t s = 0; s < p; ++s) {
      const auto in = static_cast<std::size_t>(matrix[s * p + r]);
      to_each[s] = bytes_of<T>(send_counts[s]);
      from_each[s] = bytes_of<T>(in);
      in_total += in;
    }
    recv.resize(in_total);
    recv_counts.resize(p);
    for (std::size_t s = 0; s < p; ++s) recv_counts[s] = static_cast<std::size_t>(matrix[s * p + r]);
    if (in_total == 0 && send.empty()) {
      // Still a collective for the others, who may send or receive: take part.
      std::byte none{};
      alltoall_bytes(&none, 0, to_each, &none, 0, from_each, "alltoallv");
      return;
    }
    alltoall_bytes(send.data(), send.size_bytes(), to_each, recv.data(), in_total * sizeof(T),
                   from_each, "alltoallv");
  }

  // Copies root's data into every other rank's data; counts must agree.
  template <detail::pg_element T>
  void broadcast(std::span<T> data, int root) {
    if (root < 0 || root >= size_) {
      detail::throw_invalid_argument("process_group_comm::broadcast", "root", root,
                                     detail::concat("0 <= root < size() = ", size_));
    }
    if (size_ == 1 || data.empty()) return;  // gloo cannot move zero bytes; counts agree
    const at::Tensor host = detail::byte_tensor(data.data(), data.size_bytes());
    std::vector<at::Tensor> tensors{staged(host)};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    run("broadcast", [&] { return group_->broadcast(tensors, opts); });
    if (staging_device_) host.copy_(tensors[0]);
  }

  // One alltoall_base of the caller's own tensors (splits in elements of dim 0), with this
  // communicator's error handling: for a caller that moves its payloads as device tensors
  // itself (gradcomp.torch's CUDA engine). `what` names the call in the error.
  void alltoall_tensors(at::Tensor& out, at::Tensor& in, std::vector<std::int64_t> from_each,
                        std::vector<std::int64_t> to_each, const char* what) {
    run(what, [&] { return group_->alltoall_base(out, in, from_each, to_each); });
  }

  void barrier() {
    if (size_ == 1) return;
    run("barrier", [&] { return group_->barrier(); });
  }

 private:
  // torch's alltoall_base takes lengths and offsets in bytes up to INT_MAX.
  template <class T>
  static constexpr std::uint64_t most_elements() {
    return static_cast<std::uint64_t>(std::numeric_limits<int>::max()) / sizeof(T);
  }

  template <class T>
  static std::int64_t bytes_of(std::size_t elements) {
    return static_cast<std::int64_t>(elements * sizeof(T));
  }

  // `values` from every rank, rank 0's first (the same number from each). Leaves staging_
  // alone: allgatherv has its payload staged there already.
  std::vector<std::uint64_t> everyone_s(std::span<const std::uint64_t> values, const char* what) {
    const auto p = static_cast<std::size_t>(size_);
    std::vector<std::byte> out;
    repeat_into(std::as_bytes(values), p, out);
    std::vector<std::uint64_t> in(p * values.size());
    const std::vector<std::int64_t> each(p, static_cast<std::int64_t>(values.size_bytes()));
    alltoall_bytes(out.data(), out.size(), each, in.data(), in.size() * sizeof(std::uint64_t), each,
                   what);
    return in;
  }

  // staging_ = `bytes` repeated p times: what every peer should receive of ours.
  // The buffer is kept from call to call (bytes never lies inside it: callers pass the user's
  // send buffer or a local one).
  void stage_repeated(std::span<const std::byte> bytes, std::size_t p) {
    repeat_into(bytes, p, staging_);
  }

  static void repeat_into(std::span<const std::byte> bytes, std::size_t p,
                          std::vector<std::byte>& out) {
    out.resize(bytes.size() * p);
    if (bytes.empty()) return;
    for (std::size_t s = 0; s < p; ++s) std::memcpy(out.data() + s * bytes.size(), bytes.data(), bytes.size());
  }

  void alltoall_bytes(const void* send, std::size_t send_bytes, std::vector<std::int64_t> to_each,
                      void* recv, std::size_t recv_bytes, std::vector<std::int64_t> from_each,
                      const char* what) {
    if (size_ == 1) {
      // One rank: its block to itself.
      const auto n = static_cast<std::size_t>(to_each[0]);
      if (n > 0 && send != recv) std::memmove(recv, send, n);
      return;
    }
    at::Tensor in = staged(detail::byte_tensor(send, send_bytes));
    const at::Tensor host_out = detail::byte_tensor(recv, recv_bytes);
    at::Tensor out = staging_device_ ? at::empty_like(host_out, host_out.options().device(*staging_device_))
                                     : host_out;
    alltoall_tensors(out, in, std::move(from_each), std::move(to_each), what);
    if (staging_device_) host_out.copy_(out);
  }

  // t, or a copy of it on the staging device.
  at::Tensor staged(const at::Tensor& t) const {
    return staging_device_ ? t.to(*staging_device_) : t;
  }

  template <class Start>
  void run(const char* what, Start&& start) {
    try {
      c10::intrusive_ptr<c10d::Work> work = start();
      work->wait();
    } catch (const gradcomp::error&) {
      throw;
    } catch (const std::exception& e) {
      throw communicator_error(detail::concat("gradcomp::process_group_comm: ", what, " over ",
                                              group_->getBackendName(), " failed on rank ", rank_,
                                              " of ", size_, ": ", e.what()));
    }
  }

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::optional<c10::Device> staging_device_;
  int rank_ = 0;
  int size_ = 1;
  std::vector<std::byte> staging_;
  std::vector<std::byte> shares_;
};

static_assert(communicator<process_group_comm>);
static_assert(bounds_receives<process_group_comm, std::byte>);
static_assert(bounds_receives<process_group_comm, index_value>);

}  // namespace gradcomp
