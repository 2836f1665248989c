// gradcomp/runtime/registry.hpp: every policy by name, for callers that learn the policies
// from a configuration at run time (the PyTorch hook, the LibTorch and Fashion-MNIST
// examples). One vocabulary, the C++ names; one place that checks a configuration, whose
// errors name the field, the value given and what is allowed.
//
// Adding a selector: its header (with its include in select.hpp), one line in `selectors`
// below, and its test. with_selector() hands the caller a value of the policy's type, so that
// a caller instantiates gradcomp's templates for exactly the policies it can be asked for; the
// names (selector_names, for the errors and the hook's SELECTORS) come from the same lines.
// The examples' --compressor takes the aliases at the end of this file: a selector offered
// there also gets an alias line (with_aliased_compressor makes it from the registry's lines).
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

#include <gradcomp/compressor.hpp>
#include <gradcomp/error.hpp>
#include <gradcomp/exchange.hpp>
#include <gradcomp/feedback.hpp>
#include <gradcomp/quantize.hpp>
#include <gradcomp/select.hpp>
#include <gradcomp/sgd.hpp>

namespace gradcomp::runtime {

// A configuration: the policies by name and their parameters. Each field's comment gives
// what check_config() allows.
struct engine_config {
  std::string selector = "topk";       // a name in `selectors` (selector_names)
  std::string quantizer = "fp32";      // a name in `quantizers` (quantizer_names)
  std::string feedback = "residual";   // a name in `feedbacks` (feedback_names)
  std::string exchange = "allgather";  // a name in `exchanges` (exchange_names)
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

inline std::string listed(std::span<const std::string_view> names) {
  std::string list;
  for (std::size_t i = 0; i < names.size(); ++i) list += detail::concat(i ? ", " : "", "'", names[i], "'");
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
[[noreturn]] inline void unknown_name(std::string_view what, const std::string& got,
                                      std::span<const std::string_view> names) {
  detail_registry::refuse(what, detail_registry::shown(got),
                          detail::concat("one of ", detail_registry::listed(names)));
}

// ---- the policies by name ---------------------------------------------------------------
// One line per policy: its name, and how to make it from a configuration whose parameters
// check_config() has passed. The tables' order is the order error messages list them in.

template <class P>
struct named_policy {
  using type = P;
  std::string_view name;
  P (*make)(const engine_config&);
};

inline constexpr std::tuple selectors{
    named_policy<topk>{"topk", [](const engine_config&) { return topk{}; }},
    named_policy<gaussiank>{"gaussiank", [](const engine_config&) { return gaussiank{}; }},
    named_policy<gaussiank>{"gaussiank_published", [](const engine_config&) { return gaussiank::published(); }},
    named_policy<randomk>{"randomk", [](const engine_config&) { return randomk{}; }},
    named_policy<threshold>{"threshold", [](const engine_config& c) { return threshold{given_threshold(c)}; }},
    named_policy<redsync>{"redsync", [](const engine_config&) { return redsync{}; }},
    named_policy<dgc_sampling>{"dgc", [](const engine_config&) { return dgc_sampling{}; }},
    named_policy<dense>{"dense", [](const engine_config&) { return dense{}; }},
};

inline constexpr std::tuple quantizers{
    named_policy<identity>{"fp32", [](const engine_config&) { return identity{}; }},
    named_policy<fp16>{"fp16", [](const engine_config&) { return fp16{}; }},
    named_policy<bf16>{"bf16", [](const engine_config&) { return bf16{}; }},
    named_policy<qsgd>{"qsgd", [](const engine_config& c) { return qsgd::with_bits(c.bits, c.bucket_size); }},
    named_policy<terngrad>{"terngrad", [](const engine_config& c) { return terngrad(c.bucket_size); }},
    named_policy<scaled_sign>{"sign", [](const engine_config& c) { return scaled_sign(c.bucket_size); }},
};

inline constexpr std::tuple feedbacks{
    named_policy<residual>{"residual", [](const engine_config&) { return residual{}; }},
    named_policy<no_feedback>{"none", [](const engine_config&) { return no_feedback{}; }},
    named_policy<dgc_momentum>{"dgc", [](const engine_config& c) { return dgc_momentum{c.dgc_momentum, c.dgc_clip_norm}; }},
};

inline constexpr std::tuple exchanges{
    named_policy<dense_allreduce>{"allreduce", [](const engine_config&) { return dense_allreduce{}; }},
    named_policy<sparse_allgather>{"allgather", [](const engine_config&) { return sparse_allgather{}; }},
    named_policy<gtopk>{"gtopk", [](const engine_config&) { return gtopk{}; }},
    named_policy<topk_a2a>{"a2a", [](const engine_config&) { return topk_a2a{}; }},
    named_policy<auto_exchange>{"auto", [](const engine_config&) { return auto_exchange{}; }},
};

namespace detail_registry {

template <class Table>
constexpr auto names_of(const Table& table) {
  return std::apply([](const auto&... p) { return std::array<std::string_view, sizeof...(p)>{p.name...}; },
                    table);
}

// fn(the policy named `name`, made from c) for the first entry of `table` with that name.
template <std::size_t I, class R, class Table, class Fn>
R call_named(const Table& table, std::string_view what, const std::string& name, const engine_config& c,
             Fn& fn) {
  if constexpr (I == std::tuple_size_v<Table>) {
    unknown_name(what, name, names_of(table));
  } else {
    const auto& entry = std::get<I>(table);
    if (name == entry.name) return fn(entry.make(c));
    return call_named<I + 1, R>(table, what, name, c, fn);
  }
}

// Whether fn returns the same type for every policy of the table.
template <class Table, class Fn, std::size_t... I>
constexpr bool same_results(std::index_sequence<I...>) {
  using R = std::invoke_result_t<Fn&, typename std::tuple_element_t<0, Table>::type>;
  return (std::is_same_v<R, std::invoke_result_t<Fn&, typename std::tuple_element_t<I, Table>::type>> && ...);
}

template <class Table, class Fn>
decltype(auto) with_named(const Table& table, std::string_view what, const std::string& name,
                          const engine_config& c, Fn& fn) {
  static_assert(same_results<Table, Fn>(std::make_index_sequence<std::tuple_size_v<Table>>{}),
                "the function given to with_selector() and the others must return the same type "
                "for every policy");
  using R = std::invoke_result_t<Fn&, typename std::tuple_element_t<0, Table>::type>;
  return call_named<0, R>(table, what, name, c, fn);
}

// Whether `names` lists no name twice (a second entry of a name could never be chosen).
template <std::size_t N>
constexpr bool distinct(const std::array<std::string_view, N>& names) {
  for (std::size_t i = 0; i < N; ++i) {
    for (std::size_t j = i + 1; j < N; ++j) {
      if (names[i] == names[j]) return false;
    }
  }
  return true;
}

// Whether `name` is one of `names`.
template <std::size_t N>
constexpr bool listed_in(std::string_view name, const std::array<std::string_view, N>& names) {
  for (std::string_view n : names) {
    if (n == name) return true;
  }
  return false;
}

}  // namespace detail_registry

// The names a configuration may use, in the order error messages list them.
inline constexpr auto selector_names = detail_registry::names_of(selectors);
inline constexpr auto quantizer_names = detail_registry::names_of(quantizers);
inline constexpr auto feedback_names = detail_registry::names_of(feedbacks);
inline constexpr auto exchange_names = detail_registry::names_of(exchanges);
static_assert(detail_registry::distinct(selector_names) && detail_registry::distinct(quantizer_names) &&
                  detail_registry::distinct(feedback_names) && detail_registry::distinct(exchange_names),
              "a policy's name is listed twice in the registry");

// ---- one policy of each kind by name ----------------------------------------------------
// Each calls fn with a value of the named policy's type (fn returns the same type for every
// policy); parameters are those check_config() allows (call it first for errors in the
// configuration's own words).

template <class Fn>
decltype(auto) with_selector(const engine_config& c, Fn&& fn) {
  return detail_registry::with_named(selectors, "selector", c.selector, c, fn);
}

template <class Fn>
decltype(auto) with_quantizer(const engine_config& c, Fn&& fn) {
  return detail_registry::with_named(quantizers, "quantizer", c.quantizer, c, fn);
}

template <class Fn>
decltype(auto) with_feedback(const engine_config& c, Fn&& fn) {
  return detail_registry::with_named(feedbacks, "feedback", c.feedback, c, fn);
}

template <class Fn>
decltype(auto) with_exchange(const engine_config& c, Fn&& fn) {
  return detail_registry::with_named(exchanges, "exchange", c.exchange, c, fn);
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
    if (!detail_registry::listed_in(got, names)) unknown_name(what, got, names);
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

static_assert(
    [] {
      for (const compressor_alias& a : compressor_aliases) {
        if (!detail_registry::listed_in(a.selector, selector_names) ||
            !detail_registry::listed_in(a.quantizer, quantizer_names) ||
            !detail_registry::listed_in(a.feedback, feedback_names)) {
          return false;
        }
      }
      return true;
    }(),
    "every compressor alias names policies of the registry");

// The aliases' names, in the order error messages list them.
inline constexpr auto alias_names = [] {
  std::array<std::string_view, std::size(compressor_aliases)> names{};
  for (std::size_t i = 0; i < names.size(); ++i) names[i] = compressor_aliases[i].name;
  return names;
}();
static_assert(detail_registry::distinct(alias_names), "a compressor alias is listed twice");

// The alias named `name`, or nullptr.
inline const compressor_alias* find_alias(std::string_view name) {
  for (const compressor_alias& a : compressor_aliases) {
    if (a.name == name) return &a;
  }
  return nullptr;
}

// c with the alias's policies (the parameters as c has them), checked; an unknown alias is
// refused with the list.
inline engine_config with_alias(engine_config c, std::string_view alias) {
  if (const compressor_alias* a = find_alias(alias)) {
    c.selector = a->selector;
    c.quantizer = a->quantizer;
    c.feedback = a->feedback;
    check_config(c);
    return c;
  }
  detail_registry::refuse("compressor", detail_registry::shown(alias),
                          detail::concat("one of ", detail_registry::listed(alias_names)));
}

namespace detail_registry {

// The position of `name` in `names` (N where it is not there).
template <std::size_t N>
constexpr std::size_t index_in(std::string_view name, const std::array<std::string_view, N>& names) {
  for (std::size_t i = 0; i < N; ++i) {
    if (names[i] == name) return i;
  }
  return N;
}

// Alias I's registry lines, and the compressor they make.
template <std::size_t I, class T>
struct alias_lines {
  static constexpr compressor_alias alias = compressor_aliases[I];
  static constexpr const auto& selector = std::get<index_in(alias.selector, selector_names)>(selectors);
  static constexpr const auto& quantizer = std::get<index_in(alias.quantizer, quantizer_names)>(quantizers);
  static constexpr const auto& feedback = std::get<index_in(alias.feedback, feedback_names)>(feedbacks);
  using type = compressor<typename std::remove_cvref_t<decltype(selector)>::type,
                          typename std::remove_cvref_t<decltype(quantizer)>::type,
                          typename std::remove_cvref_t<decltype(feedback)>::type, T>;
  static type make(const engine_config& c) {
    return type(selector.make(c), quantizer.make(c), feedback.make(c));
  }
};

template <class T, std::size_t I, class R, class Fn>
R call_aliased(const engine_config& c, Fn& fn) {
  if constexpr (I == std::size(compressor_aliases)) {
    throw invalid_argument(detail::concat(
        "gradcomp: selector '", c.selector, "', quantizer '", c.quantizer, "', feedback '",
        c.feedback, "' is not one of the aliased compressors; allowed: those of ",
        listed(alias_names), " (runtime::compressor_aliases)"));
  } else {
    constexpr compressor_alias a = compressor_aliases[I];
    if (c.selector == a.selector && c.quantizer == a.quantizer && c.feedback == a.feedback) {
      return fn(alias_lines<I, T>::make(c));
    }
    return call_aliased<T, I + 1, R>(c, fn);
  }
}

}  // namespace detail_registry

// fn(compressor<S, Q, F, T>) for a configuration that is one of the aliases: the compressors a
// program that takes --compressor instantiates (one per alias, not every combination), each
// made by the registry's lines for its policies. fn returns the same type for each.
template <class T = float, class Fn>
decltype(auto) with_aliased_compressor(const engine_config& c, Fn&& fn) {
  using R = std::invoke_result_t<Fn&, typename detail_registry::alias_lines<0, T>::type>;
  return detail_registry::call_aliased<T, 0, R>(c, fn);
}

}  // namespace gradcomp::runtime
