// gradcomp/runtime/registry.hpp: every policy by name, for callers that learn the policies
// from a configuration at run time (the PyTorch hook, the LibTorch and Fashion-MNIST
// examples). One vocabulary, the C++ names; one place that checks a configuration, whose
// errors name the field, the value given and what is allowed.
//
// Adding a selector: its header, one line in selector_names and one in with_selector (and its
// test). with_selector() hands the caller a value of the policy's type, so that a caller
// instantiates gradcomp's templates for exactly the policies it can be asked for.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

#include <gradcomp/compressor.hpp>
#include <gradcomp/error.hpp>
#include <gradcomp/exchange.hpp>
#include <gradcomp/feedback.hpp>
#include <gradcomp/quantize.hpp>
#include <gradcomp/select.hpp>
#include <gradcomp/sgd.hpp>

namespace gradcomp::runtime {

// The names a configuration may use, in the order error messages list them.
inline constexpr std::string_view selector_names[] = {
    "topk", "gaussiank", "gaussiank_published", "randomk", "threshold", "redsync", "dgc", "dense"};
inline constexpr std::string_view quantizer_names[] = {"fp32", "fp16", "bf16",
                                                       "qsgd", "terngrad", "sign"};
inline constexpr std::string_view feedback_names[] = {"residual", "none", "dgc"};
inline constexpr std::string_view exchange_names[] = {"allreduce", "allgather", "gtopk", "a2a",
                                                      "auto"};

// A configuration: the policies by name and their parameters. Each field's comment gives
// what check_config() allows.
struct engine_config {
  std::string selector = "topk";     // selector_names
  std::string quantizer = "fp32";    // quantizer_names
  std::string feedback = "residual";  // feedback_names
  std::string exchange = "allgather";  // exchange_names
  unsigned bits = 4;              // quantizer 'qsgd': bits per value, 2..16
  unsigned bucket_size = 512;     // 'qsgd': 1..2^24 values share one scale; 'terngrad',
                                  // 'sign': any (0: one scale for the whole bucket)
  std::optional<double> threshold;  // selector 'threshold': |g| >= threshold is sent;
                                    // 0 < t < inf, and given (none: refused)
  double dgc_momentum = 0.9;      // feedback 'dgc': momentum m, 0 <= m < 1
  double dgc_clip_norm = 0.0;     // feedback 'dgc': clip ||g|| before accumulating; 0 = off
  std::uint64_t seed = 0;         // random selectors and stochastic rounding
  // The density schedule (density_schedule::warmup): the final density in (0, 1], and DGC's
  // exponential warm-up over warmup_epochs epochs of steps_per_epoch steps (0: none).
  double density = 0.01;
  unsigned warmup_epochs = 0;
  std::uint64_t steps_per_epoch = 1;
  // bucket_engine: a non-finite gradient on any rank fails the bucket on every rank (false), or
  // skips it on every rank (true: the bucket comes back as NaN everywhere, as an allreduce of
  // it would, and no feedback state changes), for a loss scaler to skip the optimizer's step.
  bool skip_nonfinite = false;

  [[nodiscard]] density_schedule schedule() const {
    return density_schedule::warmup(density, warmup_epochs, steps_per_epoch);
  }
};

namespace detail_registry {

template <std::size_t N>
std::string listed(const std::string_view (&names)[N]) {
  std::string list;
  for (std::size_t i = 0; i < N; ++i) list += detail::concat(i ? ", " : "", "'", names[i], "'");
  return list;
}

[[noreturn]] inline void refuse(std::string_view field, std::string_view given,
                                std::string_view allowed) {
  throw invalid_argument(detail::concat("gradcomp: ", field, " = ", given, " is not allowed; allowed: ",
                                        allowed));
}

template <class V>
std::string shown(const V& v) {
  if constexpr (std::is_convertible_v<const V&, std::string_view>) {
    return detail::concat("'", v, "'");
  } else {
    return detail::concat(v);
  }
}

}  // namespace detail_registry

// Selector 'threshold''s threshold, refused when none was given (check_config checks its range).
inline double given_threshold(const engine_config& c) {
  if (!c.threshold) {
    throw invalid_argument(
        "gradcomp: selector 'threshold' needs a threshold, and none was given; allowed: "
        "0 < threshold < inf");
  }
  return *c.threshold;
}

// The error for a name that is not among `names`: lists what is.
template <std::size_t N>
[[noreturn]] inline void unknown_name(std::string_view what, const std::string& got,
                                      const std::string_view (&names)[N]) {
  detail_registry::refuse(what, detail_registry::shown(got),
                          detail::concat("one of ", detail_registry::listed(names)));
}

// ---- one policy of each kind by name ----------------------------------------------------
// Each calls fn with a value of the named policy's type; parameters are those check_config()
// allows (call it first for errors in the configuration's own words).

template <class Fn>
decltype(auto) with_quantizer(const engine_config& c, Fn&& fn) {
  if (c.quantizer == "fp32") return fn(identity{});
  if (c.quantizer == "fp16") return fn(fp16{});
  if (c.quantizer == "bf16") return fn(bf16{});
  if (c.quantizer == "qsgd") return fn(qsgd::with_bits(c.bits, c.bucket_size));
  if (c.quantizer == "terngrad") return fn(terngrad(c.bucket_size));
  if (c.quantizer == "sign") return fn(scaled_sign(c.bucket_size));
  unknown_name("quantizer", c.quantizer, quantizer_names);
}

template <class Fn>
decltype(auto) with_selector(const engine_config& c, Fn&& fn) {
  if (c.selector == "topk") return fn(topk{});
  if (c.selector == "gaussiank") return fn(gaussiank{});
  if (c.selector == "gaussiank_published") return fn(gaussiank::published());
  if (c.selector == "randomk") return fn(randomk{});
  if (c.selector == "threshold") return fn(threshold{given_threshold(c)});
  if (c.selector == "redsync") return fn(redsync{});
  if (c.selector == "dgc") return fn(dgc_sampling{});
  if (c.selector == "dense") return fn(dense{});
  unknown_name("selector", c.selector, selector_names);
}

template <class Fn>
decltype(auto) with_feedback(const engine_config& c, Fn&& fn) {
  if (c.feedback == "residual") return fn(residual{});
  if (c.feedback == "none") return fn(no_feedback{});
  if (c.feedback == "dgc") return fn(dgc_momentum{c.dgc_momentum, c.dgc_clip_norm});
  unknown_name("feedback", c.feedback, feedback_names);
}

template <class Fn>
decltype(auto) with_exchange(const engine_config& c, Fn&& fn) {
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

// Whether the payloads of the named selector and quantizer can be added as they are (every
// rank sends the same indices, values that sum): what exchange 'allreduce' needs.
inline bool summable(const engine_config& c) {
  return with_selector(c, [&](auto s) {
    return with_quantizer(c, [&](auto q) {
      return compressor<std::remove_cvref_t<decltype(s)>, std::remove_cvref_t<decltype(q)>,
                        no_feedback, float>::summable;
    });
  });
}

// Every check of a configuration, in one place: the names, each parameter its policy uses,
// and the combination. Throws gradcomp::invalid_argument naming the field, the value and what
// is allowed; a caller makes nothing before it has passed.
inline void check_config(const engine_config& c) {
  using detail_registry::refuse;
  using detail_registry::shown;
  auto known = [](std::string_view what, const std::string& got, const auto& names) {
    for (std::string_view n : names) {
      if (got == n) return;
    }
    unknown_name(what, got, names);
  };
  known("selector", c.selector, selector_names);
  known("quantizer", c.quantizer, quantizer_names);
  known("feedback", c.feedback, feedback_names);
  known("exchange", c.exchange, exchange_names);

  if (!(c.density > 0.0 && c.density <= 1.0)) refuse("density", shown(c.density), "0 < density <= 1");
  if (c.warmup_epochs > 0 && c.steps_per_epoch < 1) {
    refuse("steps_per_epoch", shown(c.steps_per_epoch), "an integer >= 1 (warmup_epochs > 0 needs it)");
  }
  if (c.quantizer == "qsgd") {
    if (c.bits < 2 || c.bits > 16) refuse("bits", shown(c.bits), "2 <= bits <= 16 (quantizer 'qsgd')");
    if (c.bucket_size < 1 || c.bucket_size > (1u << 24)) {
      refuse("bucket_size", shown(c.bucket_size), "1 <= bucket_size <= 16777216 (quantizer 'qsgd')");
    }
  }
  if (c.selector == "threshold") {
    const double t = given_threshold(c);
    if (!(t > 0.0 && std::isfinite(t))) refuse("threshold", shown(t), "0 < threshold < inf (selector 'threshold')");
  }
  if (c.feedback == "dgc") {
    if (!(c.dgc_momentum >= 0.0 && c.dgc_momentum < 1.0)) {
      refuse("dgc_momentum", shown(c.dgc_momentum), "0 <= dgc_momentum < 1 (feedback 'dgc')");
    }
    if (!(c.dgc_clip_norm >= 0.0 && std::isfinite(c.dgc_clip_norm))) {
      refuse("dgc_clip_norm", shown(c.dgc_clip_norm), "0 (off) <= dgc_clip_norm < inf (feedback 'dgc')");
    }
  }

  const bool dgc_selector = c.selector == "dgc";
  const bool dgc_feedback = c.feedback == "dgc";
  if ((dgc_selector && !dgc_feedback) || (dgc_feedback && !dgc_selector && c.selector != "topk")) {
    throw invalid_argument(detail::concat(
        "gradcomp: selector '", c.selector, "' with feedback '", c.feedback,
        "' is not a valid combination; allowed: selector 'dgc' with feedback 'dgc' "
        "(DGC's momentum correction), feedback 'dgc' with selector 'topk' or 'dgc', and "
        "feedback 'residual' or 'none' with every other selector"));
  }
  if (c.exchange == "allreduce" && !summable(c)) {
    throw invalid_argument(detail::concat(
        "gradcomp: exchange 'allreduce' adds the payloads of all ranks as they are, which "
        "needs every rank to send the same indices (selector 'dense' or 'randomk') with a "
        "summable quantizer ('fp32', 'fp16' or 'bf16'); got selector '", c.selector,
        "' with quantizer '", c.quantizer,
        "'. Allowed for this selector and quantizer: exchange 'allgather', 'gtopk', 'a2a' "
        "or 'auto'"));
  }
}

// ---- compressors by one name: the examples' --compressor --------------------------------
// Documented aliases, each for a (selector, quantizer, feedback) of the vocabulary above, for
// command lines that name a whole compressor. "dgc" here is DGC as its paper trains: exact top-k
// with DGC's momentum correction (selector 'topk', feedback 'dgc'); the sampled selection is the
// selector 'dgc'.
struct compressor_alias {
  std::string_view name;
  std::string_view selector;
  std::string_view quantizer;
  std::string_view feedback;
};

inline constexpr compressor_alias compressor_aliases[] = {
    {"dense", "dense", "fp32", "none"},
    {"topk", "topk", "fp32", "residual"},
    {"gaussiank", "gaussiank", "fp32", "residual"},
    {"gaussiank_published", "gaussiank_published", "fp32", "residual"},
    {"randomk", "randomk", "fp32", "residual"},
    {"redsync", "redsync", "fp32", "residual"},
    {"dgc", "topk", "fp32", "dgc"},
    {"qsgd", "dense", "qsgd", "none"},
    {"terngrad", "dense", "terngrad", "none"},
    {"sign", "dense", "sign", "residual"},
};

// c with the alias's policies (the parameters as c has them), checked; an unknown alias is
// refused with the list.
inline engine_config with_alias(engine_config c, std::string_view alias) {
  for (const compressor_alias& a : compressor_aliases) {
    if (a.name != alias) continue;
    c.selector = a.selector;
    c.quantizer = a.quantizer;
    c.feedback = a.feedback;
    check_config(c);
    return c;
  }
  std::string list;
  for (const compressor_alias& a : compressor_aliases) list += detail::concat(list.empty() ? "" : ", ", "'", a.name, "'");
  detail_registry::refuse("compressor", detail_registry::shown(alias), detail::concat("one of ", list));
}

// fn(compressor<S, Q, F, T>) for a configuration that is one of the aliases: the compressors a
// program that takes --compressor instantiates (ten, not every combination).
template <class T = float, class Fn>
decltype(auto) with_aliased_compressor(const engine_config& c, Fn&& fn) {
  auto is = [&](std::string_view s, std::string_view q, std::string_view f) {
    return c.selector == s && c.quantizer == q && c.feedback == f;
  };
  auto qsgd_q = [&] { return qsgd::with_bits(c.bits, c.bucket_size); };
  if (is("dense", "fp32", "none")) return fn(compressor<dense, identity, no_feedback, T>{});
  if (is("topk", "fp32", "residual")) return fn(compressor<topk, identity, residual, T>{});
  if (is("gaussiank", "fp32", "residual")) return fn(compressor<gaussiank, identity, residual, T>{});
  if (is("gaussiank_published", "fp32", "residual")) {
    return fn(compressor<gaussiank, identity, residual, T>(gaussiank::published()));
  }
  if (is("randomk", "fp32", "residual")) return fn(compressor<randomk, identity, residual, T>{});
  if (is("redsync", "fp32", "residual")) return fn(compressor<redsync, identity, residual, T>{});
  if (is("topk", "fp32", "dgc")) {
    return fn(compressor<topk, identity, dgc_momentum, T>(
        topk{}, identity{}, dgc_momentum{.momentum = c.dgc_momentum, .clip_norm = c.dgc_clip_norm}));
  }
  if (is("dense", "qsgd", "none")) return fn(compressor<dense, qsgd, no_feedback, T>(dense{}, qsgd_q()));
  if (is("dense", "terngrad", "none")) {
    return fn(compressor<dense, terngrad, no_feedback, T>(dense{}, terngrad(c.bucket_size)));
  }
  if (is("dense", "sign", "residual")) {
    return fn(compressor<dense, scaled_sign, residual, T>(dense{}, scaled_sign(c.bucket_size)));
  }
  throw invalid_argument(detail::concat("gradcomp: selector '", c.selector, "', quantizer '", c.quantizer,
                                        "', feedback '", c.feedback,
                                        "' is not one of the aliased compressors (runtime::compressor_aliases)"));
}

}  // namespace gradcomp::runtime
