// gradcomp/detail/comm_common.hpp: what the host communicators share (in_process_comm,
// mpi_comm, process_group_comm): the element types a collective moves and reduces, the one
// fold rule of allreduce (in rank order, the running result on the left), the split of n
// elements over p ranks, and the checks of buffers and counts. Each communicator includes this
// instead of another communicator's header.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <gradcomp/detail/comm_concepts.hpp>
#include <gradcomp/error.hpp>

namespace gradcomp::detail {

// Element types a collective can move: copied bytewise (between threads, or into a message).
template <class T>
concept in_process_element = std::is_trivially_copyable_v<T> && std::copyable<T>;

// Element types allreduce can combine; sum needs `a + b`, max and min need `a < b`.
template <class T>
concept in_process_reducible = in_process_element<T> && requires(const T& a, const T& b) {
  { a + b } -> std::convertible_to<T>;
  { a < b } -> std::convertible_to<bool>;
};

// Start of rank r's share when n elements are split as evenly as possible over p ranks.
inline std::size_t share_begin(std::size_t n, std::size_t p, std::size_t r) noexcept {
  return n / p * r + std::min(r, n % p);
}

// Whether [a, a + na bytes) and [b, b + nb bytes) share a byte. std::less gives a total order
// even for pointers into unrelated objects.
inline bool bytes_overlap(const void* a, std::size_t na, const void* b, std::size_t nb) noexcept {
  if (na == 0 || nb == 0) return false;
  const auto* pa = static_cast<const unsigned char*>(a);
  const auto* pb = static_cast<const unsigned char*>(b);
  const std::less<const unsigned char*> before;
  return before(pa, pb + nb) && before(pb, pa + na);
}

// counts must add up to `buffer`'s size, checked without the sum wrapping; else
// invalid_argument naming `where`, the sum of `what` and the size.
inline void check_count_sum(std::string_view where, std::string_view what,
                            std::span<const std::size_t> counts, std::string_view buffer,
                            std::size_t size) {
  std::size_t total = 0;
  bool sum_ok = true;
  for (std::size_t s = 0; s < counts.size() && sum_ok; ++s) {
    sum_ok = counts[s] <= size - total;  // cannot wrap
    if (sum_ok) total += counts[s];
  }
  if (!sum_ok || total != size) {
    std::size_t sum = 0;
    for (const std::size_t c : counts) sum += c;  // for the message only; may wrap
    throw_invalid_argument(where, concat("sum of ", what), sum, concat(buffer, ".size() = ", size));
  }
}

// An alltoallv's send_counts (one per rank) must add up to the send buffer's size.
inline void check_send_counts(std::string_view where, std::span<const std::size_t> send_counts,
                              std::size_t send_size) {
  check_count_sum(where, "send_counts", send_counts, "send", send_size);
}

// The counts of a collective whose blocks every rank already knows (the device communicators'
// allgatherv_known and alltoallv_known): one per rank (p), adding up to `buffer`'s size; else
// invalid_argument naming them. Returns the largest.
inline std::size_t check_block_counts(std::string_view where, std::string_view what,
                                      std::span<const std::size_t> counts, std::size_t p,
                                      std::string_view buffer, std::size_t size) {
  if (counts.size() != p) {
    throw_invalid_argument(where, concat(what, ".size()"), counts.size(), concat("size() = ", p));
  }
  check_count_sum(where, what, counts, buffer, size);
  return counts.empty() ? 0 : *std::max_element(counts.begin(), counts.end());
}

// The counts peers announced for a collective (counts[i] elements from rank i / per_row:
// per_row 1 for allgatherv, size() for alltoallv's matrix), checked before anything is sized
// by them: each at most limit.per_rank, and all of them together at most `most_total`, what
// the transport can address in one collective (MPI: an int count of elements; torch's
// alltoall_base: an int byte offset). Every rank that sees the same counts throws the same
// communicator_error, naming the rank, its count and the bound.
inline void check_announced(std::string_view where, std::span<const std::uint64_t> counts,
                            std::size_t per_row, receive_limit limit, std::uint64_t most_total) {
  const std::uint64_t most = std::min<std::uint64_t>(limit.per_rank, most_total);
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < counts.size(); ++i) {
    if (counts[i] > most) {
      throw communicator_error(concat(
          "gradcomp::", where, ": rank ", i / per_row, " announced ", counts[i],
          " elements; allowed: at most ", most,
          limit.per_rank <= most_total ? " (what the protocol lets one rank send here)"
                                       : " (what one collective of this transport can address)",
          ". Nothing was received"));
    }
    total += counts[i];  // no overflow: both are at most most_total < 2^63
    if (total > most_total) {
      throw communicator_error(concat("gradcomp::", where, ": the counts announced add up to ",
                                      total, " elements or more; allowed: at most ", most_total,
                                      " in one collective. Nothing was received"));
    }
  }
}

// allgatherv and alltoallv with the receive bounded by `limit` (see bounds_receives), through
// the communicator's own overload where it has one. Otherwise allgatherv's counts are checked
// once received (every rank sees the same counts, so every rank throws alike), and alltoallv's
// are left to the caller's checks of what arrived, which fail the exchange on every rank (a
// check here would throw on the receiving rank alone and leave the others waiting).
template <class T, class Comm>
void allgatherv_within(Comm& comm, std::span<const T> send, std::vector<T>& recv,
                       std::vector<std::size_t>& recv_counts, receive_limit limit,
                       std::string_view where) {
  if constexpr (bounds_receives<Comm, T>) {
    (void)where;
    comm.allgatherv(send, recv, recv_counts, limit);
  } else {
    comm.allgatherv(send, recv, recv_counts);
    for (std::size_t r = 0; r < recv_counts.size(); ++r) {
      if (recv_counts[r] > limit.per_rank) {
        throw communicator_error(concat("gradcomp::", where, ": rank ", r, " sent ",
                                        recv_counts[r], " elements; allowed: at most ",
                                        limit.per_rank));
      }
    }
  }
}

template <class T, class Comm>
void alltoallv_within(Comm& comm, std::span<const T> send, std::span<const std::size_t> send_counts,
                      std::vector<T>& recv, std::vector<std::size_t>& recv_counts,
                      receive_limit limit) {
  if constexpr (bounds_receives<Comm, T>) {
    comm.alltoallv(send, send_counts, recv, recv_counts, limit);
  } else {
    (void)limit;
    comm.alltoallv(send, send_counts, recv, recv_counts);
  }
}

inline std::string describe(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    return ex.what();
  } catch (...) {
    return "unknown exception";
  }
}

// acc[j] = acc[j] op x[j]: the running result is always the left operand, so the fold over
// ranks is ((x0 op x1) op x2) ... on every rank.
template <class T>
void combine(T* acc, const T* x, std::size_t len, reduce_op op) {
  switch (op) {
    case reduce_op::sum:
      for (std::size_t j = 0; j < len; ++j) acc[j] = static_cast<T>(acc[j] + x[j]);
      break;
    case reduce_op::max:
      for (std::size_t j = 0; j < len; ++j) {
        if (acc[j] < x[j]) acc[j] = x[j];
      }
      break;
    case reduce_op::min:
      for (std::size_t j = 0; j < len; ++j) {
        if (x[j] < acc[j]) acc[j] = x[j];
      }
      break;
  }
}

}  // namespace gradcomp::detail
