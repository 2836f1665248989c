// exchange_model: plans an exchange beyond one machine with the alpha-beta model that
// auto_exchange uses (gradcomp/exchange/cost_model.hpp). It prints, for P in {4 ... 1024}
// ranks on 1, 10 and 100 Gbit/s links, the predicted time per step of each exchange for a
// ResNet-50 (25.6M) and a BERT-large (340M) gradient at densities 0.001 and 0.01, and the
// winner (network terms only). Started under mpirun (P <= 4 here), it then measures the link
// with measure_link() (alpha and beta by ping-pong and by a ring with every rank sending at
// once, the communicator's allreduce, the burst by ping-pongs after an idle pause; the local
// work's gamma, scatter and merge costs on every rank at once), times every
// exchange over MPI and prints the predictions and the measurement side by side.
//   exchange_model                     the planning tables only
//   mpirun -np 4 exchange_model        the tables, then model against measurement
//   exchange_model --quick             smaller measured tensors, fewer repeats (for tests)
//   exchange_model --extrapolate ALPHA_US GAMMA_NS [SCATTER_NS MERGE_NS MERGE_LOG_NS
//                                [CACHED_SCATTER_NS]]
//                                      the tables on 25 and 100 Gbit/s links for P = 16 ... 1024
//                                      with that latency and local-work costs (docs/cluster.md;
//                                      SCATTER to MERGE_LOG 0 when left out; CACHED_SCATTER,
//                                      the cost of a pair added into a cached region, which the
//                                      allgather and TopKA2A pay, SCATTER when left out)
//   exchange_model [--no-tables] [--link-only] [--sizes N,N...] [--repeats R]
//                  [--calibrations C]
//                                      the measured tensor sizes (default 1048576,4194304),
//                                      repeats (default 5; the exchanges take turns, one run of
//                                      each per round) and calibrations of the link (default
//                                      1; more: each cost the median over them,
//                                      median_link()); --no-tables skips the tables,
//                                      --link-only the exchanges (alpha, beta, gamma only)
//                                      (scripts/cluster_measure.sh uses all of them)
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <gradcomp/exchange/cost_model.hpp>

#include "options.hpp"

#if defined(GRADCOMP_TOOL_WITH_MPI)
#include <gradcomp/comm/mpi.hpp>
#include <gradcomp/exchange.hpp>
#include <gradcomp/feedback.hpp>
#include <gradcomp/quantize.hpp>
#include <gradcomp/select.hpp>
#include <gradcomp/step.hpp>
#endif

namespace {

using namespace gradcomp;

// What one rank sends for a flat fp32 gradient of n values at density rho (identity values).
exchange_shape shape_for(std::size_t ranks, std::size_t n, double rho) {
  exchange_shape s;
  s.ranks = ranks;
  s.n = n;
  s.value_bytes = 4;
  s.k = std::max(1.0, std::round(rho * static_cast<double>(n)));
  s.k_max = static_cast<std::size_t>(s.k);
  s.payload_bytes = 40.0 + 8.0 * s.k;  // wire header, u32 index and f32 value per pick
  s.summed_bytes = 0;                  // dense: the decoded fp32 gradient, 4n bytes
  return s;
}

struct link_case {
  const char* name;
  link_model link;
};

// The tables for these links and rank counts.
void print_tables(std::span<const link_case> links, std::span<const std::size_t> ranks, const char* what);

void print_tables() {
  // Latencies are assumptions, typical of MPI over each kind of network: TCP over 1 and
  // 10 Gbit/s Ethernet, RDMA over 100 Gbit/s InfiniBand or RoCE.
  const link_case links[] = {{"1 Gbit/s, 50 us", link_model::from_gbit(1, 50e-6)},
                             {"10 Gbit/s, 20 us", link_model::from_gbit(10, 20e-6)},
                             {"100 Gbit/s, 3 us", link_model::from_gbit(100, 3e-6)}};
  const std::size_t ranks[] = {4, 16, 64, 256, 1024};
  print_tables(links, ranks, "network only");
}

// The tables on 25 and 100 Gbit/s links with a calibrated latency and local-work costs (from a
// run on the emulated cluster, docs/cluster.md), for P = 16 ... 1024; `calibrated` gives
// alpha, gamma, scatter, merge and merge_log, beta comes from each link's rate.
void print_extrapolation(const link_model& calibrated) {
  const double alpha = calibrated.alpha;
  link_model l25 = calibrated, l100 = calibrated;
  l25.beta = link_model::from_gbit(25, alpha).beta;
  l100.beta = link_model::from_gbit(100, alpha).beta;
  char n25[64], n100[64];
  std::snprintf(n25, sizeof n25, "25 Gbit/s, %.3g us", alpha * 1e6);
  std::snprintf(n100, sizeof n100, "100 Gbit/s, %.3g us", alpha * 1e6);
  const link_case links[] = {{n25, l25}, {n100, l100}};
  const std::size_t ranks[] = {16, 64, 256, 1024};
  const bool two = calibrated.large_elements > 0;  // scatter_large for pairs at random places
  std::printf("Extrapolation: alpha %.3g us, gamma %.3g ns/element, scatter %.3g ns/pair",
              alpha * 1e6, calibrated.gamma * 1e9,
              (two ? calibrated.scatter_large : calibrated.scatter) * 1e9);
  if (two) std::printf(" (%.3g into a cached region)", calibrated.scatter * 1e9);
  std::printf(", merge %.3g + %.3g log2(k + 1) ns/pair as calibrated; beta from the link's rate.\n",
              calibrated.merge * 1e9, calibrated.merge_log * 1e9);
  print_tables(links, ranks, "network plus the local work");
}

void print_tables(std::span<const link_case> links, std::span<const std::size_t> ranks, const char* what) {
  const struct {
    const char* name;
    std::size_t n;
  } models[] = {{"ResNet-50 (25.6M)", 25'600'000}, {"BERT-large (340M)", 340'000'000}};
  std::printf("Predicted milliseconds per step (fp32 gradient as one tensor; the alpha-beta model\n"
              "of exchange/cost_model.hpp, %s; dense = ring allreduce of 4n bytes)\n", what);
  for (const auto& m : models) {
    for (double rho : {0.001, 0.01}) {
      std::printf("\n%s, density %g\n", m.name, rho);
      std::printf("%-18s %5s %12s %12s %12s %12s  %s\n", "link", "P", "dense", "allgather",
                  "topk_a2a", "gtopk", "winner");
      for (const auto& l : links) {
        for (std::size_t p : ranks) {
          const exchange_prediction e = predict(shape_for(p, m.n, rho), l.link);
          std::printf("%-18s %5zu %12.4g %12.4g %12.4g %12.4g  %s\n", l.name, p,
                      1e3 * e.seconds[static_cast<unsigned>(exchange_kind::dense_allreduce)],
                      1e3 * e.seconds[static_cast<unsigned>(exchange_kind::sparse_allgather)],
                      1e3 * e.seconds[static_cast<unsigned>(exchange_kind::topk_a2a)],
                      1e3 * e.seconds[static_cast<unsigned>(exchange_kind::gtopk)],
                      std::string(exchange_kind_name(e.best)).c_str());
        }
      }
    }
  }
}

// The measured tensor sizes and repeats (with MPI).
struct measure_options {
  std::vector<std::size_t> sizes = {std::size_t{1} << 20, std::size_t{1} << 22};
  int repeats = 5;
  int calibrations = 1;
  bool link_only = false;  // alpha, beta and gamma only, no exchanges
};

#if defined(GRADCOMP_TOOL_WITH_MPI)

// Least time of `repeats` runs of each of fs, agreed over ranks (the slowest rank's least
// time). The functions take turns, one run of each per round, in an order shuffled anew each
// round, so that a phase in which the machine runs slow falls on all of them alike rather than
// on every repeat of one. The shuffle's seed is rank 0's, broadcast: every rank runs the same
// collectives in the same order. Each timed run follows an untimed run of the same function,
// as when each was timed on its own (its caches and buffers warm, its port just used by itself
// and refilled only while the ranks meet at the barrier; the model frees a full bucket,
// docs/cluster.md). Without the warm-up, gTop-k measured 1.4 to 1.5x slower on the cluster at
// 1 Gbit/s (docs/cluster.md, "Calibrations in threes").
template <class... F>
std::array<double, sizeof...(F)> time_in_turns(mpi_comm& comm, int repeats, std::uint32_t seed, F&&... fs) {
  constexpr std::size_t count = sizeof...(F);
  const std::array<std::function<void()>, count> run = {std::function<void()>(fs)...};
  std::array<std::size_t, count> order;
  for (std::size_t j = 0; j < count; ++j) order[j] = j;
  std::mt19937 rng(seed);  // mt19937's output is fixed by the standard
  std::array<double, count> best;
  best.fill(1e300);
  for (int i = 0; i < repeats; ++i) {
    // Fisher-Yates by hand: std::shuffle's draws differ between standard libraries.
    for (std::size_t j = count - 1; j > 0; --j) std::swap(order[j], order[rng() % (j + 1)]);
    for (const std::size_t f : order) {
      comm.barrier();
      run[f]();  // the warm-up
      comm.barrier();
      const auto t0 = std::chrono::steady_clock::now();
      run[f]();
      best[f] = std::min(best[f], std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  comm.allreduce(std::span<double>(best), reduce_op::max);
  return best;
}

void measure(mpi_comm& comm, const measure_options& mo) {
  // The link measured mo.calibrations times, each cost the median over them (median_link).
  std::vector<link_model> links;
  std::vector<link_probe> probes;
  for (int i = 0; i < mo.calibrations; ++i) {
    link_probe one;
    links.push_back(measure_link(comm, link_measure_options{}, &one));
    probes.push_back(one);
  }
  const link_model link = median_link(links);
  const link_probe probe = median_probe(probes);
  if (comm.rank() == 0 && mo.calibrations > 1) {
    std::printf("\nThe link measured %d times, one after the other; below, each cost is the median "
                "over them (median_link). Each time:\n",
                mo.calibrations);
    for (std::size_t i = 0; i < links.size(); ++i) {
      std::printf("  %zu: ping-pong %.3g us %.3g ns/byte, ring %.3g us %.3g ns/byte, dense_beta %.3g "
                  "ns/byte, burst %.0f bytes, gamma %.3g and %.3g ns/element, scatter %.3g and %.3g "
                  "ns/pair\n",
                  i + 1, probes[i].pingpong_alpha * 1e6, probes[i].pingpong_beta * 1e9,
                  probes[i].ring_alpha * 1e6, probes[i].ring_beta * 1e9, links[i].dense_beta * 1e9,
                  links[i].burst_bytes, links[i].gamma * 1e9, links[i].gamma_large * 1e9,
                  links[i].scatter * 1e9, links[i].scatter_large * 1e9);
    }
  }
  // The measured link without the local work.
  const link_model network{.alpha = link.alpha, .beta = link.beta, .pair_alpha = link.pair_alpha,
                           .pair_beta = link.pair_beta, .dense_beta = link.dense_beta,
                           .burst_bytes = link.burst_bytes};
  const std::size_t p = static_cast<std::size_t>(comm.size());
  if (comm.rank() == 0) {
    std::printf("\nMeasured on this machine with MPI, P = %zu:\n"
                "  ping-pong between ranks 0 and %zu: alpha = %.3g us, beta = %.3g ns/byte (%.3g GB/s)\n"
                "  ring, every rank at once:        alpha = %.3g us, beta = %.3g ns/byte (%.3g GB/s)\n"
                "  model: alpha = %.3g us, beta = %.3g ns/byte (the larger of each, per calibration; gTop-k's bytes: the "
                "ping-pong's beta); local work on "
                "every rank at once: gamma = %.3g ns/element streamed, scatter = %.3g ns/pair "
                "(on %zu elements), gamma = %.3g, scatter = %.3g (on %zu elements), "
                "merge = %.3g + %.3g log2(k + 1) ns/pair\n",
                p, p - 1, probe.pingpong_alpha * 1e6, probe.pingpong_beta * 1e9,
                probe.pingpong_beta > 0 ? 1e-9 / probe.pingpong_beta : 0.0, probe.ring_alpha * 1e6,
                probe.ring_beta * 1e9, probe.ring_beta > 0 ? 1e-9 / probe.ring_beta : 0.0,
                link.alpha * 1e6, link.beta * 1e9, link.gamma * 1e9, link.scatter * 1e9,
                link.small_elements, link.gamma_large * 1e9, link.scatter_large * 1e9,
                link.large_elements, link.merge * 1e9, link.merge_log * 1e9);
    std::printf("  allreduce of %zu bytes of floats, every rank: dense_beta = %.3g ns/byte as "
                "2 (P-1)/P of them (%.2fx the model's beta; prices dense_allreduce)\n",
                probe.allreduce_bytes, link.dense_beta * 1e9,
                link.beta > 0 ? link.dense_beta / link.beta : 0.0);
    std::printf("  ping-pongs after an idle pause: burst = %.0f bytes sent before the rate applies "
                "(%.3g us at the ping-pong's beta; freed from the first message each rank sends in the "
                "sparse exchanges, in gTop-k from each round's sender and the broadcast's first)\n",
                link.burst_bytes, link.burst_bytes * link.pair_beta * 1e6);
  }
  if (mo.link_only) return;
  // The seed of the exchanges' order: rank 0's, from the clock, printed (a double holds it
  // exactly).
  double seed_value[1] = {static_cast<double>(
      static_cast<std::uint32_t>(std::chrono::steady_clock::now().time_since_epoch().count()))};
  comm.broadcast(std::span<double>(seed_value), 0);
  const auto seed = static_cast<std::uint32_t>(seed_value[0]);
  if (comm.rank() == 0) {
    std::printf("the exchanges' order shuffled with seed %u\n", seed);
    std::printf("network: the alpha-beta model plus one header allgather (log2 P alpha + 48 (P-1) "
                "beta), dense_allreduce at dense_beta (the measured allreduce, copies and sums included); +local: plus the local work (gamma, scatter, merge);\nmeasured: least of the repeats (the exchanges in turns, each timed "
                "run after an untimed one), slowest rank. Milliseconds.\n");
    std::printf("%10s %8s  %-18s %9s %9s %9s %14s\n", "n", "density", "exchange", "network", "+local",
                "measured", "measured/+local");
  }
  const double header = p > 1 ? std::ceil(std::log2(static_cast<double>(p))) * link.alpha +
                                    48.0 * static_cast<double>(p - 1) * link.beta
                              : 0.0;
  const std::vector<std::size_t>& sizes = mo.sizes;
  const int repeats = mo.repeats;
  const compressor<dense, identity, no_feedback> dense_c;
  const compressor<topk, identity, residual> topk_c;
  for (std::size_t n : sizes) {
    std::vector<float> g(n), out(n);
    for (std::size_t i = 0; i < n; ++i) {
      g[i] = std::sin(0.001f * static_cast<float>(i * 7 + static_cast<std::size_t>(comm.rank()) * 13 + 1));
    }
    for (double rho : {0.001, 0.01}) {
      compressor<topk, identity, residual> c = topk_c;
      auto st = c.make_state(n);
      payload sparse;
      c.compress(g, st, compress_context{rho, {}}, sparse);
      compressor<dense, identity, no_feedback> d = dense_c;
      auto dst = d.make_state(n);
      payload full;
      d.compress(g, dst, compress_context{1.0, {}}, full);

      const exchange_prediction e = predict(shape_for(p, n, rho), link);
      const exchange_prediction net = predict(shape_for(p, n, rho), network);
      sparse_allgather sa;
      topk_a2a a2a;
      gtopk gt;
      const std::array<double, exchange_kinds> measured = time_in_turns(
          comm, repeats, seed, [&] { dense_allreduce{}.exchange(comm, d, full, std::span<float>(out)); },
          [&] { sa.exchange(comm, c, sparse, std::span<float>(out)); },
          [&] { a2a.exchange(comm, c, sparse, std::span<float>(out)); },
          [&] { gt.exchange(comm, c, sparse, std::span<float>(out)); });
      if (comm.rank() == 0) {
        for (unsigned k = 0; k < exchange_kinds; ++k) {
          const double predicted = e.seconds[k] + header;
          std::printf("%10zu %8g  %-18s %9.3f %9.3f %9.3f %14.2f\n", n, rho,
                      std::string(exchange_kind_name(static_cast<exchange_kind>(k))).c_str(),
                      (net.seconds[k] + header) * 1e3, predicted * 1e3, measured[k] * 1e3,
                      predicted > 0 ? measured[k] / predicted : 0.0);
        }
        const auto fastest = static_cast<unsigned>(std::min_element(std::begin(measured), std::end(measured)) -
                                                   std::begin(measured));
        const double pick = measured[static_cast<unsigned>(e.best)];
        std::printf("%10s %8s  the model (+local) picks %s; fastest measured: %s; the pick measured "
                    "%.2fx the fastest\n",
                    "", "", std::string(exchange_kind_name(e.best)).c_str(),
                    std::string(exchange_kind_name(static_cast<exchange_kind>(fastest))).c_str(),
                    measured[fastest] > 0 ? pick / measured[fastest] : 1.0);
      }
    }
  }
}

#endif

using gradcomp_tools::whole_number;

// "1048576,25600000" -> {1048576, 25600000}; throws on anything else.
std::vector<std::size_t> parse_sizes(const std::string& list) {
  return gradcomp_tools::parse_sizes(list, 4294967295.0, "[1, 2^32 - 1]");
}

}  // namespace

int main(int argc, char** argv) {
  bool tables = true;
  [[maybe_unused]] measure_options mo;
  const char* usage =
      "usage: [mpirun -np P] exchange_model [--quick] [--no-tables] [--link-only] [--sizes N,N...] "
      "[--repeats R] [--calibrations C]\n       exchange_model --extrapolate ALPHA_US GAMMA_NS [SCATTER_NS MERGE_NS "
      "MERGE_LOG_NS [CACHED_SCATTER_NS]]\n";
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--quick") {
        mo.sizes = {std::size_t{1} << 16};
        mo.repeats = 2;
      } else if (a == "--no-tables") {
        tables = false;
      } else if (a == "--link-only") {
        mo.link_only = true;
      } else if (a == "--extrapolate" &&
                 (argc - i - 1 == 2 || argc - i - 1 == 5 || argc - i - 1 == 6)) {
        // --extrapolate ALPHA_US GAMMA_NS [SCATTER_NS MERGE_NS MERGE_LOG_NS [CACHED_SCATTER_NS]]:
        // the tables on 25 and 100 Gbit/s, nothing measured.
        const int given = argc - i - 1;
        double v[6] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
        for (int j = 0; j < given; ++j) {
          const auto x = whole_number(argv[i + 1 + j], 0.0, HUGE_VAL);
          if (!x) {
            throw std::invalid_argument(std::string("--extrapolate: '") + argv[i + 1 + j] +
                                        "' is not a finite number >= 0");
          }
          v[j] = *x;
        }
        link_model l{v[0] * 1e-6, 0.0, v[1] * 1e-9, v[2] * 1e-9, v[3] * 1e-9, v[4] * 1e-9};
        if (given == 6) {
          // Every tensor of the tables priced at the given (large-vector) costs, the pairs
          // added into a cached region at CACHED_SCATTER: per_item gives the large costs from
          // 2 elements on, and cached pairs cost link_model::scatter.
          l.gamma_large = l.gamma;
          l.scatter_large = l.scatter;
          l.scatter = v[5] * 1e-9;
          l.small_elements = 1;
          l.large_elements = 2;
        }
        print_extrapolation(l);
        return 0;
      } else if (a == "--sizes" && i + 1 < argc) {
        mo.sizes = parse_sizes(argv[++i]);
      } else if (a == "--repeats" && i + 1 < argc) {
        mo.repeats = gradcomp_tools::parse_count("--repeats", argv[++i], 1000);
      } else if (a == "--calibrations" && i + 1 < argc) {
        mo.calibrations = gradcomp_tools::parse_count("--calibrations", argv[++i], 100);
      } else {
        std::fprintf(stderr, "%s", usage);
        return 2;
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "exchange_model: %s\n%s", e.what(), usage);
    return 2;
  }
#if defined(GRADCOMP_TOOL_WITH_MPI)
  mpi_environment env(argc, argv);
  mpi_comm comm;
  if (comm.rank() == 0 && tables) print_tables();
  if (comm.size() > 1) {
    measure(comm, mo);
  } else {
    std::printf("\nRun under mpirun -np 2 (up to 4 on this machine) to compare the model with "
                "measured MPI timings.\n");
  }
#else
  if (tables) print_tables();
  std::printf("\nBuilt without MPI: no measurements.\n");
#endif
  return 0;
}
