// gradcomp/detail/timer.hpp: wall-clock seconds for the per-phase statistics.
#pragma once

#include <chrono>

namespace gradcomp::detail {

class stopwatch {
 public:
  stopwatch() : start_(std::chrono::steady_clock::now()) {}
  // Seconds since construction or the previous lap().
  double lap() {
    const auto now = std::chrono::steady_clock::now();
    const double s = std::chrono::duration<double>(now - start_).count();
    start_ = now;
    return s;
  }

 private:
  std::chrono::steady_clock::time_point start_;
};

}  // namespace gradcomp::detail
