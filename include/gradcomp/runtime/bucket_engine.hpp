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

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <gradcomp/compressor.hpp>
#include <gradcomp/concepts.hpp>
#include <gradcomp/detail/comm_common.hpp>
#include <gradcomp/detail/nonfinite.hpp>
#include <gradcomp/engine/staged_feedback.hpp>
#include <gradcomp/engine/tensor_record.hpp>
#include <gradcomp/detail/bitpack.hpp>
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
  // Forgets a bucket's state, committed and staged, and frees it (a later run of the bucket
  // starts from zeros); nothing happens for a bucket without state.
  virtual void drop(std::int64_t bucket) = 0;
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
    const std::size_t i = feedback_.slot_for(bucket, g.size(), [&] { return fresh(g.size()); });
    return feedback_.compress(c_, i, g, ctx, out);
  }

  std::size_t restore(std::int64_t bucket, std::span<const std::uint32_t> idx,
                      std::span<const float> values) override {
    return feedback_.restore(c_, feedback_.find(bucket).value(), idx, values);
  }

  void commit() override { feedback_.commit(); }
  void discard() override { feedback_.discard(); }
  [[nodiscard]] bool pending() const override { return feedback_.pending(); }

  std::vector<std::span<float>> buffers(std::int64_t bucket) override {
    const auto i = feedback_.find(bucket);
    if (!i) return {};
    return feedback_.committed(*i).buffers();
  }

  std::vector<std::span<float>> reset(std::int64_t bucket, std::size_t n) override {
    auto [committed, staged] = fresh(n);
    return feedback_.committed(feedback_.put(bucket, std::move(committed), std::move(staged), n))
        .buffers();
  }

  void drop(std::int64_t bucket) override {
    feedback_.drop(bucket, c_.make_state(0), c_.make_state(0));
  }

  void clear() override { feedback_.clear(); }
  [[nodiscard]] std::size_t buffer_count() const override {
    return c_.make_state(0).buffers().size();
  }
  void decode(const payload& p, std::vector<float>& values) const override {
    values.resize(p.count);
    c_.decode_values(p, values);
  }

 private:
  // Zeroed committed and staged state of n elements.
  std::pair<typename C::state_type, typename C::state_type> fresh(std::size_t n) const {
    return {c_.make_state(n), c_.make_state(n)};
  }

  C c_;
  detail::staged_feedback<C, detail::bucket_slots> feedback_;  // every bucket's, by bucket id
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

// ---- the bucket's agreement -----------------------------------------------------------------
// Before a bucket's exchange every rank allgathers a small record: which step and bucket it is
// about to exchange, and whether its own part failed (a non-finite gradient, or any other
// error, with the error's text). So a rank that fails locally still takes part, every rank
// learns of the failure at once with its cause, and buckets of different steps or indices
// never pair up in an exchange.

enum class bucket_outcome : std::uint8_t { ok = 0, nonfinite = 1, failed = 2 };

struct bucket_record {
  std::uint64_t step = 0;
  std::uint32_t bucket = 0;
  bucket_outcome outcome = bucket_outcome::ok;
  std::string message;  // the error's text, at most bucket_message_max bytes
};

inline constexpr std::size_t bucket_record_head = 20;  // "GCBK", step, bucket, outcome, 0, length
inline constexpr std::size_t bucket_message_max = 1024;

namespace detail_engine {

inline constexpr std::byte magic[4] = {std::byte{'G'}, std::byte{'C'}, std::byte{'B'},
                                       std::byte{'K'}};

inline std::vector<std::byte> write_record(const bucket_record& r) {
  const std::size_t len = std::min(r.message.size(), bucket_message_max);
  std::vector<std::byte> out(bucket_record_head + len);
  std::memcpy(out.data(), magic, 4);
  detail::store_le64(out.data() + 4, r.step);
  detail::store_le32(out.data() + 12, r.bucket);
  out[16] = static_cast<std::byte>(r.outcome);
  out[17] = std::byte{0};
  detail::store_le16(out.data() + 18, static_cast<std::uint16_t>(len));
  std::memcpy(out.data() + bucket_record_head, r.message.data(), len);
  return out;
}

// Rank `rank`'s record from its `size` bytes; a communicator_error for anything that is not one.
inline bucket_record read_record(const std::byte* in, std::size_t size, std::size_t rank) {
  const auto refuse = [&](std::string_view why) {
    throw communicator_error(detail::concat(
        "gradcomp: rank ", rank, " sent ", size, " bytes that are not a bucket "
        "record (", why, "): the ranks are not running the same step of the same engine, or run "
        "different gradcomp versions"));
  };
  if (size < bucket_record_head || std::memcmp(in, magic, 4) != 0) refuse("no \"GCBK\" head");
  bucket_record r;
  r.step = detail::load_le64(in + 4);
  r.bucket = detail::load_le32(in + 12);
  const auto outcome = static_cast<std::uint8_t>(in[16]);
  if (outcome > 2) refuse(detail::concat("outcome ", unsigned{outcome}, "; allowed 0, 1, 2"));
  r.outcome = static_cast<bucket_outcome>(outcome);
  const std::size_t len = detail::load_le16(in + 18);
  if (len > bucket_message_max || size != bucket_record_head + len) {
    refuse(detail::concat("a message of ", len, " bytes in ", size, "; allowed: at most ",
                          bucket_message_max, " and exactly the bytes that follow the head"));
  }
  r.message.assign(reinterpret_cast<const char*>(in + bucket_record_head), len);
  return r;
}

}  // namespace detail_engine

// Allgathers every rank's record for (step, bucket) and returns them in rank order, having
// refused (communicator_error, the same on every rank) records that are malformed or name
// another step or bucket.
template <class Comm>
std::vector<bucket_record> agree_on_bucket(Comm& comm, const bucket_record& mine,
                                           std::vector<std::byte>& scratch) {
  const std::vector<std::byte> bytes = detail_engine::write_record(mine);
  std::vector<std::size_t> counts;
  detail::allgatherv_within(comm, std::span<const std::byte>(bytes), scratch, counts,
                            receive_limit{bucket_record_head + bucket_message_max},
                            "bucket_engine: the bucket's agreement");
  std::vector<bucket_record> all;
  all.reserve(counts.size());
  std::size_t offset = 0;
  for (std::size_t r = 0; r < counts.size(); ++r) {
    if (counts[r] > scratch.size() - offset) {
      throw communicator_error(detail::concat("gradcomp: rank ", r, " announced ",
                                              counts[r], " bytes beyond what arrived"));
    }
    all.push_back(detail_engine::read_record(scratch.data() + offset, counts[r], r));
    offset += counts[r];
  }
  for (std::size_t r = 1; r < all.size(); ++r) {
    if (all[r].step != all[0].step || all[r].bucket != all[0].bucket) {
      throw communicator_error(detail::concat(
          "gradcomp: ranks are at different buckets: rank ", r, " is at step ",
          all[r].step, ", bucket ", all[r].bucket, "; rank 0 at step ", all[0].step, ", bucket ",
          all[0].bucket, " (every rank must run the same buckets in the same order; no rank "
          "exchanged)"));
    }
  }
  return all;
}

// The bucket's agreement for an engine (bucket_engine here, gradcomp.torch's CUDA engine):
// returns false when every rank succeeded, true when the bucket is skipped (skip_nonfinite and
// only non-finite failures), and otherwise throws on every rank, the failing ranks their own
// exception (`local`). Calls discard() (which forgets the step's new feedback states) whenever
// a rank failed or the agreement itself did.
template <class Comm, class Discard>
bool settle_bucket(Comm& comm, const bucket_record& mine, const std::exception_ptr& local,
                   bool skip_nonfinite, std::vector<std::byte>& scratch, Discard&& discard) {
  std::vector<bucket_record> all;
  try {
    all = agree_on_bucket(comm, mine, scratch);
  } catch (...) {
    discard();
    throw;
  }
  std::size_t first_failed = all.size();
  bool only_nonfinite = true;
  for (std::size_t r = 0; r < all.size(); ++r) {
    if (all[r].outcome == bucket_outcome::ok) continue;
    if (first_failed == all.size()) first_failed = r;
    only_nonfinite = only_nonfinite && all[r].outcome == bucket_outcome::nonfinite;
  }
  if (first_failed == all.size()) return false;
  discard();
  if (only_nonfinite && skip_nonfinite) return true;
  if (local) std::rethrow_exception(local);
  const bucket_record& bad = all[first_failed];
  const std::string text = detail::concat(
      "gradcomp: bucket ", bad.bucket, " of step ", bad.step, " failed on rank ", first_failed,
      " (no rank exchanged it, and no feedback state changed): ", bad.message);
  if (bad.outcome == bucket_outcome::nonfinite) throw nonfinite_error(text);
  throw communicator_error(text);
}

// An engine's fail(): for a caller whose own part of the bucket failed before run(), takes part
// in the bucket's agreement as failed with `message` (so that the other ranks throw at once,
// carrying it), calls discard(), and throws invalid_argument(message) here.
template <class Comm, class Discard>
[[noreturn]] void fail_bucket(Comm& comm, std::int64_t bucket, std::uint64_t step,
                              std::string message, bool skip_nonfinite,
                              std::vector<std::byte>& scratch, Discard&& discard) {
  const std::exception_ptr local = std::make_exception_ptr(invalid_argument(message));
  const bucket_record mine{step, static_cast<std::uint32_t>(bucket), bucket_outcome::failed,
                           std::move(message)};
  settle_bucket(comm, mine, local, skip_nonfinite, scratch, discard);
  std::rethrow_exception(local);  // settle_bucket() rethrows it; for the compiler
}

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
          throw error("gradcomp: internal error: check_config passed a "
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
          throw error("gradcomp: internal error: check_config passed a "
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

// A name for each tensor of a bucket, in order, with its element count: run() names the one
// whose gradient is not finite in its refusal (the parameter, not the bucket's element index).
struct tensor_label {
  std::string name;
  std::size_t size = 0;
};

// The refusal of a non-finite value in g in the caller's words: "the gradient of parameter
// 'name' (bucket b) holds nan at element e; ...". `fallback` where g holds none or the labels
// do not cover g.
inline std::string name_nonfinite(std::uint32_t bucket, std::span<const float> g,
                                  std::span<const tensor_label> labels, std::string fallback) {
  const std::size_t bad = detail::first_nonfinite(g);
  if (bad == g.size()) return fallback;
  std::size_t at = bad;
  for (const auto& label : labels) {
    if (at < label.size) {
      const float v = g[bad];
      return detail::concat("the gradient of parameter '", label.name, "' (bucket ", bucket,
                            ") holds ", std::isnan(v) ? "nan" : v > 0 ? "inf" : "-inf",
                            " at element ", at,
                            "; non-finite gradients are refused before any rank's state changes");
    }
    at -= label.size;
  }
  return fallback;
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
  //
  // Every rank first agrees on the bucket (agree_on_bucket): a rank whose compression failed
  // still takes part, and then every rank throws: the failing rank its own exception, the others
  // nonfinite_error (a non-finite gradient) or communicator_error naming the rank and carrying
  // its message. With config.skip_nonfinite, a bucket whose only failures are non-finite
  // gradients is skipped on every rank instead: g is filled with NaN (what an allreduce of it
  // would give), the step's new feedback states are forgotten, and skipped() is true.
  // `labels` (optional): see tensor_label.
  tensor_stats run(std::int64_t bucket, std::span<float> g, std::uint64_t step, double density,
                   std::span<const tensor_label> labels = {}) {
    if (bucket < 0 || bucket > std::int64_t{0xffffffff}) {
      detail::throw_invalid_argument("bucket_engine::run", "bucket", bucket, "0 <= bucket < 2^32");
    }
    if (compress_->pending() && step != pending_step_) compress_->discard();
    pending_step_ = step;
    skipped_ = false;
    const auto id = static_cast<std::uint32_t>(bucket);
    const compress_context ctx{density, call_id{config_.seed, step, id,
                                                static_cast<std::uint32_t>(comm_->rank())}};
    compress_stats cs;
    bucket_record mine{step, id, bucket_outcome::ok, {}};
    std::exception_ptr local;
    try {
      cs = compress_->compress(bucket, g, ctx, payload_);
    } catch (const nonfinite_error& e) {
      mine.outcome = bucket_outcome::nonfinite;
      if (labels.empty()) {
        local = std::current_exception();
        mine.message = e.what();
      } else {
        mine.message = name_nonfinite(id, g, labels, e.what());
        local = std::make_exception_ptr(nonfinite_error(mine.message));
      }
    } catch (const std::exception& e) {
      local = std::current_exception();
      mine.outcome = bucket_outcome::failed;
      mine.message = e.what();
    }
    if (settle(mine, local)) {
      std::fill(g.begin(), g.end(), std::numeric_limits<float>::quiet_NaN());
      skipped_ = true;
      return detail::tensor_stats_of(id, g.size(), compress_stats{}, exchange_stats{}, 0);
    }
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

  // Whether the last run() skipped its bucket (config.skip_nonfinite).
  [[nodiscard]] bool skipped() const noexcept { return skipped_; }

  // For a caller whose own part of the bucket failed before run(): takes part in the bucket's
  // agreement as failed with `message` (so that the other ranks throw at once, carrying it),
  // forgets the step's new feedback states, and throws invalid_argument(message) here.
  [[noreturn]] void fail(std::int64_t bucket, std::uint64_t step, std::string message) {
    fail_bucket(*comm_, bucket, step, std::move(message), config_.skip_nonfinite, record_scratch_,
                [this] { compress_->discard(); });
  }

  // Keeps the new feedback state of every bucket run since the last commit or discard.
  void commit() { compress_->commit(); }
  // Forgets them: every bucket's state is what the last commit left.
  void discard() { compress_->discard(); }

 private:
  bool settle(const bucket_record& mine, const std::exception_ptr& local) {
    return settle_bucket(*comm_, mine, local, config_.skip_nonfinite, record_scratch_,
                         [this] { compress_->discard(); });
  }

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
  std::vector<std::byte> record_scratch_;
  std::uint64_t pending_step_ = 0;
  bool skipped_ = false;
};

}  // namespace gradcomp::runtime
