// gradcomp/detail/host_simd.hpp: the host quantizers' vector paths. Their loops are written
// once, with GCC/Clang vector extensions on chunks of 16 values, and compiled three times:
// for the build's own target (SSE2 on a plain x86-64 build, or whatever -march says), and,
// on x86, for AVX2 and for AVX-512 (F, BW, DQ, VL), picked at run time by what the CPU
// offers (detail/host_dispatch.hpp). A header-only library cannot assume its users build with
// -march=native; the dispatch gives them the wide paths anyway.
//
// Every path computes the same bits as the portable per-element loop (the device kernels'
// arithmetic, detail/quantize_math.hpp and detail/float16.hpp): integer and exactly-rounded
// float operations only, each the one the portable loop performs, and no fused multiply-add,
// so that the paths agree under any MXCSR setting (QSGD's and TernGrad's divisions follow its
// rounding mode and flush-to-zero on every path alike). The one hardware conversion used,
// fp16's F16C encoder, takes its rounding from its operand and ignores flush-to-zero (see
// half_encode_hardware, a function of its own per instruction set). The bucket sums, which
// GCC's vector extensions compile badly, use the AVX2 and AVX-512 intrinsics of the clone they
// run in (isa_tag), TernGrad's encoder has a loop of its own on AVX-512 with BMI2
// (terngrad_encode_hardware), and scaled sign's codes on AVX-512 are one compare into a mask
// register per 16 values (sign_codes_avx512).
// tests/quantize/same_bits_test.cpp runs every path against the portable one and against
// hashes recorded before the vector paths existed.
//
// detail::limit_host_isa lowers the ceiling (tests, and benchmarks that compare paths), as
// does the environment variable GRADCOMP_HOST_ISA=portable|baseline|avx2|avx512 read once at
// the first call; portable turns the vector paths off, as does GRADCOMP_NO_VECTOR_EXTENSIONS.
//
// The paths live in detail/host_simd/, one topic a header, each including the one before:
// lanes.hpp (the chunk as vector lanes, packing, per-value arithmetic), sums.hpp (bucket
// statistics), codecs.hpp (the loops over buckets and the five codecs) and entry.hpp (the
// quantizers' entry points and the CPU feature probes).
#pragma once

#include <gradcomp/detail/host_simd/entry.hpp>
