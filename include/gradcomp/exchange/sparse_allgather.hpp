// gradcomp/exchange/sparse_allgather.hpp: TopK-SGD's exchange. Each rank's payload (any
// selector, any quantizer, its own count) is encoded in the wire format and gathered by one
// allgatherv; every rank decodes all of them, in rank order, into the dense mean.
#pragma once

#include <algorithm>
#include <cstddef>
#include <exception>
#include <span>
#include <vector>

#include <gradcomp/concepts.hpp>
#include <gradcomp/detail/rank_mean.hpp>
#include <gradcomp/detail/timer.hpp>
#include <gradcomp/error.hpp>
#include <gradcomp/sparse.hpp>
#include <gradcomp/wire.hpp>

namespace gradcomp {

class sparse_allgather {
 public:
  // out = mean over ranks of the decoded payloads, added in rank order so every rank gets
  // bit-identical results. bytes_sent is this rank's encoded payload, bytes_received the
  // other ranks' encoded payloads. A payload from another rank that is malformed or was made
  // for a tensor of another size throws on every rank (each rank decodes all of them).
  template <class Compressor, communicator Comm>
  exchange_stats exchange(Comm& comm, const Compressor& c, const payload& p,
                          std::span<typename Compressor::value_type> out) {
    detail::stopwatch clock;
    send_.clear();
    // A malformed payload here still takes part with an empty block, which every other rank
    // then rejects naming this rank: no rank is left waiting in the allgatherv.
    std::exception_ptr own_error;
    try {
      encode_wire(p, send_);
    } catch (const payload_error&) {
      own_error = std::current_exception();
      send_.clear();
    }
    comm.allgatherv(std::span<const std::byte>(send_), recv_, counts_);
    if (own_error) std::rethrow_exception(own_error);

    combine(c, std::span<const std::byte>(recv_), std::span<const std::size_t>(counts_), out);

    exchange_stats st;
    st.name = "sparse_allgather";
    st.bytes_sent = send_.size();
    st.bytes_received = recv_.size() - send_.size();
    st.seconds = clock.lap();
    return st;
  }

  // The local work after the allgatherv: out = the mean of the payloads in `blocks` (counts[r]
  // bytes from rank r, in rank order), decoded and added in rank order, then divided by the
  // number of ranks (detail::rank_order_mean: region by region, each written once). Throws
  // payload_error naming the rank whose block is malformed or holds more than one payload,
  // communicator_error for a payload of another tensor size, and payload_error for counts that
  // do not add up to the bytes in `blocks`; out is written only once every block is valid.
  // Public so that gradcomp_bench measures exactly this (exchange_local/sparse_allgather).
  template <class Compressor>
  void combine(const Compressor& c, std::span<const std::byte> blocks,
               std::span<const std::size_t> counts,
               std::span<typename Compressor::value_type> out) {
    using T = typename Compressor::value_type;
    if (counts.empty()) {
      detail::throw_invalid_argument("sparse_allgather::combine", "counts.size()", 0,
                                     ">= 1 (one byte count per rank)");
    }
    std::size_t sum = 0;
    bool fits = true;
    for (const std::size_t bytes : counts) {
      if (bytes > blocks.size() - sum) {
        fits = false;
        break;
      }
      sum += bytes;
    }
    if (!fits || sum != blocks.size()) {
      throw payload_error(detail::concat("gradcomp::sparse_allgather: the ", counts.size(),
                                         " ranks' byte counts do not add up to the ",
                                         blocks.size(), " bytes received"));
    }
    // Every block is decoded and validated before out is written: a malformed one changes
    // nothing.
    const std::size_t ranks = counts.size();
    if (received_.size() < ranks) received_.resize(ranks);
    if (values_.size() < ranks) values_.resize(ranks);
    runs_.resize(ranks);
    std::size_t offset = 0;
    for (std::size_t r = 0; r < ranks; ++r) {
      const auto block = blocks.subspan(offset, counts[r]);
      offset += counts[r];
      payload& p = received_[r];
      std::size_t used = 0;
      try {
        used = decode_wire(block, p);
        validate_indices("sparse_allgather::combine", p);
      } catch (const payload_error& e) {
        // Every rank decodes every block, so every rank throws this, naming the sender.
        throw payload_error(detail::concat("gradcomp::sparse_allgather: the payload of rank ", r,
                                           " is not one this build can read: ", e.what()));
      }
      if (used != block.size()) {
        throw payload_error(detail::concat("gradcomp::sparse_allgather: rank ", r, " sent ",
                                           block.size(), " bytes, more than one payload"));
      }
      if (p.dense_size != out.size()) {
        throw communicator_error(detail::concat(
            "gradcomp::sparse_allgather: rank ", r, " sent a payload for a tensor of ",
            p.dense_size, " elements; this rank's tensor has ", out.size()));
      }
      values_[r].resize(p.count);
      try {
        c.decode_values(p, values_[r]);
      } catch (const payload_error& e) {
        throw payload_error(detail::concat("gradcomp::sparse_allgather: the payload of rank ", r,
                                           " does not decode: ", e.what()));
      }
      runs_[r] = {p.indices.data(), values_[r].data(), p.count, p.layout == index_layout::dense};
    }
    detail::rank_order_mean<T>(out, 0, std::span<const detail::rank_values>(runs_), cursor_);
  }

 private:
  std::vector<std::byte> send_;
  std::vector<std::byte> recv_;
  std::vector<std::size_t> counts_;
  // combine()'s scratch, kept between calls: every rank's payload and its decoded values (all
  // of them are decoded before the mean is written), and the mean's cursors.
  std::vector<payload> received_;
  std::vector<std::vector<float>> values_;
  std::vector<detail::rank_values> runs_;
  std::vector<std::size_t> cursor_;
};

static_assert(exchange<sparse_allgather, archetypes::compressor<false>, archetypes::communicator>);
// The bodies too: calling anything the concepts do not promise fails to compile here.
static_assert(archetypes::instantiates<sparse_allgather, false>);

}  // namespace gradcomp
