// gradcomp/sgd.hpp: what every SGD driver (sparsified_sgd, layerwise_sgd, periodic_averaging)
// shares: the options of the update, the density schedule, the tensors of the flat parameter
// buffer, the statistics a step reports, and the update itself.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string_view>
#include <vector>

#include <gradcomp/context.hpp>
#include <gradcomp/error.hpp>

namespace gradcomp {

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
  [[nodiscard]] unsigned warmup_epochs() const noexcept { return warmup_epochs_; }
  [[nodiscard]] std::uint64_t steps_per_epoch() const noexcept { return steps_per_epoch_; }

 private:
  double rho_ = 1.0;
  unsigned warmup_epochs_ = 0;
  std::uint64_t steps_per_epoch_ = 1;
};

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

// Tensors with ids 0..n-1 and the given sizes: what the drivers' constructors from layer sizes
// mean.
inline std::vector<tensor_spec> tensor_specs(const std::vector<std::size_t>& sizes) {
  std::vector<tensor_spec> specs;
  specs.reserve(sizes.size());
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    specs.push_back(tensor_spec{static_cast<std::uint32_t>(i), sizes[i]});
  }
  return specs;
}

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

// The largest tensor a payload can describe: indices are 32-bit, so n <= 2^32, and the count is
// 32-bit, so a selector that sends every coordinate (dense) needs n < 2^32. Checked before any
// buffer of the tensor's size is allocated.
inline void check_tensor_size(std::string_view where, const tensor_spec& t, bool selects_all) {
  const std::uint64_t limit = selects_all ? 0xffffffffull : (std::uint64_t{1} << 32);
  if (static_cast<std::uint64_t>(t.size) > limit) {
    throw_invalid_argument(where, concat("size of tensor ", t.id), t.size,
                           selects_all ? "n <= 2^32 - 1 (a payload's count is 32-bit, and this "
                                         "selector sends every coordinate)"
                                       : "n <= 2^32 (a payload's indices are 32-bit)");
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
  double accumulate_seconds = 0.0;  // this tensor's compression: the feedback's accumulation,
  double select_seconds = 0.0;      // the selection,
  double encode_seconds = 0.0;      // and gather, quantization and the feedback's update
  std::size_t restored = 0;        // picks the exchange left out (gtopk) that went back to the
                                   // feedback (0 for feedback without restore(): dropped)
  // The top-k contraction on this rank: ||acc on the selection||^2 / ||acc||^2 (see
  // compress_stats::contraction); NaN where not measured.
  double contraction = std::numeric_limits<double>::quiet_NaN();
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

}  // namespace gradcomp
