// gradcomp/cuda/kernels/gtopk_kernels.cuh: the kernels of gTop-k's merge tree on the device
// (cuda/gtopk.cuh): a message's check, the pairwise merge of two ranks' sets (equal indices
// added; its per-pick steps and the keys that order the union as the host's gtopk_before does
// are detail/gtopk_merge.hpp's, which a host test runs against the host's merge), the top k taken after
// the sort, the moves between the step's compact picks and a message's capacity layout, and
// what every rank does with the global set (its own values there, the picks left out given back
// to the feedback).
//
// A message holds every tensor of the step in 32-bit words: [status][count of tensor 0] ...
// [count of tensor T-1], then the indices (flat, ascending in each tensor) in the capacity
// layout (tensor t owns slots [cap[t], cap[t + 1]), k_t of them: at most k picks travel), then
// the values' bits in the same layout. Slots past a tensor's count are padding, never read.
// Every addition is one correctly rounded __fadd_rn, so that the sums are the host's bit for bit.
// (The kernels are templates, used with V = float, so that the header can be part of several
// translation units of one program.)
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include <gradcomp/config.hpp>
#include <gradcomp/cuda/block/sparse_common.cuh>
#include <gradcomp/detail/gtopk_merge.hpp>

namespace gradcomp::cuda::gtopk_impl {

using detail::find_sorted;
using detail::segment_of;
inline constexpr std::uint32_t padding_index = detail::gtopk_padding_index;

// A message's parts, in the layout above, for T tensors and K slots.
struct message {
  std::uint32_t* words;
  unsigned tensors;
  std::uint64_t slots;
  GRADCOMP_HOST_DEVICE std::uint32_t* count() const { return words + 1; }
  GRADCOMP_HOST_DEVICE std::uint32_t* index() const { return words + 1 + tensors; }
  GRADCOMP_HOST_DEVICE std::uint32_t* value() const { return words + 1 + tensors + slots; }
};

// errors->first = the first slot s of m whose pick is not a selection of its tensor: inside
// [lo[t], hi[t]) (the tensor's range of the flat buffer) and above the pick before it. The
// counts were checked against the capacities on the host.
template <class V = float>
__global__ void validate_kernel(message m, const std::uint64_t* cap, const std::uint64_t* lo,
                                const std::uint64_t* hi, error_record* errors) {
  for (std::uint64_t s = blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x;
       s < m.slots; s += static_cast<std::uint64_t>(gridDim.x) * blockDim.x) {
    const unsigned t = segment_of(cap, m.tensors, s);
    const std::uint64_t j = s - cap[t];
    if (j >= m.count()[t]) continue;
    const std::uint32_t i = m.index()[s];
    const bool in_range = i >= lo[t] && i < hi[t];
    const bool ascending = j == 0 || m.index()[s - 1] < i;
    if (!in_range || !ascending) report_error(errors, s);
  }
}

// The union of a (this rank's set) and b (the one received), tensor by tensor, into the
// union's segment of tensor t, slots [2 cap[t], 2 cap[t] + a_t + b_t), in index order, each
// pick placed by detail::gtopk_merge_slot (equal indices side by side, a's slot holding a + b,
// b's a hole counted in dups[t]), with the key that sorts the union as gtopk_before and the
// value's bits. (On unchecked input the positions stay inside the segment; the result is then
// discarded.)
template <class V = float>
__global__ void merge_kernel(message a, message b, const std::uint64_t* cap,
                             std::uint64_t* key, std::uint32_t* value, unsigned* dups) {
  const std::uint64_t slots = a.slots;
  for (std::uint64_t s = blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x;
       s < 2 * slots; s += static_cast<std::uint64_t>(gridDim.x) * blockDim.x) {
    const bool from_b = s >= slots;
    const std::uint64_t slot = from_b ? s - slots : s;
    const unsigned t = segment_of(cap, a.tensors, slot);
    const auto j = static_cast<std::uint32_t>(slot - cap[t]);
    const message& mine = from_b ? b : a;
    const message& other = from_b ? a : b;
    if (j >= mine.count()[t]) continue;
    const detail::gtopk_union_slot u = detail::gtopk_merge_slot(
        j, mine.index()[slot], __uint_as_float(mine.value()[slot]), other.index() + cap[t],
        other.value() + cap[t], other.count()[t], from_b);
    key[2 * cap[t] + u.at] = u.key;
    value[2 * cap[t] + u.at] = u.value;
    if (u.hole) atomicAdd(dups + t, 1u);
  }
}

// After the union's segments were sorted by key: slot j < min(k_t, a_t + b_t) of tensor t
// gets the union's j-th pick (index and value bits) where j < the number kept, k_t or the
// union's distinct picks if fewer, else padding (sorted last by index next).
template <class V = float>
__global__ void take_kernel(message a, message b, const std::uint64_t* cap,
                            const std::uint64_t* key, const std::uint32_t* value,
                            const unsigned* dups, std::uint32_t* index_out,
                            std::uint32_t* value_out) {
  for (std::uint64_t s = blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x;
       s < a.slots; s += static_cast<std::uint64_t>(gridDim.x) * blockDim.x) {
    const unsigned t = segment_of(cap, a.tensors, s);
    const std::uint64_t j = s - cap[t];
    const std::uint64_t k = cap[t + 1] - cap[t];
    const std::uint64_t len = std::uint64_t{a.count()[t]} + b.count()[t];
    if (j >= (k < len ? k : len)) continue;
    const std::uint64_t distinct = len - dups[t];
    if (j < (k < distinct ? k : distinct)) {
      index_out[s] = static_cast<std::uint32_t>(key[2 * cap[t] + j]);
      value_out[s] = value[2 * cap[t] + j];
    } else {
      index_out[s] = padding_index;
      value_out[s] = 0;
    }
  }
}

// The merged message's header: status 0, and each tensor's count, min(k_t, distinct picks).
template <class V = float>
__global__ void merged_counts_kernel(message a, message b, const std::uint64_t* cap,
                                     const unsigned* dups, message out) {
  for (unsigned t = blockIdx.x * blockDim.x + threadIdx.x; t < a.tensors;
       t += gridDim.x * blockDim.x) {
    const std::uint64_t k = cap[t + 1] - cap[t];
    const std::uint64_t distinct = std::uint64_t{a.count()[t]} + b.count()[t] - dups[t];
    out.count()[t] = static_cast<std::uint32_t>(k < distinct ? k : distinct);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) out.words[0] = 0;
}

// This rank's picks (compact: tensor t's at [at[t], at[t + 1]), flat indices, their values)
// into message m's slots.
template <class V = float>
__global__ void to_message_kernel(const std::uint32_t* picks, const float* values,
                                  const std::uint64_t* at, std::uint64_t n,
                                  const std::uint64_t* cap, message m) {
  for (std::uint64_t i = blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::uint64_t>(gridDim.x) * blockDim.x) {
    const unsigned t = segment_of(at, m.tensors, i);
    const std::uint64_t s = cap[t] + (i - at[t]);
    m.index()[s] = picks[i];
    m.value()[s] = __float_as_uint(values[i]);
  }
}

// Message m's picks, compact (tensor t's count at [at[t], at[t + 1])), into picks and values.
template <class V = float>
__global__ void from_message_kernel(message m, const std::uint64_t* cap,
                                    const std::uint64_t* at, std::uint64_t n,
                                    std::uint32_t* picks, float* values) {
  for (std::uint64_t i = blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::uint64_t>(gridDim.x) * blockDim.x) {
    const unsigned t = segment_of(at, m.tensors, i);
    const std::uint64_t s = cap[t] + (i - at[t]);
    picks[i] = m.index()[s];
    values[i] = __uint_as_float(m.value()[s]);
  }
}

// gtopk_values::exact: this rank's value at global pick i (its own picks of the same tensor,
// searched by index), or 0 where it did not pick that index, at the pick's slot of the
// capacity layout (out: cap[tensors] slots, zeroed before).
template <class V = float>
__global__ void own_values_kernel(const std::uint32_t* global, const std::uint64_t* global_at,
                                  std::uint64_t n, unsigned tensors, const std::uint64_t* cap,
                                  const std::uint32_t* picks, const float* values,
                                  const std::uint64_t* picks_at, float* out) {
  for (std::uint64_t i = blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::uint64_t>(gridDim.x) * blockDim.x) {
    const unsigned t = segment_of(global_at, tensors, i);
    const std::uint32_t* mine = picks + picks_at[t];
    const auto m = static_cast<std::uint32_t>(picks_at[t + 1] - picks_at[t]);
    const std::uint32_t j = find_sorted(mine, m, global[i]);
    out[cap[t] + (i - global_at[t])] = j < m ? values[picks_at[t] + j] : 0.0f;
  }
}

// The capacity layout's values of the global picks, compact: out[i] = in[cap[t] + j] for
// global pick j of tensor t at i.
template <class V = float>
__global__ void from_capacity_kernel(const float* in, const std::uint64_t* cap,
                                     const std::uint64_t* global_at, std::uint64_t n,
                                     unsigned tensors, float* out) {
  for (std::uint64_t i = blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::uint64_t>(gridDim.x) * blockDim.x) {
    const unsigned t = segment_of(global_at, tensors, i);
    out[i] = in[cap[t] + (i - global_at[t])];
  }
}

// The picks of this rank that are not global go back to the feedback (the host's
// residual::restore and dgc_momentum::restore: e[i] += value), counted per tensor.
template <class V = float>
__global__ void restore_kernel(const std::uint32_t* picks, const float* values,
                               const std::uint64_t* picks_at, std::uint64_t n,
                               unsigned tensors, const std::uint32_t* global,
                               const std::uint64_t* global_at, float* e,
                               unsigned* restored) {
  for (std::uint64_t i = blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::uint64_t>(gridDim.x) * blockDim.x) {
    const unsigned t = segment_of(picks_at, tensors, i);
    const std::uint32_t* g = global + global_at[t];
    const auto m = static_cast<std::uint32_t>(global_at[t + 1] - global_at[t]);
    if (find_sorted(g, m, picks[i]) < m) continue;
    e[picks[i]] = __fadd_rn(e[picks[i]], values[i]);
    atomicAdd(restored + t, 1u);
  }
}

}  // namespace gradcomp::cuda::gtopk_impl
