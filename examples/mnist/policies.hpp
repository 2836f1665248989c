// From the examples' command line (cli.hpp) to gradcomp's policy types: with_policies() calls
// f(compressor, exchange) with the compressor and exchange that --compressor and --exchange
// name, with_quantizer() calls f(quantizer) for --schedule pqasgd. Both examples share it, so a
// flag means the same in both.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <gradcomp/gradcomp.hpp>
#include <gradcomp/runtime/registry.hpp>

#include "cli.hpp"

namespace fmnist {

[[noreturn]] inline void unsupported(const train_options& o) {
  throw std::runtime_error("--compressor " + o.compressor + " with --exchange " + o.exchange +
                           " and --schedule " + o.schedule + " is not supported");
}

// DGC applies momentum itself (before compression).
template <class Compressor>
inline constexpr bool applies_momentum_v =
    requires { requires Compressor::feedback_type::applies_momentum; };

// The SGD options for this rank. Where the selection does not depend on the seed a seed per
// rank costs nothing (it varies DGC's sample positions per rank; sparsified_sgd makes the
// ranks' rounding independent itself).
template <class Compressor>
gradcomp::sgd_options sgd_for(const train_options& o, int rank) {
  gradcomp::sgd_options opt{.lr = o.lr, .momentum = o.momentum, .seed = o.seed};
  if constexpr (applies_momentum_v<Compressor>) opt.momentum = 0.0;
  if constexpr (!gradcomp::shared_indices_v<typename Compressor::selector_type> ||
                gradcomp::selects_all_v<typename Compressor::selector_type>) {
    opt.seed = o.seed + 0x9e3779b97f4a7c15ULL * static_cast<std::uint64_t>(rank);
  }
  return opt;
}

// --density, and for DGC its warm-up, 0.25, 0.063, 0.016, 0.004 then rho (for rho = 0.001):
// its four stages over --warmup epochs instead of DGC's four epochs, which would be most of a
// short run.
template <class Compressor>
gradcomp::density_schedule density_for(const train_options& o, std::uint64_t steps_per_epoch) {
  gradcomp::density_schedule ds = gradcomp::density_schedule::constant(o.density);
  if constexpr (applies_momentum_v<Compressor>) {
    const auto stage = static_cast<std::uint64_t>(
        std::llround(o.warmup_epochs * static_cast<double>(steps_per_epoch) / 4.0));
    if (stage > 0) ds = gradcomp::density_schedule::warmup(o.density, 4, stage);
  }
  return ds;
}

template <class Compressor, class F>
auto with_exchange(const train_options& o, Compressor c, F&& f) {
  using namespace gradcomp;
  using S = typename Compressor::selector_type;
  constexpr bool sparse = !selects_all_v<S>;
  const bool pipelined = o.schedule != "none";
  if (o.exchange == "allreduce") {
    if constexpr (Compressor::summable) return f(std::move(c), dense_allreduce{});
  } else if (o.exchange == "allgather") {
    return f(std::move(c), sparse_allgather{});
  } else if (pipelined) {
    unsupported(o);  // the pipelined schedules exchange layer by layer: allreduce or allgather
  } else if (o.exchange == "gtopk") {
    if constexpr (sparse) return f(std::move(c), gtopk{});
  } else if (o.exchange == "a2a") {
    if constexpr (sparse) return f(std::move(c), topk_a2a{});
  } else if (o.exchange == "auto") {
    return f(std::move(c), auto_exchange{});
  }
  unsupported(o);
}

// The merged schedule's selection cost per element: one compression of an n-element Gaussian
// gradient at --density, the slowest rank's (collective, so that every rank plans alike).
template <class Compressor, class Comm>
double selection_seconds_per_element(const Compressor& c, std::size_t n, const train_options& o, Comm& comm) {
  Compressor probe = c;
  std::vector<float> g(n);
  std::mt19937 gen(7);
  std::normal_distribution<float> normal;
  for (float& v : g) v = normal(gen);
  auto st = probe.make_state(g.size());
  gradcomp::payload p;
  const gradcomp::compress_stats cs = probe.compress(g, st, {o.density, {}}, p);
  double per_element = (cs.seconds_accumulate + cs.seconds_select + cs.seconds_encode) / static_cast<double>(n);
  comm.allreduce(std::span<double>(&per_element, 1), gradcomp::reduce_op::max);
  return per_element;
}

// f(compressor, exchange) for --compressor and --exchange (schedules none, lags, merged).
// --compressor is one of gradcomp's documented aliases (runtime::compressor_aliases: a
// selector, quantizer and feedback of the registry's vocabulary), checked by the registry.
template <class F>
auto with_policies(const train_options& o, F&& f) {
  using namespace gradcomp;
  if (o.schedule != "none" && o.schedule != "lags" && o.schedule != "merged") {
    throw std::runtime_error("unknown --schedule " + o.schedule);
  }
  runtime::engine_config c;
  c.bits = o.bits;
  c.bucket_size = o.bucket;
  c.dgc_momentum = o.momentum;
  c.dgc_clip_norm = o.clip;
  c = runtime::with_alias(c, o.compressor);
  return runtime::with_aliased_compressor(c, [&](auto compressor) { return with_exchange(o, std::move(compressor), f); });
}

// f(quantizer) for --schedule pqasgd (its rounds use sparse_allgather).
template <class F>
auto with_quantizer(const train_options& o, F&& f) {
  using namespace gradcomp;
  if (o.exchange != "allgather" && o.exchange != "allreduce") unsupported(o);
  if (o.compressor == "qsgd") return f(qsgd::with_bits(o.bits, o.bucket));
  if (o.compressor == "terngrad") return f(terngrad(o.bucket));
  if (o.compressor == "sign") return f(scaled_sign(o.bucket));
  if (o.compressor == "dense") return f(identity{});
  unsupported(o);
}

}  // namespace fmnist
