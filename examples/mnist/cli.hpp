// The Fashion-MNIST examples' shared command line and report: train_fashion_mnist (the MLP,
// no LibTorch) and examples/libtorch/train_libtorch (the CNN) take the same flags where they
// apply, print one line per epoch and, last, one JSON object in the same format.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <gradcomp/runtime/registry.hpp>

#include "fashion_mnist.hpp"

namespace fmnist {

struct train_options {
  std::string compressor = "dense";
  double density = 0.01;
  std::string exchange = "default";
  std::string schedule = "none";
  std::string tensors = "model";  // none: compress the model as one tensor, or each layer
  unsigned period = 4;
  unsigned epochs = 3;
  int workers = 4;
  std::size_t batch = 32;
  double lr = 0.05;
  double momentum = 0.9;
  std::uint64_t seed = 1;
  unsigned bits = 4;             // qsgd bits
  unsigned bucket = 512;         // qsgd, terngrad, sign: values per scale
  // pqasgd: error feedback on the model difference. auto: on, except for qsgd, whose error at
  // 2 bits exceeds its input, so that the residual grows until training diverges (README).
  std::string feedback = "auto";
  bool error_feedback = true;
  double warmup_epochs = 1.0;    // dgc: DGC's 4-stage density warm-up spread over this many epochs
  double clip = 0.0;             // dgc: local gradient clipping by L2 norm, 0 = off
  unsigned subsets = 1;          // pqasgd: rotating slices (sparse parameter averaging)
  double link_gbit = 0.0;        // lags/merged: model this link instead of the measured one
  double link_latency_us = 0.0;
  std::size_t train_limit = 0;   // use only the first N training / test images (0: all)
  std::size_t test_limit = 0;
  unsigned evals_per_epoch = 1;  // test accuracy this many times per epoch ("eval" lines)
  std::string data_dir = default_dir();
};

// A program's own flags beyond the shared ones: `handle(flag, value)` returns false for a flag
// it does not know; `usage` is appended to the help text.
struct extra_flags {
  std::string usage;
  std::function<bool(const std::string&, const std::string&)> handle;
};

// "a|b|c": the choices of a flag, as the registry names them.
template <std::size_t N>
std::string choices(const std::array<std::string_view, N>& names) {
  std::string s;
  for (const std::string_view n : names) s += (s.empty() ? "" : "|") + std::string(n);
  return s;
}

[[noreturn]] inline void usage(const char* program, const extra_flags& extra, const char* why) {
  const std::string compressors = choices(gradcomp::runtime::alias_names);
  std::fprintf(stderr,
               "%s%s"
               "usage: %s [options]\n"
               "  --compressor %s\n"
               "                 (dense)\n"
               "  --density R      target density of the sparsifiers; LAGS: the least one (0.01)\n"
               "  --exchange %s\n"
               "                   (default: allreduce for dense and randomk, else allgather)\n"
               "  --schedule none|lags|merged|pqasgd   (none)\n"
               "  --tensors model|layer   none: one selection over all parameters (model), or\n"
               "                   one per layer; lags and merged always work per layer\n"
               "  --period P       pqasgd: average every P local steps (4)\n"
               "  --bits B         qsgd bits per value (4)\n"
               "  --bucket N       qsgd, terngrad, sign: values sharing one scale (512)\n"
               "  --feedback auto|0|1  pqasgd: error feedback on the model difference\n"
               "                   (auto: off for qsgd, on otherwise)\n"
               "  --subsets R      pqasgd: average one of R rotating slices per round (1)\n"
               "  --warmup E       dgc: density warm-up over E epochs (1)\n"
               "  --clip C         dgc: clip each local gradient to L2 norm C (0: off)\n"
               "  --link-gbit G --link-latency-us L   lags/merged: plan for this link\n"
               "  --epochs E (3)  --workers N (4)  --batch B per worker (32)\n"
               "  --lr (0.05)  --momentum (0.9)  --seed S (1)\n"
               "  --train-limit N --test-limit N   use the first N images only\n"
               "  --evals-per-epoch E   also print the test accuracy E times per epoch, against\n"
               "                   the training time without the evaluations (1: epoch lines only;\n"
               "                   the epoch lines' elapsed time includes them)\n"
               "  --data DIR       (%s)\n"
               "%s",
               why ? why : "", why ? "\n" : "", program, compressors.c_str(),
               choices(gradcomp::runtime::exchange_names).c_str(), default_dir().c_str(), extra.usage.c_str());
  std::exit(why ? 2 : 0);
}

inline train_options parse(int argc, char** argv, const char* program, const extra_flags& extra = {}) {
  train_options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") usage(program, extra, nullptr);
    if (i + 1 >= argc) usage(program, extra, ("missing value for " + a).c_str());
    const std::string v = argv[++i];
    try {
      if (a == "--compressor") o.compressor = v;
      else if (a == "--density") o.density = std::stod(v);
      else if (a == "--exchange") o.exchange = v;
      else if (a == "--schedule") o.schedule = v;
      else if (a == "--tensors") o.tensors = v;
      else if (a == "--period") o.period = static_cast<unsigned>(std::stoul(v));
      else if (a == "--epochs") o.epochs = static_cast<unsigned>(std::stoul(v));
      else if (a == "--workers") o.workers = std::stoi(v);
      else if (a == "--batch") o.batch = std::stoul(v);
      else if (a == "--lr") o.lr = std::stod(v);
      else if (a == "--momentum") o.momentum = std::stod(v);
      else if (a == "--seed") o.seed = std::stoull(v);
      else if (a == "--bits") o.bits = static_cast<unsigned>(std::stoul(v));
      else if (a == "--bucket") o.bucket = static_cast<unsigned>(std::stoul(v));
      else if (a == "--feedback") o.feedback = v;
      else if (a == "--subsets") o.subsets = static_cast<unsigned>(std::stoul(v));
      else if (a == "--warmup") o.warmup_epochs = std::stod(v);
      else if (a == "--clip") o.clip = std::stod(v);
      else if (a == "--link-gbit") o.link_gbit = std::stod(v);
      else if (a == "--link-latency-us") o.link_latency_us = std::stod(v);
      else if (a == "--train-limit") o.train_limit = std::stoul(v);
      else if (a == "--test-limit") o.test_limit = std::stoul(v);
      else if (a == "--evals-per-epoch") o.evals_per_epoch = static_cast<unsigned>(std::min(std::stoul(v), 1001ul));
      else if (a == "--data") o.data_dir = v;
      else if (!extra.handle || !extra.handle(a, v)) usage(program, extra, ("unknown option " + a).c_str());
    } catch (const std::logic_error&) {
      usage(program, extra, ("bad value for " + a + ": " + v).c_str());
    }
  }
  if (!(o.density > 0.0 && o.density <= 1.0)) usage(program, extra, "--density must be in (0, 1]");
  if (o.epochs < 1 || o.workers < 1 || o.batch < 1 || o.period < 1 || o.subsets < 1) {
    usage(program, extra, "--epochs, --workers, --batch, --period and --subsets must be >= 1");
  }
  if (o.evals_per_epoch < 1 || o.evals_per_epoch > 1000) {
    usage(program, extra, "--evals-per-epoch must be in [1, 1000]");
  }
  if (!(o.warmup_epochs >= 0.0)) usage(program, extra, "--warmup must be >= 0");
  if (o.tensors != "model" && o.tensors != "layer") usage(program, extra, "--tensors must be model or layer");
  if (o.feedback != "auto" && o.feedback != "0" && o.feedback != "1") {
    usage(program, extra, "--feedback must be auto, 0 or 1");
  }
  o.error_feedback = o.feedback == "auto" ? o.compressor != "qsgd" : o.feedback == "1";
  if (o.exchange == "default") {
    o.exchange = o.compressor == "dense" || o.compressor == "randomk" ? "allreduce" : "allgather";
  }
  return o;
}

// What every rank knows at the end; rank 0 prints it.
struct outcome {
  double test_accuracy = 0.0;
  double train_accuracy = 0.0;
  double loss = 0.0;
  double bytes_sent = 0.0;  // per worker, mean over workers
  double dense_bytes = 0.0;
  double seconds = 0.0;
  std::uint64_t steps = 0;
  double overlap = -1.0;    // lags/merged: overlapped / communication time over the run
  // Rank 0's top-k contraction per step and tensor (compress_stats::contraction: the share of
  // ||e + g||^2 its selection kept; NaN where not measured), in step order.
  std::vector<std::vector<double>> contraction;
};

inline void print_epoch(unsigned epoch, const train_options& o, const outcome& r) {
  std::printf("epoch %u/%u  loss %.4f  train_acc %.4f  test_acc %.4f  bytes_sent %.0f (%.3f%% of dense)  elapsed %.1f s\n",
              epoch, o.epochs, r.loss, r.train_accuracy, r.test_accuracy, r.bytes_sent,
              100.0 * r.bytes_sent / r.dense_bytes, r.seconds);
  std::fflush(stdout);
}

// The last line of output. density is the one in effect (1 for the quantizers, which send
// every coordinate; 1/subsets for pqasgd), bits the bits per value sent; the fields after
// dense_bytes_per_worker are extras, `more` (", \"key\": value" pairs) last.
inline void print_json(const train_options& o, int workers, const outcome& r, const std::string& more = {}) {
  // A sparsifier: an alias whose selector is not 'dense' (runtime::compressor_aliases).
  const gradcomp::runtime::compressor_alias* alias = gradcomp::runtime::find_alias(o.compressor);
  const bool sparsifier = alias != nullptr && alias->selector != "dense";
  const double density = o.schedule == "pqasgd" ? 1.0 / o.subsets : sparsifier ? o.density : 1.0;
  const unsigned bits = o.compressor == "qsgd" ? o.bits
                        : o.compressor == "terngrad" ? 2u
                        : o.compressor == "sign"     ? 1u
                                                     : 32u;
  std::printf("{\"compressor\": \"%s\", \"density\": %g, \"exchange\": \"%s\", \"schedule\": \"%s\", "
              "\"epochs\": %u, \"workers\": %d, \"test_accuracy\": %.4f, "
              "\"bytes_sent_per_worker\": %.0f, \"dense_bytes_per_worker\": %.0f",
              o.compressor.c_str(), density, o.exchange.c_str(), o.schedule.c_str(), o.epochs, workers,
              r.test_accuracy, r.bytes_sent, r.dense_bytes);
  std::printf(", \"bits\": %u, \"tensors\": \"%s\", \"batch\": %zu, \"lr\": %g, \"momentum\": %g, "
              "\"seed\": %llu, \"train_accuracy\": %.4f, \"loss\": %.4f, \"steps\": %llu, \"seconds\": %.1f",
              bits, o.schedule == "none" ? o.tensors.c_str() : "layer", o.batch, o.lr, o.momentum,
              static_cast<unsigned long long>(o.seed), r.train_accuracy, r.loss,
              static_cast<unsigned long long>(r.steps), r.seconds);
  if (r.overlap >= 0.0) std::printf(", \"overlap\": %.3f", r.overlap);
  if (o.schedule == "pqasgd") {
    std::printf(", \"period\": %u, \"subsets\": %u, \"feedback\": %s", o.period, o.subsets,
                o.error_feedback ? "true" : "false");
  }
  if (!r.contraction.empty()) {
    // Per step, one value per tensor (null where not measured).
    std::printf(", \"contraction\": [");
    for (std::size_t s = 0; s < r.contraction.size(); ++s) {
      std::printf("%s[", s ? ", " : "");
      for (std::size_t t = 0; t < r.contraction[s].size(); ++t) {
        const double v = r.contraction[s][t];
        if (std::isfinite(v)) {
          std::printf("%s%.4g", t ? ", " : "", v);
        } else {
          std::printf("%snull", t ? ", " : "");
        }
      }
      std::printf("]");
    }
    std::printf("]");
  }
  std::printf("%s}\n", more.c_str());
  std::fflush(stdout);
}

// Started by mpirun / mpiexec (Open MPI, MPICH, or a PMIx launcher)?
inline bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"}) {
    if (std::getenv(v)) return true;
  }
  return false;
}

}  // namespace fmnist
