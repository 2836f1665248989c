// gradcomp/exchange/auto.hpp: auto_exchange picks, per tensor and per step, the exchange the
// alpha-beta model (exchange/cost_model.hpp) predicts fastest: dense allreduce, sparse
// allgather, TopKA2A or gTop-k, with alpha and beta measured by a ping-pong at the first
// exchange. Its statistics say what it chose, and the predicted and the measured time.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <gradcomp/concepts.hpp>
#include <gradcomp/detail/exchange_common.hpp>
#include <gradcomp/detail/timer.hpp>
#include <gradcomp/error.hpp>
#include <gradcomp/exchange/agreement.hpp>
#include <gradcomp/exchange/cost_model.hpp>
#include <gradcomp/exchange/dense_allreduce.hpp>
#include <gradcomp/exchange/gtopk.hpp>
#include <gradcomp/exchange/sparse_allgather.hpp>
#include <gradcomp/exchange/topk_a2a.hpp>
#include <gradcomp/wire.hpp>

namespace gradcomp {

struct auto_options {
  // The link (alpha, beta and the local work's costs); measured with measure_link() at the
  // first exchange when empty.
  std::optional<link_model> link{};
  // The exchanges it may choose (exchange_bit() masks). gtopk changes the result, not only
  // the time (a global top-k instead of the union of the picks): leave it out for a choice
  // that only affects speed.
  unsigned candidates = all_exchanges;
  link_measure_options measure{};
  gtopk_values gtopk_mode = gtopk_values::tree;
};

// What "dense" means here: for a summable compressor, dense_allreduce of the wire values; for
// any other, every rank decodes its payload into a dense vector of n values (T) and those are
// allreduced, which is always possible. With a rank-order communicator (in_process_comm,
// mpi_comm's default) every choice except gtopk gives bit for bit the result of
// sparse_allgather (dense_allreduce: of dense_allreduce), so the choice changes the time only.
class auto_exchange {
 public:
  auto_exchange() : auto_exchange(auto_options{}) {}
  explicit auto_exchange(auto_options o) : options_(o), gtopk_(o.gtopk_mode) {
    if ((o.candidates & all_exchanges) == 0) {
      detail::throw_invalid_argument("auto_exchange", "candidates", o.candidates,
                                     "a non-empty mask of exchange_bit(exchange_kind)");
    }
    // A NaN or negative time would make every comparison of the model false, and the choice
    // silently the first candidate.
    if (o.link) {
      for (const auto& [name, field] : link_model_fields) {
        detail::check_link_value("auto_exchange", detail::concat("link.", name), (*o.link).*field);
      }
      if (o.link->large_elements != 0 && o.link->large_elements <= o.link->small_elements) {
        detail::throw_invalid_argument("auto_exchange", "link.large_elements",
                                       detail::concat(o.link->large_elements, " (small_elements ",
                                                      o.link->small_elements, ")"),
                                       "0, or more than small_elements");
      }
    }
    // What measure_link() would refuse at the first exchange, refused here instead.
    detail::check_measure_options("auto_exchange", "measure", o.measure);
    link_ = o.link;
  }

  // Measures the link now (a collective: every rank calls it); the first exchange does it
  // otherwise.
  template <communicator Comm>
  const link_model& calibrate(Comm& comm) {
    link_ = measure_link(comm, options_.measure);
    return *link_;
  }

  [[nodiscard]] const std::optional<link_model>& link() const noexcept { return link_; }
  [[nodiscard]] exchange_kind last_choice() const noexcept { return last_.best; }
  [[nodiscard]] const exchange_prediction& last_prediction() const noexcept { return last_; }
  [[nodiscard]] const exchange_shape& last_shape() const noexcept { return shape_; }

  template <class Compressor, communicator Comm>
  exchange_stats exchange(Comm& comm, const Compressor& c, const payload& p,
                          std::span<typename Compressor::value_type> out) {
    unused_picks dropped;
    return exchange(comm, c, p, out, dropped);
  }

  // out as the chosen exchange writes it; `unused` is only filled when gtopk was chosen.
  // exchange_stats::name is the chosen exchange, predicted_seconds the model's time for it,
  // seconds the measured time (header included).
  template <class Compressor, communicator Comm>
  exchange_stats exchange(Comm& comm, const Compressor& c, const payload& p,
                          std::span<typename Compressor::value_type> out, unused_picks& unused) {
    using T = typename Compressor::value_type;
    if (!link_) calibrate(comm);
    detail::stopwatch clock;
    unused.clear();

    const local_check local = check_locally([&] {
      detail::check_out_size("auto_exchange::exchange", "out.size()", out.size(), p);
      if constexpr (Compressor::summable) {
        dense_allreduce::check_local<Compressor>(p, out);
      }
      // Decoding now means no later step can fail on this rank alone.
      detail::decode_pairs("auto_exchange::exchange", c, p, decoded_, pairs_);
    });
    const unsigned must_agree =
        agree::dense_size | (Compressor::summable ? agree::quantizer | agree::count | agree::indices : 0u);
    const auto headers = agree_on_header(
        comm, "auto_exchange",
        header_of(p, exchange_id::automatic, sizeof(T), /*with_index_hash=*/Compressor::summable),
        must_agree, header_scratch_, local.error, local.is_payload);

    shape_ = shape_of(headers, p, sizeof(T), Compressor::summable, comm.size());
    last_ = predict(shape_, *link_, options_.candidates);

    exchange_stats st;
    switch (last_.best) {
      case exchange_kind::dense_allreduce:
        if constexpr (Compressor::summable) {
          st = dense_allreduce::exchange_agreed<Compressor>(comm, p, out);
        } else {
          st = decoded_allreduce(comm, c, p, out);
        }
        break;
      case exchange_kind::sparse_allgather:
        st = sparse_.exchange(comm, c, p, out);
        break;
      case exchange_kind::topk_a2a: {
        const payload* ps[] = {&p};
        const std::span<T> outs[] = {out};
        a2a_.prepare(c, std::span<const payload* const>(ps), std::span<const std::span<T>>(outs));
        st = a2a_.exchange_agreed(comm, std::span<const std::span<T>>(outs));
        break;
      }
      case exchange_kind::gtopk:
        gtopk_.prepare(c, p);
        st = gtopk_.exchange_agreed(comm, headers, out, unused);
        break;
    }
    st.name = exchange_kind_name(last_.best);
    st.predicted_seconds = last_.seconds[static_cast<unsigned>(last_.best)];
    st.bytes_sent += exchange_header_bytes;
    st.bytes_received += exchange_header_bytes * (headers.size() - 1);
    st.seconds = clock.lap();
    return st;
  }

  // The model's view of one exchange, from the agreed headers.
  static exchange_shape shape_of(const std::vector<exchange_header>& headers, const payload& p,
                                 std::size_t value_bytes, bool summable, int ranks) {
    exchange_shape s;
    s.ranks = static_cast<std::size_t>(ranks);
    s.n = static_cast<std::size_t>(p.dense_size);
    s.value_bytes = value_bytes;
    double counts = 0.0, bytes = 0.0;
    for (const auto& h : headers) {
      counts += h.count;
      s.k_max = std::max<std::size_t>(s.k_max, h.count);
      bytes += static_cast<double>(wire_header_bytes) +
               (h.layout == index_layout::sparse ? 4.0 * h.count : 0.0) +
               static_cast<double>(payload::packed_bytes(h.count, h.bits_per_value));
    }
    s.k = counts / static_cast<double>(headers.size());
    s.payload_bytes = bytes / static_cast<double>(headers.size());
    s.summed_bytes = summable ? p.values.size() : 0;
    return s;
  }

 private:
  // Dense allreduce of the decoded payloads: x_r = 0 + decoded_r, folded by the communicator.
  template <class Compressor, communicator Comm>
  exchange_stats decoded_allreduce(Comm& comm, const Compressor& c, const payload& p,
                                   std::span<typename Compressor::value_type> out) {
    using T = typename Compressor::value_type;
    std::fill(out.begin(), out.end(), T(0));
    c.decompress(p, out, decompress_mode::accumulate);
    comm.allreduce(out, reduce_op::sum);
    const T divisor = static_cast<T>(comm.size());
    for (T& x : out) x /= divisor;
    exchange_stats st;
    st.bytes_sent = out.size_bytes();
    st.bytes_received = out.size_bytes();
    return st;
  }

  auto_options options_;
  std::optional<link_model> link_;
  exchange_prediction last_{};
  exchange_shape shape_{};
  std::vector<std::byte> header_scratch_;
  std::vector<float> decoded_;
  std::vector<index_value> pairs_;
  sparse_allgather sparse_;
  topk_a2a a2a_;
  gtopk gtopk_;
};

static_assert(exchange_with_unused<auto_exchange, archetypes::compressor<false>, archetypes::communicator>);
// The bodies too: calling anything the concepts do not promise fails to compile here.
static_assert(archetypes::instantiates<auto_exchange, false>);

}  // namespace gradcomp
