// gradcomp/torch/bucket_engine.hpp: gradcomp's compressor and exchanges chosen by name at run
// time, for callers that learn the policies from a configuration (the PyTorch hook,
// gradcomp.torch). Every valid combination is a compiled instantiation of the same templates
// that sparsified_sgd uses; the engine only removes the need to spell the types.
//
// It is split in two halves, so that the instantiations add up instead of multiplying:
// - compress_half<S, Q, F>: selection, quantization and the feedback state of each bucket
//   (keyed by an integer bucket id);
// - exchange_half<Q, summable, X, Comm>: the exchange, which needs of the compressor only
//   decoding (the quantizer) and whether payloads can be added without decoding.
// bucket_engine<Comm> runs one bucket through both: compress, exchange (the mean over ranks is
// written over the bucket), and give the picks an exchange left out (gtopk) back to the
// feedback. Floats only: other dtypes are staged through float32 by the caller.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <gradcomp/comm/in_process.hpp>  // check_config instantiates the exchanges for it
#include <gradcomp/compressor.hpp>
#include <gradcomp/concepts.hpp>
#include <gradcomp/error.hpp>
#include <gradcomp/exchange.hpp>
#include <gradcomp/feedback.hpp>
#include <gradcomp/quantize.hpp>
#include <gradcomp/select.hpp>
#include <gradcomp/sgd.hpp>

namespace gradcomp::runtime {

// The names a configuration may use, in the order error messages list them.
inline constexpr std::string_view selector_names[] = {
    "topk", "gaussiank", "gaussiank_published", "randomk", "threshold", "dgc", "dense"};
inline constexpr std::string_view quantizer_names[] = {"fp32", "fp16", "bf16",
                                                       "qsgd", "terngrad", "sign"};
inline constexpr std::string_view feedback_names[] = {"residual", "none", "dgc"};
inline constexpr std::string_view exchange_names[] = {"allreduce", "allgather", "gtopk", "a2a",
                                                      "auto"};

struct engine_config {
  std::string selector = "topk";
  std::string quantizer = "fp32";
  std::string feedback = "residual";
  std::string exchange = "allgather";
  unsigned bits = 4;              // qsgd: bits per value, 2..16
  unsigned bucket_size = 512;     // qsgd, terngrad, sign: values sharing one scale
  double threshold = 0.0;         // selector "threshold": |g| >= threshold is sent
  double dgc_momentum = 0.9;      // feedback "dgc": momentum m, [0, 1)
  double dgc_clip_norm = 0.0;     // feedback "dgc": clip ||g|| before accumulating; 0 = off
  std::uint64_t seed = 0;         // random selectors and stochastic rounding
};

// The error for a name that is not among `names`: lists what is.
template <std::size_t N>
[[noreturn]] inline void unknown_name(std::string_view what, const std::string& got,
                                      const std::string_view (&names)[N]) {
  std::string list;
  for (std::size_t i = 0; i < N; ++i) list += detail::concat(i ? ", " : "", "'", names[i], "'");
  throw invalid_argument(detail::concat("gradcomp: unknown ", what, " '", got,
                                        "'; allowed: one of ", list));
}

// What one bucket's step reports.
struct bucket_stats {
  std::int64_t bucket = 0;
  std::size_t n = 0;
  std::size_t selected = 0;
  double density = 0.0;  // achieved: selected / n
  double threshold = 0.0;
  // The top-k contraction of this rank's selection (compress_stats::contraction); NaN where
  // not measured.
  double contraction = std::numeric_limits<double>::quiet_NaN();
  std::size_t bytes_sent = 0;
  std::size_t bytes_received = 0;
  std::size_t restored = 0;  // picks the exchange left out, given back to the feedback
  std::string exchange;      // the exchange that ran (auto: the one it chose)
  double seconds_accumulate = 0.0;
  double seconds_select = 0.0;
  double seconds_encode = 0.0;
  double seconds_exchange = 0.0;
};

// ---- the compressing half ---------------------------------------------------------------

// Each bucket's feedback state is kept twice: the committed state, and the state a step in
// flight makes from it (compress() writes it, restore() adds to it). commit() keeps the new
// states of every bucket compressed since the last commit or discard; discard() forgets them.
// A step that fails anywhere therefore leaves every bucket's state as it was.
class compress_half {
 public:
  virtual ~compress_half() = default;
  virtual compress_stats compress(std::int64_t bucket, std::span<const float> g,
                                  const compress_context& ctx, payload& out) = 0;
  virtual void restore(std::int64_t bucket, std::span<const std::uint32_t> idx,
                       std::span<const float> values) = 0;
  virtual void commit() = 0;
  virtual void discard() = 0;
  // Whether a bucket's new state waits for commit() or discard().
  [[nodiscard]] virtual bool pending() const = 0;
  // The bucket's feedback buffers (residual: e; dgc: u, v), or none before its first step.
  virtual std::vector<std::span<float>> buffers(std::int64_t bucket) = 0;
  // Makes (zeroed) state for a bucket of n elements, replacing what was there.
  virtual std::vector<std::span<float>> reset(std::int64_t bucket, std::size_t n) = 0;
  virtual void clear() = 0;
  [[nodiscard]] virtual std::size_t buffer_count() const = 0;
  [[nodiscard]] virtual bool summable() const = 0;
  // Whether restore() gives values back (the feedback has restore(); no_feedback has not).
  [[nodiscard]] virtual bool restores() const = 0;
  // The decoded values of p in payload order (what the feedback subtracted).
  virtual void decode(const payload& p, std::vector<float>& values) const = 0;
};

template <class S, class Q, class F>
class compress_impl final : public compress_half {
  using C = compressor<S, Q, F, float>;

 public:
  compress_impl(S s, Q q, F f) : c_(std::move(s), std::move(q), std::move(f)) {}

  compress_stats compress(std::int64_t bucket, std::span<const float> g,
                          const compress_context& ctx, payload& out) override {
    auto it = states_.find(bucket);
    if (it == states_.end()) it = states_.emplace(bucket, make_entry(g.size())).first;
    entry& e = it->second;
    if (e.n != g.size()) {
      detail::throw_invalid_argument(
          "bucket_engine", "bucket size", g.size(),
          detail::concat("the size bucket ", bucket, " had before (", e.n,
                         "); its feedback state is kept per bucket id"));
    }
    e.pending = false;  // a second compression of the bucket replaces the first
    const compress_stats cs = c_.compress(g, std::as_const(e.st), e.staged, ctx, out);
    e.pending = true;
    return cs;
  }

  void restore(std::int64_t bucket, std::span<const std::uint32_t> idx,
               std::span<const float> values) override {
    if constexpr (can_restore) c_.feedback().restore(states_.at(bucket).staged, idx, values);
  }

  void commit() override {
    for (auto& [bucket, e] : states_) {
      if (e.pending) std::swap(e.st, e.staged);
      e.pending = false;
    }
  }
  void discard() override {
    for (auto& [bucket, e] : states_) e.pending = false;
  }
  [[nodiscard]] bool pending() const override {
    for (const auto& [bucket, e] : states_) {
      if (e.pending) return true;
    }
    return false;
  }

  std::vector<std::span<float>> buffers(std::int64_t bucket) override {
    const auto it = states_.find(bucket);
    if (it == states_.end()) return {};
    return it->second.st.buffers();
  }

  std::vector<std::span<float>> reset(std::int64_t bucket, std::size_t n) override {
    states_.insert_or_assign(bucket, make_entry(n));
    return states_.at(bucket).st.buffers();
  }

  void clear() override { states_.clear(); }
  [[nodiscard]] std::size_t buffer_count() const override {
    return c_.make_state(0).buffers().size();
  }
  [[nodiscard]] bool summable() const override { return C::summable; }
  [[nodiscard]] bool restores() const override { return can_restore; }
  void decode(const payload& p, std::vector<float>& values) const override {
    values.resize(p.count);
    c_.decode_values(p, values);
  }

 private:
  static constexpr bool can_restore = restores_picks<F, float>;

  struct entry {
    typename C::state_type st;      // committed
    typename C::state_type staged;  // what the step in flight makes of it
    std::size_t n = 0;  // the bucket's size (a feedback without buffers has no other record)
    bool pending = false;
  };

  entry make_entry(std::size_t n) const { return entry{c_.make_state(n), c_.make_state(n), n, false}; }

  C c_;
  std::map<std::int64_t, entry> states_;
};

// ---- the exchanging half ----------------------------------------------------------------

template <class Comm>
class exchange_half {
 public:
  virtual ~exchange_half() = default;
  virtual exchange_stats exchange(Comm& comm, const payload& p, std::span<float> out,
                                  unused_picks& unused) = 0;
};

template <class Q, bool Summable, class X, class Comm>
class exchange_impl final : public exchange_half<Comm> {
  // Decoding needs the quantizer only; the selector stands for whether payloads of two ranks
  // share their indices (randomk, dense) or not (every other selector).
  using decoder = compressor<std::conditional_t<Summable, randomk, topk>, Q, no_feedback, float>;

 public:
  exchange_impl(Q q, X x) : decoder_(std::conditional_t<Summable, randomk, topk>{}, std::move(q)), x_(std::move(x)) {}

  exchange_stats exchange(Comm& comm, const payload& p, std::span<float> out,
                          unused_picks& unused) override {
    unused.clear();
    if constexpr (exchange_with_unused<X, decoder, Comm>) {
      return x_.exchange(comm, decoder_, p, out, unused);
    } else {
      return x_.exchange(comm, decoder_, p, out);
    }
  }

 private:
  decoder decoder_;
  X x_;
};

// ---- choosing by name ---------------------------------------------------------------------

template <class Fn>
void with_quantizer(const engine_config& c, Fn&& fn) {
  if (c.quantizer == "fp32") return fn(identity{});
  if (c.quantizer == "fp16") return fn(fp16{});
  if (c.quantizer == "bf16") return fn(bf16{});
  if (c.quantizer == "qsgd") return fn(qsgd::with_bits(c.bits, c.bucket_size));
  if (c.quantizer == "terngrad") return fn(terngrad(c.bucket_size));
  if (c.quantizer == "sign") return fn(scaled_sign(c.bucket_size));
  unknown_name("quantizer", c.quantizer, quantizer_names);
}

template <class Fn>
void with_selector(const engine_config& c, Fn&& fn) {
  if (c.selector == "topk") return fn(topk{});
  if (c.selector == "gaussiank") return fn(gaussiank{});
  if (c.selector == "gaussiank_published") return fn(gaussiank::published());
  if (c.selector == "randomk") return fn(randomk{});
  if (c.selector == "threshold") {
    if (!(c.threshold > 0.0 && c.threshold < 1e300)) {
      detail::throw_invalid_argument("bucket_engine", "threshold", c.threshold,
                                     "0 < threshold < inf (selector 'threshold' needs it)");
    }
    return fn(threshold{c.threshold});
  }
  if (c.selector == "dgc") return fn(dgc_sampling{});
  if (c.selector == "dense") return fn(dense{});
  unknown_name("selector", c.selector, selector_names);
}

template <class Fn>
void with_feedback(const engine_config& c, Fn&& fn) {
  if (c.feedback == "residual") return fn(residual{});
  if (c.feedback == "none") return fn(no_feedback{});
  if (c.feedback == "dgc") {
    if (!(c.dgc_momentum >= 0.0 && c.dgc_momentum < 1.0)) {
      detail::throw_invalid_argument("bucket_engine", "dgc_momentum", c.dgc_momentum,
                                     "0 <= dgc_momentum < 1");
    }
    if (!(c.dgc_clip_norm >= 0.0 && c.dgc_clip_norm < 1e300)) {
      detail::throw_invalid_argument("bucket_engine", "dgc_clip_norm", c.dgc_clip_norm,
                                     "0 (off) <= dgc_clip_norm < inf");
    }
    return fn(dgc_momentum{c.dgc_momentum, c.dgc_clip_norm});
  }
  unknown_name("feedback", c.feedback, feedback_names);
}

template <class Fn>
void with_exchange(const engine_config& c, Fn&& fn) {
  if (c.exchange == "allreduce") return fn(dense_allreduce{});
  if (c.exchange == "allgather") return fn(sparse_allgather{});
  if (c.exchange == "gtopk") return fn(gtopk{});
  if (c.exchange == "a2a") return fn(topk_a2a{});
  if (c.exchange == "auto") return fn(auto_exchange{});
  unknown_name("exchange", c.exchange, exchange_names);
}

// DGC's selection goes with DGC's momentum correction (it samples the corrected velocity);
// the momentum correction goes with the two top-k selections that DGC was published with.
template <class S, class F>
inline constexpr bool valid_pair =
    std::is_same_v<S, dgc_sampling> ? std::is_same_v<F, dgc_momentum>
    : std::is_same_v<F, dgc_momentum> ? std::is_same_v<S, topk>
                                      : true;

inline std::unique_ptr<compress_half> make_compress_half(const engine_config& c) {
  std::unique_ptr<compress_half> out;
  with_selector(c, [&](auto s) {
    with_quantizer(c, [&](auto q) {
      with_feedback(c, [&](auto f) {
        using S = std::remove_cvref_t<decltype(s)>;
        using Q = std::remove_cvref_t<decltype(q)>;
        using F = std::remove_cvref_t<decltype(f)>;
        if constexpr (valid_pair<S, F>) {
          out = std::make_unique<compress_impl<S, Q, F>>(s, q, f);
        } else {
          throw invalid_argument(detail::concat(
              "gradcomp: selector '", c.selector, "' with feedback '", c.feedback,
              "' is not a valid combination; allowed: selector 'dgc' with feedback 'dgc' "
              "(DGC's momentum correction), feedback 'dgc' with selector 'topk' or 'dgc', and "
              "feedback 'residual' or 'none' with every other selector"));
        }
      });
    });
  });
  return out;
}

template <class Comm>
std::unique_ptr<exchange_half<Comm>> make_exchange_half(const engine_config& c, bool summable) {
  std::unique_ptr<exchange_half<Comm>> out;
  with_quantizer(c, [&](auto q) {
    with_exchange(c, [&](auto x) {
      using Q = std::remove_cvref_t<decltype(q)>;
      using X = std::remove_cvref_t<decltype(x)>;
      auto make = [&]<bool Summable>(std::bool_constant<Summable>) {
        if constexpr (std::is_same_v<X, dense_allreduce> && !(Summable && Q::summable)) {
          throw invalid_argument(detail::concat(
              "gradcomp: exchange 'allreduce' adds the payloads of all ranks as they are, which "
              "needs every rank to send the same indices (selector 'dense' or 'randomk') with a "
              "summable quantizer ('fp32', 'fp16' or 'bf16'); got selector '", c.selector,
              "' with quantizer '", c.quantizer,
              "'. Allowed for this selector and quantizer: exchange 'allgather', 'gtopk', 'a2a' "
              "or 'auto'"));
        } else {
          out = std::make_unique<exchange_impl<Q, Summable, X, Comm>>(q, x);
        }
      };
      if (summable) {
        make(std::true_type{});
      } else {
        make(std::false_type{});
      }
    });
  });
  return out;
}

// Checks a configuration (names, combination, parameters) without a communicator: what a
// constructor should refuse at once rather than at the first step.
inline void check_config(const engine_config& c) {
  auto half = make_compress_half(c);
  // The exchange half's own refusals (allreduce of a payload that cannot be added) depend
  // only on names: re-run them with the in-process communicator's type.
  (void)make_exchange_half<in_process_comm>(c, half->summable());
}

// One rank's engine over a communicator.
template <class Comm>
class bucket_engine {
 public:
  bucket_engine(Comm& comm, engine_config config)
      : comm_(&comm), config_(std::move(config)), compress_(make_compress_half(config_)),
        exchange_(make_exchange_half<Comm>(config_, compress_->summable())) {}

  // Compresses g (one bucket's gradients) with the bucket's feedback state, exchanges, and
  // writes the mean over ranks of what every rank sent over g. The bucket's new feedback state
  // waits for commit(), which the caller makes once every bucket of the step has succeeded;
  // discard() (or a run() for another step) forgets the new states, so that a step that fails
  // anywhere leaves all feedback state as it was. A failed exchange also leaves g as it was.
  bucket_stats run(std::int64_t bucket, std::span<float> g, std::uint64_t step, double density) {
    if (bucket < 0 || bucket > std::int64_t{0xffffffff}) {
      detail::throw_invalid_argument("bucket_engine::run", "bucket", bucket, "0 <= bucket < 2^32");
    }
    if (compress_->pending() && step != pending_step_) compress_->discard();
    pending_step_ = step;
    const compress_context ctx{density, call_id{config_.seed, step, static_cast<std::uint32_t>(bucket),
                                                static_cast<std::uint32_t>(comm_->rank())}};
    const compress_stats cs = compress_->compress(bucket, g, ctx, payload_);
    // The exchange writes the mean over g only once it has succeeded: into a buffer first.
    mean_.resize(g.size());
    exchange_stats xs;
    try {
      xs = exchange_->exchange(*comm_, payload_, std::span<float>(mean_), unused_);
    } catch (...) {
      compress_->discard();
      throw;
    }
    std::copy(mean_.begin(), mean_.end(), g.begin());
    if (!unused_.indices.empty()) compress_->restore(bucket, unused_.indices, unused_.values);
    bucket_stats st;
    st.bucket = bucket;
    st.n = g.size();
    st.selected = cs.selection.count;
    st.density = st.n ? static_cast<double>(st.selected) / static_cast<double>(st.n) : 0.0;
    st.threshold = cs.selection.threshold;
    st.contraction = cs.contraction;
    st.bytes_sent = xs.bytes_sent;
    st.bytes_received = xs.bytes_received;
    st.restored = compress_->restores() ? unused_.indices.size() : 0;
    st.exchange = std::string(xs.name);
    st.seconds_accumulate = cs.seconds_accumulate;
    st.seconds_select = cs.seconds_select;
    st.seconds_encode = cs.seconds_encode;
    st.seconds_exchange = xs.seconds;
    return st;
  }

  [[nodiscard]] compress_half& feedback() noexcept { return *compress_; }
  [[nodiscard]] const engine_config& config() const noexcept { return config_; }
  [[nodiscard]] Comm& comm() noexcept { return *comm_; }

  // Keeps the new feedback state of every bucket run since the last commit or discard.
  void commit() { compress_->commit(); }
  // Forgets them: every bucket's state is what the last commit left.
  void discard() { compress_->discard(); }

 private:
  Comm* comm_;
  engine_config config_;
  std::unique_ptr<compress_half> compress_;
  std::unique_ptr<exchange_half<Comm>> exchange_;
  payload payload_;
  unused_picks unused_;
  std::vector<float> mean_;
  std::uint64_t pending_step_ = 0;
};

}  // namespace gradcomp::runtime
