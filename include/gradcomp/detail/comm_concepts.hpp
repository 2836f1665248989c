// gradcomp/detail/comm_concepts.hpp: the communicator concepts, the part of gradcomp's
// contract (gradcomp/concepts.hpp, which includes this file) that the communication helpers
// under detail/ are written against, so that they need no more of the contract than this.
#pragma once

#include <concepts>
#include <cstddef>
#include <span>
#include <string_view>
#include <vector>

#include <gradcomp/detail/float16.hpp>
#include <gradcomp/sparse.hpp>

namespace gradcomp {

enum class reduce_op { sum, max, min };

// A communicator among size() ranks. Collectives are blocking and must be called by every
// rank in the same order. Variable-size collectives resize the receive vector and report
// per-rank counts (in elements). The element types are those the exchanges, the cost model
// and the drivers move:
//   allreduce (sum and max)   float, double, half, bfloat16  (summed payloads, decoded
//                                                             values, times)
//   allgatherv                std::byte, float, double       (payloads and headers, shards)
//   alltoallv                 std::byte, index_value         (gTop-k's and TopKA2A's pairs)
//   broadcast                 std::byte, double, index_value (the global set, calibrations)
template <class C, class T>
concept reduces = requires(C& c, std::span<T> data) {
  c.allreduce(data, reduce_op::sum);
  c.allreduce(data, reduce_op::max);
};
template <class C, class T>
concept gathers = requires(C& c, std::span<const T> send, std::vector<T>& recv,
                           std::vector<std::size_t>& recv_counts) {
  c.allgatherv(send, recv, recv_counts);
};
template <class C, class T>
concept scatters = requires(C& c, std::span<const T> send, std::span<const std::size_t> send_counts,
                            std::vector<T>& recv, std::vector<std::size_t>& recv_counts) {
  c.alltoallv(send, send_counts, recv, recv_counts);
};
template <class C, class T>
concept broadcasts = requires(C& c, std::span<T> data) { c.broadcast(data, 0); };

template <class C>
concept communicator =
    requires(C& c) {
      { c.rank() } -> std::convertible_to<int>;
      { c.size() } -> std::convertible_to<int>;
      c.barrier();
    } &&
    reduces<C, float> && reduces<C, double> && reduces<C, half> && reduces<C, bfloat16> &&
    gathers<C, std::byte> && gathers<C, float> && gathers<C, double> &&
    scatters<C, std::byte> && scatters<C, index_value> &&
    broadcasts<C, std::byte> && broadcasts<C, double> && broadcasts<C, index_value>;

// Optional: point-to-point messages (mpi_comm). sendrecv(send, dest, recv, source) sends to
// rank dest and receives from rank source (-1: none). gTop-k's tree and the link ping-pong use
// it where it exists, and an alltoallv where it does not.
template <class C, class T>
concept point_to_point = requires(C& c, std::span<const T> send, std::vector<T>& recv) {
  c.sendrecv(send, 0, recv, 0);
};

// Optional: receives bounded by the protocol. In allgatherv and alltoallv the peers announce
// how much they send, and the receiver sizes its buffer by it; a communicator whose peers are
// other processes takes a receive_limit, the most elements any one rank may contribute there
// (what the calling protocol allows: 48 bytes for an exchange header, a wire payload's size
// for a tensor of n elements), and throws communicator_error on every rank (each sees every
// rank's counts) before anything is allocated or received. The exchanges pass their limit
// through detail::allgatherv_within and detail::alltoallv_within, which fall back to the plain
// collective on a communicator without the overload (in_process_comm: its peers are threads of
// this process) and then rely on the checks of what arrived.
struct receive_limit {
  std::size_t per_rank = static_cast<std::size_t>(-1);
};

template <class C, class T>
concept bounds_receives =
    requires(C& c, std::span<const T> send, std::span<const std::size_t> send_counts,
             std::vector<T>& recv, std::vector<std::size_t>& recv_counts, receive_limit limit) {
      c.allgatherv(send, recv, recv_counts, limit);
      c.alltoallv(send, send_counts, recv, recv_counts, limit);
    };

// Optional: a communicator that can only be used from another thread under conditions
// (mpi_comm needs MPI_THREAD_SERIALIZED) checks them in require_thread_support(who), which a
// driver with a communication thread of its own (layerwise_sgd) calls before it starts.
template <class C>
concept checks_thread_support = requires(const C& c, std::string_view who) {
  c.require_thread_support(who);
};

}  // namespace gradcomp
