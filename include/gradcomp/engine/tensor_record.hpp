// gradcomp/engine/tensor_record.hpp: the one function from a tensor's compression and
// exchange to its statistics, and the step's totals, for every driver (sparsified_sgd,
// periodic_averaging, the run-time bucket engine behind the PyTorch hook).
#pragma once

#include <cstddef>
#include <cstdint>

#include <gradcomp/compressor.hpp>
#include <gradcomp/concepts.hpp>
#include <gradcomp/sgd.hpp>

namespace gradcomp::detail {

// Tensor (or slice, or bucket) `id` of n elements: what it selected and sent, and where its
// time went. `restored`: picks the exchange left out that went back to the feedback.
inline tensor_stats tensor_stats_of(std::uint32_t id, std::size_t n, const compress_stats& cs,
                                    const exchange_stats& xs, std::size_t restored) {
  tensor_stats ts;
  ts.id = id;
  ts.n = n;
  ts.selected = cs.selection.count;
  ts.density = n ? static_cast<double>(ts.selected) / static_cast<double>(n) : 0.0;
  ts.threshold = cs.selection.threshold;
  ts.iterations = cs.selection.iterations;
  ts.fallback = cs.selection.fallback;
  ts.contraction = cs.contraction;
  ts.bytes_sent = xs.bytes_sent;
  ts.bytes_received = xs.bytes_received;
  ts.exchange = xs.name;
  ts.predicted_seconds = xs.predicted_seconds;
  ts.exchange_seconds = xs.seconds;
  ts.accumulate_seconds = cs.seconds_accumulate;
  ts.select_seconds = cs.seconds_select;
  ts.encode_seconds = cs.seconds_encode;
  ts.restored = restored;
  return ts;
}

// Adds a tensor's statistics to its step's totals (the step's density is selected / n, set
// once the step's tensors are all in: finish_totals).
inline void add_tensor(step_stats& st, const tensor_stats& ts) {
  st.selected += ts.selected;
  st.bytes_sent += ts.bytes_sent;
  st.bytes_received += ts.bytes_received;
  st.seconds.accumulate += ts.accumulate_seconds;
  st.seconds.select += ts.select_seconds;
  st.seconds.encode += ts.encode_seconds;
  st.seconds.exchange += ts.exchange_seconds;
  st.tensors.push_back(ts);
}

inline void finish_totals(step_stats& st) {
  st.density = st.n ? static_cast<double>(st.selected) / static_cast<double>(st.n) : 0.0;
}

}  // namespace gradcomp::detail
