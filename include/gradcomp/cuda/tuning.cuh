// gradcomp/cuda/tuning.cuh: every launch shape of gradcomp's kernels, in one place: the
// selection kernels' as one constexpr aggregate (a plain value, so benchmarks can inject
// alternatives: threads per block, items per thread, bits per radix pass), and the
// element-wise kernels' (quantizers, sparse calls, feedback, the DDP hook's division) as threads
// and a grid cap, and the hook's energy reduction. The values were chosen on sm_90; sm_80
// builds use the same (not tuned there).
// Every kernel that walks g does so in tiles of threads * items consecutive elements, one tile
// per block, loaded row by row (row r of a tile is threads consecutive elements), so loads are
// coalesced and the per-tile counts of the ordered passes line up with the tiles.
#pragma once

#include <cstddef>

#include <gradcomp/detail/select/keys.hpp>

namespace gradcomp::cuda {

struct select_tuning {
  int threads;          // per block of the tile kernels (a multiple of 32)
  int items;            // rows per tile (items per thread)
  int single_threads;   // the single-block kernels (the finish's miss check, scans, picks)
  int reduce_blocks;    // at most this many blocks in the moments reduction
  int tile_blocks;      // at most this many blocks in the gated tile kernels (grid-stride over
                        // tiles), so that a pass the device skipped costs a short launch
  unsigned radix_bits;  // digit width of the radix select
  int list_items;       // list selects (the sample, the candidates): items per thread a block
  int list_blocks;      // at most this many blocks a list-select pass (grid-stride beyond)
  int filter_min_blocks;  // the topk filter's __launch_bounds__ blocks an SM (a register cap)

  [[nodiscard]] constexpr std::size_t tile() const noexcept {
    return static_cast<std::size_t>(threads) * static_cast<std::size_t>(items);
  }
  [[nodiscard]] constexpr unsigned buckets() const noexcept { return 1u << radix_bits; }
  // Blocks of a list-select pass over at most `count` keys.
  [[nodiscard]] constexpr unsigned list_grid(std::size_t count) const noexcept {
    const std::size_t per = static_cast<std::size_t>(threads) * static_cast<std::size_t>(list_items);
    const std::size_t b = (count + per - 1) / per;
    return static_cast<unsigned>(b < 1 ? 1 : (b > static_cast<std::size_t>(list_blocks) ? static_cast<std::size_t>(list_blocks) : b));
  }
};

// sm_90: 256 x 16 = 4096 elements a tile (16 KiB of float) keeps enough loads in flight per SM
// to stream g at full bandwidth; 1024 threads for the single-block kernels; 11-bit digits as
// on the host (detail::radix_digit_bits), 2048 buckets (a list select's two histograms are
// 16 KiB of shared counters); list selects over 4 items a thread (1024 a block: a 64k-key
// candidate list spreads over 64 blocks), at most 264 blocks (2 an SM of an H100 SXM); the
// filter capped to 32 registers (8 blocks of 256 an SM: full occupancy on sm_80 and sm_90).
inline constexpr select_tuning default_select_tuning{
    256, 16, 1024, 1024, 2048, detail::radix_digit_bits, 4, 264, 8};

static_assert(default_select_tuning.threads % 32 == 0);
static_assert(default_select_tuning.tile() < (std::size_t{1} << 16),
              "per-tile counts are packed in 16 bits");
static_assert(default_select_tuning.radix_bits == detail::radix_digit_bits,
              "host and device radix selects must use the same digits");
static_assert(default_select_tuning.buckets() % default_select_tuning.single_threads == 0,
              "the digit pick gives each thread the same number of buckets");

// The element-wise kernels: one item per thread, blocks of `threads`, at most max_blocks
// (grid-stride beyond).
struct elementwise_tuning {
  unsigned threads = 256;
  std::size_t max_blocks = 1u << 20;
};
// The quantizers' encode, decode and validate kernels (their statistics kernel's block is fixed
// by its shared tile).
inline constexpr elementwise_tuning quantize_tuning_sm90{256, 1u << 20};
// gather, the scatter-adds, decompress and index validation.
inline constexpr elementwise_tuning sparse_tuning_sm90{256, 1u << 20};
// e += g and the residual feedback's scatter, gather and validation: few blocks, each looping.
inline constexpr elementwise_tuning feedback_tuning_sm90{256, 4096};
// The DDP hook's CUDA engine (python/src/cuda_bucket.cu): the mean's division by the rank count.
inline constexpr elementwise_tuning divide_tuning_sm90{256, 4096};

// A two-pass reduction: a grid of `blocks` blocks of `threads` per vector writes one partial
// sum a block, and one more pass adds the partials in order (so the sum's order, and its
// rounding, are fixed by these two numbers).
struct reduction_tuning {
  unsigned threads = 256;
  unsigned blocks = 512;
};
// The DDP hook's energies ||sent||^2 and ||e + g - sent||^2, in double.
inline constexpr reduction_tuning energy_tuning_sm90{256, 512};

}  // namespace gradcomp::cuda
