// gradcomp/detail/host_dispatch.hpp: which instruction set the host's vector loops run in.
// Loops written once with GCC/Clang vector extensions are compiled for the build's own
// target and, on x86, also for AVX2 and for AVX-512 (F, BW, DQ, VL) by run_vector, which
// inlines the whole loop into a clone with that target; the widest clone the CPU offers runs,
// capped by a process-wide ceiling (limit_host_isa, or GRADCOMP_HOST_ISA in the environment).
// Used by the quantizers (detail/host_simd.hpp), top-k's bracket pass (select/topk.hpp) and
// Gaussian-k's statistics pass (select/gaussiank.hpp).
#pragma once

#include <atomic>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include <gradcomp/detail/simd.hpp>

// On 32-bit x86 only with SSE2: x87 arithmetic would not give the clones' bits anyway.
#if GRADCOMP_VECTOR_EXTENSIONS && (defined(__x86_64__) || (defined(__i386__) && defined(__SSE2__)))
#define GRADCOMP_HOST_DISPATCH 1
#include <cpuid.h>
#include <immintrin.h>
#else
#define GRADCOMP_HOST_DISPATCH 0
#endif

namespace gradcomp::detail {

enum class host_isa : int {
  portable = 0,  // the per-element loops (no vector path)
  baseline = 1,  // vector path compiled for the build's own target
  avx2 = 2,
  avx512 = 3,  // AVX-512 F, BW, DQ and VL
};

inline const char* host_isa_name(host_isa isa) noexcept {
  switch (isa) {
    case host_isa::portable: return "portable";
    case host_isa::baseline: return "baseline";
    case host_isa::avx2: return "avx2";
    case host_isa::avx512: return "avx512";
  }
  return "unknown";
}

// What this CPU and build run: on x86, the widest clone the CPU offers; the build's own
// target only when it has AVX2 itself (plain SSE2 code for 64-byte vectors was measured
// slower than the portable loops); elsewhere the portable loops, as the vector path's code
// on other architectures has not been measured.
inline host_isa detected_host_isa() noexcept {
#if !GRADCOMP_VECTOR_EXTENSIONS
  return host_isa::portable;
#else
  if constexpr (std::endian::native != std::endian::little) return host_isa::portable;
#if GRADCOMP_HOST_DISPATCH
  static const host_isa found = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")) {
      return host_isa::avx512;
    }
    if (__builtin_cpu_supports("avx2")) return host_isa::avx2;
#if defined(__AVX2__)
    return host_isa::baseline;
#else
    return host_isa::portable;
#endif
  }();
  return found;
#else
  return host_isa::portable;
#endif
#endif
}

// The ceiling starts at GRADCOMP_HOST_ISA (portable, baseline, avx2 or avx512) when the
// environment sets it, else at avx512 (no limit).
inline host_isa host_isa_from_environment() noexcept {
  const char* v = std::getenv("GRADCOMP_HOST_ISA");
  if (v == nullptr) return host_isa::avx512;
  for (const host_isa isa :
       {host_isa::portable, host_isa::baseline, host_isa::avx2, host_isa::avx512}) {
    if (std::strcmp(v, host_isa_name(isa)) == 0) return isa;
  }
  return host_isa::avx512;
}

inline std::atomic<int>& host_isa_ceiling() noexcept {
  static std::atomic<int> ceiling{static_cast<int>(host_isa_from_environment())};
  return ceiling;
}

// The path the quantizers take now: the detected one, at most the ceiling.
inline host_isa active_host_isa() noexcept {
  const int detected = static_cast<int>(detected_host_isa());
  const int ceiling = host_isa_ceiling().load(std::memory_order_relaxed);
  return static_cast<host_isa>(detected < ceiling ? detected : ceiling);
}

// Sets the ceiling (process-wide) and returns the previous one.
inline host_isa limit_host_isa(host_isa ceiling) noexcept {
  return static_cast<host_isa>(
      host_isa_ceiling().exchange(static_cast<int>(ceiling), std::memory_order_relaxed));
}

// Which clone a loop is compiled in, for the few places that use that clone's intrinsics
// (a target attribute is not visible to the preprocessor).
template <host_isa Isa>
using isa_tag = std::integral_constant<host_isa, Isa>;

#if GRADCOMP_VECTOR_EXTENSIONS

// Runs k(isa_tag<path>{}) compiled for path `isa`; portable and baseline run the build's own
// target (run_baseline). Every call inside k is inlined into the clone (flatten), so the
// vector code takes the clone's instruction set.
#if GRADCOMP_HOST_DISPATCH
template <class K>
[[gnu::target("avx512f,avx512bw,avx512dq,avx512vl"), gnu::flatten]] inline void run_avx512(
    const K& k) {
  k(isa_tag<host_isa::avx512>{});
}
template <class K>
[[gnu::target("avx2"), gnu::flatten]] inline void run_avx2(const K& k) {
  k(isa_tag<host_isa::avx2>{});
}
#endif
template <class K>
[[gnu::flatten]] inline void run_baseline(const K& k) {
  k(isa_tag<host_isa::baseline>{});
}

template <class K>
void run_vector(host_isa isa, const K& k) {
#if GRADCOMP_HOST_DISPATCH
  switch (isa) {
    case host_isa::avx512: run_avx512(k); return;
    case host_isa::avx2: run_avx2(k); return;
    default: break;
  }
#endif
  run_baseline(k);
}
#endif  // GRADCOMP_VECTOR_EXTENSIONS

// Runs k on the active path (run_vector), or, in a build without vector extensions, as it
// is: the selectors' passes, which have no portable loops of their own to fall back to.
template <class K>
void run_active(const K& k) {
#if GRADCOMP_VECTOR_EXTENSIONS
  run_vector(active_host_isa(), k);
#else
  k(isa_tag<host_isa::portable>{});
#endif
}

}  // namespace gradcomp::detail
