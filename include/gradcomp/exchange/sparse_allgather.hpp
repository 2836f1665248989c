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
#include <gradcomp/detail/comm_common.hpp>
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
    // No payload for this tensor is longer than wire_max_size(out.size()): a peer that
    // announces more is refused before anything is sized by it.
    detail::allgatherv_within(comm, std::span<const std::byte>(send_), recv_, counts_,
                              receive_limit{wire_max_size(out.size())}, "sparse_allgather");
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
    // nothing. While the ranks' values together are no more than the output holds, all of them
    // are kept and added region by region (detail::rank_order_mean); beyond that (dense
    // payloads, or high densities at many ranks) keeping them would cost up to P times the
    // output, so each block is decoded a second time and added into out in turn, the
    // textbook way, with the same additions in the same order.
    const std::size_t ranks = counts.size();
    std::size_t values = 0;
    for (std::size_t r = 0, at = 0; r < ranks; at += counts[r], ++r) {
      values += detail::wire_count(blocks.subspan(at, counts[r]));
    }
    const bool by_region = values <= out.size();
    if (by_region && received_.size() < ranks) received_.resize(ranks);
    values_.resize(by_region ? values : 0);
    runs_.resize(ranks);
    std::size_t offset = 0;
    std::size_t stored = 0;
    for (std::size_t r = 0; r < ranks; ++r) {
      payload& p = by_region ? received_[r] : one_;
      decode_block(blocks.subspan(offset, counts[r]), r, out.size(), p);
      offset += counts[r];
      if (!by_region) {  // its values decoded once here only to be refused before out changes
        values_.resize(p.count);
        decode_values(c, p, r, std::span<float>(values_));
        continue;
      }
      // wire_count read the same header field that decode_wire accepted.
      detail::check_invariant(p.count <= values - stored, "sparse_allgather: counts as peeked");
      float* v = values_.data() + stored;
      decode_values(c, p, r, std::span<float>(v, p.count));
      runs_[r] = {p.indices.data(), v, p.count, p.layout == index_layout::dense};
      stored += p.count;
    }
    if (by_region) {
      detail::rank_order_mean<T>(out, 0, std::span<const detail::rank_values>(runs_), cursor_);
      return;
    }
    std::fill(out.begin(), out.end(), T(0));
    offset = 0;
    for (std::size_t r = 0; r < ranks; ++r) {
      decode_block(blocks.subspan(offset, counts[r]), r, out.size(), one_);
      offset += counts[r];
      c.decompress(one_, out, decompress_mode::accumulate);
    }
    const T divisor = static_cast<T>(ranks);
    for (T& x : out) x /= divisor;
  }

 private:
  std::vector<std::byte> send_;
  std::vector<std::byte> recv_;
  std::vector<std::size_t> counts_;
  // combine()'s scratch, kept between calls: every rank's payload (as many bytes as recv_) and
  // their decoded values (at most the output's size), or one payload at a time; the mean's
  // runs and cursors.
  std::vector<payload> received_;
  payload one_;
  std::vector<float> values_;
  std::vector<detail::rank_values> runs_;
  std::vector<std::size_t> cursor_;

  // Rank r's block into p, refused (naming the rank) unless it holds exactly one valid payload
  // for a tensor of n elements.
  static void decode_block(std::span<const std::byte> block, std::size_t r, std::size_t n,
                           payload& p) {
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
    if (p.dense_size != n) {
      throw communicator_error(detail::concat(
          "gradcomp::sparse_allgather: rank ", r, " sent a payload for a tensor of ",
          p.dense_size, " elements; this rank's tensor has ", n));
    }
  }
  template <class Compressor>
  static void decode_values(const Compressor& c, const payload& p, std::size_t r,
                            std::span<float> out) {
    try {
      c.decode_values(p, out);
    } catch (const payload_error& e) {
      throw payload_error(detail::concat("gradcomp::sparse_allgather: the payload of rank ", r,
                                         " does not decode: ", e.what()));
    }
  }
};

static_assert(exchange<sparse_allgather, archetypes::compressor<false>, archetypes::communicator>);
// The bodies too: calling anything the concepts do not promise fails to compile here.
static_assert(archetypes::instantiates<sparse_allgather, false>);

}  // namespace gradcomp
