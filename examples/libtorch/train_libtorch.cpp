// Data-parallel training of a CNN (80,202 parameters) on Fashion-MNIST with LibTorch's torch::nn
// and gradcomp's module optimizers (gradcomp/torch/module.hpp). The command line is
// train_fashion_mnist's (examples/mnist/cli.hpp), plus --comm:
//
//   train_libtorch --compressor topk --density 0.01 --workers 4        (threads)
//   train_libtorch --comm gloo --workers 4 --schedule lags             (4 processes, gloo)
//   mpirun -np 2 train_libtorch --compressor dgc --density 0.001       (MPI ranks)
//   RANK=0 WORLD_SIZE=2 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 train_libtorch --comm gloo ...
//   torchrun --nproc_per_node 2 --no-python train_libtorch --comm gloo ...
//
// --schedule none steps a module_sgd after the backward pass; lags and merged drive module_lags
// from autograd's hooks, so that each layer is exchanged while the backward pass goes on with
// the layers before it; pqasgd is module_averaging. Rank 0 prints one line per epoch and, last,
// one JSON object.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <memory>
#include <mutex>
#include <numeric>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>

#include <gradcomp/gradcomp.hpp>
#include <gradcomp/torch/module.hpp>
#include <gradcomp/torch/process_group.hpp>

#include "../mnist/cli.hpp"
#include "cnn.hpp"
#include "../mnist/fashion_mnist.hpp"
#include "../mnist/policies.hpp"
#include "../mnist/training.hpp"

#if defined(GRADCOMP_EXAMPLE_WITH_MPI)
#include <gradcomp/comm/mpi.hpp>
#include <gradcomp/comm/mpi_guard.hpp>
#endif

namespace {

using namespace gradcomp;
namespace tm = gradcomp::torch_module;
using fmnist::outcome;
using options = fmnist::train_options;
using fmnist::CNN;

// Every rank's model starts from --seed. Threads share torch's default generator: one at a
// time.
CNN make_model(std::uint64_t seed) {
  static std::mutex mu;
  const std::lock_guard lock(mu);
  torch::manual_seed(seed);
  return CNN();
}

// Consecutive parameters of one module (conv1.weight, conv1.bias) form a layer: the plan that
// makes each layer one gradcomp tensor.
merge_plan layer_plan(torch::nn::Module& m) {
  merge_plan plan;
  std::string previous;
  std::size_t i = 0;
  for (const auto& item : m.named_parameters()) {
    const std::string& name = item.key();
    const std::string layer = name.substr(0, name.rfind('.'));
    if (i == 0 || layer != previous) plan.groups.push_back({i, 0});
    ++plan.groups.back().count;
    previous = layer;
    ++i;
  }
  return plan;
}

// A plan over layers (plan_merged_groups()) as a plan over parameters.
merge_plan parameters_of_layers(const merge_plan& layers, const merge_plan& by_layer) {
  merge_plan out = layers;
  out.groups.clear();
  for (const layer_group& g : layers.groups) {
    const layer_group& first = by_layer.groups[g.first];
    const layer_group& last = by_layer.groups[g.first + g.count - 1];
    out.groups.push_back({first.first, last.first + last.count - first.first});
  }
  return out;
}

// Fashion-MNIST as tensors, normalised as examples/torch/train_ddp.py does; shared read-only.
struct data_tensors {
  torch::Tensor train_x, train_y, test_x, test_y;

  explicit data_tensors(const fmnist::fashion_mnist& d) {
    auto images = [](const fmnist::dataset& s) {
      return torch::from_blob(const_cast<float*>(s.images.data()),
                              {static_cast<std::int64_t>(s.count), 1, 28, 28}, torch::kFloat32)
          .sub(0.2860)
          .div(0.3530);
    };
    auto labels = [](const fmnist::dataset& s) {
      return torch::from_blob(const_cast<std::uint8_t*>(s.labels.data()), {static_cast<std::int64_t>(s.count)},
                              torch::kUInt8)
          .to(torch::kInt64);
    };
    train_x = images(d.train);
    train_y = labels(d.train);
    test_x = images(d.test);
    test_y = labels(d.test);
  }
};

struct batch_result {
  double loss_sum = 0.0;
  double correct = 0.0;
};

// Forward and backward on one batch; the loss is the batch mean.
batch_result forward_backward(CNN& model, const torch::Tensor& x, const torch::Tensor& y) {
  const torch::Tensor out = model->forward(x);
  const torch::Tensor loss = torch::nn::functional::cross_entropy(out, y);
  loss.backward();
  return {loss.item<double>() * static_cast<double>(x.size(0)),
          out.detach().argmax(1).eq(y).sum().item<double>()};
}

// ---------------------------------------------------------------------------------------
// Schedules behind one interface: train_step() runs forward, backward and what the schedule
// does with the gradients.

template <class Comm, class Compressor, class Exchange>
class sync_schedule {
 public:
  sync_schedule(CNN& model, Comm& comm, Compressor c, Exchange x, tm::module_options mo)
      : opt_(*model, comm, std::move(c), std::move(x), std::move(mo)) {}
  batch_result train_step(CNN& model, const torch::Tensor& x, const torch::Tensor& y) {
    opt_.zero_grad();
    const batch_result r = forward_backward(model, x, y);
    opt_.step();
    return r;
  }
  void epoch_end() {}
  [[nodiscard]] std::size_t bytes_sent() const { return opt_.driver().total_bytes_sent(); }
  [[nodiscard]] double overlap() const { return -1.0; }
  tm::module_base<float>& module() { return opt_; }

 private:
  tm::module_sgd<Compressor, Exchange, Comm> opt_;
};

template <class Comm, class Compressor, class Exchange>
class pipelined_schedule {
 public:
  pipelined_schedule(CNN& model, Comm& comm, std::span<const double> densities, Compressor c, Exchange x,
                     sgd_options opt, merge_plan plan)
      : lags_(*model, comm, densities, std::move(c), std::move(x), opt, std::move(plan)) {}
  batch_result train_step(CNN& model, const torch::Tensor& x, const torch::Tensor& y) {
    lags_.begin_step();
    const batch_result r = forward_backward(model, x, y);
    const layerwise_stats& s = lags_.finish_step();
    comm_seconds_ += s.communication_seconds;
    overlapped_seconds_ += s.overlapped_seconds;
    return r;
  }
  void epoch_end() {}
  [[nodiscard]] std::size_t bytes_sent() const { return lags_.driver().total_bytes_sent(); }
  [[nodiscard]] double overlap() const { return comm_seconds_ > 0.0 ? overlapped_seconds_ / comm_seconds_ : 0.0; }
  tm::module_base<float>& module() { return lags_; }

 private:
  tm::module_lags<Compressor, Exchange, Comm> lags_;
  double comm_seconds_ = 0.0;
  double overlapped_seconds_ = 0.0;
};

template <class Comm, class Quantizer>
class pqasgd_schedule {
 public:
  pqasgd_schedule(CNN& model, Comm& comm, Quantizer q, sgd_options opt, averaging_options avg, merge_plan plan)
      : avg_(*model, comm, std::move(q), sparse_allgather{}, opt, avg, tm::module_layout::flat, plan) {}
  batch_result train_step(CNN& model, const torch::Tensor& x, const torch::Tensor& y) {
    avg_.zero_grad();
    const batch_result r = forward_backward(model, x, y);
    avg_.step();
    return r;
  }
  // Evaluate the averaged model: one more round unless the epoch ended on one.
  void epoch_end() { avg_.average(); }
  [[nodiscard]] std::size_t bytes_sent() const { return avg_.driver().total_bytes_sent(); }
  [[nodiscard]] double overlap() const { return -1.0; }
  tm::module_base<float>& module() { return avg_; }

 private:
  tm::module_averaging<Quantizer, sparse_allgather, Comm> avg_;
};

// ---------------------------------------------------------------------------------------
// One rank's training.

template <class Comm>
class trainer {
 public:
  trainer(Comm& comm, const options& o, const data_tensors& data)
      : comm_(comm), o_(o), data_(data), model_(make_model(o.seed)), by_layer_(layer_plan(*model_)) {
    const auto p = static_cast<std::size_t>(comm.size());
    steps_per_epoch_ = static_cast<std::size_t>(data_.train_x.size(0)) / p / o_.batch;
    if (steps_per_epoch_ == 0) throw std::runtime_error("fewer training images per worker than --batch");
    for (const auto& t : model_->parameters()) parameters_ += static_cast<std::size_t>(t.numel());
  }

  [[nodiscard]] CNN& model() { return model_; }
  [[nodiscard]] std::size_t steps_per_epoch() const { return steps_per_epoch_; }
  [[nodiscard]] const merge_plan& by_layer() const { return by_layer_; }
  [[nodiscard]] std::size_t parameter_count() const { return parameters_; }

  // Elements per layer, in registration (forward) order.
  [[nodiscard]] std::vector<std::size_t> layer_sizes() {
    std::vector<std::size_t> sizes;
    const auto ps = model_->parameters();
    for (const layer_group& g : by_layer_.groups) {
      std::size_t n = 0;
      for (std::size_t i = g.first; i < g.first + g.count; ++i) n += static_cast<std::size_t>(ps[i].numel());
      sizes.push_back(n);
    }
    return sizes;
  }

  // Each layer's backward time on the real backward pass (median of 12 batches), the maximum
  // over ranks so that every rank plans alike. Collective.
  std::vector<double> measure_backward() {
    std::vector<std::int64_t> first(o_.batch);
    std::iota(first.begin(), first.end(), std::int64_t{0});
    const torch::Tensor idx = torch::tensor(first);
    const torch::Tensor x = data_.train_x.index_select(0, idx), y = data_.train_y.index_select(0, idx);
    std::vector<double> t = tm::measure_backward<float>(
        *model_, [&] { return torch::nn::functional::cross_entropy(model_->forward(x), y); }, 12, by_layer_);
    model_->zero_grad();
    comm_.allreduce(std::span<double>(t), reduce_op::max);
    return t;
  }

  template <class Schedule>
  outcome run(Schedule& schedule) {
    // The same initial parameters on every rank, guaranteed rather than assumed.
    tm::module_base<float>& m = schedule.module();
    comm_.broadcast(torch_views::as_span<float>(m.flat_parameters(), "train_libtorch", "parameters"), 0);
    m.sync_module();

    return fmnist::train_epochs(
        comm_, o_, static_cast<std::size_t>(data_.train_x.size(0)), parameters_, schedule,
        [&](std::span<const std::int64_t> batch) {
          const torch::Tensor idx = torch::from_blob(const_cast<std::int64_t*>(batch.data()),
                                                     {static_cast<std::int64_t>(batch.size())}, torch::kInt64);
          const batch_result r =
              schedule.train_step(model_, data_.train_x.index_select(0, idx), data_.train_y.index_select(0, idx));
          return std::pair<double, double>(r.loss_sum, r.correct);
        },
        [&] { schedule.epoch_end(); }, [&] { return test_accuracy(); });
  }

 private:
  // Each rank scores its share of the test set with its own parameters (in eval mode; the
  // model goes back to training mode after).
  double test_accuracy() {
    torch::NoGradGuard no_grad;
    model_->eval();
    const auto p = static_cast<std::int64_t>(comm_.size()), r = static_cast<std::int64_t>(comm_.rank());
    const std::int64_t n = data_.test_x.size(0);
    double correct[1] = {0.0};
    for (std::int64_t i = n * r / p, end = n * (r + 1) / p; i < end; i += 500) {
      const std::int64_t m = std::min<std::int64_t>(500, end - i);
      correct[0] += model_->forward(data_.test_x.narrow(0, i, m)).argmax(1).eq(data_.test_y.narrow(0, i, m))
                        .sum()
                        .item<double>();
    }
    model_->train();
    comm_.allreduce(std::span<double>(correct), reduce_op::sum);
    return correct[0] / static_cast<double>(n);
  }

  Comm& comm_;
  const options& o_;
  const data_tensors& data_;
  CNN model_;
  merge_plan by_layer_;
  std::size_t parameters_ = 0;
  std::size_t steps_per_epoch_ = 0;
};

// ---------------------------------------------------------------------------------------
// From the command line to types.

template <class Comm, class Compressor, class Exchange>
outcome run_with(Comm& comm, const options& o, const data_tensors& data, Compressor c, Exchange x) {
  trainer<Comm> t(comm, o, data);
  const sgd_options opt = fmnist::sgd_for<Compressor>(o, comm.rank());

  if (o.schedule == "none") {
    tm::module_options mo{.sgd = opt, .schedule = fmnist::density_for<Compressor>(o, t.steps_per_epoch())};
    if (o.tensors == "layer") {
      mo.groups = t.by_layer();
    } else {
      mo.groups = merge_plan{.groups = {{0, t.model()->parameters().size()}}};  // the model as one tensor
    }
    sync_schedule<Comm, Compressor, Exchange> s(t.model(), comm, std::move(c), std::move(x), std::move(mo));
    return t.run(s);
  }

  // lags / merged: the layers' backward times and the link decide the densities or the groups.
  const fmnist::pipeline_plan plan = fmnist::plan_pipeline(o, comm, c, t.layer_sizes(), t.measure_backward());
  pipelined_schedule<Comm, Compressor, Exchange> s(
      t.model(), comm, plan.densities, std::move(c), std::move(x), opt,
      plan.groups ? parameters_of_layers(*plan.groups, t.by_layer()) : t.by_layer());
  return t.run(s);
}

template <class Comm>
outcome run_rank(Comm& comm, const options& o, const data_tensors& data) {
  if (o.schedule == "pqasgd") {
    return fmnist::with_quantizer(o, [&](auto q) {
      trainer<Comm> t(comm, o, data);
      pqasgd_schedule<Comm, decltype(q)> s(
          t.model(), comm, std::move(q), sgd_options{.lr = o.lr, .momentum = o.momentum, .seed = o.seed},
          averaging_options{.period = o.period, .subsets = o.subsets, .error_feedback = o.error_feedback},
          t.by_layer());
      return t.run(s);
    });
  }
  return fmnist::with_policies(o, [&](auto c, auto x) { return run_with(comm, o, data, std::move(c), std::move(x)); });
}

// ---------------------------------------------------------------------------------------
// Communicators.

struct launch {
  std::string comm = "auto";  // threads | gloo | mpi
  int threads = 1;            // LibTorch's intra-op threads per rank
  double min_accuracy = 0.0;  // exit with 3 below this final test accuracy (tests)
};

launch the_launch;

// Rank 0's last word: the JSON line, and the exit status.
int finish(const options& o, int workers, const outcome& r, const char* comm) {
  fmnist::print_json(o, workers, r, std::string(", \"comm\": \"") + comm + "\", \"model\": \"cnn\"");
  if (r.test_accuracy < the_launch.min_accuracy) {
    std::fprintf(stderr, "train_libtorch: test accuracy %.4f is below --min-accuracy %.4f\n", r.test_accuracy,
                 the_launch.min_accuracy);
    return 3;
  }
  return 0;
}

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

// One rank over gloo: train, and rank 0 prints. Returns the exit status.
int gloo_rank(const options& o, const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
              std::shared_ptr<::gloo::transport::Device> device) {
  auto go = c10d::ProcessGroupGloo::Options::create(std::chrono::minutes(5));
  go->devices.push_back(std::move(device));
  process_group_comm comm(c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, go));
  const auto raw = fmnist::load(o.data_dir, o.train_limit, o.test_limit);
  const data_tensors data(raw);
  const outcome r = run_rank(comm, o, data);
  return rank == 0 ? finish(o, size, r, "gloo") : 0;
}

int report(const char* where, const std::exception& e) {
  if (dynamic_cast<const nonfinite_error*>(&e)) {
    std::fprintf(stderr, "train_libtorch%s: training diverged: %s\n(try a smaller --lr)\n", where, e.what());
  } else {
    std::fprintf(stderr, "train_libtorch%s: %s\n", where, e.what());
  }
  return 1;
}

// --comm gloo without a launcher: fork --workers ranks that meet through a FileStore.
int fork_gloo(const options& o, int threads) {
  char dir_template[] = "/tmp/gradcomp_libtorch_XXXXXX";
  const char* dir = mkdtemp(dir_template);
  if (dir == nullptr) {
    std::perror("train_libtorch: mkdtemp");
    return 1;
  }
  const std::string path = std::string(dir) + "/store";
  std::vector<pid_t> children;
  for (int r = 0; r < o.workers; ++r) {
    const pid_t pid = fork();
    if (pid < 0) {
      std::perror("train_libtorch: fork");
      for (const pid_t c : children) kill(c, SIGTERM);
      return 1;
    }
    if (pid == 0) {
      int status = 1;
      try {
        at::set_num_threads(threads);
        status = gloo_rank(o, c10::make_intrusive<c10d::FileStore>(path, o.workers), r, o.workers,
                           c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      } catch (const std::exception& e) {
        status = report((" rank " + std::to_string(r)).c_str(), e);
      }
      std::fflush(nullptr);
      _exit(status);
    }
    children.push_back(pid);
  }
  // The first rank to fail ends the others (they would wait for it in a collective); its
  // status is the program's.
  std::vector<pid_t> live = children;
  int first_failure = 0;
  while (!live.empty()) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, 0);
    if (pid < 0) {
      if (errno == EINTR) continue;
      std::perror("train_libtorch: waitpid");
      break;
    }
    const auto it = std::find(live.begin(), live.end(), pid);
    if (it == live.end()) continue;
    live.erase(it);
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (code != 0 && first_failure == 0) {
      first_failure = code;
      for (const pid_t c : live) kill(c, SIGTERM);
    }
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return first_failure;
}

}  // namespace

int main(int argc, char** argv) {
  launch& l = the_launch;
  const fmnist::extra_flags extra{
      "  --comm auto|threads|gloo|mpi   (auto: mpi under mpirun, gloo when RANK and WORLD_SIZE\n"
      "                   are set (with MASTER_ADDR, MASTER_PORT: a TCPStore), else threads);\n"
      "                   gloo without RANK forks --workers processes meeting in a FileStore\n"
      "  --torch-threads N   LibTorch's intra-op threads per rank (1)\n"
      "  --min-accuracy A    exit with status 3 if the final test accuracy is below A (0)\n",
      [&](const std::string& flag, const std::string& value) {
        if (flag == "--comm") l.comm = value;
        else if (flag == "--torch-threads") l.threads = std::stoi(value);
        else if (flag == "--min-accuracy") l.min_accuracy = std::stod(value);
        else return false;
        return true;
      }};
  const options o = fmnist::parse(argc, argv, "train_libtorch", extra);
  if (l.comm == "auto") {
    l.comm = fmnist::launched_by_mpi() ? "mpi" : !env("RANK").empty() && !env("WORLD_SIZE").empty() ? "gloo" : "threads";
  }
  if (l.threads < 1) fmnist::usage("train_libtorch", extra, "--torch-threads must be >= 1");

  if (l.comm == "mpi") {
#if defined(GRADCOMP_EXAMPLE_WITH_MPI)
    at::set_num_threads(l.threads);
    // lags and merged call MPI from their communication thread, never at the same time as the
    // main thread: MPI_THREAD_SERIALIZED.
    gradcomp::mpi_environment mpi(argc, argv, MPI_THREAD_SERIALIZED);
    return gradcomp::mpi_run(MPI_COMM_WORLD, [&] {
      if (mpi.provided() < MPI_THREAD_SERIALIZED && o.schedule != "none" && o.schedule != "pqasgd") {
        throw std::runtime_error("--schedule " + o.schedule + " needs MPI_THREAD_SERIALIZED");
      }
      gradcomp::mpi_comm comm;
      const auto raw = fmnist::load(o.data_dir, o.train_limit, o.test_limit);
      const data_tensors data(raw);
      const outcome r = run_rank(comm, o, data);
      return comm.rank() == 0 ? finish(o, comm.size(), r, "mpi") : 0;
    });
#else
    std::fprintf(stderr, "train_libtorch: built without MPI; --comm mpi is not available\n");
    return 2;
#endif
  }
  if (l.comm == "gloo") {
    if (env("RANK").empty() || env("WORLD_SIZE").empty()) return fork_gloo(o, l.threads);
    // Started by a launcher (torchrun's variables): a TCPStore served by rank 0.
    try {
      at::set_num_threads(l.threads);
      const int rank = std::stoi(env("RANK")), size = std::stoi(env("WORLD_SIZE"));
      if (rank < 0 || rank >= size) throw std::runtime_error("RANK must be in [0, WORLD_SIZE)");
      c10d::TCPStoreOptions so;
      so.port = static_cast<std::uint16_t>(env("MASTER_PORT").empty() ? 29500 : std::stoi(env("MASTER_PORT")));
      so.numWorkers = static_cast<std::size_t>(size);
      const std::string host = env("MASTER_ADDR").empty() ? "127.0.0.1" : env("MASTER_ADDR");
      auto device = env("GLOO_SOCKET_IFNAME").empty()
                        ? c10d::ProcessGroupGloo::createDefaultDevice()
                        : c10d::ProcessGroupGloo::createDeviceForInterface(env("GLOO_SOCKET_IFNAME"));
      c10::intrusive_ptr<c10d::Store> store;
      if (env("TORCHELASTIC_USE_AGENT_STORE") == "True") {
        // torchrun's agent already serves the store on MASTER_PORT: every rank is a client,
        // under the prefix of this restart attempt (as torch.distributed does).
        so.isServer = false;
        store = c10::make_intrusive<c10d::PrefixStore>("/worker/attempt_" + env("TORCHELASTIC_RESTART_COUNT"),
                                                       c10::make_intrusive<c10d::TCPStore>(host, so));
      } else {
        so.isServer = rank == 0;
        so.multiTenant = true;
        store = c10::make_intrusive<c10d::TCPStore>(host, so);
      }
      return gloo_rank(o, store, rank, size, std::move(device));
    } catch (const std::exception& e) {
      return report("", e);
    }
  }
  if (l.comm != "threads") fmnist::usage("train_libtorch", extra, "--comm must be auto, threads, gloo or mpi");
  try {
    at::set_num_threads(l.threads);
    const auto raw = fmnist::load(o.data_dir, o.train_limit, o.test_limit);
    const data_tensors data(raw);
    outcome result;
    gradcomp::run_in_process(o.workers, [&](gradcomp::in_process_comm& comm) {
      const outcome r = run_rank(comm, o, data);
      if (comm.rank() == 0) result = r;
    });
    return finish(o, o.workers, result, "threads");
  } catch (const std::exception& e) {
    return report("", e);
  }
}
