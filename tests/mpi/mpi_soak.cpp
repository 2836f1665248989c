// The soak run: many steps of top-k + residual under MPI with every exchange, checking every
// `check` steps that nothing was lost or made up, and that the resident memory stays flat
// after warm-up.
//
//   mpiexec -n 4 build/default/tests/mpi/mpi_soak [--steps 100000] [--n 1048576]
//       [--density 0.001] [--check 1000] [--exchanges allgather,a2a,gtopk,auto,allreduce]
//
// Conservation, exactly: the gradients are multiples of 2^-10 in [-1, 1], each rank's pool of
// gradients sums to zero coordinate by coordinate (it holds pairs g, -g), so no running sum
// outgrows what a float holds at that resolution however long the run, and the quantizer is
// fp32; every operation on the residual, the exchanges' sums over ranks, the division by
// P = 4 and the SGD update (lr 1, no momentum) is then exact, and for every coordinate
//     sum over ranks of residual  +  P * (theta_0 - theta)  ==  sum over ranks and steps of g
// holds bit for bit (theta - theta_0 is the applied update). gtopk runs with exact values, the
// mode whose picks are each applied or given back (tree mode may drop some by design), and
// allreduce runs Random-k, since top-k payloads cannot be added position by position.
//
// Memory: the resident set (/proc/self/statm) is read at every check; after the first check
// it may not grow by more than `--rss-slack-mib` (default 16 MiB) on any rank. Under
// AddressSanitizer the check is skipped and says so: its quarantine keeps freed memory
// resident by design (256 MiB by default), and LeakSanitizer checks leaks there instead.
//
// Each rank cycles through 98 gradients of its own, made once, so that the run measures the
// library and not a random number generator; the sum of the gradients applied so far is then
// a count per gradient times that gradient. The ctest test mpi_soak_smoke runs 2000 steps on
// every push (500 in the sanitizer builds); mpi_soak_np4 (label soak, left out of the presets) is the full run.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include <gradcomp/comm/mpi.hpp>
#include <gradcomp/comm/mpi_guard.hpp>
#include <gradcomp/gradcomp.hpp>

namespace {

using namespace gradcomp;

#if defined(__SANITIZE_ADDRESS__)
constexpr bool checks_rss = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool checks_rss = false;
#else
constexpr bool checks_rss = true;
#endif
#else
constexpr bool checks_rss = true;
#endif

struct options {
  std::uint64_t steps = 100000;
  std::size_t n = std::size_t{1} << 20;
  double density = 0.001;
  std::uint64_t check = 1000;
  double rss_slack_mib = 16.0;
  std::vector<std::string> exchanges = {"allgather", "a2a", "gtopk", "auto", "allreduce"};
};

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw invalid_argument(detail::concat("mpi_soak: ", a, " needs a value"));
      return argv[++i];
    };
    if (a == "--steps") {
      o.steps = std::stoull(value());
    } else if (a == "--n") {
      o.n = std::stoull(value());
    } else if (a == "--density") {
      o.density = std::stod(value());
    } else if (a == "--check") {
      o.check = std::stoull(value());
    } else if (a == "--rss-slack-mib") {
      o.rss_slack_mib = std::stod(value());
    } else if (a == "--exchanges") {
      o.exchanges.clear();
      std::string list = value();
      for (std::size_t at = 0; at <= list.size();) {
        const std::size_t comma = std::min(list.find(',', at), list.size());
        o.exchanges.push_back(list.substr(at, comma - at));
        at = comma + 1;
      }
    } else {
      throw invalid_argument(detail::concat("mpi_soak: unknown argument ", a));
    }
  }
  if (o.check == 0 || o.steps < o.check) {
    throw invalid_argument("mpi_soak: --check must be >= 1 and <= --steps");
  }
  return o;
}

double rss_mib() {
  std::ifstream statm("/proc/self/statm");
  long pages = 0, resident = 0;
  statm >> pages >> resident;
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) / (1024.0 * 1024.0);
}

// 49 gradients and their negatives; step s applies pool[(31 s) % 98], which visits every
// entry once in each 98 steps (31 and 98 are coprime).
constexpr std::size_t pool_half = 49;
constexpr std::size_t pool_size = 2 * pool_half;

// Rank r's pool of gradients: multiples of 2^-10 in [-1, 1], from SplitMix64, and their
// negatives, so that the pool sums to zero.
std::vector<std::vector<float>> make_pool(std::size_t n, int rank) {
  std::vector<std::vector<float>> pool(pool_size, std::vector<float>(n));
  std::uint64_t state = 0x9e3779b97f4a7c15ull * static_cast<std::uint64_t>(rank + 1);
  for (std::size_t j = 0; j < pool_half; ++j) {
    std::vector<float>& g = pool[j];
    for (float& x : g) {
      std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      z ^= z >> 31;
      // A bell shape from the sum of two uniforms, in steps of 2^-10.
      const auto a = static_cast<int>(z & 1023u), b = static_cast<int>((z >> 10) & 1023u);
      x = static_cast<float>(a + b - 1023) / 1024.0f;
    }
    std::transform(g.begin(), g.end(), pool[pool_half + j].begin(), [](float v) { return -v; });
  }
  return pool;
}

struct soak_result {
  double seconds = 0.0;
  double rss_after_warmup = 0.0;
  double rss_max = 0.0;
  double rss_end = 0.0;
  std::uint64_t checks = 0;
  std::size_t bytes_sent = 0;
};

template <class Compressor, class Exchange>
soak_result soak(const options& o, mpi_comm& comm, const std::vector<std::vector<float>>& pool,
                 Compressor c, Exchange x, const char* name) {
  const int P = comm.size();
  const int rank = comm.rank();
  sparsified_sgd<Compressor, Exchange, mpi_comm> sgd(comm, {o.n}, std::move(c), std::move(x),
                                                     sgd_options{.lr = 1.0, .seed = 11},
                                                     density_schedule::constant(o.density));
  const std::vector<float> theta0(o.n, 0.0f);
  std::vector<float> theta = theta0;
  std::vector<std::uint64_t> used(pool_size, 0);  // how often each gradient was applied
  std::vector<double> lhs(o.n), rhs(o.n);
  soak_result res;
  const auto start = std::chrono::steady_clock::now();
  for (std::uint64_t step = 1; step <= o.steps; ++step) {
    const std::size_t which = static_cast<std::size_t>((step * 31) % pool_size);
    sgd.step(theta, pool[which]);
    ++used[which];
    if (step % o.check != 0) continue;

    // sum over ranks of (residual - sum of g) + P * applied == 0, coordinate by coordinate.
    const auto& e = sgd.feedback_state(0).e;
    for (std::size_t i = 0; i < o.n; ++i) {
      lhs[i] = static_cast<double>(e[i]) + static_cast<double>(theta0[i] - theta[i]);
    }
    std::fill(rhs.begin(), rhs.end(), 0.0);
    for (std::size_t j = 0; j < pool_size; ++j) {
      if (!used[j]) continue;
      const auto count = static_cast<double>(used[j]);
      for (std::size_t i = 0; i < o.n; ++i) rhs[i] += count * static_cast<double>(pool[j][i]);
    }
    // residual_r + applied - G_r, summed over ranks: P * applied counts once per rank.
    for (std::size_t i = 0; i < o.n; ++i) lhs[i] -= rhs[i];
    MPI_Allreduce(MPI_IN_PLACE, lhs.data(), static_cast<int>(o.n), MPI_DOUBLE, MPI_SUM, comm.native());
    std::size_t bad = 0, first = o.n;
    for (std::size_t i = 0; i < o.n; ++i) {
      if (lhs[i] != 0.0) {
        ++bad;
        first = std::min(first, i);
      }
    }
    if (bad) {
      throw error(detail::concat("mpi_soak ", name, ": after step ", step, ", ", bad,
                                 " coordinates break residual + applied == sum of gradients (first: ",
                                 first, ", off by ", lhs[first], ")"));
    }
    ++res.checks;
    const double rss = rss_mib();
    if (step == o.check) res.rss_after_warmup = rss;
    res.rss_max = std::max(res.rss_max, rss);
    res.rss_end = rss;
    if (checks_rss && rss > res.rss_after_warmup + o.rss_slack_mib) {
      throw error(detail::concat("mpi_soak ", name, ": rank ", rank, "'s resident memory grew from ",
                                 res.rss_after_warmup, " MiB after warm-up to ", rss,
                                 " MiB at step ", step));
    }
  }
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  res.bytes_sent = sgd.total_bytes_sent();
  (void)P;
  return res;
}

void report(mpi_comm& comm, const char* name, const options& o, const soak_result& r) {
  double mine[3] = {r.rss_after_warmup, r.rss_max, r.rss_end};
  double high[3];
  MPI_Reduce(mine, high, 3, MPI_DOUBLE, MPI_MAX, 0, comm.native());
  if (comm.rank() == 0) {
    std::printf("%-10s %8llu steps %6llu checks passed  %8.1f s  %7.2f ms/step  "
                "RSS after warm-up %7.1f MiB, max %7.1f, end %7.1f (largest rank)  sent/rank %zu B\n",
                name, static_cast<unsigned long long>(o.steps),
                static_cast<unsigned long long>(r.checks), r.seconds, 1e3 * r.seconds / static_cast<double>(o.steps),
                high[0], high[1], high[2], r.bytes_sent);
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  mpi_environment env(argc, argv);
  return mpi_run(MPI_COMM_WORLD, [&] {
    const options o = parse(argc, argv);
    mpi_comm comm;
    const auto pool = make_pool(o.n, comm.rank());
    if (comm.rank() == 0) {
      std::printf("# mpi_soak: %d ranks, n = %zu, density %g, %llu steps, checks every %llu\n",
                  comm.size(), o.n, o.density, static_cast<unsigned long long>(o.steps),
                  static_cast<unsigned long long>(o.check));
      if (!checks_rss) {
        std::printf("# resident memory is reported, not checked: AddressSanitizer's quarantine "
                    "keeps freed memory resident\n");
      }
    }
    using topk_res = compressor<topk, identity, residual>;
    for (const std::string& x : o.exchanges) {
      soak_result r;
      if (x == "allgather") {
        r = soak(o, comm, pool, topk_res{}, sparse_allgather{}, "allgather");
      } else if (x == "a2a") {
        r = soak(o, comm, pool, topk_res{}, topk_a2a{}, "a2a");
      } else if (x == "gtopk") {
        r = soak(o, comm, pool, topk_res{}, gtopk(gtopk_values::exact), "gtopk");
      } else if (x == "auto") {
        r = soak(o, comm, pool, topk_res{}, auto_exchange(auto_options{.gtopk_mode = gtopk_values::exact}),
                 "auto");
      } else if (x == "allreduce") {
        r = soak(o, comm, pool, compressor<randomk, identity, residual>{}, dense_allreduce{},
                 "allreduce");
      } else {
        throw invalid_argument(detail::concat("mpi_soak: unknown exchange ", x,
                                              "; allowed: allgather, a2a, gtopk, auto, allreduce"));
      }
      report(comm, x.c_str(), o, r);
    }
    return 0;
  });
}
