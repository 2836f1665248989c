// gradcomp/runtime/bucket_engine.hpp: gradcomp's compressor and exchanges chosen by name at
// run time (runtime/registry.hpp), for callers that learn the policies from a configuration
// (the PyTorch hook, gradcomp.torch). Every valid combination is a compiled instantiation of
// the same templates that sparsified_sgd uses; the engine only removes the need to spell the
// types. It needs no torch header: any gradcomp communicator runs it.
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

#include <gradcomp/compressor.hpp>
#include <gradcomp/concepts.hpp>
#include <gradcomp/detail/staged_feedback.hpp>
#include <gradcomp/detail/tensor_record.hpp>
#include <gradcomp/error.hpp>
#include <gradcomp/runtime/registry.hpp>
#include <gradcomp/sgd.hpp>

namespace gradcomp::runtime {

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
  // Returns how many picks the feedback took (0 where it drops them).
  virtual std::size_t restore(std::int64_t bucket, std::span<const std::uint32_t> idx,
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
    auto it = slots_.find(bucket);
    if (it == slots_.end()) it = slots_.emplace(bucket, feedback_.add(c_, g.size())).first;
    if (const std::size_t n = feedback_.elements(it->second); n != g.size()) {
      detail::throw_invalid_argument(
          "bucket_engine", "bucket size", g.size(),
          detail::concat("the size bucket ", bucket, " had before (", n,
                         "); its feedback state is kept per bucket id"));
    }
    return feedback_.compress(c_, it->second, g, ctx, out);
  }

  std::size_t restore(std::int64_t bucket, std::span<const std::uint32_t> idx,
                      std::span<const float> values) override {
    return feedback_.restore(c_, slots_.at(bucket), idx, values);
  }

  void commit() override { feedback_.commit(); }
  void discard() override { feedback_.discard(); }
  [[nodiscard]] bool pending() const override { return feedback_.pending(); }

  std::vector<std::span<float>> buffers(std::int64_t bucket) override {
    const auto it = slots_.find(bucket);
    if (it == slots_.end()) return {};
    return feedback_.committed(it->second).buffers();
  }

  std::vector<std::span<float>> reset(std::int64_t bucket, std::size_t n) override {
    const auto it = slots_.find(bucket);
    if (it == slots_.end()) {
      slots_.emplace(bucket, feedback_.add(c_, n));
    } else {
      feedback_.reset(c_, it->second, n);
    }
    return feedback_.committed(slots_.at(bucket)).buffers();
  }

  void clear() override {
    slots_.clear();
    feedback_.clear();
  }
  [[nodiscard]] std::size_t buffer_count() const override {
    return c_.make_state(0).buffers().size();
  }
  void decode(const payload& p, std::vector<float>& values) const override {
    values.resize(p.count);
    c_.decode_values(p, values);
  }

 private:
  C c_;
  detail::staged_feedback<C> feedback_;
  std::map<std::int64_t, std::size_t> slots_;  // bucket id -> its slot in feedback_
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
// Both take a configuration check_config() has passed (bucket_engine checks it first); the
// combinations it refuses are not instantiated.

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
          check_config(c);  // refuses the pair, naming it
          throw error("gradcomp::bucket_engine: internal error: check_config passed a "
                      "combination that has no instantiation");
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
          check_config(c);  // refuses allreduce of payloads that cannot be added
          throw error("gradcomp::bucket_engine: internal error: check_config passed a "
                      "combination that has no instantiation");
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

// One rank's engine over a communicator.
template <class Comm>
class bucket_engine {
 public:
  // The configuration is checked whole (check_config) before anything is made.
  bucket_engine(Comm& comm, engine_config config)
      : comm_(&comm), config_(checked(std::move(config))), compress_(make_compress_half(config_)),
        exchange_(make_exchange_half<Comm>(config_, summable(config_))) {}

  // Compresses g (one bucket's gradients) with the bucket's feedback state, exchanges, and
  // writes the mean over ranks of what every rank sent over g. The bucket's new feedback state
  // waits for commit(), which the caller makes once every bucket of the step has succeeded;
  // discard() (or a run() for another step) forgets the new states, so that a step that fails
  // anywhere leaves all feedback state as it was. A failed exchange also leaves g as it was.
  //
  // The statistics are the drivers' tensor_stats, with the bucket id as the tensor's id.
  tensor_stats run(std::int64_t bucket, std::span<float> g, std::uint64_t step, double density) {
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
    const std::size_t restored =
        unused_.indices.empty() ? 0 : compress_->restore(bucket, unused_.indices, unused_.values);
    return detail::tensor_stats_of(static_cast<std::uint32_t>(bucket), g.size(), cs, xs, restored);
  }

  [[nodiscard]] compress_half& feedback() noexcept { return *compress_; }
  [[nodiscard]] const engine_config& config() const noexcept { return config_; }
  [[nodiscard]] Comm& comm() noexcept { return *comm_; }

  // Keeps the new feedback state of every bucket run since the last commit or discard.
  void commit() { compress_->commit(); }
  // Forgets them: every bucket's state is what the last commit left.
  void discard() { compress_->discard(); }

 private:
  static engine_config checked(engine_config c) {
    check_config(c);
    return c;
  }

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
