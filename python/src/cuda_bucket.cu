// python/src/cuda_bucket.cu: cuda_bucket.hpp's calls, over gradcomp's device policies
// (gradcomp/cuda.cuh). No torch header is included here.
#include "cuda_bucket.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <type_traits>

#include <gradcomp/cuda.cuh>
#include <gradcomp/cuda/dispatch/feedback.cuh>
#include <gradcomp/cuda/dispatch/launch.cuh>
#include <gradcomp/cuda/dispatch/scratch.cuh>
#include <gradcomp/cuda/kernels/step_kernels.cuh>
#include <gradcomp/cuda/memory.cuh>
#include <gradcomp/cuda/tuning.cuh>
#include <gradcomp/detail/float16.hpp>

namespace gradcomp::torch_cuda {

namespace {

// DGC's clipping: the blocks of the bucket's sum of squares (a fixed grid, so that the sum is
// the same in every run), and their threads.
constexpr unsigned clip_blocks = 256;
constexpr unsigned clip_threads = 256;

// The selection's scratch, then gather_and_clear's, back to back (each 256-byte aligned by
// the carver); with DGC, one error record after them (dgc_accumulate_kernel reports a
// non-finite v there; the engine learns of it from the energies instead), and with its
// clipping the partial sums of squares and the scale.
struct compress_layout {
  std::size_t select = 0;
  std::size_t clear = 0;
  std::size_t errors = 0;
  std::size_t clip = 0;
};

// How a compression selects: from e + g in the selection's own pass (select_accumulate), from
// a vector accumulated beforehand (a plain select: threshold's e + g), or from DGC's v
// (a plain select after dgc_accumulate_kernel; clipped: with dgc_clip_norm > 0).
enum class selection_form { fused, plain, dgc, dgc_clipped };

// DGC's form: with the clipping's partial sums where clip_norm > 0.
selection_form dgc_form(double clip_norm) {
  return clip_norm > 0.0 ? selection_form::dgc_clipped : selection_form::dgc;
}

// Scratch bytes of the residual's gather_and_clear over n elements and `capacity` picks.
std::size_t clear_bytes(std::size_t n, std::size_t capacity) {
  temp_storage c;
  residual feedback;
  const auto c_stats = reinterpret_cast<const selection_stats*>(alignof(selection_stats));
  on_device(feedback).gather_and_clear(c, device_span<float>(nullptr, n),
                                         device_span<const std::uint32_t>(nullptr, capacity),
                                         c_stats, device_span<float>(nullptr, capacity));
  return c.bytes;
}

// k: the selection's target; capacity: the picks it may write (k for top-k, up to n for
// Gaussian-k and threshold).
template <class Sel>
compress_layout compress_sizes(const Sel& sel, std::size_t n, std::size_t k, std::size_t capacity,
                               selection_form form) {
  compress_layout out;
  temp_storage q;
  const select_context ctx{k, 0.0, {}};
  const auto d_stats = reinterpret_cast<selection_stats*>(alignof(selection_stats));
  if (form != selection_form::fused) {
    on_device(sel).select(q, device_span<const float>(nullptr, n), ctx,
                          device_span<std::uint32_t>(nullptr, capacity), d_stats);
    if (form != selection_form::plain) out.errors = sizeof(cuda::error_record);
    if (form == selection_form::dgc_clipped) {
      out.clip = clip_blocks * sizeof(double) + sizeof(float);
    }
  } else if constexpr (std::is_same_v<Sel, threshold>) {
    throw std::logic_error("torch_cuda::compress_sizes: threshold selects from e + g made first");
  } else {
    on_device(sel).select_accumulate(q, device_span<float>(nullptr, n),
                                     device_span<const float>(nullptr, n), ctx,
                                     device_span<std::uint32_t>(nullptr, capacity), d_stats);
  }
  out.select = q.bytes;
  out.clear = clear_bytes(n, capacity);
  return out;
}

__global__ void divide_kernel(float* out, std::size_t n, float divisor) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    out[i] /= divisor;  // a division, as the host's rank_order_mean: not a reciprocal product
  }
}

// Per vector: partials[0, energy_blocks) values, [energy_blocks, 2 energy_blocks) e.
constexpr unsigned energy_threads = cuda::energy_tuning_sm90.threads;
constexpr unsigned energy_blocks = cuda::energy_tuning_sm90.blocks;
static_assert(energy_threads % 32 == 0, "the energy kernel sums whole warps");

// The block's sum of x[i]^2 over its grid-stride share, in double, into partials[blockIdx.x]
// (blockIdx.y: 0 the values, 1 e).
__global__ void energy_partials_kernel(const float* values, std::size_t k, const float* e,
                                       std::size_t n, double* partials) {
  const float* x = blockIdx.y == 0 ? values : e;
  const std::size_t m = blockIdx.y == 0 ? k : n;
  double acc = 0.0;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < m;
       i += std::size_t{gridDim.x} * blockDim.x) {
    const double v = x[i];
    acc += v * v;
  }
  __shared__ double warp_sums[energy_threads / 32];
  for (int off = 16; off > 0; off /= 2) acc += __shfl_down_sync(0xffffffffu, acc, off);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    double sum = 0.0;
    for (unsigned w = 0; w < energy_threads / 32; ++w) sum += warp_sums[w];
    partials[blockIdx.y * energy_blocks + blockIdx.x] = sum;
  }
}

// out[y] = the sum of partials[y * energy_blocks, (y + 1) * energy_blocks), in order.
__global__ void energy_finish_kernel(const double* partials, double* out) {
  if (threadIdx.x < 2) {
    double sum = 0.0;
    for (unsigned b = 0; b < energy_blocks; ++b) sum += partials[threadIdx.x * energy_blocks + b];
    out[threadIdx.x] = sum;
  }
}

}  // namespace

std::size_t energy_partials() { return 2 * std::size_t{energy_blocks}; }

void energies(const float* values, std::size_t k, const float* e, std::size_t n, double* out,
              double* partials, cudaStream_t stream) {
  energy_partials_kernel<<<dim3(energy_blocks, 2), energy_threads, 0, stream>>>(values, k, e, n,
                                                                              partials);
  detail::cuda_check(cudaGetLastError(), "energy_partials_kernel launch");
  energy_finish_kernel<<<1, 32, 0, stream>>>(partials, out);
  detail::cuda_check(cudaGetLastError(), "energy_finish_kernel launch");
}

namespace {

// compress_layout's parts carved out of the caller's scratch, refused (naming `where`) when it
// is too small.
struct compress_parts {
  temp_storage select_tmp, clear_tmp;
  cuda::error_record* errors = nullptr;
  double* clip_partials = nullptr;  // clip_blocks of them, then the scale (a float)
};

std::size_t layout_bytes(const compress_layout& l) {
  cuda::scratch_carver s(nullptr);
  s.take_bytes(l.select);
  s.take_bytes(l.clear);
  if (l.errors) s.take_bytes(l.errors);
  if (l.clip) s.take_bytes(l.clip);
  return s.bytes();
}

compress_parts carve(const compress_layout& l, void* scratch, std::size_t scratch_bytes,
                     const char* where, const char* query) {
  cuda::scratch_carver s(scratch);
  compress_parts out;
  out.select_tmp = temp_storage{s.take_bytes(l.select), l.select};
  out.clear_tmp = temp_storage{s.take_bytes(l.clear), l.clear};
  if (l.errors) out.errors = static_cast<cuda::error_record*>(s.take_bytes(l.errors));
  if (l.clip) out.clip_partials = static_cast<double*>(s.take_bytes(l.clip));
  if (s.bytes() > scratch_bytes) {
    detail::throw_invalid_argument(where, "scratch_bytes", scratch_bytes,
                                   detail::concat(">= ", s.bytes(), " (", query, ")"));
  }
  return out;
}

// values[j] = x[indices[j]], then x[indices[j]] = 0: the residual's gather_and_clear. The
// indices are the selector's own: trusted (no validation pass, no wait).
void take_picks(temp_storage tmp, float* x, std::size_t n, const std::uint32_t* indices,
                std::size_t k, const selection_stats* stats, float* values, cudaStream_t stream) {
  residual feedback;
  on_device(feedback).gather_and_clear(tmp, device_span<float>(x, n),
                                         device_span<const std::uint32_t>(indices, k), stats,
                                         device_span<float>(values, k), stream,
                                         device_validation::trusted);
}

}  // namespace

std::size_t compress_scratch(const topk& sel, std::size_t n, std::size_t k) {
  return layout_bytes(compress_sizes(sel, n, k, k, selection_form::fused));
}

std::size_t compress_scratch(const gaussiank& sel, std::size_t n, std::size_t k,
                             std::size_t capacity) {
  return layout_bytes(compress_sizes(sel, n, k, capacity, selection_form::fused));
}

std::size_t compress_scratch(const threshold& sel, std::size_t n, std::size_t capacity) {
  return layout_bytes(compress_sizes(sel, n, 0, capacity, selection_form::plain));
}

std::size_t compress_dgc_scratch(const topk& sel, std::size_t n, std::size_t k, double clip_norm) {
  return layout_bytes(compress_sizes(sel, n, k, k, dgc_form(clip_norm)));
}

void compress_dgc(const topk& sel, void* scratch, std::size_t scratch_bytes, float* u, float* v,
                  const float* u0, const float* v0, const float* g, std::size_t n, std::size_t k,
                  float momentum, double clip_norm, std::uint32_t* indices, float* values,
                  selection_stats* stats, cudaStream_t stream) {
  if (!(clip_norm >= 0.0)) {
    detail::throw_invalid_argument("torch_cuda::compress_dgc", "clip_norm", clip_norm,
                                   "clip_norm >= 0 (0 disables clipping)");
  }
  const bool clipped = clip_norm > 0.0;
  compress_parts parts = carve(compress_sizes(sel, n, k, k, dgc_form(clip_norm)), scratch,
                               scratch_bytes, "torch_cuda::compress_dgc", "compress_dgc_scratch");
  // dgc_accumulate_kernel reports a non-finite v here; the engine learns of it from the
  // energies instead (as for the residual), so the record is cleared and not read.
  detail::cuda_check(cudaMemsetAsync(parts.errors, 0xff, sizeof(cuda::error_record), stream),
                     "cudaMemsetAsync");
  constexpr unsigned threads = 256;
  if (n) {
    // The clipping scale, clip / ||g|| where ||g|| > clip (else 1), from two small reductions
    // of g: the host's rule, with its sum of squares added in another order (exact where the
    // squares add up exactly; otherwise the scale may differ in its last bit).
    const float* scale = nullptr;
    if (clipped) {
      auto* const partials = parts.clip_partials;
      auto* const s = reinterpret_cast<float*>(partials + clip_blocks);
      cuda::step_impl::square_sum_kernel<float, clip_threads>
          <<<clip_blocks, clip_threads, 0, stream>>>(g, n, partials);
      cuda::check_launch("square_sum_kernel");
      cuda::step_impl::clip_scale_kernel<float, clip_threads>
          <<<1, clip_threads, 0, stream>>>(partials, clip_blocks, clip_norm, s);
      cuda::check_launch("clip_scale_kernel");
      scale = s;
    }
    cuda::step_impl::dgc_accumulate_kernel<float>
        <<<cuda::grid_for(n, threads, 4096), threads, 0, stream>>>(u, v, u0, v0, g, n, momentum,
                                                                  scale, 0, parts.errors);
    cuda::check_launch("dgc_accumulate_kernel");
  }
  const select_context ctx{k, 0.0, {}};
  on_device(sel).select(parts.select_tmp, device_span<const float>(v, n), ctx,
                        device_span<std::uint32_t>(indices, k), stats, stream);
  take_picks(parts.clear_tmp, v, n, indices, k, stats, values, stream);
  if (k) {
    cuda::step_impl::clear_at_kernel<float, std::uint32_t>
        <<<cuda::grid_for(k, threads, 4096), threads, 0, stream>>>(u, indices, k);
    cuda::check_launch("clear_at_kernel");
  }
}

namespace {

// The fused selection with residual feedback (compress()'s two forms), with room for
// `capacity` picks.
template <class Sel>
void compress_residual(const Sel& sel, void* scratch, std::size_t scratch_bytes, float* e,
                       const float* g, std::size_t n, std::size_t k, std::size_t capacity,
                       std::uint32_t* indices, float* values, selection_stats* stats,
                       cudaStream_t stream, const call_id& id = {}) {
  compress_parts parts = carve(compress_sizes(sel, n, k, capacity, selection_form::fused), scratch,
                               scratch_bytes, "torch_cuda::compress", "compress_scratch");
  const select_context ctx{k, 0.0, id};
  on_device(sel).select_accumulate(parts.select_tmp, device_span<float>(e, n),
                                   device_span<const float>(g, n), ctx,
                                   device_span<std::uint32_t>(indices, capacity), stats, stream);
  take_picks(parts.clear_tmp, e, n, indices, capacity, stats, values, stream);
}

}  // namespace

void compress(const topk& sel, void* scratch, std::size_t scratch_bytes, float* e,
              const float* g, std::size_t n, std::size_t k, std::uint32_t* indices,
              float* values, selection_stats* stats, cudaStream_t stream) {
  compress_residual(sel, scratch, scratch_bytes, e, g, n, k, k, indices, values, stats, stream);
}

void compress(const gaussiank& sel, void* scratch, std::size_t scratch_bytes, float* e,
              const float* g, std::size_t n, std::size_t k, std::size_t capacity,
              std::uint32_t* indices, float* values, selection_stats* stats,
              cudaStream_t stream) {
  compress_residual(sel, scratch, scratch_bytes, e, g, n, k, capacity, indices, values, stats,
                    stream);
}

std::size_t compress_scratch(const randomk& sel, std::size_t n, std::size_t k) {
  return layout_bytes(compress_sizes(sel, n, k, k, selection_form::fused));
}

void compress(const randomk& sel, const call_id& id, void* scratch, std::size_t scratch_bytes,
              float* e, const float* g, std::size_t n, std::size_t k, std::uint32_t* indices,
              float* values, selection_stats* stats, cudaStream_t stream) {
  compress_residual(sel, scratch, scratch_bytes, e, g, n, k, k, indices, values, stats, stream, id);
}

void compress(const threshold& sel, void* scratch, std::size_t scratch_bytes, float* e,
              const float* g, std::size_t n, std::size_t capacity, std::uint32_t* indices,
              float* values, selection_stats* stats, cudaStream_t stream) {
  compress_parts parts = carve(compress_sizes(sel, n, 0, capacity, selection_form::plain), scratch,
                               scratch_bytes, "torch_cuda::compress", "compress_scratch");
  // e += g (the host residual's accumulate, element by element), then the picks of e.
  if (n) cuda::feedback_impl::launch_accumulate(e, g, n, stream);
  on_device(sel).select(parts.select_tmp, device_span<const float>(e, n),
                        select_context{0, 0.0, {}}, device_span<std::uint32_t>(indices, capacity),
                        stats, stream);
  take_picks(parts.clear_tmp, e, n, indices, capacity, stats, values, stream);
}

namespace {

// fn(q) with q the host quantizer of `code` (fp16 or bf16).
template <class Fn>
decltype(auto) with_pick_code(pick_code code, const char* where, Fn&& fn) {
  switch (code) {
    case pick_code::fp16:
      return fn(fp16{});
    case pick_code::bf16:
      return fn(bf16{});
    case pick_code::fp32:
      break;
  }
  detail::throw_invalid_argument(where, "code", static_cast<unsigned>(code),
                                 "pick_code::fp16 (1) or pick_code::bf16 (2)");
}

template <class Q>
device_encoded encoded_picks(const Q& q, std::byte* codes, std::size_t k) {
  return {device_span<std::byte>(codes, device_encoded_size(q, k).packed_bytes),
          device_span<float>()};
}

}  // namespace

std::size_t pick_code_bytes(pick_code code) { return code == pick_code::fp32 ? 4 : 2; }

std::size_t quantize_picks_scratch(pick_code code, std::size_t k) {
  return with_pick_code(code, "torch_cuda::quantize_picks_scratch", [&](auto q) {
    const auto d = on_device(q);
    const device_encoded enc = encoded_picks(q, nullptr, k);
    temp_storage encode_tmp, decode_tmp;
    d.encode(encode_tmp, device_span<const float>(nullptr, k), call_id{}, enc);
    d.decode(decode_tmp, enc, device_span<float>(nullptr, k));
    return std::max<std::size_t>({encode_tmp.bytes, decode_tmp.bytes, 256});
  });
}

std::size_t decode_picks_scratch(pick_code code, std::size_t count) {
  return with_pick_code(code, "torch_cuda::decode_picks_scratch", [&](auto q) {
    temp_storage tmp;
    on_device(q).decode(tmp, encoded_picks(q, nullptr, count), device_span<float>(nullptr, count));
    return std::max<std::size_t>(tmp.bytes, 256);
  });
}

void quantize_picks(pick_code code, void* scratch, std::size_t scratch_bytes, const float* values,
                    std::size_t k, std::byte* codes, float* decoded, float* x,
                    const std::uint32_t* indices, cudaStream_t stream) {
  with_pick_code(code, "torch_cuda::quantize_picks", [&](auto q) {
    if (k == 0) return;
    const auto d = on_device(q);
    const device_encoded enc = encoded_picks(q, codes, k);
    // fp16 and bf16 draw nothing: the call's id does not matter.
    temp_storage tmp{scratch, scratch_bytes};
    d.encode(tmp, device_span<const float>(values, k), call_id{}, enc, stream);
    tmp = temp_storage{scratch, scratch_bytes};
    d.decode(tmp, enc, device_span<float>(decoded, k), stream, device_validation::trusted);
    constexpr unsigned threads = 256;
    cuda::step_impl::keep_error_kernel<float, std::uint32_t>
        <<<cuda::grid_for(k, threads, 4096), threads, 0, stream>>>(x, indices, values, decoded, k);
    cuda::check_launch("keep_error_kernel");
  });
}

void decode_picks(pick_code code, void* scratch, std::size_t scratch_bytes, const std::byte* codes,
                  std::size_t count, float* out, cudaStream_t stream) {
  with_pick_code(code, "torch_cuda::decode_picks", [&](auto q) {
    if (count == 0) return;
    temp_storage tmp{scratch, scratch_bytes};
    const device_encoded_view in(
        device_span<const std::byte>(codes, device_encoded_size(q, count).packed_bytes),
        device_span<const float>());
    on_device(q).decode(tmp, in, device_span<float>(out, count), stream);
  });
}

namespace {

// fn(W{}) with W the sum type of `code`'s codes.
template <class Fn>
void with_sum_type(pick_code code, Fn&& fn) {
  switch (code) {
    case pick_code::fp32:
      return fn(float{});
    case pick_code::fp16:
      return fn(gradcomp::half{});
    case pick_code::bf16:
      return fn(gradcomp::bfloat16{});
  }
  detail::throw_invalid_argument("torch_cuda::dense", "code", static_cast<unsigned>(code),
                                 "pick_code::fp32 (0), fp16 (1) or bf16 (2)");
}

// acc[i] = shares[i] + shares[m + i] + ..., folded left to right in W (half and bfloat16 round
// each addition as the host's operator+ does: the same function on both sides).
template <class W>
__global__ void fold_kernel(const W* shares, std::size_t m, unsigned p, W* acc) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < m;
       i += std::size_t{gridDim.x} * blockDim.x) {
    W a = shares[i];
    for (unsigned s = 1; s < p; ++s) a = static_cast<W>(a + shares[s * m + i]);
    acc[i] = a;
  }
}

constexpr unsigned dense_threads = 256;
constexpr std::size_t dense_blocks = 4096;

}  // namespace

void accumulate(float* x, const float* g, std::size_t n, cudaStream_t stream) {
  if (n == 0) return;
  cuda::feedback_impl::launch_accumulate(x, g, n, stream);
}

void encode_dense(pick_code code, float* x, std::byte* codes, std::size_t n, int ranks,
                  cudaStream_t stream) {
  if (ranks < 1) detail::throw_invalid_argument("torch_cuda::encode_dense", "ranks", ranks, ">= 1");
  if (n == 0) return;
  with_sum_type(code, [&](auto w) {
    using W = decltype(w);
    // fp16 divides each code by P before the sum (fp16::prescale_before_sum); fp32 and bf16 do
    // not (0: no division).
    const float prescale = code == pick_code::fp16 ? static_cast<float>(ranks) : 0.0f;
    cuda::step_impl::summable_encode_kernel<W, float>
        <<<cuda::grid_for(n, dense_threads, dense_blocks), dense_threads, 0, stream>>>(
            x, x, reinterpret_cast<W*>(codes), n, prescale);
    cuda::check_launch("summable_encode_kernel");
  });
}

void fold_shares(pick_code code, const std::byte* shares, std::size_t m, int p, std::byte* acc,
                 cudaStream_t stream) {
  if (p < 1) detail::throw_invalid_argument("torch_cuda::fold_shares", "p", p, ">= 1");
  if (m == 0) return;
  with_sum_type(code, [&](auto w) {
    using W = decltype(w);
    fold_kernel<W><<<cuda::grid_for(m, dense_threads, dense_blocks), dense_threads, 0, stream>>>(
        reinterpret_cast<const W*>(shares), m, static_cast<unsigned>(p), reinterpret_cast<W*>(acc));
    cuda::check_launch("fold_kernel");
  });
}

void average_codes(pick_code code, const std::byte* sum, std::size_t n, float divisor, float* out,
                   cudaStream_t stream) {
  if (n == 0) return;
  with_sum_type(code, [&](auto w) {
    using W = decltype(w);
    cuda::step_impl::average_kernel<float, W>
        <<<cuda::grid_for(n, dense_threads, dense_blocks), dense_threads, 0, stream>>>(
            out, reinterpret_cast<const W*>(sum), n, divisor);
    cuda::check_launch("average_kernel");
  });
}

std::size_t combine_scratch(std::size_t total, std::size_t n) {
  temp_storage q;
  cuda::scatter_add_sorted(q, device_span<const std::uint32_t>(nullptr, total),
                           device_span<const float>(nullptr, total), device_span<float>(nullptr, n));
  return q.bytes;
}

void combine(void* scratch, std::size_t scratch_bytes, const std::uint32_t* indices,
             const float* values, std::size_t total, float* out, std::size_t n, int ranks,
             cudaStream_t stream) {
  if (ranks < 1) {
    detail::throw_invalid_argument("torch_cuda::combine", "ranks", ranks, ">= 1");
  }
  if (n == 0) return;
  detail::cuda_check(cudaMemsetAsync(out, 0, n * sizeof(float), stream), "cudaMemsetAsync");
  temp_storage tmp{scratch, scratch_bytes};
  // Checked on the device before anything is added: a peer's index at or past n throws here.
  cuda::scatter_add_sorted(tmp, device_span<const std::uint32_t>(indices, total),
                           device_span<const float>(values, total), device_span<float>(out, n),
                           stream, device_validation::check);
  if (ranks == 1) return;  // x / 1 == x
  constexpr cuda::elementwise_tuning t = cuda::divide_tuning_sm90;
  divide_kernel<<<cuda::grid_for(n, t.threads, t.max_blocks), t.threads, 0, stream>>>(
      out, n, static_cast<float>(ranks));
  cuda::check_launch("divide_kernel launch");
}

}  // namespace gradcomp::torch_cuda
