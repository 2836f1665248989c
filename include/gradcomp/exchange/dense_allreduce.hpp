// gradcomp/exchange/dense_allreduce.hpp: S-SGD's exchange. Every rank's payload has the same
// indices (dense, or Random-k with a shared seed) and summable values, so the payloads are
// added on the wire without decoding by one allreduce, then decoded once.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <span>
#include <vector>

#include <gradcomp/concepts.hpp>
#include <gradcomp/detail/timer.hpp>
#include <gradcomp/error.hpp>
#include <gradcomp/sparse.hpp>

namespace gradcomp {

struct dense_allreduce {
  // out = mean over ranks of the decoded payloads. bytes_sent and bytes_received count this
  // rank's reduced buffer (a ring allreduce moves 2 (P-1)/P of it in each direction).
  template <class Compressor, communicator Comm>
  exchange_stats exchange(Comm& comm, const Compressor& /*c*/, const payload& p,
                          std::span<typename Compressor::value_type> out) const {
    static_assert(Compressor::summable,
                  "dense_allreduce needs a summable payload: use the identity, fp16 or bf16 "
                  "quantizer with the dense or randomk selector, or a sparse exchange such as "
                  "sparse_allgather.");
    if constexpr (Compressor::summable) {
      return summed<Compressor>(comm, p, out);
    } else {
      return {};  // unreachable: the static_assert above already failed; no follow-on errors
    }
  }

 private:
  template <class Compressor, communicator Comm>
  static exchange_stats summed(Comm& comm, const payload& p,
                               std::span<typename Compressor::value_type> out) {
    using T = typename Compressor::value_type;
    using Q = typename Compressor::quantizer_type;
    // A summable quantizer's values are an array of sum_type; decoding is float(sum_type).
    using W = typename Q::sum_type;

    detail::stopwatch clock;
    if (p.dense_size != out.size()) {
      detail::throw_invalid_argument("dense_allreduce::exchange", "out.size()", out.size(),
                                     detail::concat("the payload's dense_size (", p.dense_size, ")"));
    }
    validate_indices("dense_allreduce::exchange", p);
    if (p.values.size() != p.count * sizeof(W)) {
      detail::throw_payload_error("dense_allreduce::exchange", "values hold ", p.values.size(),
                                  " bytes, expected ", p.count * sizeof(W));
    }
    const int ranks = comm.size();
    std::vector<W> sum(p.count);
    if (p.count) std::memcpy(sum.data(), p.values.data(), p.values.size());
    if constexpr (Q::prescale_before_sum) {
      // fp16 sums overflow: each contribution is divided by P before the sum.
      for (W& w : sum) w = W(static_cast<float>(w) / static_cast<float>(ranks));
    }
    comm.allreduce(std::span<W>(sum), reduce_op::sum);

    std::fill(out.begin(), out.end(), T(0));
    const T divisor = Q::prescale_before_sum ? T(1) : static_cast<T>(ranks);
    for (std::size_t j = 0; j < p.count; ++j) {
      out[p.index(j)] = static_cast<T>(static_cast<float>(sum[j])) / divisor;
    }

    exchange_stats st;
    st.bytes_sent = p.values.size();
    st.bytes_received = p.values.size();
    st.seconds = clock.lap();
    return st;
  }
};

static_assert(exchange<dense_allreduce, archetypes::compressor<true>, archetypes::communicator>);

}  // namespace gradcomp
