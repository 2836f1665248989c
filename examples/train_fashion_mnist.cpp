// Data-parallel training of an MLP 784-256-128-10 on Fashion-MNIST with gradcomp's compressors
// and schedules. N workers are threads of this process (in_process_comm), or MPI processes when
// the program is built with MPI and started by mpirun. Rank 0 prints one progress line per
// epoch and, last, one JSON object with the result.
//
//   train_fashion_mnist --compressor topk --density 0.01 --workers 4 --epochs 3
//   mpirun -np 4 train_fashion_mnist --compressor dgc --density 0.001
//
// The data come from Debian's dataset-fashion-mnist package (gzip IDX files).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <numeric>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <gradcomp/gradcomp.hpp>  // policies, exchanges, schedules, in-process communicator

#include "mnist/cli.hpp"
#include "mnist/fashion_mnist.hpp"
#include "mnist/mlp.hpp"
#include "mnist/policies.hpp"
#include "mnist/training.hpp"

#if defined(GRADCOMP_EXAMPLE_WITH_MPI)
#include <gradcomp/comm/mpi.hpp>
#include <gradcomp/comm/mpi_guard.hpp>
#endif

namespace {

using namespace gradcomp;

using fmnist::outcome;
using options = fmnist::train_options;

// ---------------------------------------------------------------------------------------
// Schedules behind one interface: train_step() runs the forward and backward pass on one batch
// and everything the schedule does with the gradient; bytes_sent() counts gradcomp's own
// statistics (this rank's encoded payloads).

// none: sparsified_sgd after the whole backward pass, over the whole model as one tensor
// (--tensors model: one top-k over all parameters) or layer by layer (--tensors layer).
template <class Comm, class Compressor, class Exchange>
class sync_schedule {
 public:
  sync_schedule(Comm& comm, const std::vector<std::size_t>& sizes, Compressor c, Exchange x,
                sgd_options opt, density_schedule ds)
      : sgd_(comm, sizes, std::move(c), std::move(x), opt, ds) {}

  fmnist::batch_result train_step(fmnist::mlp& net, std::span<float> params, std::span<float> grads,
                                  const float* x, const std::uint8_t* y, std::size_t b) {
    const auto r = net.train_batch(params, x, y, b, grads, [](std::size_t) {});
    sgd_.step(params, grads);
    return r;
  }
  void epoch_end(std::span<float>) {}
  [[nodiscard]] std::size_t bytes_sent() const { return sgd_.total_bytes_sent(); }
  [[nodiscard]] double overlap() const { return -1.0; }
  // The last step's top-k contraction per tensor, on this rank.
  void contraction(std::vector<double>& row) const {
    for (const tensor_stats& ts : sgd_.last_stats().tensors) row.push_back(ts.contraction);
  }

 private:
  sparsified_sgd<Compressor, Exchange, Comm> sgd_;
};

// lags and merged: layerwise_sgd; `layer_to_tensor[l]` is the tensor that layer l completes
// (or -1 while its group waits for earlier layers).
template <class Comm, class Compressor, class Exchange>
class pipelined_schedule {
 public:
  pipelined_schedule(Comm& comm, std::span<const tensor_spec> tensors, std::span<const double> densities,
                     std::vector<long> layer_to_tensor, Compressor c, Exchange x, sgd_options opt)
      : sgd_(comm, tensors, densities, std::move(c), std::move(x), opt),
        layer_to_tensor_(std::move(layer_to_tensor)) {}

  fmnist::batch_result train_step(fmnist::mlp& net, std::span<float> params, std::span<float> grads,
                                  const float* x, const std::uint8_t* y, std::size_t b) {
    sgd_.begin_step(params, grads);
    const auto r = net.train_batch(params, x, y, b, grads, [this](std::size_t l) {
      if (layer_to_tensor_[l] >= 0) sgd_.ready(static_cast<std::size_t>(layer_to_tensor_[l]));
    });
    const layerwise_stats& s = sgd_.finish_step();
    comm_seconds_ += s.communication_seconds;
    overlapped_seconds_ += s.overlapped_seconds;
    contraction_.clear();
    for (const tensor_stats& ts : s.step.tensors) contraction_.push_back(ts.contraction);
    return r;
  }
  // The last step's contraction per tensor, in the order the tensors were exchanged.
  void contraction(std::vector<double>& row) const {
    row.insert(row.end(), contraction_.begin(), contraction_.end());
  }
  void epoch_end(std::span<float>) {}
  [[nodiscard]] std::size_t bytes_sent() const { return sgd_.total_bytes_sent(); }
  [[nodiscard]] double overlap() const {
    return comm_seconds_ > 0.0 ? overlapped_seconds_ / comm_seconds_ : 0.0;
  }

 private:
  layerwise_sgd<Compressor, Exchange, Comm> sgd_;
  std::vector<long> layer_to_tensor_;
  std::vector<double> contraction_;
  double comm_seconds_ = 0.0;
  double overlapped_seconds_ = 0.0;
};

template <class Comm, class Quantizer>
class pqasgd_schedule {
 public:
  pqasgd_schedule(Comm& comm, std::span<const tensor_spec> tensors, Quantizer q, sgd_options opt,
                  averaging_options avg)
      : avg_(comm, tensors, std::move(q), sparse_allgather{}, opt, avg) {}

  fmnist::batch_result train_step(fmnist::mlp& net, std::span<float> params, std::span<float> grads,
                                  const float* x, const std::uint8_t* y, std::size_t b) {
    const auto r = net.train_batch(params, x, y, b, grads, [](std::size_t) {});
    avg_.step(params, grads);
    return r;
  }
  // Evaluate the averaged model: one more round unless the epoch ended on one (it does when p
  // divides the steps per epoch). With subsets > 1 the other slices still hold local
  // progress, so each rank evaluates its own model.
  void epoch_end(std::span<float> params) {
    if (!avg_.just_averaged()) avg_.average(params);
  }
  [[nodiscard]] std::size_t bytes_sent() const { return avg_.total_bytes_sent(); }
  [[nodiscard]] double overlap() const { return -1.0; }
  // Quantizers send every coordinate: no selection to measure.
  void contraction(std::vector<double>&) const {}

 private:
  periodic_averaging<Quantizer, sparse_allgather, Comm> avg_;
};

// ---------------------------------------------------------------------------------------
// One rank's training.

template <class Comm>
class trainer {
 public:
  trainer(Comm& comm, const options& o, const fmnist::fashion_mnist& data)
      : comm_(comm), o_(o), data_(data), net_({fmnist::pixels, 256, 128, fmnist::classes}),
        params_(net_.param_count()), grads_(net_.param_count()) {
    steps_per_epoch_ = data_.train.count / static_cast<std::size_t>(comm.size()) / o_.batch;
    if (steps_per_epoch_ == 0) {
      throw std::runtime_error("fewer training images per worker than --batch");
    }
    net_.init(params_, o_.seed);
    // Every rank initialises from the same seed; the broadcast makes equal parameters a
    // guarantee rather than a consequence of identical builds.
    comm_.broadcast(std::span<float>(params_), 0);
    for (std::size_t l = 0; l < net_.layers(); ++l) {
      layers_.push_back(tensor_spec{static_cast<std::uint32_t>(l), net_.layer_size(l)});
    }
  }

  [[nodiscard]] std::size_t steps_per_epoch() const { return steps_per_epoch_; }
  [[nodiscard]] const fmnist::mlp& net() const { return net_; }
  [[nodiscard]] const std::vector<tensor_spec>& layers() const { return layers_; }

  // Median over a few batches of each layer's backward time, maximum over ranks (the slowest
  // rank sets the pace, and every rank must plan alike). Collective.
  std::vector<double> measure_backward(unsigned batches = 12) {
    const std::size_t layers = net_.layers();
    std::vector<std::vector<double>> samples(layers);
    std::vector<float> scratch(params_.size());
    std::vector<std::int64_t> first(o_.batch);
    std::iota(first.begin(), first.end(), std::int64_t{0});
    gather_batch(first);
    for (unsigned b = 0; b < batches; ++b) {
      net_.train_batch(params_, x_.data(), y_.data(), o_.batch, scratch, [](std::size_t) {});
      for (std::size_t l = 0; l < layers; ++l) samples[l].push_back(net_.last_backward_seconds()[l]);
    }
    std::vector<double> t(layers);
    for (std::size_t l = 0; l < layers; ++l) {
      auto& s = samples[l];
      std::nth_element(s.begin(), s.begin() + static_cast<std::ptrdiff_t>(s.size() / 2), s.end());
      t[l] = s[s.size() / 2];
    }
    comm_.allreduce(std::span<double>(t), reduce_op::max);
    return t;
  }

  template <class Schedule>
  outcome run(Schedule& schedule) {
    std::vector<std::vector<double>> contraction;  // rank 0's, per step and tensor
    std::vector<double> row;
    outcome out = fmnist::train_epochs(
        comm_, o_, data_.train.count, net_.param_count(), schedule,
        [&](std::span<const std::int64_t> batch) {
          gather_batch(batch);
          const auto r = schedule.train_step(net_, params_, grads_, x_.data(), y_.data(), o_.batch);
          if (comm_.rank() == 0) {
            row.clear();
            schedule.contraction(row);
            if (!row.empty()) contraction.push_back(row);
          }
          return std::pair<double, double>(r.loss_sum, static_cast<double>(r.correct));
        },
        [&] { schedule.epoch_end(params_); }, [&] { return test_accuracy(); });
    out.contraction = std::move(contraction);
    return out;
  }

 private:
  void gather_batch(std::span<const std::int64_t> batch) {
    x_.resize(o_.batch * fmnist::pixels);
    y_.resize(o_.batch);
    for (std::size_t b = 0; b < o_.batch; ++b) {
      const auto i = static_cast<std::size_t>(batch[b]);
      std::copy_n(data_.train.images.data() + i * fmnist::pixels, fmnist::pixels,
                  x_.data() + b * fmnist::pixels);
      y_[b] = data_.train.labels[i];
    }
  }

  // Each rank scores its share of the test set with its own parameters.
  double test_accuracy() {
    const std::size_t p = static_cast<std::size_t>(comm_.size());
    const std::size_t r = static_cast<std::size_t>(comm_.rank());
    const std::size_t n = data_.test.count;
    const std::size_t begin = n * r / p, end = n * (r + 1) / p;
    double correct[1] = {0.0};
    constexpr std::size_t chunk = 250;
    for (std::size_t i = begin; i < end; i += chunk) {
      const std::size_t m = std::min(chunk, end - i);
      correct[0] += static_cast<double>(
          net_.evaluate(params_, data_.test.images.data() + i * fmnist::pixels,
                        data_.test.labels.data() + i, m)
              .correct);
    }
    comm_.allreduce(std::span<double>(correct), reduce_op::sum);
    return correct[0] / static_cast<double>(n);
  }

  Comm& comm_;
  const options& o_;
  const fmnist::fashion_mnist& data_;
  fmnist::mlp net_;
  std::vector<float> params_;
  std::vector<float> grads_;
  std::vector<tensor_spec> layers_;
  std::size_t steps_per_epoch_ = 0;
  std::vector<float> x_;
  std::vector<std::uint8_t> y_;
};

// ---------------------------------------------------------------------------------------
// From the command line to types.

template <class Comm, class Compressor, class Exchange>
outcome run_with(Comm& comm, const options& o, const fmnist::fashion_mnist& data, Compressor c,
                 Exchange x) {
  trainer<Comm> t(comm, o, data);
  const sgd_options opt = fmnist::sgd_for<Compressor>(o, comm.rank());

  if (o.schedule == "none") {
    const density_schedule ds = fmnist::density_for<Compressor>(o, t.steps_per_epoch());
    const std::vector<std::size_t> sizes =
        o.tensors == "layer" ? t.net().layer_sizes() : std::vector<std::size_t>{t.net().param_count()};
    sync_schedule<Comm, Compressor, Exchange> s(comm, sizes, std::move(c), std::move(x), opt, ds);
    return t.run(s);
  }

  // lags / merged: per-layer times and the link decide the densities or the groups.
  const std::vector<std::size_t> sizes = t.net().layer_sizes();
  const fmnist::pipeline_plan plan = fmnist::plan_pipeline(o, comm, c, sizes, t.measure_backward());
  std::vector<tensor_spec> tensors = t.layers();
  std::vector<long> layer_to_tensor(sizes.size());
  if (!plan.groups) {
    std::iota(layer_to_tensor.begin(), layer_to_tensor.end(), 0L);
  } else {
    tensors = merged_tensors(*plan.groups, t.layers());
    std::fill(layer_to_tensor.begin(), layer_to_tensor.end(), -1L);
    for (std::size_t l = 0; l < sizes.size(); ++l) {
      if (const auto g = plan.groups->completes(l)) layer_to_tensor[l] = static_cast<long>(*g);
    }
  }
  pipelined_schedule<Comm, Compressor, Exchange> s(comm, tensors, plan.densities, std::move(layer_to_tensor),
                                                   std::move(c), std::move(x), opt);
  return t.run(s);
}

template <class Comm, class Quantizer>
outcome run_pqasgd(Comm& comm, const options& o, const fmnist::fashion_mnist& data, Quantizer q) {
  trainer<Comm> t(comm, o, data);
  const sgd_options opt{.lr = o.lr, .momentum = o.momentum, .seed = o.seed};
  pqasgd_schedule<Comm, Quantizer> s(comm, t.layers(), std::move(q), opt,
                                     averaging_options{.period = o.period, .subsets = o.subsets,
                                                       .error_feedback = o.error_feedback});
  return t.run(s);
}

template <class Comm>
outcome run_rank(Comm& comm, const options& o, const fmnist::fashion_mnist& data) {
  if (o.schedule == "pqasgd") {
    return fmnist::with_quantizer(o, [&](auto q) { return run_pqasgd(comm, o, data, std::move(q)); });
  }
  return fmnist::with_policies(o, [&](auto c, auto x) { return run_with(comm, o, data, std::move(c), std::move(x)); });
}

}  // namespace

int main(int argc, char** argv) {
  const options o = fmnist::parse(argc, argv, "train_fashion_mnist");
#if defined(GRADCOMP_EXAMPLE_WITH_MPI)
  if (fmnist::launched_by_mpi()) {
    // lags and merged call MPI from their communication thread, never at the same time as the
    // main thread: MPI_THREAD_SERIALIZED.
    gradcomp::mpi_environment env(argc, argv, MPI_THREAD_SERIALIZED);
    return gradcomp::mpi_run(MPI_COMM_WORLD, [&] {
      if (env.provided() < MPI_THREAD_SERIALIZED && o.schedule != "none" && o.schedule != "pqasgd") {
        throw std::runtime_error("--schedule " + o.schedule + " needs MPI_THREAD_SERIALIZED");
      }
      gradcomp::mpi_comm comm;
      const auto data = fmnist::load(o.data_dir, o.train_limit, o.test_limit);
      const outcome r = run_rank(comm, o, data);
      if (comm.rank() == 0) fmnist::print_json(o, comm.size(), r);
      return 0;
    });
  }
#endif
  try {
    const auto data = fmnist::load(o.data_dir, o.train_limit, o.test_limit);
    outcome result;
    gradcomp::run_in_process(o.workers, [&](gradcomp::in_process_comm& comm) {
      const outcome r = run_rank(comm, o, data);
      if (comm.rank() == 0) result = r;
    });
    fmnist::print_json(o, o.workers, result);
  } catch (const gradcomp::nonfinite_error& e) {
    std::fprintf(stderr, "train_fashion_mnist: training diverged: %s\n%s", e.what(),
                 o.schedule == "pqasgd" && o.error_feedback
                     ? "(error feedback with a quantizer whose error exceeds its input makes the "
                       "residual grow: try --feedback 0)\n"
                     : "(try a smaller --lr)\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_fashion_mnist: %s\n", e.what());
    return 1;
  }
  return 0;
}
