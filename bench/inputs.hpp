// Benchmark inputs: gradients from a normal and two heavy-tailed distributions, several
// buffers per (n, distribution) so that a benchmark rotates through more memory than the
// last-level cache holds, and a cache that keeps the inputs of only one n alive at a time
// (the 2^27 buffers are 512 MiB each).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <numbers>
#include <string>
#include <thread>
#include <vector>

namespace gradcomp_bench {

enum class dist { normal, laplace, student_t3 };

inline constexpr dist all_dists[] = {dist::normal, dist::laplace, dist::student_t3};

// The suffix a benchmark family gets for its input: none for the normal input, so that the
// names the targets refer to (select/topk/n:.../ppm:...) are the normal ones.
inline std::string suffix(dist d) {
  switch (d) {
    case dist::normal:
      return "";
    case dist::laplace:
      return "_laplace";
    case dist::student_t3:
      return "_t3";
  }
  return "_?";
}

// Counter-based: element i of buffer b is a pure function of (b, i), so buffers fill in
// parallel and every run sees the same inputs. Element i owns the 8 keys (stream << 40) |
// (i << 3) | j, j < 8, which never collide for i < 2^32 (indices are 32-bit anyway).
inline std::uint64_t mix(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Uniform in (0, 1), never 0.
inline double uniform(std::uint64_t key) {
  return (static_cast<double>(mix(key) >> 11) + 0.5) * 0x1.0p-53;
}

// Box-Muller from keys base | j and base | (j + 1).
inline double normal(std::uint64_t base, std::uint64_t j) {
  return std::sqrt(-2.0 * std::log(uniform(base | j))) *
         std::cos(2.0 * std::numbers::pi * uniform(base | (j + 1)));
}

// Laplace(0, 1): sd sqrt(2). Student-t with 3 degrees of freedom: Z / sqrt(chi2_3 / 3), finite
// variance (so Gaussian-k's model applies at all) but polynomial tails.
inline float draw(dist d, std::uint64_t base) {
  switch (d) {
    case dist::normal:
      return static_cast<float>(normal(base, 0));
    case dist::laplace: {
      const double u = uniform(base) - 0.5;
      return static_cast<float>((u < 0 ? 1.0 : -1.0) * std::log(1.0 - 2.0 * std::fabs(u)));
    }
    case dist::student_t3: {
      double chi2 = 0.0;
      for (std::uint64_t j = 2; j <= 6; j += 2) {
        const double z = normal(base, j);
        chi2 += z * z;
      }
      return static_cast<float>(normal(base, 0) / std::sqrt(chi2 / 3.0));
    }
  }
  return 0.0f;
}

inline void fill(std::vector<float>& buf, dist d, std::uint64_t stream) {
  const std::size_t n = buf.size();
  const unsigned workers = std::max(1u, std::min(8u, std::thread::hardware_concurrency()));
  auto work = [&](unsigned w) {
    const std::size_t b = n * w / workers;
    const std::size_t e = n * (w + 1) / workers;
    for (std::size_t i = b; i < e; ++i) {
      buf[i] = draw(d, (stream << 40) | (static_cast<std::uint64_t>(i) << 3));
    }
  };
  std::vector<std::thread> threads;
  for (unsigned w = 1; w < workers; ++w) threads.emplace_back(work, w);
  work(0);
  for (auto& t : threads) t.join();
}

// At least 4x the 32 MiB L3 of the machine of docs/performance.md, and at least two buffers:
// a benchmark that cycles through them always reads from memory. The environment variable
// GRADCOMP_BENCH_ROTATE_MIB overrides the 128 MiB (the ctest smoke run sets 0: two
// buffers, quick to fill under the sanitizers).
inline std::size_t buffers_for(std::size_t n) {
  std::size_t rotate_bytes = std::size_t{128} << 20;
  if (const char* env = std::getenv("GRADCOMP_BENCH_ROTATE_MIB")) {
    rotate_bytes = static_cast<std::size_t>(std::strtoull(env, nullptr, 10)) << 20;
  }
  const std::size_t bytes = n * sizeof(float);
  return std::max<std::size_t>(2, (rotate_bytes + bytes - 1) / bytes);
}

struct input_set {
  std::size_t n = 0;
  dist d = dist::normal;
  std::vector<std::vector<float>> buffers;

  const std::vector<float>& operator[](std::size_t i) const { return buffers[i % buffers.size()]; }
  std::size_t size() const { return buffers.size(); }
};

// The inputs of (n, d). The sets of one n are kept (all distributions, so that
// --benchmark_enable_random_interleaving, which mixes the benchmarks of one size, does not
// rebuild them) and dropped when another n is asked for; the benchmarks are registered with n
// outermost. Peak memory: three sets (3 x 2 x 512 MiB at n = 2^27) plus what the running
// benchmark allocates.
inline const input_set& inputs(std::size_t n, dist d) {
  static std::vector<std::unique_ptr<input_set>> sets;
  if (!sets.empty() && sets.front()->n != n) sets.clear();
  for (const auto& set : sets) {
    if (set->d == d) return *set;
  }
  auto set = std::make_unique<input_set>();
  set->n = n;
  set->d = d;
  set->buffers.resize(buffers_for(n));
  for (std::size_t b = 0; b < set->buffers.size(); ++b) {
    set->buffers[b].resize(n);
    fill(set->buffers[b], d, 100 * static_cast<std::uint64_t>(d) + b);
  }
  sets.push_back(std::move(set));
  return *sets.back();
}

}  // namespace gradcomp_bench
