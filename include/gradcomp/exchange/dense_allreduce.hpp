// gradcomp/exchange/dense_allreduce.hpp: S-SGD's exchange. Every rank's payload has the same
// indices (dense, or Random-k with a shared seed) and summable values, so the payloads are
// added on the wire without decoding by one allreduce, then decoded once. A small header
// exchanged first makes ranks that disagree on the tensor fail together instead of hanging.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include <gradcomp/concepts.hpp>
#include <gradcomp/detail/timer.hpp>
#include <gradcomp/error.hpp>
#include <gradcomp/detail/exchange_common.hpp>
#include <gradcomp/exchange/agreement.hpp>
#include <gradcomp/sparse.hpp>

namespace gradcomp {

struct dense_allreduce {
  // Before the allreduce the ranks allgather a small header (exchange/agreement.hpp) and check
  // that they agree on the tensor size, the quantizer, the count and the indices (by hash), so
  // that a mismatch throws communicator_error on every rank instead of hanging in the
  // allreduce or adding unrelated coordinates. false skips it, saving one small allgather.
  bool check_agreement = true;

  // out = mean over ranks of the decoded payloads. bytes_sent and bytes_received count this
  // rank's reduced buffer (a ring allreduce moves 2 (P-1)/P of it in each direction) and the
  // headers.
  template <class Compressor, communicator Comm>
  exchange_stats exchange(Comm& comm, const Compressor& /*c*/, const payload& p,
                          std::span<typename Compressor::value_type> out) const {
    static_assert(Compressor::summable,
                  "dense_allreduce needs a summable payload: use the identity, fp16 or bf16 "
                  "quantizer with the dense or randomk selector, or a sparse exchange such as "
                  "sparse_allgather.");
    if constexpr (Compressor::summable) {
      detail::stopwatch clock;
      exchange_stats st;
      if (check_agreement) {
        const local_check local = check_locally([&] { check_local<Compressor>(p, out); });
        std::vector<std::byte> scratch;
        const auto headers = agree_on_header(
            comm, "dense_allreduce",
            header_of(p, exchange_id::dense_allreduce, sizeof(out[0]), /*with_index_hash=*/true),
            agree::dense_size | agree::quantizer | agree::count | agree::indices, scratch,
            local.error, local.is_payload);
        st = exchange_agreed<Compressor>(comm, p, out);
        st.bytes_sent += exchange_header_bytes;
        st.bytes_received += exchange_header_bytes * (headers.size() - 1);
      } else {
        check_local<Compressor>(p, out);
        st = exchange_agreed<Compressor>(comm, p, out);
      }
      st.seconds = clock.lap();
      return st;
    } else {
      return {};  // unreachable: the static_assert above already failed; no follow-on errors
    }
  }

  // The allreduce itself, once the ranks agree (auto_exchange's entry).
  template <class Compressor, communicator Comm>
  static exchange_stats exchange_agreed(Comm& comm, const payload& p,
                                        std::span<typename Compressor::value_type> out) {
    using T = typename Compressor::value_type;
    using Q = typename Compressor::quantizer_type;
    // A summable quantizer's values are an array of sum_type; decoding is float(sum_type).
    using W = typename Q::sum_type;

    const int ranks = comm.size();
    // The sum's buffer is kept per thread: a fresh one per call (megabytes, past malloc's mmap
    // threshold) costs a page fault per page, more than the reduction itself.
    thread_local std::vector<W> buffer;
    buffer.resize(p.count);
    const std::span<W> sum(buffer.data(), p.count);
    if (p.count) std::memcpy(sum.data(), p.values.data(), p.values.size());
    if constexpr (Q::prescale_before_sum) {
      // fp16 sums overflow: each contribution is divided by P before the sum.
      for (W& w : sum) w = W(static_cast<float>(w) / static_cast<float>(ranks));
    }
    comm.allreduce(sum, reduce_op::sum);

    // out changes only once the allreduce has succeeded.
    const T divisor = Q::prescale_before_sum ? T(1) : static_cast<T>(ranks);
    if (p.layout == index_layout::dense) {
      for (std::size_t j = 0; j < p.count; ++j) out[j] = static_cast<T>(static_cast<float>(sum[j])) / divisor;
    } else {
      std::fill(out.begin(), out.end(), T(0));
      for (std::size_t j = 0; j < p.count; ++j) {
        out[p.indices[j]] = static_cast<T>(static_cast<float>(sum[j])) / divisor;
      }
    }

    exchange_stats st;
    st.name = "dense_allreduce";
    st.bytes_sent = p.values.size();
    st.bytes_received = p.values.size();
    return st;
  }

  template <class Compressor>
  static void check_local(const payload& p, std::span<const typename Compressor::value_type> out) {
    using W = typename Compressor::quantizer_type::sum_type;
    detail::check_out_size("dense_allreduce::exchange", "out.size()", out.size(), p);
    validate_indices("dense_allreduce::exchange", p);
    if (p.values.size() != p.count * sizeof(W)) {
      detail::throw_payload_error("dense_allreduce::exchange", "values hold ", p.values.size(),
                                  " bytes, expected ", p.count * sizeof(W));
    }
  }
};

static_assert(exchange<dense_allreduce, archetypes::compressor<true>, archetypes::communicator>);
// The bodies too: calling anything the concepts do not promise fails to compile here.
static_assert(archetypes::instantiates<dense_allreduce, true>);

}  // namespace gradcomp
