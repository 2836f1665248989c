// gradcomp/compressor.hpp: compressor<Selector, Quantizer, Feedback, T>, the compile-time
// composition of three policies. compress() turns one gradient tensor (and its feedback state)
// into a payload; decompress() and decode_values() turn a payload back into values.
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include <gradcomp/concepts.hpp>
#include <gradcomp/context.hpp>
#include <gradcomp/detail/nonfinite.hpp>
#include <gradcomp/detail/select/sources.hpp>
#include <gradcomp/detail/stream_store.hpp>
#include <gradcomp/detail/timer.hpp>
#include <gradcomp/error.hpp>
#include <gradcomp/feedback/none.hpp>
#include <gradcomp/sparse.hpp>

namespace gradcomp {

struct compress_context {
  double density = 1.0;  // target density, (0, 1]
  call_id id{};          // seed, step and the tensor's stable id
  // g was already checked for non-finite values (sparsified_sgd checks all tensors at once,
  // before any state changes): compress() skips its own check.
  bool finite_checked = false;
};

struct compress_stats {
  std::size_t n = 0;
  selection_stats selection{};
  double seconds_accumulate = 0.0;
  double seconds_select = 0.0;
  double seconds_encode = 0.0;  // gather, quantize, and decode for the feedback
  // The top-k contraction of this call, delta = ||acc on the selection||^2 / ||acc||^2, acc the
  // vector selected from (e + g under error feedback), before quantization: how much of its
  // energy the selection keeps (GaussianK-SGD's delta; exact top-k maximises it for the count,
  // and k/n is what a random choice keeps on average). 1 when every coordinate is sent. The
  // selected part comes from the gather before encoding, ||acc||^2 from a pass that reads the
  // data anyway: the selector's own (top-k's fused pass, Gaussian-k's moments), the feedback's
  // accumulation (residual's e += g, DGC momentum's v += u) or, without feedback (acc = g), the
  // check of g for NaN and Inf. NaN where no such pass ran (no feedback with
  // nonfinite_policy::propagate or compress_context::finite_checked, for every selector but
  // Gaussian-k) or ||acc||^2 is 0.
  double contraction = std::numeric_limits<double>::quiet_NaN();
};

template <class Selector, class Quantizer, class Feedback, class T = float>
class compressor {
  static_assert(gradient_value<T>, "compressor<S, Q, F, T>: T must be float or double.");
  static_assert(gradcomp::selector<Selector, T>,
                "compressor<S, Q, F>: S is not a gradcomp::selector: it needs a member "
                "`selection_stats select(std::span<const T>, const select_context&, "
                "std::vector<std::uint32_t>&)`.");
  static_assert(gradcomp::quantizer<Quantizer>,
                "compressor<S, Q, F>: Q is not a gradcomp::quantizer: it needs id, summable, "
                "bits_per_value(), params(), encode(values, id, payload&) and "
                "decode(payload, values).");
  static_assert(gradcomp::feedback<Feedback, T>,
                "compressor<S, Q, F>: F is not a gradcomp::feedback: it needs state<T>, "
                "make_state<T>(n), accumulate(state, g) and update(state, indices, decoded).");

 public:
  using value_type = T;
  using selector_type = Selector;
  using quantizer_type = Quantizer;
  using feedback_type = Feedback;
  using state_type = typename Feedback::template state<T>;

  // Payloads of two ranks can be added position by position without decoding: the
  // quantizer's values are summable and every rank picks the same indices.
  static constexpr bool summable = Quantizer::summable && shared_indices_v<Selector>;

  compressor() = default;
  explicit compressor(Selector s, Quantizer q = {}, Feedback f = {},
                      nonfinite_policy nonfinite = nonfinite_policy::error)
      : selector_(std::move(s)), quantizer_(std::move(q)), feedback_(std::move(f)),
        nonfinite_(nonfinite) {}

  [[nodiscard]] state_type make_state(std::size_t n) const {
    return feedback_.template make_state<T>(n);
  }

  // Compress g (with feedback state st) into out: accumulate (e + g, or DGC's v), select,
  // encode, and record in st what the receivers will decode. Every argument is checked before
  // st changes: a bad density, a size mismatch, a non-finite gradient or a selector setting
  // rejected by the selector's check() throws and leaves st as it was. An exception from
  // inside a policy's work (bad_alloc, a custom selector that throws) leaves st valid but
  // holding the accumulated gradient, and so does an accumulated value that overflows to Inf
  // (e + g of two finite values, or DGC's v + u), which residual feedback's pass (dgc_momentum's:
  // its sum of squares) finds and refuses afterwards.
  compress_stats compress(std::span<const T> g, state_type& st, const compress_context& ctx,
                          payload& out) {
    return compress_staged(g, nullptr, st, ctx, out);
  }

  // The same step, staged: reads the feedback state `from` and writes the state after this
  // step to `to` (made by make_state for the same size; its old contents do not matter),
  // leaving `from` exactly as it was. A driver whose step may still fail after compression
  // (an exchange that throws) keeps `from` on failure and `to` on success: the step then
  // changes nothing or everything. With a feedback that stages_accumulation (residual,
  // dgc_momentum, no_feedback) this costs no more than compress() (the accumulation writes `to`
  // instead of `from`); any other feedback's state is copied first. With residual feedback it
  // costs less (checks_in_pass): the pass that writes `to` also refuses a NaN or Inf in g (or
  // an e + g that overflows), so g is not read once more before it, and a large `to` is
  // written with streaming stores. Refused for a bad argument or a non-finite value, it leaves
  // `from` and `out` as they were.
  compress_stats compress(std::span<const T> g, const state_type& from, state_type& to,
                          const compress_context& ctx, payload& out) {
    if (&from == &to) return compress_staged(g, nullptr, to, ctx, out);
    return compress_staged(g, &from, to, ctx, out);
  }

  // Decode p into dense (size p.dense_size). The payload is validated (indices in range and
  // strictly increasing, quantizer and side data consistent) before anything is written.
  //
  // The const members (decompress, decode_values, make_state, the accessors) may be called
  // from several threads at once on one compressor: they keep no scratch in the object.
  // compress() is not const and needs the compressor to itself.
  void decompress(const payload& p, std::span<T> dense,
                  decompress_mode mode = decompress_mode::overwrite) const {
    if (p.dense_size != dense.size()) {
      detail::throw_invalid_argument("compressor::decompress", "dense.size()", dense.size(),
                                     detail::concat("payload dense_size (", p.dense_size, ")"));
    }
    validate_indices("compressor::decompress", p);
    // Per thread, reused: a fresh buffer per call (megabytes for a dense payload) would cost a
    // page fault per page.
    thread_local std::vector<float> decoded;
    decoded.resize(p.count);
    quantizer_.decode(p, decoded);
    if (mode == decompress_mode::overwrite) std::fill(dense.begin(), dense.end(), T(0));
    if (p.layout == index_layout::dense) {
      for (std::size_t j = 0; j < p.count; ++j) dense[j] += static_cast<T>(decoded[j]);
    } else {
      for (std::size_t j = 0; j < p.count; ++j) dense[p.indices[j]] += static_cast<T>(decoded[j]);
    }
  }

  // The decoded values of p, in payload order (validated like decompress).
  void decode_values(const payload& p, std::span<float> out) const { quantizer_.decode(p, out); }

  [[nodiscard]] const Selector& selector() const noexcept { return selector_; }
  [[nodiscard]] Selector& selector() noexcept { return selector_; }
  [[nodiscard]] const Quantizer& quantizer() const noexcept { return quantizer_; }
  [[nodiscard]] const Feedback& feedback() const noexcept { return feedback_; }
  [[nodiscard]] nonfinite_policy nonfinite() const noexcept { return nonfinite_; }

 private:
  static constexpr std::size_t max_count = 0xffffffffu;

  // The feedback accumulates into its own buffer and the selector adds while it scans.
  static constexpr bool fused = fuses_accumulation<Selector, Feedback, T>;

  // compress() from the state `from` (null: in place) into `to`.
  compress_stats compress_staged(std::span<const T> g, const state_type* from, state_type& to,
                                 const compress_context& ctx, payload& out) {
    // Staged, the pass that adds g into `to` finds a NaN or Inf itself (`from` and `out` stay as
    // they were until it has finished): no read of g before the step.
    const bool check_before = nonfinite_ == nonfinite_policy::error && !ctx.finite_checked &&
                              !(from != nullptr && checks_in_pass);
    // Without feedback the vector selected from is g: the check's read of it also gives
    // ||g||^2 for the contraction.
    double g_energy = std::numeric_limits<double>::quiet_NaN();
    const select_context sc{
        checked_k(g, from, to, ctx, check_before, selects_from_g ? &g_energy : nullptr),
        ctx.density, ctx.id};
    compress_stats stats;
    stats.n = g.size();
    stats.selection.energy = g_energy;
    detail::stopwatch clock;
    const std::span<const T> acc = accumulate_and_select(g, from, to, sc, out, stats, clock);
    const double kept = encode(acc, ctx.id, out);
    const double energy = stats.selection.energy;
    if (out.layout == index_layout::dense) {
      stats.contraction = 1.0;
    } else if (energy > 0.0 && std::isfinite(energy)) {
      stats.contraction = std::min(kept / energy, 1.0);  // the two sums round differently
    }
    // The feedback keeps exactly what the receivers will decode, not what was intended (a
    // feedback that keeps nothing needs no decoding).
    if constexpr (!std::is_same_v<Feedback, no_feedback>) {
      decoded_.resize(out.count);
      quantizer_.decode(out, decoded_);
      feedback_.update(to, sent_indices(out), decoded_);
    }
    stats.seconds_encode = clock.lap();
    return stats;
  }

  // Every check compress() makes before the state changes; returns the target count k.
  // With `g_energy`, the finiteness check also puts ||g||^2 there.
  std::size_t checked_k(std::span<const T> g, const state_type* from, state_type& to,
                        const compress_context& ctx, bool check_finite,
                        double* g_energy) const {
    const std::size_t n = g.size();
    if (n > (std::size_t{1} << 32)) {
      detail::throw_invalid_argument("compressor::compress", "g.size()", n,
                                     "<= 2^32 (a payload's indices are 32-bit)");
    }
    const std::size_t k = k_for_density(n, ctx.density);
    // A payload counts its coordinates in 32 bits: 2^32 of them cannot be described.
    if constexpr (selects_all_v<Selector>) {
      if (n > max_count) {
        detail::throw_invalid_argument("compressor::compress", "g.size()", n,
                                       "<= 2^32 - 1 (a payload's count is 32-bit, and this "
                                       "selector sends every coordinate)");
      }
    }
    if (k > max_count) {
      detail::throw_invalid_argument("compressor::compress", "k", k,
                                     "<= 2^32 - 1 (a payload's count is 32-bit): a density "
                                     "below 1 for a tensor of 2^32 elements");
    }
    // buffers() is not const; `from` is only measured here.
    if (from) check_state_size(const_cast<state_type&>(*from), n);
    check_state_size(to, n);
    // The selector runs on the accumulated vector, after the feedback has changed st: its own
    // settings (threshold's tau, RedSync's interval) must be rejected before that.
    if constexpr (checks_settings<Selector>) selector_.check();
    if (check_finite) {
      const std::size_t bad =
          g_energy != nullptr ? detail::first_nonfinite(g, g_energy) : detail::first_nonfinite(g);
      if (bad != n) throw_nonfinite(g, {}, ctx.id);
    }
    return k;
  }

  // The error for a gradient g holding a NaN or Inf, or (g finite) for the accumulated vector
  // acc = e + g that overflowed.
  [[noreturn]] static void throw_nonfinite(std::span<const T> g, std::span<const T> acc,
                                           const call_id& id) {
    if (const std::size_t bad = detail::first_nonfinite(g); bad != g.size()) {
      throw nonfinite_error(detail::concat(
          "gradcomp::compressor::compress: gradient of tensor ", id.tensor_id, " holds ", g[bad],
          " at index ", bad,
          "; nonfinite_policy::error (the default) rejects non-finite gradients before any "
          "state changes"));
    }
    const std::size_t bad = detail::first_nonfinite(acc);
    throw nonfinite_error(detail::concat(
        "gradcomp::compressor::compress: the accumulated gradient (feedback state + gradient) of "
        "tensor ", id.tensor_id, " overflowed to ", bad < acc.size() ? acc[bad] : T(0),
        " at index ", bad, "; nonfinite_policy::error (the default) rejects it"));
  }

  void check_state_size(state_type& st, std::size_t n) const {
    for (const auto& buf : st.buffers()) {
      if (buf.size() != n) {
        detail::throw_invalid_argument("compressor::compress", "g.size()", n,
                                       detail::concat("the size the feedback state was made for (",
                                                      buf.size(), ")"));
      }
    }
  }

  // Accumulates g into the feedback state (from `from` into `to`, or in place in `to`) and
  // selects from the result into out's indices. Returns the accumulated vector (the values to
  // encode). Fused, the addition happens inside the selector's scan and its time counts as
  // selection.
  std::span<const T> accumulate_and_select(std::span<const T> g, const state_type* from,
                                           state_type& to, const select_context& sc,
                                           payload& out, compress_stats& stats,
                                           detail::stopwatch& clock) {
    std::span<const T> acc;
    const bool refuse = nonfinite_ == nonfinite_policy::error;
    if constexpr (fused) {
      const std::span<T> e = feedback_.in_place_accumulator(to);
      const std::span<const T> e_from = from ? feedback_.in_place_accumulator(*from) : e;
      // Into scratch, so that a step refused for a non-finite sum leaves `out` as it was.
      stats.selection = selector_.select_accumulate_into(e, e_from, g, sc, picked_);
      if (refuse && stats.selection.nonfinite) throw_nonfinite(g, e, sc.id);
      start_payload(out, g.size(), index_layout::sparse);
      out.indices.swap(picked_);
      acc = e;
    } else {
      double energy = stats.selection.energy;  // ||g||^2 from the check, or NaN
      bool nonfinite = false;
      acc = accumulate(g, from, to, energy, nonfinite);
      if (refuse && nonfinite) throw_nonfinite(g, acc, sc.id);
      stats.seconds_accumulate = clock.lap();
      // Only now: accumulate() is where a feedback without buffers (no_feedback) checks g's
      // size, and a refused call must leave `out` as it was.
      if constexpr (selects_all_v<Selector>) {
        start_payload(out, g.size(), index_layout::dense);
        out.count = static_cast<std::uint32_t>(g.size());
        stats.selection = selection_stats{g.size(), 0.0, 0, false};
      } else {
        start_payload(out, g.size(), index_layout::sparse);
        stats.selection = selector_.select(acc, sc, out.indices);
      }
      if (std::isnan(stats.selection.energy)) stats.selection.energy = energy;
    }
    if (out.layout == index_layout::sparse) {
      // A selector with a data-dependent count (threshold, Gaussian-k) may pick every one of
      // 2^32 coordinates: more than a payload can count.
      if (out.indices.size() > max_count) {
        const std::size_t picked = out.indices.size();
        out.clear();
        detail::throw_invalid_argument("compressor::compress", "selected count", picked,
                                       "<= 2^32 - 1 (a payload's count is 32-bit)");
      }
      out.count = static_cast<std::uint32_t>(out.indices.size());
      validate_indices("compressor::compress (selector output)", out);
    }
    stats.seconds_select = clock.lap();
    return acc;
  }

  // The feedback accumulates into a buffer it hands out (residual): e + g is written here, in
  // one loop that also adds up ||e + g||^2 (the same sums as feedback_.accumulate).
  static constexpr bool accumulates_in_place =
      requires(const Feedback& f, state_type& st, const state_type& cst) {
        { f.in_place_accumulator(st) } -> std::same_as<std::span<T>>;
        { f.in_place_accumulator(cst) } -> std::same_as<std::span<const T>>;
      };

  // Unfused: acc = e + g by the feedback; `energy` = ||acc||^2 and `nonfinite` whether a sum is
  // NaN or Inf, where this loop computed them (a staged one into a second buffer beyond the
  // caches with streaming stores, as the fused pass does).
  std::span<const T> accumulate(std::span<const T> g, const state_type* from, state_type& to,
                                double& energy, bool& nonfinite) {
    if constexpr (accumulates_in_place) {
      const std::span<T> e = feedback_.in_place_accumulator(to);
      const std::span<const T> e_from = from ? feedback_.in_place_accumulator(*from) : e;
      if (e.size() == g.size() && e_from.size() == g.size()) {
        energy = 0.0;
        const detail::sum_source<T> src =
            detail::accumulating_source(e, e_from, g, &energy, &nonfinite);
        src.finish(0);
        detail::stream_fence();
        return e;
      }
    }
    if constexpr (measures_energy) {
      energy = 0.0;
      const std::span<const T> acc = feedback_.accumulate_into(from ? *from : to, to, g, &energy);
      // A NaN or Inf in acc (g was checked, or is refused first: an accumulation that
      // overflowed) makes ||acc||^2 NaN or Inf, so only then is acc read again; the read also
      // tells a sum of squares that overflowed with every value finite (doubles above 1e154).
      if (!std::isfinite(energy)) nonfinite = detail::first_nonfinite(acc) != acc.size();
      return acc;
    }
    return accumulate(g, from, to);
  }

  // The feedback adds up ||acc||^2 in its own accumulation pass (dgc_momentum): the
  // four-argument accumulate_into(from, to, g, &energy), with to == from for a step in place.
  static constexpr bool measures_energy = requires(const Feedback& f, const state_type& from,
                                                   state_type& to, std::span<const T> g,
                                                   double* energy) {
    { f.accumulate_into(from, to, g, energy) } -> std::same_as<std::span<const T>>;
  };
  // The vector selected from is g itself.
  static constexpr bool selects_from_g = std::is_same_v<Feedback, no_feedback>;

 public:
  // Whether a staged compress() (from != to) needs no read of g before the step to refuse a NaN
  // or Inf: the pass that writes the second buffer finds it (residual feedback, fused into a
  // selector that flags_nonfinite, or compressor<>'s own e += g). Either way compress()
  // refuses them itself unless told finite_checked.
  static constexpr bool checks_in_pass =
      fused ? flags_nonfinite<Selector> : accumulates_in_place;

 private:

  std::span<const T> accumulate(std::span<const T> g, const state_type* from, state_type& to) {
    if (!from) return feedback_.accumulate(to, g);
    if constexpr (stages_accumulation<Feedback, T>) {
      return feedback_.accumulate_into(*from, to, g);
    } else {
      to = *from;  // a feedback that cannot stage: start from a copy
      return feedback_.accumulate(to, g);
    }
  }

  static void start_payload(payload& out, std::size_t n, index_layout layout) {
    out.clear();
    out.dense_size = n;
    out.layout = layout;
  }

  // Quantizes the selected values of acc into out. A dense float selection is encoded from acc
  // as it is; anything else is gathered (and converted to float) first.
  // Returns the sum of squares of the gathered (sparse) values, the contraction's numerator
  // (0 for a dense payload, whose contraction is 1).
  double encode(std::span<const T> acc, const call_id& id, payload& out) {
    if constexpr (std::is_same_v<T, float>) {
      if (out.layout == index_layout::dense) {
        quantizer_.encode(acc, id, out);
        return 0.0;
      }
    }
    values_.resize(out.count);
    double kept = 0.0;
    if (out.layout == index_layout::dense) {
      for (std::size_t j = 0; j < out.count; ++j) values_[j] = static_cast<float>(acc[j]);
    } else {
      for (std::size_t j = 0; j < out.count; ++j) {
        const T v = acc[out.indices[j]];
        values_[j] = static_cast<float>(v);
        kept += static_cast<double>(v) * static_cast<double>(v);
      }
    }
    quantizer_.encode(values_, id, out);
    return kept;
  }

  std::span<const std::uint32_t> sent_indices(const payload& p) {
    if (p.layout == index_layout::sparse) return p.indices;
    if (iota_.size() != p.count) {
      iota_.resize(p.count);
      std::iota(iota_.begin(), iota_.end(), std::uint32_t{0});
    }
    return iota_;
  }

  [[no_unique_address]] Selector selector_{};
  [[no_unique_address]] Quantizer quantizer_{};
  [[no_unique_address]] Feedback feedback_{};
  nonfinite_policy nonfinite_ = nonfinite_policy::error;
  // compress()'s scratch, reused across calls (compress is not const: one thread at a time).
  std::vector<float> values_;
  std::vector<float> decoded_;
  std::vector<std::uint32_t> iota_;
  std::vector<std::uint32_t> picked_;  // the fused selection, moved into the payload once kept
};

}  // namespace gradcomp
