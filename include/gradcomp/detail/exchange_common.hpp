// gradcomp/detail/exchange_common.hpp: what the sparse exchanges share: a payload decoded into
// (index, value) pairs, and a pairwise send/receive over any communicator.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include <gradcomp/detail/comm_concepts.hpp>
#include <gradcomp/detail/comm_common.hpp>
#include <gradcomp/error.hpp>
#include <gradcomp/sparse.hpp>

namespace gradcomp {

namespace detail {

// The payload's coordinates with their decoded values, in payload (index) order. The indices
// are validated first, so a malformed payload cannot make a later scatter write out of bounds.
// The dense output of an exchange must be as long as the payload's tensor.
inline void check_out_size(std::string_view where, std::string_view arg, std::size_t size,
                           const payload& p) {
  if (p.dense_size != size) {
    throw_invalid_argument(where, arg, size, concat("the payload's dense_size (", p.dense_size, ")"));
  }
}

template <class Compressor>
void decode_pairs(std::string_view where, const Compressor& c, const payload& p,
                  std::vector<float>& scratch, std::vector<index_value>& out) {
  validate_indices(where, p);
  scratch.resize(p.count);
  c.decode_values(p, scratch);
  out.resize(p.count);
  for (std::size_t j = 0; j < p.count; ++j) out[j] = index_value{p.index(j), scratch[j]};
}

// Sends `send` to rank dest and receives from rank source (-1: none). Every rank must call it,
// with matching pairs, since without sendrecv() it is one collective alltoallv, whose receive
// is bounded by `limit` (sendrecv receives the message that arrived, whatever it claims).
template <class T, class Comm>
void pairwise(Comm& comm, std::span<const T> send, int dest, std::vector<T>& recv, int source,
              receive_limit limit) {
  if constexpr (point_to_point<Comm, T>) {
    comm.sendrecv(send, dest, recv, source);
  } else {
    const auto p = static_cast<std::size_t>(comm.size());
    std::vector<std::size_t> send_counts(p, 0);
    if (dest >= 0) send_counts[static_cast<std::size_t>(dest)] = send.size();
    std::vector<T> all;
    std::vector<std::size_t> counts;
    alltoallv_within(comm, dest >= 0 ? send : std::span<const T>(),
                     std::span<const std::size_t>(send_counts), all, counts, limit);
    recv.clear();
    if (source >= 0) {
      std::size_t at = 0;
      for (int s = 0; s < source; ++s) at += counts[static_cast<std::size_t>(s)];
      const auto len = counts[static_cast<std::size_t>(source)];
      recv.assign(all.begin() + static_cast<std::ptrdiff_t>(at),
                  all.begin() + static_cast<std::ptrdiff_t>(at + len));
    }
  }
}

// ceil(log2(p)) for p >= 1: the rounds of a binomial tree.
inline unsigned ceil_log2(std::size_t p) noexcept {
  unsigned r = 0;
  while ((std::size_t{1} << r) < p) ++r;
  return r;
}

}  // namespace detail
}  // namespace gradcomp
