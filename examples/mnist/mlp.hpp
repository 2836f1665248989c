// examples/mnist/mlp.hpp: a small fully connected ReLU network with softmax cross-entropy, its
// own forward and backward pass on the CPU. Parameters live in one flat buffer, layer by layer
// ([W_l, b_l] for l = 0, 1, ...), so that each layer is one gradcomp tensor; the backward pass
// reports each layer as soon as its gradient is complete (for LAGS).
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <stdexcept>
#include <vector>

namespace fmnist {

struct batch_result {
  double loss_sum = 0.0;     // cross-entropy summed over the batch
  std::size_t correct = 0;   // argmax == label
};

class mlp {
 public:
  // widths = {inputs, hidden..., classes}, e.g. {784, 256, 128, 10}.
  explicit mlp(std::vector<std::size_t> widths) : widths_(std::move(widths)) {
    if (widths_.size() < 2) throw std::invalid_argument("mlp: needs at least an input and an output width");
    std::size_t offset = 0;
    for (std::size_t l = 0; l + 1 < widths_.size(); ++l) {
      offsets_.push_back(offset);
      offset += layer_size(l);
    }
    params_ = offset;
  }

  [[nodiscard]] std::size_t layers() const noexcept { return widths_.size() - 1; }
  [[nodiscard]] std::size_t inputs() const noexcept { return widths_.front(); }
  [[nodiscard]] std::size_t outputs() const noexcept { return widths_.back(); }
  [[nodiscard]] std::size_t param_count() const noexcept { return params_; }
  [[nodiscard]] std::size_t layer_offset(std::size_t l) const { return offsets_.at(l); }
  // W_l (in x out) and b_l (out).
  [[nodiscard]] std::size_t layer_size(std::size_t l) const {
    return widths_.at(l) * widths_.at(l + 1) + widths_.at(l + 1);
  }
  [[nodiscard]] std::vector<std::size_t> layer_sizes() const {
    std::vector<std::size_t> s;
    for (std::size_t l = 0; l < layers(); ++l) s.push_back(layer_size(l));
    return s;
  }

  // PyTorch's nn.Linear default: weights and biases uniform in +-1/sqrt(fan_in).
  void init(std::span<float> params, std::uint64_t seed) const {
    std::mt19937_64 gen(seed);
    for (std::size_t l = 0; l < layers(); ++l) {
      const float bound = 1.0f / std::sqrt(static_cast<float>(widths_[l]));
      std::uniform_real_distribution<float> u(-bound, bound);
      for (std::size_t i = 0; i < layer_size(l); ++i) params[offsets_[l] + i] = u(gen);
    }
  }

  // Loss and correct predictions of the batch x (batch x inputs), labels y; no gradient.
  batch_result evaluate(std::span<const float> params, const float* x, const std::uint8_t* y,
                        std::size_t batch) {
    forward(params, x, batch);
    return score(y, batch, nullptr);
  }

  // Forward and backward pass on the batch: grads (same layout as params) receives the
  // gradient of the mean cross-entropy. on_layer(l) is called as soon as layer l's gradient is
  // written and layer l's parameters are no longer needed, last layer first.
  template <class OnLayer>
  batch_result train_batch(std::span<const float> params, const float* x, const std::uint8_t* y,
                           std::size_t batch, std::span<float> grads, OnLayer&& on_layer) {
    forward(params, x, batch);
    const std::size_t last = layers() - 1;
    std::vector<float>& dz = delta_[last];
    const batch_result r = score(y, batch, &dz);
    backward_seconds_.resize(layers());
    for (std::size_t l = last + 1; l-- > 0;) {
      const auto start = std::chrono::steady_clock::now();
      const std::size_t in = widths_[l], out = widths_[l + 1];
      const float* a = l == 0 ? x : act_[l - 1].data();
      const float* w = params.data() + offsets_[l];
      float* gw = grads.data() + offsets_[l];
      float* gb = gw + in * out;
      const float* d = delta_[l].data();
      weight_gradient(a, d, batch, in, out, gw, gb);
      if (l > 0) input_delta(w, d, batch, in, out, act_[l - 1].data(), delta_[l - 1]);
      backward_seconds_[l] =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      on_layer(l);
    }
    return r;
  }

  // Each layer's own backward time in the last train_batch() (on_layer's time excluded).
  [[nodiscard]] const std::vector<double>& last_backward_seconds() const noexcept {
    return backward_seconds_;
  }

 private:
  // z = a W + b, for the whole batch; W is read row by row once (the batch's z stays in cache),
  // and zero activations (ReLU, blank pixels) skip their row.
  static void affine(const float* a, const float* w, std::size_t batch, std::size_t in,
                     std::size_t out, float* z) {
    const float* bias = w + in * out;
    for (std::size_t b = 0; b < batch; ++b) std::copy_n(bias, out, z + b * out);
    for (std::size_t i = 0; i < in; ++i) {
      const float* wr = w + i * out;
      for (std::size_t b = 0; b < batch; ++b) {
        const float ai = a[b * in + i];
        if (ai == 0.0f) continue;
        float* zr = z + b * out;
        for (std::size_t o = 0; o < out; ++o) zr[o] += ai * wr[o];
      }
    }
  }

  void forward(std::span<const float> params, const float* x, std::size_t batch) {
    act_.resize(layers());
    delta_.resize(layers());
    for (std::size_t l = 0; l < layers(); ++l) {
      const std::size_t in = widths_[l], out = widths_[l + 1];
      act_[l].resize(batch * out);
      delta_[l].resize(batch * out);
      const float* a = l == 0 ? x : act_[l - 1].data();
      affine(a, params.data() + offsets_[l], batch, in, out, act_[l].data());
      if (l + 1 < layers()) {
        for (float& v : act_[l]) v = std::max(v, 0.0f);
      }
    }
  }

  // Softmax cross-entropy on the logits in act_.back(); dz = (softmax - onehot) / batch.
  batch_result score(const std::uint8_t* y, std::size_t batch, std::vector<float>* dz) const {
    const std::size_t k = outputs();
    const std::vector<float>& logits = act_.back();
    batch_result r;
    for (std::size_t b = 0; b < batch; ++b) {
      const float* z = logits.data() + b * k;
      const std::size_t arg = static_cast<std::size_t>(std::max_element(z, z + k) - z);
      const float top = z[arg];
      double sum = 0.0;
      for (std::size_t c = 0; c < k; ++c) sum += std::exp(static_cast<double>(z[c] - top));
      r.loss_sum += std::log(sum) - static_cast<double>(z[y[b]] - top);
      r.correct += arg == y[b];
      if (dz) {
        float* d = dz->data() + b * k;
        for (std::size_t c = 0; c < k; ++c) {
          const double p = std::exp(static_cast<double>(z[c] - top)) / sum;
          d[c] = static_cast<float>((p - (c == y[b] ? 1.0 : 0.0)) / static_cast<double>(batch));
        }
      }
    }
    return r;
  }

  // gW[i][o] = sum_b a[b][i] d[b][o]; gb[o] = sum_b d[b][o].
  static void weight_gradient(const float* a, const float* d, std::size_t batch, std::size_t in,
                              std::size_t out, float* gw, float* gb) {
    for (std::size_t i = 0; i < in; ++i) {
      float* gr = gw + i * out;
      std::fill_n(gr, out, 0.0f);
      for (std::size_t b = 0; b < batch; ++b) {
        const float ai = a[b * in + i];
        if (ai == 0.0f) continue;
        const float* dr = d + b * out;
        for (std::size_t o = 0; o < out; ++o) gr[o] += ai * dr[o];
      }
    }
    std::fill_n(gb, out, 0.0f);
    for (std::size_t b = 0; b < batch; ++b) {
      for (std::size_t o = 0; o < out; ++o) gb[o] += d[b * out + o];
    }
  }

  // dprev[b][i] = (sum_o d[b][o] W[i][o]) * (a_prev[b][i] > 0), through a transposed copy of W
  // so that the inner loop runs along contiguous memory (a sum over o would not vectorise
  // without reassociating float additions).
  void input_delta(const float* w, const float* d, std::size_t batch, std::size_t in,
                   std::size_t out, const float* a_prev, std::vector<float>& dprev) {
    wt_.resize(in * out);
    for (std::size_t i = 0; i < in; ++i) {
      for (std::size_t o = 0; o < out; ++o) wt_[o * in + i] = w[i * out + o];
    }
    for (std::size_t b = 0; b < batch; ++b) {
      float* dr = dprev.data() + b * in;
      std::fill_n(dr, in, 0.0f);
      for (std::size_t o = 0; o < out; ++o) {
        const float g = d[b * out + o];
        if (g == 0.0f) continue;
        const float* wr = wt_.data() + o * in;
        for (std::size_t i = 0; i < in; ++i) dr[i] += g * wr[i];
      }
      const float* ar = a_prev + b * in;
      for (std::size_t i = 0; i < in; ++i) {
        if (!(ar[i] > 0.0f)) dr[i] = 0.0f;
      }
    }
  }

  std::vector<std::size_t> widths_;
  std::vector<std::size_t> offsets_;
  std::size_t params_ = 0;
  // Workspace: one mlp per thread.
  std::vector<std::vector<float>> act_;    // per layer: ReLU output (hidden), logits (last)
  std::vector<std::vector<float>> delta_;  // per layer: d loss / d pre-activation
  std::vector<float> wt_;
  std::vector<double> backward_seconds_;
};

}  // namespace fmnist
