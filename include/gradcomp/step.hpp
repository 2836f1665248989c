// gradcomp/step.hpp: compile-time composition. compressor<Selector, Quantizer, Feedback>
// turns one gradient tensor into a payload and back; sparsified_sgd<Compressor, Exchange,
// Communicator> runs a whole data-parallel SGD step over a list of tensors and reports what
// it selected, sent and spent.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <istream>
#include <limits>
#include <numeric>
#include <ostream>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <gradcomp/concepts.hpp>
#include <gradcomp/context.hpp>
#include <gradcomp/detail/select_common.hpp>
#include <gradcomp/detail/timer.hpp>
#include <gradcomp/error.hpp>
#include <gradcomp/feedback/none.hpp>
#include <gradcomp/sparse.hpp>

namespace gradcomp {

// ---------------------------------------------------------------------------------------
// compressor

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
};

enum class decompress_mode {
  overwrite,   // dense = decoded (zero where the payload has no coordinate)
  accumulate,  // dense += decoded
};

namespace detail {

// Index of the first NaN or Inf, or g.size() if all finite. Vectorised: with the default
// nonfinite_policy::error this check is a full read of g on every compress().
template <gradient_value T>
std::size_t find_nonfinite(std::span<const T> g) {
  return first_nonfinite(g);
}

}  // namespace detail

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

  // Compress g (with feedback state st) into out. Every argument is checked before st
  // changes: a bad density, a size mismatch, a non-finite gradient or a selector setting
  // rejected by the selector's `check() const` (when it has one) throws and leaves st as it
  // was. An exception from inside a policy's work (bad_alloc, a custom selector that throws)
  // leaves st valid but holding the accumulated gradient.
  compress_stats compress(std::span<const T> g, state_type& st, const compress_context& ctx,
                          payload& out) {
    const std::size_t n = g.size();
    if (n > (std::size_t{1} << 32)) {
      detail::throw_invalid_argument("compressor::compress", "g.size()", n, "<= 2^32");
    }
    const std::size_t k = k_for_density(n, ctx.density);
    check_state_size(st, n);
    // The selector runs on the accumulated vector, after the feedback has changed st: its own
    // settings (threshold's tau, RedSync's interval) must be rejected before that.
    if constexpr (requires(const Selector& s) { s.check(); }) selector_.check();
    if (nonfinite_ == nonfinite_policy::error && !ctx.finite_checked) {
      if (const std::size_t bad = detail::find_nonfinite(g); bad != n) {
        throw nonfinite_error(detail::concat(
            "gradcomp::compressor::compress: gradient of tensor ", ctx.id.tensor_id, " holds ",
            g[bad], " at index ", bad,
            "; nonfinite_policy::error (the default) rejects non-finite gradients before any "
            "state changes"));
      }
    }

    compress_stats stats;
    stats.n = n;
    detail::stopwatch clock;
    // A feedback that accumulates by e += g into a buffer it exposes (residual) and a selector
    // that can do that addition during its own scan (topk, gaussiank) fuse the two passes:
    // one read of g and e and one write of e. The time then counts as seconds_select.
    constexpr bool fused =
        !selects_all_v<Selector> &&
        requires(const Feedback& f, state_type& s, Selector& sel, std::span<T> e,
                 std::span<const T> gv, const select_context& sc, std::vector<std::uint32_t>& idx) {
          { f.in_place_accumulator(s) } -> std::same_as<std::span<T>>;
          { sel.select_accumulate(e, gv, sc, idx) } -> std::same_as<selection_stats>;
        };
    std::span<const T> acc;
    if constexpr (fused) {
      const std::span<T> e = feedback_.in_place_accumulator(st);
      out.clear();
      out.dense_size = n;
      out.layout = index_layout::sparse;
      stats.selection =
          selector_.select_accumulate(e, g, select_context{k, ctx.density, ctx.id}, out.indices);
      acc = e;
    } else {
      acc = feedback_.accumulate(st, g);
      stats.seconds_accumulate = clock.lap();
      // Only now: accumulate() is where a feedback without buffers (no_feedback) checks g's
      // size, and a refused call must leave `out` as it was.
      out.clear();
      out.dense_size = n;
      if constexpr (selects_all_v<Selector>) {
        out.layout = index_layout::dense;
        out.count = static_cast<std::uint32_t>(n);
        stats.selection = selection_stats{n, 0.0, 0, false};
      } else {
        out.layout = index_layout::sparse;
        stats.selection = selector_.select(acc, select_context{k, ctx.density, ctx.id}, out.indices);
      }
    }
    if (out.layout == index_layout::sparse) {
      out.count = static_cast<std::uint32_t>(out.indices.size());
      validate_indices("compressor::compress (selector output)", out);
    }
    stats.seconds_select = clock.lap();

    if constexpr (std::is_same_v<T, float>) {
      if (out.layout == index_layout::dense) {
        quantizer_.encode(acc, ctx.id, out);  // every value, in order: no gather
      }
    }
    if (!std::is_same_v<T, float> || out.layout != index_layout::dense) {
      values_.resize(out.count);
      if (out.layout == index_layout::dense) {
        for (std::size_t j = 0; j < n; ++j) values_[j] = static_cast<float>(acc[j]);
      } else {
        for (std::size_t j = 0; j < out.count; ++j) values_[j] = static_cast<float>(acc[out.indices[j]]);
      }
      quantizer_.encode(values_, ctx.id, out);
    }
    // The feedback keeps exactly what the receivers will decode, not what was intended (a
    // feedback that keeps nothing needs no decoding).
    if constexpr (!std::is_same_v<Feedback, no_feedback>) {
      decoded_.resize(out.count);
      quantizer_.decode(out, decoded_);
      feedback_.update(st, sent_indices(out), decoded_);
    }
    stats.seconds_encode = clock.lap();
    return stats;
  }

  // Decode p into dense (size p.dense_size). The payload is validated (indices in range and
  // strictly increasing, quantizer and side data consistent) before anything is written.
  void decompress(const payload& p, std::span<T> dense,
                  decompress_mode mode = decompress_mode::overwrite) const {
    if (p.dense_size != dense.size()) {
      detail::throw_invalid_argument("compressor::decompress", "dense.size()", dense.size(),
                                     detail::concat("payload dense_size (", p.dense_size, ")"));
    }
    validate_indices("compressor::decompress", p);
    decoded_.resize(p.count);
    quantizer_.decode(p, decoded_);
    if (mode == decompress_mode::overwrite) std::fill(dense.begin(), dense.end(), T(0));
    if (p.layout == index_layout::dense) {
      for (std::size_t j = 0; j < p.count; ++j) dense[j] += static_cast<T>(decoded_[j]);
    } else {
      for (std::size_t j = 0; j < p.count; ++j) dense[p.indices[j]] += static_cast<T>(decoded_[j]);
    }
  }

  // The decoded values of p, in payload order (validated like decompress).
  void decode_values(const payload& p, std::span<float> out) const { quantizer_.decode(p, out); }

  [[nodiscard]] const Selector& selector_policy() const noexcept { return selector_; }
  [[nodiscard]] Selector& selector_policy() noexcept { return selector_; }
  [[nodiscard]] const Quantizer& quantizer_policy() const noexcept { return quantizer_; }
  [[nodiscard]] const Feedback& feedback_policy() const noexcept { return feedback_; }
  [[nodiscard]] nonfinite_policy nonfinite() const noexcept { return nonfinite_; }

 private:
  void check_state_size(state_type& st, std::size_t n) const {
    for (const auto& buf : st.buffers()) {
      if (buf.size() != n) {
        detail::throw_invalid_argument("compressor::compress", "g.size()", n,
                                       detail::concat("the size the feedback state was made for (",
                                                      buf.size(), ")"));
      }
    }
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
  // Scratch reused across calls: a compressor belongs to one rank (one thread).
  std::vector<float> values_;
  mutable std::vector<float> decoded_;
  std::vector<std::uint32_t> iota_;
};

// ---------------------------------------------------------------------------------------
// density schedule

// The target density per step. warmup() is DGC's exponential warm-up: during epoch e < W the
// density is rho^((e + 1) / (W + 1)), e.g. 0.25, 0.063, 0.016, 0.004 then 0.001 for
// rho = 0.001, W = 4.
class density_schedule {
 public:
  static density_schedule constant(double rho) { return warmup(rho, 0, 1); }

  static density_schedule warmup(double rho, unsigned warmup_epochs, std::uint64_t steps_per_epoch) {
    (void)k_for_density(1, rho);  // validates 0 < rho <= 1
    if (steps_per_epoch == 0) {
      detail::throw_invalid_argument("density_schedule::warmup", "steps_per_epoch", 0, ">= 1");
    }
    density_schedule s;
    s.rho_ = rho;
    s.warmup_epochs_ = warmup_epochs;
    s.steps_per_epoch_ = steps_per_epoch;
    return s;
  }

  [[nodiscard]] double at(std::uint64_t step) const {
    const std::uint64_t epoch = step / steps_per_epoch_;
    if (epoch >= warmup_epochs_) return rho_;
    return std::pow(rho_, static_cast<double>(epoch + 1) / static_cast<double>(warmup_epochs_ + 1));
  }

  [[nodiscard]] double final_density() const noexcept { return rho_; }

 private:
  double rho_ = 1.0;
  unsigned warmup_epochs_ = 0;
  std::uint64_t steps_per_epoch_ = 1;
};

// ---------------------------------------------------------------------------------------
// sparsified_sgd

struct sgd_options {
  double lr = 0.01;
  double momentum = 0.0;      // heavy-ball momentum on the averaged gradient; must be 0 with
                              // dgc_momentum feedback, which applies momentum before compression
  bool nesterov = false;
  double weight_decay = 0.0;  // added to the averaged gradient: wd * theta (theta is replicated)
  std::uint64_t seed = 0;     // seeds every random policy, with the step and the tensor id
};

// One tensor (layer) of the flat parameter buffer: a stable id (keys the feedback state and
// the random streams) and its element count.
struct tensor_spec {
  std::uint32_t id = 0;
  std::size_t size = 0;
};

namespace detail {

// The checks every SGD driver (sparsified_sgd, periodic_averaging) makes of its options.
inline void check_sgd_options(std::string_view where, const sgd_options& opt) {
  if (!(opt.lr > 0.0 && std::isfinite(opt.lr))) {
    throw_invalid_argument(where, "lr", opt.lr, "0 < lr < inf");
  }
  if (!(opt.momentum >= 0.0 && opt.momentum < 1.0)) {
    throw_invalid_argument(where, "momentum", opt.momentum, "0 <= momentum < 1");
  }
  if (!(opt.weight_decay >= 0.0 && std::isfinite(opt.weight_decay))) {
    throw_invalid_argument(where, "weight_decay", opt.weight_decay, "0 <= weight_decay < inf");
  }
  if (opt.nesterov && opt.momentum == 0.0) {
    throw_invalid_argument(where, "nesterov", "true", "nesterov needs momentum > 0");
  }
}

// Where each tensor starts in the flat parameter buffer, after checking that the tensor ids
// (which key the feedback state and the random streams) are unique.
inline std::vector<std::size_t> tensor_offsets(std::string_view where,
                                               std::span<const tensor_spec> tensors) {
  std::vector<std::size_t> offsets;
  offsets.reserve(tensors.size());
  std::size_t offset = 0;
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    for (std::size_t u = 0; u < t; ++u) {
      if (tensors[u].id == tensors[t].id) {
        throw_invalid_argument(where, "tensor id", tensors[t].id, "ids unique across tensors");
      }
    }
    offsets.push_back(offset);
    offset += tensors[t].size;
  }
  return offsets;
}

// params -= lr * d with d = g + weight_decay * params, through heavy-ball (or Nesterov)
// momentum when `velocity` is not empty: the update of every SGD driver.
template <class T>
void sgd_update(std::span<T> params, std::span<const T> g, std::span<T> velocity,
                const sgd_options& opt) {
  const T lr = static_cast<T>(opt.lr);
  const T wd = static_cast<T>(opt.weight_decay);
  const T m = static_cast<T>(opt.momentum);
  // Three branch-free loops over unaliased arrays, so that the compiler vectorises each:
  // params, g and velocity must not overlap (the drivers pass their own buffers; a caller of
  // periodic_averaging::step passes params and grads, which must be distinct).
  const std::size_t n = params.size();
  T* __restrict p = params.data();
  const T* __restrict gr = g.data();
  if (velocity.empty()) {
    for (std::size_t i = 0; i < n; ++i) p[i] -= lr * (gr[i] + wd * p[i]);
    return;
  }
  T* __restrict v = velocity.data();
  if (opt.nesterov) {
    for (std::size_t i = 0; i < n; ++i) {
      const T d = gr[i] + wd * p[i];
      v[i] = m * v[i] + d;
      p[i] -= lr * (d + m * v[i]);
    }
  } else {
    for (std::size_t i = 0; i < n; ++i) {
      v[i] = m * v[i] + (gr[i] + wd * p[i]);
      p[i] -= lr * v[i];
    }
  }
}

// The flat parameter buffer's length.
inline std::size_t total_size(std::span<const tensor_spec> tensors) {
  std::size_t n = 0;
  for (const tensor_spec& t : tensors) n += t.size;
  return n;
}

}  // namespace detail

struct tensor_stats {
  std::uint32_t id = 0;
  std::size_t n = 0;
  std::size_t selected = 0;
  double density = 0.0;    // achieved: selected / n
  double threshold = 0.0;
  unsigned iterations = 0;
  bool fallback = false;
  std::size_t bytes_sent = 0;
  std::size_t bytes_received = 0;
  std::string_view exchange{};     // the exchange that ran (auto_exchange: the one it chose)
  double predicted_seconds = 0.0;  // the exchange's cost-model forecast (auto_exchange), else 0
  double exchange_seconds = 0.0;   // measured: communication, decoding and averaging
  std::size_t restored = 0;        // picks the exchange left out (gtopk) that went back to the
                                   // feedback (0 for feedback without restore(): dropped)
};

struct phase_seconds {
  double accumulate = 0.0;
  double select = 0.0;
  double encode = 0.0;
  double exchange = 0.0;  // communication, decoding and averaging
  double update = 0.0;    // the SGD update of the parameters
};

struct step_stats {
  std::uint64_t step = 0;
  double target_density = 0.0;
  std::size_t n = 0;         // parameters
  std::size_t selected = 0;  // over all tensors
  double density = 0.0;      // achieved, selected / n
  std::size_t bytes_sent = 0;
  std::size_t bytes_received = 0;
  phase_seconds seconds{};
  std::vector<tensor_stats> tensors;
};

template <class Compressor, class Exchange, class Comm>
class sparsified_sgd {
  static_assert(communicator<Comm>,
                "sparsified_sgd<C, X, Comm>: Comm is not a gradcomp::communicator: it needs "
                "rank(), size(), allreduce, allgatherv, alltoallv, broadcast and barrier.");
  static_assert(exchange<Exchange, Compressor, Comm>,
                "sparsified_sgd<C, X, Comm>: X is not a gradcomp::exchange for this compressor: "
                "it needs `exchange_stats exchange(Comm&, const C&, const payload&, "
                "std::span<value_type>)`.");

 public:
  using value_type = typename Compressor::value_type;
  using T = value_type;

  // Tensors with ids 0, 1, ... in the order of layer_sizes.
  sparsified_sgd(Comm& comm, const std::vector<std::size_t>& layer_sizes, Compressor c = {},
                 Exchange x = {}, sgd_options opt = {},
                 density_schedule schedule = density_schedule::constant(1.0))
      : sparsified_sgd(comm, specs_from_sizes(layer_sizes), std::move(c), std::move(x), opt,
                       schedule) {}

  // Tensors with explicit ids (taken as a span so that a braced list of sizes picks the
  // constructor above).
  sparsified_sgd(Comm& comm, std::span<const tensor_spec> tensors, Compressor c, Exchange x,
                 sgd_options opt, density_schedule schedule)
      : comm_(&comm), tensors_(tensors.begin(), tensors.end()), compressor_(std::move(c)),
        exchange_(std::move(x)), opt_(opt), schedule_(schedule) {
    check_options();
    offsets_ = detail::tensor_offsets("sparsified_sgd", tensors_);
    for (const tensor_spec& t : tensors_) states_.push_back(compressor_.make_state(t.size));
    total_ = detail::total_size(tensors_);
    average_.assign(total_, T(0));
    if (opt_.momentum > 0.0) velocity_.assign(total_, T(0));
  }

  // One synchronous step on every rank: compress each tensor's gradient, exchange, average,
  // then params -= lr * update. Sizes and the gradient's finiteness are checked for all
  // tensors before any state changes.
  const step_stats& step(std::span<T> params, std::span<const T> grads) {
    if (params.size() != total_) {
      detail::throw_invalid_argument("sparsified_sgd::step", "params.size()", params.size(),
                                     detail::concat("the total of the tensor sizes (", total_, ")"));
    }
    if (grads.size() != total_) {
      detail::throw_invalid_argument("sparsified_sgd::step", "grads.size()", grads.size(),
                                     detail::concat("the total of the tensor sizes (", total_, ")"));
    }
    if (compressor_.nonfinite() == nonfinite_policy::error) {
      if (const std::size_t bad = detail::find_nonfinite(grads); bad != total_) {
        const std::size_t t = tensor_of(bad);
        throw nonfinite_error(detail::concat(
            "gradcomp::sparsified_sgd::step: gradient of tensor ", tensors_[t].id, " holds ",
            grads[bad], " at index ", bad - offsets_[t],
            "; nonfinite_policy::error (the default) rejects non-finite gradients before any "
            "state changes"));
      }
    }

    const bool finite_checked = compressor_.nonfinite() == nonfinite_policy::error;
    const double rho = schedule_.at(step_);
    stats_ = step_stats{};
    stats_.step = step_;
    stats_.target_density = rho;
    stats_.n = total_;
    stats_.tensors.reserve(tensors_.size());
    auto record = [this](std::size_t t, const compress_stats& cs, const exchange_stats& xs,
                         std::size_t restored) {
      tensor_stats ts;
      ts.id = tensors_[t].id;
      ts.n = tensors_[t].size;
      ts.selected = cs.selection.count;
      ts.density = ts.n ? static_cast<double>(ts.selected) / static_cast<double>(ts.n) : 0.0;
      ts.threshold = cs.selection.threshold;
      ts.iterations = cs.selection.iterations;
      ts.fallback = cs.selection.fallback;
      ts.bytes_sent = xs.bytes_sent;
      ts.bytes_received = xs.bytes_received;
      ts.exchange = xs.name;
      ts.predicted_seconds = xs.predicted_seconds;
      ts.exchange_seconds = xs.seconds;
      ts.restored = restored;
      stats_.tensors.push_back(ts);
      stats_.selected += ts.selected;
      stats_.bytes_sent += xs.bytes_sent;
      stats_.bytes_received += xs.bytes_received;
      stats_.seconds.accumulate += cs.seconds_accumulate;
      stats_.seconds.select += cs.seconds_select;
      stats_.seconds.encode += cs.seconds_encode;
      stats_.seconds.exchange += xs.seconds;
    };
    if constexpr (fuses_tensors) {
      // Every tensor is compressed first, then the exchange sees them all (topk_a2a buckets).
      payloads_.resize(tensors_.size());
      std::vector<compress_stats> cstats(tensors_.size());
      std::vector<std::span<T>> outs(tensors_.size());
      std::vector<exchange_stats> xstats(tensors_.size());
      for (std::size_t t = 0; t < tensors_.size(); ++t) {
        const auto range = std::span<const T>(grads).subspan(offsets_[t], tensors_[t].size);
        outs[t] = std::span<T>(average_).subspan(offsets_[t], tensors_[t].size);
        const compress_context ctx{rho, call_id{opt_.seed, step_, tensors_[t].id, rank_id()}, finite_checked};
        cstats[t] = compressor_.compress(range, states_[t], ctx, payloads_[t]);
      }
      exchange_.exchange_tensors(*comm_, std::as_const(compressor_),
                                 std::span<const payload>(payloads_),
                                 std::span<const std::span<T>>(outs), std::span<exchange_stats>(xstats));
      for (std::size_t t = 0; t < tensors_.size(); ++t) record(t, cstats[t], xstats[t], 0);
    } else {
      for (std::size_t t = 0; t < tensors_.size(); ++t) {
        const auto range = std::span<const T>(grads).subspan(offsets_[t], tensors_[t].size);
        const auto out = std::span<T>(average_).subspan(offsets_[t], tensors_[t].size);
        const compress_context ctx{rho, call_id{opt_.seed, step_, tensors_[t].id, rank_id()}, finite_checked};
        const compress_stats cs = compressor_.compress(range, states_[t], ctx, payload_);
        if constexpr (exchange_with_unused<Exchange, Compressor, Comm>) {
          // Picks the exchange left out (gTop-k) go back to the feedback: nothing is lost.
          const exchange_stats xs = exchange_.exchange(*comm_, compressor_, payload_, out, unused_);
          if constexpr (restores_feedback) {
            compressor_.feedback_policy().restore(states_[t], unused_.indices, unused_.values);
          }
          record(t, cs, xs, restores_feedback ? unused_.indices.size() : 0);
        } else {
          record(t, cs, exchange_.exchange(*comm_, compressor_, payload_, out), 0);
        }
      }
    }
    stats_.density = total_ ? static_cast<double>(stats_.selected) / static_cast<double>(total_) : 0.0;

    detail::stopwatch clock;
    apply_update(params);
    stats_.seconds.update = clock.lap();
    total_bytes_sent_ += stats_.bytes_sent;
    total_bytes_received_ += stats_.bytes_received;
    ++step_;
    return stats_;
  }

  [[nodiscard]] const step_stats& last_stats() const noexcept { return stats_; }
  [[nodiscard]] std::uint64_t steps_done() const noexcept { return step_; }
  [[nodiscard]] std::size_t size() const noexcept { return total_; }
  [[nodiscard]] std::size_t total_bytes_sent() const noexcept { return total_bytes_sent_; }
  [[nodiscard]] std::size_t total_bytes_received() const noexcept { return total_bytes_received_; }
  [[nodiscard]] const std::vector<tensor_spec>& tensors() const noexcept { return tensors_; }
  // The last averaged gradient (before weight decay and momentum).
  [[nodiscard]] std::span<const T> averaged_gradient() const noexcept { return average_; }
  [[nodiscard]] Compressor& compressor_instance() noexcept { return compressor_; }
  // The exchange, e.g. to tune topk_a2a's bucket size between steps.
  [[nodiscard]] Exchange& exchange_policy() noexcept { return exchange_; }
  [[nodiscard]] typename Compressor::state_type& feedback_state(std::size_t tensor_index) {
    return states_.at(tensor_index);
  }

  // Checkpoints: the step counter, every tensor's feedback buffers keyed by tensor id, and
  // the optimizer's velocity. load_state() accepts the tensors in any order, checks ids,
  // sizes, element type and buffer counts, and changes nothing unless all of it matches.
  void save_state(std::ostream& os) const {
    put(os, checkpoint_magic);
    put(os, checkpoint_version);
    put(os, static_cast<std::uint32_t>(sizeof(T)));
    put(os, step_);
    put(os, static_cast<std::uint32_t>(tensors_.size()));
    for (std::size_t t = 0; t < tensors_.size(); ++t) {
      // buffers() hands out mutable spans for load_state(); here they are only read.
      auto buffers = const_cast<typename Compressor::state_type&>(states_[t]).buffers();
      put(os, tensors_[t].id);
      put(os, static_cast<std::uint64_t>(tensors_[t].size));
      put(os, static_cast<std::uint32_t>(buffers.size()));
      for (const auto& b : buffers) put_array(os, std::span<const T>(b.data(), b.size()));
    }
    put(os, static_cast<std::uint64_t>(velocity_.size()));
    put_array(os, std::span<const T>(velocity_));
    if (!os) throw error("gradcomp::sparsified_sgd::save_state: the stream failed while writing");
  }

  void load_state(std::istream& is) {
    if (get<std::uint32_t>(is) != checkpoint_magic) fail_load("not a gradcomp checkpoint (bad magic)");
    if (const auto v = get<std::uint32_t>(is); v != checkpoint_version) {
      fail_load(detail::concat("checkpoint version ", v, " is not supported (this build reads version ",
                               checkpoint_version, ")"));
    }
    if (const auto sz = get<std::uint32_t>(is); sz != sizeof(T)) {
      fail_load(detail::concat("checkpoint holds ", sz, "-byte values, this optimizer uses ",
                               sizeof(T), "-byte values"));
    }
    const auto step = get<std::uint64_t>(is);
    const auto count = get<std::uint32_t>(is);
    if (count != tensors_.size()) {
      fail_load(detail::concat("checkpoint has ", count, " tensors, this optimizer has ", tensors_.size()));
    }
    std::vector<typename Compressor::state_type> states;
    states.reserve(tensors_.size());
    for (const auto& t : tensors_) states.push_back(compressor_.make_state(t.size));
    std::vector<bool> seen(tensors_.size(), false);
    for (std::uint32_t c = 0; c < count; ++c) {
      const auto id = get<std::uint32_t>(is);
      const auto n = get<std::uint64_t>(is);
      const auto nbuf = get<std::uint32_t>(is);
      std::size_t t = 0;
      while (t < tensors_.size() && tensors_[t].id != id) ++t;
      if (t == tensors_.size()) fail_load(detail::concat("checkpoint has unknown tensor id ", id));
      if (seen[t]) fail_load(detail::concat("checkpoint has tensor id ", id, " twice"));
      seen[t] = true;
      if (n != tensors_[t].size) {
        fail_load(detail::concat("tensor ", id, " has ", n, " elements in the checkpoint, ",
                                 tensors_[t].size, " here"));
      }
      auto buffers = states[t].buffers();
      if (nbuf != buffers.size()) {
        fail_load(detail::concat("tensor ", id, " has ", nbuf, " feedback buffers in the checkpoint, ",
                                 buffers.size(), " here (another feedback policy?)"));
      }
      for (auto& b : buffers) get_array(is, b);
    }
    const auto nvel = get<std::uint64_t>(is);
    if (nvel != velocity_.size()) {
      fail_load(detail::concat("checkpoint has a velocity of ", nvel, " elements, this optimizer ",
                               velocity_.size(), " (momentum set differently?)"));
    }
    std::vector<T> velocity(velocity_.size());
    get_array(is, std::span<T>(velocity));
    states_ = std::move(states);
    velocity_ = std::move(velocity);
    step_ = step;
  }

 private:
  // Exchanges that take all tensors of a step at once (topk_a2a, to fuse small ones).
  static constexpr bool fuses_tensors =
      requires(Exchange& x, Comm& comm, const Compressor& c, std::span<const payload> ps,
               std::span<const std::span<T>> outs, std::span<exchange_stats> st) {
        x.exchange_tensors(comm, c, ps, outs, st);
      };
  // Feedback policies that can take back picks an exchange left out (residual, dgc_momentum).
  static constexpr bool restores_feedback =
      requires(const typename Compressor::feedback_type& f, typename Compressor::state_type& st,
               std::span<const std::uint32_t> idx, std::span<const float> v) {
        f.restore(st, idx, v);
      };

  // This rank, for call_id::rank: each rank rounds with its own quantize stream.
  std::uint32_t rank_id() const { return static_cast<std::uint32_t>(comm_->rank()); }

  static constexpr std::uint32_t checkpoint_magic = 0x504b4347;  // "GCKP" little-endian
  static constexpr std::uint32_t checkpoint_version = 1;

  static std::vector<tensor_spec> specs_from_sizes(const std::vector<std::size_t>& sizes) {
    std::vector<tensor_spec> specs;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      specs.push_back(tensor_spec{static_cast<std::uint32_t>(i), sizes[i]});
    }
    return specs;
  }

  void check_options() const {
    detail::check_sgd_options("sparsified_sgd", opt_);
    if constexpr (requires { requires Compressor::feedback_type::applies_momentum; }) {
      if (opt_.momentum != 0.0) {
        detail::throw_invalid_argument(
            "sparsified_sgd", "momentum", opt_.momentum,
            "0 with dgc_momentum feedback (it applies momentum before compression)");
      }
    }
  }

  std::size_t tensor_of(std::size_t flat_index) const {
    const auto it = std::upper_bound(offsets_.begin(), offsets_.end(), flat_index);
    return static_cast<std::size_t>(it - offsets_.begin()) - 1;
  }

  void apply_update(std::span<T> params) {
    detail::sgd_update<T>(params.first(total_), average_, velocity_, opt_);
  }

  [[noreturn]] static void fail_load(const std::string& why) {
    throw invalid_argument("gradcomp::sparsified_sgd::load_state: " + why +
                           "; the optimizer state is unchanged");
  }

  template <class V>
  static void put(std::ostream& os, V v) {
    os.write(reinterpret_cast<const char*>(&v), sizeof(V));
  }
  static void put_array(std::ostream& os, std::span<const T> a) {
    os.write(reinterpret_cast<const char*>(a.data()), static_cast<std::streamsize>(a.size_bytes()));
  }
  template <class V>
  static V get(std::istream& is) {
    V v{};
    if (!is.read(reinterpret_cast<char*>(&v), sizeof(V))) fail_load("the checkpoint is truncated");
    return v;
  }
  static void get_array(std::istream& is, std::span<T> a) {
    if (!is.read(reinterpret_cast<char*>(a.data()), static_cast<std::streamsize>(a.size_bytes()))) {
      fail_load("the checkpoint is truncated");
    }
  }

  Comm* comm_;
  std::vector<tensor_spec> tensors_;
  std::vector<std::size_t> offsets_;
  std::size_t total_ = 0;
  Compressor compressor_;
  Exchange exchange_;
  sgd_options opt_;
  density_schedule schedule_;
  std::vector<typename Compressor::state_type> states_;
  std::vector<T> average_;
  std::vector<T> velocity_;
  payload payload_;
  std::vector<payload> payloads_;  // one per tensor, for exchanges that fuse tensors
  unused_picks unused_;
  step_stats stats_;
  std::uint64_t step_ = 0;
  std::size_t total_bytes_sent_ = 0;
  std::size_t total_bytes_received_ = 0;
};

}  // namespace gradcomp
