// gradcomp/cuda/kernels/step_kernels.cuh: the kernels of the device-resident SGD step
// (cuda/sparsified_sgd.cuh) around the selection, feedback and scatter kernels it reuses: the
// picks' indices into the flat parameter buffer, the non-finite check of the picks, the
// quantization error kept in the residual, DGC's momentum correction and clipping, the check of
// the received payloads, the division of the rank-order sum (or of an allreduce's sum at
// shared indices), and the SGD update.
// Every arithmetic step is one correctly rounded operation (__fmul_rn, __fadd_rn, ...), never
// contracted into a fused multiply-add, so that the results are the host's bit for bit. (The
// kernels are templates, used with float and std::uint32_t, so that the header can be part of
// several translation units of one program.)
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include <cub/block/block_reduce.cuh>

#include <gradcomp/cuda/block/sparse_common.cuh>
#include <gradcomp/detail/gtopk_merge.hpp>

namespace gradcomp::cuda::step_impl {

// idx[j] += offset for j < k: a tensor's picks become indices of the flat buffer.
template <class Index>
__global__ void add_offset_kernel(Index* idx, std::size_t k, Index offset) {
  for (std::size_t j = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; j < k;
       j += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    idx[j] += offset;
  }
}

// errors->first = the first j < m with values[j] NaN or infinite. Top-k orders NaN above +Inf
// above every finite |x|, so e + g holds a non-finite value exactly when its picks do.
template <class T>
__global__ void first_nonfinite_kernel(const T* values, std::size_t m, error_record* errors) {
  for (std::size_t j = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; j < m;
       j += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    if (!isfinite(values[j])) report_error(errors, j);
  }
}

// e[idx[j]] = values[j] - decoded[j] for j < k: the residual keeps what the quantizer lost
// of each sent value (the host's residual::update, e[i] -= decoded, on e[i] = the value sent;
// gather_and_clear has left 0 there). The picks are distinct: no two threads write one e[i].
template <class T, class Index>
__global__ void keep_error_kernel(T* e, const Index* idx, const T* values, const float* decoded,
                                  std::size_t k) {
  for (std::size_t j = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; j < k;
       j += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    e[idx[j]] = __fsub_rn(values[j], decoded[j]);
  }
}

// e[i] = values[i] - decoded[i] for i < n: the dense step's residual keeps what the quantizer
// lost of every coordinate (the host's residual::update on e = e + g).
template <class T>
__global__ void subtract_kernel(T* e, const T* values, const float* decoded, std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    e[i] = __fsub_rn(values[i], decoded[i]);
  }
}

// avg[i] = (((0 + v[i]) + v[n + i]) + ... + v[(ranks - 1) n + i]) / ranks for i < n (no
// division for one rank): every rank's values of every coordinate added in rank order, as the
// host's sparse_allgather adds dense payloads (the dense step over sparse_allgather).
template <class T>
__global__ void rank_sum_kernel(T* avg, const T* v, std::size_t n, unsigned ranks) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    T sum = T(0);
    for (unsigned r = 0; r < ranks; ++r) sum = __fadd_rn(sum, v[r * n + i]);
    avg[i] = ranks > 1 ? __fdiv_rn(sum, static_cast<T>(ranks)) : sum;
  }
}

// DGC's momentum correction (dgc_momentum::accumulate_into), operation for operation, from
// the committed state (u0, v0) into the staged one (u, v):
//   u = m * u0 + s * g;  v = v0 + u
// with s the tensor's clipping scale *scale (null: no clipping, where the host's 1 * g is g).
// errors->first: the first flat index (at + i) where v is NaN or infinite: a non-finite g, or
// an accumulation of finite values that overflowed (the host refuses both).
template <class T>
__global__ void dgc_accumulate_kernel(T* u, T* v, const T* u0, const T* v0, const T* g,
                                      std::size_t n, T m, const T* scale, std::size_t at,
                                      error_record* errors) {
  const T s = scale != nullptr ? *scale : T(1);
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const T gi = scale != nullptr ? __fmul_rn(s, g[i]) : g[i];
    const T ui = __fadd_rn(__fmul_rn(m, u0[i]), gi);
    const T vi = __fadd_rn(v0[i], ui);
    u[i] = ui;
    v[i] = vi;
    if (!isfinite(vi)) report_error(errors, at + i);
  }
}

// DGC's clipping, pass 1: partial[b] = block b's sum of g[i]^2 in double (each thread adds its
// grid-stride elements in order, then cub::BlockReduce over the block, as Gaussian-k's
// moments): the same sums for the same grid, whatever the run.
template <class T, unsigned Threads>
__global__ void square_sum_kernel(const T* g, std::size_t n, double* partial) {
  using reduce_t = cub::BlockReduce<double, static_cast<int>(Threads)>;
  __shared__ typename reduce_t::TempStorage reduce_sm;
  double acc = 0.0;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(Threads) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * Threads) {
    const double x = static_cast<double>(g[i]);
    acc = __dadd_rn(acc, __dmul_rn(x, x));
  }
  const double sum = reduce_t(reduce_sm).Sum(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = sum;
}

// Pass 2, one block: the partial sums added in a fixed order, and *scale = clip / ||g|| where
// ||g|| > clip, else 1 (dgc_momentum::accumulate_into's rule, its sqrt and division correctly
// rounded in double as the host's). The squares are exact in double; only the order of the
// additions differs from the host's loop, and with it at most the last bit of the sum.
template <class T, unsigned Threads>
__global__ void clip_scale_kernel(const double* partial, unsigned blocks, double clip, T* scale) {
  using reduce_t = cub::BlockReduce<double, static_cast<int>(Threads)>;
  __shared__ typename reduce_t::TempStorage reduce_sm;
  double acc = 0.0;
  for (unsigned b = threadIdx.x; b < blocks; b += Threads) acc = __dadd_rn(acc, partial[b]);
  const double sum = reduce_t(reduce_sm).Sum(acc);
  if (threadIdx.x == 0) {
    const double norm = __dsqrt_rn(sum);
    *scale = norm > clip ? static_cast<T>(__ddiv_rn(clip, norm)) : T(1);
  }
}

// x[idx[j]] = 0 for j < k: DGC's momentum factor masking at the coordinates sent.
template <class T, class Index>
__global__ void clear_at_kernel(T* x, const Index* idx, std::size_t k) {
  for (std::size_t j = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; j < k;
       j += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    x[idx[j]] = T(0);
  }
}

// *out = x[errors->first] where an index was reported: the refused value, kept before a later
// kernel of the step overwrites it.
template <class T>
__global__ void keep_reported_kernel(const T* x, const error_record* errors, T* out) {
  if (errors->first != no_error) *out = x[errors->first];
}

// The received picks: segment s (rank s / tensors, tensor s % tensors) holds the entries
// [start[s], start[s + 1]); each of its indices must lie in [lo[s], hi[s]) (the tensor's
// range of the flat buffer) and be above the entry before it in the segment (a selection is
// ascending and distinct). errors->first = the first entry that is not.
template <class Index>
__global__ void validate_received_kernel(const Index* idx, std::size_t m,
                                         const std::uint64_t* start, const std::uint64_t* lo,
                                         const std::uint64_t* hi, unsigned segments,
                                         error_record* errors) {
  for (std::size_t j = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; j < m;
       j += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    // The last segment that starts at or before j (empty segments share their start).
    const unsigned a = detail::segment_of(start, segments, j);
    const std::uint64_t i = idx[j];
    const bool in_range = i >= lo[a] && i < hi[a];
    const bool ascending = j == start[a] || idx[j - 1] < idx[j];
    if (!in_range || !ascending) report_error(errors, j);
  }
}

// avg[idx[j]] = float(sum[j]) / divisor for j < k (the indices distinct, the rest of avg
// zeroed before): dense_allreduce's average of values summed at indices every rank shares.
// W: the sum's type (float, or a summable quantizer's gradcomp::half or bfloat16).
template <class T, class Index, class W>
__global__ void scatter_divide_kernel(T* avg, const Index* idx, const W* sum, std::size_t k,
                                      T divisor) {
  for (std::size_t j = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; j < k;
       j += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    avg[idx[j]] = __fdiv_rn(static_cast<T>(sum[j]), divisor);
  }
}

// avg[i] = float(sum[i]) / divisor for i < n: dense_allreduce's average of every coordinate
// (the host's static_cast<T>(float(sum)) / divisor; a divisor of 1 leaves the bits as they are),
// or, with sum == avg and W = T, the rank-order sum divided in place into the mean.
template <class T, class W>
__global__ void average_kernel(T* avg, const W* sum, std::size_t n, T divisor) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    avg[i] = __fdiv_rn(static_cast<T>(sum[i]), divisor);
  }
}

// A summable quantizer's contribution to dense_allreduce's sum, the host's operations: the
// code w = W(x[i]) (fp16's or bf16's, rounded to nearest even, fp16's saturating at +-65504:
// detail::float_to_half_bits and float_to_bf16_bits, the host encoder's), then sum[i] = w, or
// W(float(w) / prescale) where the quantizer divides by the number of ranks before the sum
// (prescale > 0: fp16, whose sums of P large values would overflow). With e, the residual
// keeps what the code lost: e[i] = x[i] - float(w) (the host residual's e -= decoded on
// e = x). x and e may be the same buffer.
template <class W, class T>
__global__ void summable_encode_kernel(const T* x, T* e, W* sum, std::size_t n, float prescale) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const T v = x[i];
    const W w(static_cast<float>(v));
    if (e != nullptr) e[i] = __fsub_rn(v, static_cast<T>(static_cast<float>(w)));
    sum[i] = prescale > 0.0f ? W(__fdiv_rn(static_cast<float>(w), prescale)) : w;
  }
}

// detail::sgd_update's three loops, operation for operation:
//   plain:     p -= lr * (g + wd * p)
//   momentum:  v = m * v + (g + wd * p); p -= lr * v
//   nesterov:  d = g + wd * p; v = m * v + d; p -= lr * (d + m * v)
enum class sgd_kind : unsigned char { plain, momentum, nesterov };

// With skip != nullptr, nothing is written where *skip != 0 (graph_step's update, which runs
// only where every rank's verdict was 0: the decision is made on the device).
template <sgd_kind Kind>
__global__ void sgd_kernel(float* p, const float* g, float* v, std::size_t n, float lr, float wd,
                           float m, const std::uint32_t* skip = nullptr) {
  if (skip != nullptr && *skip != 0) return;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const float d = __fadd_rn(g[i], __fmul_rn(wd, p[i]));
    if constexpr (Kind == sgd_kind::plain) {
      p[i] = __fsub_rn(p[i], __fmul_rn(lr, d));
    } else if constexpr (Kind == sgd_kind::momentum) {
      const float w = __fadd_rn(__fmul_rn(m, v[i]), d);
      v[i] = w;
      p[i] = __fsub_rn(p[i], __fmul_rn(lr, w));
    } else {
      const float w = __fadd_rn(__fmul_rn(m, v[i]), d);
      v[i] = w;
      p[i] = __fsub_rn(p[i], __fmul_rn(lr, __fadd_rn(d, __fmul_rn(m, w))));
    }
  }
}

// graph_step (the fixed-k step with every check on the device, cuda/sparsified_sgd.cuh): this
// rank's status word: 1 where its check of its picks found NaN or Inf (errors->first set), else
// 2 where a tensor's selection did not pick its k (stats[t].count != k[t]: a gradcomp bug,
// refused before any update), else 0.
template <class Word, class Stats>
__global__ void status_word_kernel(const error_record* errors, const Stats* stats,
                                   const std::uint64_t* k, std::size_t tensors, Word* status) {
  Word w{0};
  for (std::size_t t = 0; t < tensors; ++t) {
    if (stats[t].count != k[t]) w = Word{2};
  }
  if (errors->first != no_error) w = Word{1};
  *status = w;
}

// graph_step's verdict on this rank, from every rank's status word (status[0..ranks)) and this
// rank's check of the received picks (bad->first: the first refused entry of the ranks' blocks
// of per_rank picks each, or no_error): 0, or the largest code found, 3 (ranks - 1 - r) + 1
// where rank r refused its gradient, + 2 where its status word is anything else, + 3 where
// this rank refused rank r's picks. This rank's own word (*own, rank me) counts too, whatever
// its gathered copy says, so that a rank that will throw never lets the update run. The codes
// are ordered so that an allreduce (max) of every rank's verdict gives every rank the same
// one, naming the lowest rank that failed. detail[0] = the refused entry (or no_error),
// detail[1] = the flat index it held.
template <class Index>
__global__ void fixed_k_verdict_kernel(const std::uint32_t* status, unsigned ranks,
                                       const std::uint32_t* own, unsigned me,
                                       const error_record* bad, std::uint64_t per_rank,
                                       const Index* picks, std::uint32_t* verdict,
                                       std::uint64_t* detail) {
  std::uint32_t v = 0;
  const auto raise = [&](std::uint32_t code) { v = code > v ? code : v; };
  const auto raise_status = [&](unsigned r, std::uint32_t word) {
    if (word == 1u) raise(3u * (ranks - 1u - r) + 1u);
    else if (word != 0u) raise(3u * (ranks - 1u - r) + 2u);
  };
  for (unsigned r = 0; r < ranks; ++r) raise_status(r, status[r]);
  raise_status(me, *own);
  detail[0] = bad->first;
  detail[1] = 0;
  if (bad->first != no_error && per_rank > 0) {
    const auto r = static_cast<std::uint32_t>(bad->first / per_rank);
    raise(3u * (ranks - 1u - r) + 3u);
    detail[1] = picks[bad->first];
  }
  *verdict = v;
}

// topk_a2a on the device: where each owner's picks start. picks[0..m) are ascending (every
// tensor's, offset into the flat buffer, in tensor order) and owner j's shard of the flat
// buffer starts at bounds[j] (< 2^32 for j < p), so owner j gets picks [cut[j], cut[j + 1]):
// cut[j] = the number of picks below bounds[j] for j < p, cut[p] = m.
template <class Index>
__global__ void split_by_shard_kernel(const Index* picks, Index m, const std::uint64_t* bounds,
                                      unsigned p, std::uint64_t* cut) {
  const unsigned j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j > p) return;
  cut[j] = j == p ? m : detail::count_below(picks, m, static_cast<Index>(bounds[j]), false);
}

}  // namespace gradcomp::cuda::step_impl
