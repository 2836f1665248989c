// gradcomp/cuda/gtopk.cuh: gTop-k's exchange (exchange/gtopk.hpp) on the device, for the
// device-resident step (cuda/sparsified_sgd.cuh): every tensor of the step in one merge tree.
//
// The host's gtopk runs the tree tensor by tensor. Here one message carries every tensor (a
// status word, a count per tensor, then the picks' indices and values in a capacity layout of
// k_t slots per tensor, k_t the largest count any rank announced: cuda/kernels/gtopk_kernels.cuh),
// so that the step makes ceil(log2 P) point-to-point rounds and one broadcast, whatever the
// number of tensors. Its size is known to every rank beforehand (a receiver is never sized by
// what a peer claims). Per round, a rank that receives:
//   1. reads the message's header back (a wait) and checks it on the host: the status, and
//      each count at most its tensor's k;
//   2. checks on the device that each tensor's picks are ascending and inside the tensor;
//      merges its set with the one received (merge_kernel: equal indices added, a + b as the
//      host's merge), sorts each tensor's union by gtopk_before's order
//      (cub::DeviceSegmentedRadixSort on 64-bit keys: NaN, then |value| descending, then the
//      index), keeps its first k_t, and sorts those by index again (a second segmented sort;
//      in both sorts a tensor of 2^16 picks or more goes to cub::DeviceRadixSort on its own,
//      since the segmented sort gives each segment one block);
//   3. reads the check and the new counts back (a wait).
// A message that fails a check is not merged: as on the host, the failure travels up the tree
// in the status word (1 + the rank whose message was refused), rank 0 broadcasts it, and every
// rank throws after the broadcast, naming that rank; none leaves early while others wait.
// Down: rank 0 broadcasts its set (the global top-k of each tensor); every rank checks its
// header and, on the device, its picks, then writes the staged average: the tree's sums
// divided by P (gtopk_values::tree), or the allreduced sums of every rank's own values at the
// global indices divided by P, with one more element that counts the ranks that could not use
// the broadcast (gtopk_values::exact). Each rank's picks that are not global go back to the
// staged feedback (e += value) and are counted per tensor, as the host's restore.
// Index sets, sums and their order of addition are the host's, so the result is the host's bit
// for bit: the tree's merges add two values each (commutative, so the order in the pair does
// not matter). Two exceptions: a sum that is NaN (two picks whose sum overflowed to +Inf and
// -Inf, added in a later round) has the device's canonical NaN bits, where the host's keeps an
// operand's; and the exact sums are one allreduce of every tensor's slots (the host's: one per
// tensor), the host's bits where the communicator adds every element in rank order whatever
// the length (staged_comm over the host's communicators in-process; NCCL and MPI may not from
// 3 ranks on, as for the dense step).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>

#include <gradcomp/concepts.hpp>
#include <gradcomp/cuda/dispatch/launch.cuh>
#include <gradcomp/cuda/kernels/gtopk_kernels.cuh>
#include <gradcomp/cuda/kernels/step_kernels.cuh>
#include <gradcomp/cuda/memory.cuh>
#include <gradcomp/device.hpp>
#include <gradcomp/error.hpp>
#include <gradcomp/exchange/gtopk.hpp>

namespace gradcomp {

// What gtopk's device form needs of a communicator besides the device step's calls: one
// send and one receive of a size both sides know (-1: none; every rank calls it every round;
// false where the message received had another size),
// a broadcast of device memory, and for gtopk_values::exact an allreduce of floats.
template <class C>
concept device_tree_communicator =
    requires(C& c, device_span<const std::uint32_t> s, device_span<std::uint32_t> r,
             device_span<float> f) {
      { c.sendrecv_known(s, 0, r, 0) } -> std::convertible_to<bool>;
      c.broadcast(r, 0);
      c.allreduce(f, reduce_op::sum);
    };

namespace cuda {

// The step's side of the exchange: its tensors' flat ranges, each tensor's k (the largest count
// any rank announced, checked against the tensor's size), and this rank's picks (flat indices,
// ascending in each tensor; tensor t's at [mine_at[t], mine_at[t + 1])) with the values every
// rank would add (decoded, where quantized); the staged feedback and average it writes.
struct gtopk_step {
  std::span<const std::uint32_t> ids;        // tensor ids, for messages
  std::span<const std::size_t> offsets;      // tensor t's range: [offsets[t], offsets[t] + sizes[t])
  std::span<const std::size_t> sizes;
  std::span<const std::size_t> k;            // capacity of each tensor
  std::span<const std::size_t> mine_at;      // tensors + 1 entries
  const std::uint32_t* picks = nullptr;
  const float* values = nullptr;
  float* feedback = nullptr;                 // the staged residual (DGC: v), total elements
  float* average = nullptr;                  // the staged average, total elements
  std::size_t total = 0;
};

// What the exchange cost and gave back, per tensor: the bytes of the tree's messages, the
// broadcast and (exact) the allreduce of every tensor's slots, tensor t's share being its count
// word and its slots (the status word, and exact's extra element, counted with tensor 0); the
// picks restored.
struct gtopk_tensor_result {
  std::size_t bytes_sent = 0;
  std::size_t bytes_received = 0;
  std::size_t restored = 0;
};

class device_gtopk {
 public:
  // The largest total of tensor sizes the device tree takes: CUB's segmented sort counts the
  // union's 2 K slots in an int, and indices stay below the sort keys' hole.
  static constexpr std::size_t max_total = (std::size_t{1} << 30) - 1;

  template <class Comm>
  void run(Comm& comm, cudaStream_t stream, gtopk_values mode, const gtopk_step& st,
           std::vector<gtopk_tensor_result>& result) {
    s_ = stream;
    nt_ = st.ids.size();
    const int ranks = comm.size();
    const int r = comm.rank();
    result.assign(nt_, gtopk_tensor_result{});
    lay_out(st);
    const std::size_t words = 1 + nt_ + 2 * slots_;
    // Zeroed, so that the padding slots sent are never uninitialized memory.
    for (auto& m : msg_) {
      m.resize(words);
      detail::cuda_check(cudaMemsetAsync(m.data(), 0, words * sizeof(std::uint32_t), s_),
                         "cudaMemsetAsync");
    }
    // This rank's set: status 0, its counts, its picks in the capacity layout.
    counts_.assign(nt_ + 1, 0);
    for (std::size_t t = 0; t < nt_; ++t) counts_[t + 1] = static_cast<std::uint32_t>(have_[t]);
    upload(msg_[cur_].data(), counts_.data(), counts_.size());
    const std::size_t own = st.mine_at[nt_];
    if (own) {
      gtopk_impl::to_message_kernel<float><<<grid(own), threads, 0, s_>>>(
          st.picks, st.values, dev_u64(mine_at_off_), own, dev_u64(cap_off_), view(cur_));
      check_launch("gtopk to_message_kernel");
    }

    // Up the tree, as the host's: in round j (step 2^j) rank r sends to r - step when
    // r % 2step == step, and receives from r + step when r % 2step == 0.
    std::string failure;      // this rank's refusal of a message
    std::uint32_t culprit = 0;  // 1 + the rank whose message was refused (here or below)
    // A message's (or the broadcast's) bytes, tensor t's share its count word and k_t slots.
    const auto count_message = [&](bool sent) {
      for (std::size_t t = 0; t < nt_; ++t) {
        const std::size_t b = 4 + 8 * st.k[t] + (t == 0 ? 4 : 0);
        (sent ? result[t].bytes_sent : result[t].bytes_received) += b;
      }
    };
    for (int step = 1; step < ranks; step *= 2) {
      const int dest = r % (2 * step) == step ? r - step : -1;
      const int source = r % (2 * step) == 0 && r + step < ranks ? r + step : -1;
      if (dest >= 0 && culprit != 0) set_word(msg_[cur_].data(), culprit);
      const bool sized = comm.sendrecv_known(
          dest >= 0 ? device_span<const std::uint32_t>(msg_[cur_].data(), words)
                    : device_span<const std::uint32_t>(),
          dest,
          source >= 0 ? device_span<std::uint32_t>(msg_[recv_].data(), words)
                      : device_span<std::uint32_t>(),
          source);
      if (dest >= 0) count_message(true);
      if (source < 0) continue;
      count_message(false);
      if (culprit != 0) continue;
      if (!sized) {
        failure = detail::concat("gradcomp::device_gtopk: malformed payload: rank ", source,
                                 " sent a message of another size than the ", words,
                                 " words every rank's message has");
      } else {
        failure = merge_received(source, ranks, st, culprit);
      }
      if (!failure.empty()) culprit = static_cast<std::uint32_t>(source) + 1;
    }

    // Down: rank 0's set to every rank, then each rank checks it before anything is written.
    if (r == 0 && culprit != 0) set_word(msg_[cur_].data(), culprit);
    const unsigned global = r == 0 ? cur_ : recv_;
    if (ranks > 1) {
      comm.broadcast(device_span<std::uint32_t>(msg_[global].data(), words), 0);
      count_message(/*sent=*/r == 0);
    }
    // The verdict on this rank's copy: a refusal in the tree (the status names the rank whose
    // message was refused), or a copy that is not a global set (a status, count or pick out
    // of range: a corrupted broadcast). With gtopk_values::exact every rank then joins the
    // allreduce, whose length every rank knows beforehand, before it throws: so a copy
    // corrupted on its way to one rank only fails the step on every rank.
    read_header(msg_[global].data());
    std::string tree_failed;  // communicator_error: a message was refused in the tree
    std::string refused;      // payload_error: this rank's copy of the broadcast is malformed
    const std::uint32_t status = header_[0];
    if (status > static_cast<std::uint32_t>(ranks)) {
      refused = detail::concat("gradcomp::device_gtopk: malformed payload: rank 0 broadcast the "
                               "status ", status, "; allowed: 0 (a global set) or 1 + a rank "
                               "(failed)");
    } else if (status != 0) {
      tree_failed = detail::concat(
          "gradcomp::device_gtopk: a rank refused the message rank ", status - 1,
          " sent in the merge tree (the refusing rank's exception says why); no rank applied "
          "this exchange");
    }
    global_at_.assign(nt_ + 1, 0);
    for (std::size_t t = 0; t < nt_ && status == 0; ++t) {
      if (header_[t + 1] > st.k[t]) {
        refused = detail::concat("gradcomp::device_gtopk: malformed payload: rank 0 broadcast a "
                                 "global set of ", header_[t + 1], " picks of tensor ", st.ids[t],
                                 "; at most k = ", st.k[t], " are allowed");
        global_at_.assign(nt_ + 1, 0);
        break;
      }
      global_at_[t + 1] = global_at_[t] + header_[t + 1];
    }
    const std::size_t g = global_at_[nt_];
    global_picks_.resize(std::max<std::size_t>(g, 1));
    global_values_.resize(std::max<std::size_t>(g, 1));
    upload_u64(global_at_off_, global_at_);
    if (g) {
      gtopk_impl::from_message_kernel<float><<<grid(g), threads, 0, s_>>>(
          view(global), dev_u64(cap_off_), dev_u64(global_at_off_), g, global_picks_.data(),
          global_values_.data());
      check_launch("gtopk from_message_kernel");
      // Each tensor's global picks: ascending, inside the tensor.
      reset_errors();
      step_impl::validate_received_kernel<std::uint32_t><<<grid(g), threads, 0, s_>>>(
          global_picks_.data(), g, dev_u64(global_at_off_), dev_u64(lo_off_), dev_u64(hi_off_),
          static_cast<unsigned>(nt_), errors_.data());
      check_launch("validate_received_kernel");
      const unsigned long long bad = read_error();
      if (bad != no_error) {
        const std::size_t t = tensor_at(global_at_, bad);
        refused = detail::concat(
            "gradcomp::device_gtopk: malformed payload: rank 0 broadcast global pick ",
            bad - global_at_[t], " of tensor ", st.ids[t],
            " out of order or outside the tensor; allowed: ascending and distinct, in [",
            st.offsets[t], ", ", st.offsets[t] + st.sizes[t], ") (the tensor's range of the flat "
            "buffer). Nothing was written");
      }
    }

    float refusals = 0.0f;  // exact: the ranks that could not use their copy
    if (mode == gtopk_values::exact) {
      // This rank's value at each global index, in the capacity layout (slots_ + 1 floats on
      // every rank, whatever its copy says), then one element for this rank's verdict.
      const bool usable = failure.empty() && tree_failed.empty() && refused.empty();
      exact_.resize(slots_ + 1);
      detail::cuda_check(cudaMemsetAsync(exact_.data(), 0, (slots_ + 1) * sizeof(float), s_),
                         "cudaMemsetAsync");
      if (g && usable) {
        gtopk_impl::own_values_kernel<float><<<grid(g), threads, 0, s_>>>(
            global_picks_.data(), dev_u64(global_at_off_), g, static_cast<unsigned>(nt_),
            dev_u64(cap_off_), st.picks, st.values, dev_u64(mine_at_off_), exact_.data());
        check_launch("gtopk own_values_kernel");
      }
      const float flag = usable ? 0.0f : 1.0f;
      upload(exact_.data() + slots_, &flag, 1);
      comm.allreduce(device_span<float>(exact_.data(), slots_ + 1), reduce_op::sum);
      for (std::size_t t = 0; t < nt_; ++t) {
        const std::size_t b = 4 * st.k[t] + (t == 0 ? 4 : 0);
        result[t].bytes_sent += b;
        result[t].bytes_received += b;
      }
      download(&refusals, exact_.data() + slots_, 1);
    }
    if (!failure.empty()) throw payload_error(failure);
    if (!refused.empty()) throw payload_error(refused);
    if (!tree_failed.empty()) throw communicator_error(tree_failed);
    if (refusals != 0.0f) {
      throw communicator_error(
          "gradcomp::device_gtopk: a rank could not use the broadcast global set; no rank "
          "applied this exchange");
    }
    if (mode == gtopk_values::exact && g) {
      // The sums at the global picks, compact.
      gtopk_impl::from_capacity_kernel<float><<<grid(g), threads, 0, s_>>>(
          exact_.data(), dev_u64(cap_off_), dev_u64(global_at_off_), g, static_cast<unsigned>(nt_),
          global_values_.data());
      check_launch("gtopk from_capacity_kernel");
    }
    const float* sums = global_values_.data();

    // Checked everywhere: the staged average, and the picks left out back to the feedback.
    if (st.total) {
      detail::cuda_check(cudaMemsetAsync(st.average, 0, st.total * sizeof(float), s_),
                         "cudaMemsetAsync");
    }
    if (g) {
      step_impl::scatter_divide_kernel<float, std::uint32_t, float><<<grid(g), threads, 0, s_>>>(
          st.average, global_picks_.data(), sums, g, static_cast<float>(ranks));
      check_launch("scatter_divide_kernel");
    }
    restored_.resize(std::max<std::size_t>(nt_, 1));
    if (nt_) {
      detail::cuda_check(cudaMemsetAsync(restored_.data(), 0, nt_ * sizeof(unsigned), s_),
                         "cudaMemsetAsync");
    }
    if (own) {
      gtopk_impl::restore_kernel<float><<<grid(own), threads, 0, s_>>>(
          st.picks, st.values, dev_u64(mine_at_off_), own, static_cast<unsigned>(nt_),
          global_picks_.data(), dev_u64(global_at_off_), st.feedback, restored_.data());
      check_launch("gtopk restore_kernel");
    }
    std::vector<unsigned> restored(nt_);
    if (nt_) download(restored.data(), restored_.data(), nt_);
    for (std::size_t t = 0; t < nt_; ++t) result[t].restored = restored[t];
  }

 private:
  static constexpr unsigned threads = 256;
  static constexpr std::size_t max_blocks = 4096;
  // A tensor's segment of at least this many picks is sorted by cub::DeviceRadixSort on its own
  // (a guess: not measured on a GPU yet); the others together by one segmented sort.
  static constexpr std::size_t large_segment = std::size_t{1} << 16;

  static unsigned grid(std::size_t n) { return grid_for(n, threads, max_blocks); }

  // The step's layout: each tensor's slots (cap), its range, this rank's picks, into one device
  // array of 64-bit offsets (cap_off_ ... at their places in it).
  void lay_out(const gtopk_step& st) {
    cap_.assign(nt_ + 1, 0);
    have_.assign(nt_, 0);
    for (std::size_t t = 0; t < nt_; ++t) {
      cap_[t + 1] = cap_[t] + st.k[t];
      have_[t] = st.mine_at[t + 1] - st.mine_at[t];
      detail::check_invariant(have_[t] <= st.k[t], "device_gtopk: this rank's count is at most k");
    }
    slots_ = cap_[nt_];
    detail::check_invariant(2 * slots_ <= static_cast<std::size_t>(std::numeric_limits<int>::max()),
                            "device_gtopk: the union's slots fit an int");
    table_.clear();
    cap_off_ = append(cap_);
    mine_at_off_ = append(st.mine_at);
    std::vector<std::size_t> lo(nt_), hi(nt_);
    for (std::size_t t = 0; t < nt_; ++t) {
      lo[t] = st.offsets[t];
      hi[t] = st.offsets[t] + st.sizes[t];
    }
    lo_off_ = append(lo);
    hi_off_ = append(hi);
    // The segments of the two sorts, as ints, written per round (sort_off_).
    sort_off_ = table_.size();
    table_.resize(table_.size() + 2 * nt_ + 2);  // room for 4 nt ints
    global_at_off_ = table_.size();
    table_.resize(table_.size() + nt_ + 1);
    table_dev_.resize(std::max<std::size_t>(table_.size(), 1));
    if (!table_.empty()) upload(table_dev_.data(), table_.data(), table_.size());
    errors_.resize(1);
    dups_.resize(std::max<std::size_t>(nt_, 1));
    union_key_[0].resize(std::max<std::size_t>(2 * slots_, 1));
    union_key_[1].resize(std::max<std::size_t>(2 * slots_, 1));
    union_value_[0].resize(std::max<std::size_t>(2 * slots_, 1));
    union_value_[1].resize(std::max<std::size_t>(2 * slots_, 1));
    taken_index_.resize(std::max<std::size_t>(slots_, 1));
    taken_value_.resize(std::max<std::size_t>(slots_, 1));
  }
  std::size_t append(std::span<const std::size_t> v) {
    const std::size_t at = table_.size();
    table_.insert(table_.end(), v.begin(), v.end());
    return at;
  }
  const std::uint64_t* dev_u64(std::size_t at) const { return table_dev_.data() + at; }
  void upload_u64(std::size_t at, const std::vector<std::size_t>& v) {
    std::copy(v.begin(), v.end(), table_.begin() + static_cast<std::ptrdiff_t>(at));
    if (!v.empty()) upload(table_dev_.data() + at, table_.data() + at, v.size());
  }

  gtopk_impl::message view(unsigned which) const {
    return {msg_[which].data(), static_cast<unsigned>(nt_), slots_};
  }

  // The received message (msg_[recv_]) checked and merged with this rank's (msg_[cur_]) into
  // msg_[next_], which becomes this rank's; or the reason it was refused. A message whose
  // status names a rank whose message was refused below sets culprit, and is not merged.
  // One wait for the header, one for the check and the new counts.
  std::string merge_received(int source, int ranks, const gtopk_step& st, std::uint32_t& culprit) {
    read_header(msg_[recv_].data());
    const std::uint32_t status = header_[0];
    if (status != 0) {
      if (status <= static_cast<std::uint32_t>(ranks)) {
        culprit = status;
        return {};
      }
      return detail::concat("gradcomp::device_gtopk: malformed payload: rank ", source,
                            " sent a message with the status ", status,
                            "; allowed: 0 (its set) or 1 + a rank (failed)");
    }
    std::vector<std::size_t> len(nt_);
    for (std::size_t t = 0; t < nt_; ++t) {
      if (header_[t + 1] > st.k[t]) {
        return detail::concat("gradcomp::device_gtopk: malformed payload: rank ", source,
                              " sent ", header_[t + 1], " picks of tensor ", st.ids[t],
                              "; at most k = ", st.k[t], " are allowed");
      }
      len[t] = have_[t] + header_[t + 1];
    }
    // The segments of the two sorts: the union's [2 cap, 2 cap + len), then the first
    // min(k, len) of each tensor's slots. A segment of large_segment picks or more is left
    // empty there and sorted on its own (sort_large).
    sort_ints_.assign(4 * nt_, 0);
    for (std::size_t t = 0; t < nt_; ++t) {
      const std::size_t kept = std::min(st.k[t], len[t]);
      sort_ints_[t] = static_cast<int>(2 * cap_[t]);
      sort_ints_[nt_ + t] = static_cast<int>(2 * cap_[t] + (len[t] < large_segment ? len[t] : 0));
      sort_ints_[2 * nt_ + t] = static_cast<int>(cap_[t]);
      sort_ints_[3 * nt_ + t] = static_cast<int>(cap_[t] + (kept < large_segment ? kept : 0));
    }
    int* seg = reinterpret_cast<int*>(table_dev_.data() + sort_off_);
    if (nt_) upload(seg, sort_ints_.data(), sort_ints_.size());
    reset_errors();
    if (nt_) {
      detail::cuda_check(cudaMemsetAsync(dups_.data(), 0, nt_ * sizeof(unsigned), s_),
                         "cudaMemsetAsync");
    }
    const gtopk_impl::message a = view(cur_), b = view(recv_), out = view(next_);
    const std::uint64_t* cap = dev_u64(cap_off_);
    if (slots_) {
      gtopk_impl::validate_kernel<float><<<grid(slots_), threads, 0, s_>>>(
          b, cap, dev_u64(lo_off_), dev_u64(hi_off_), errors_.data());
      check_launch("gtopk validate_kernel");
      gtopk_impl::merge_kernel<float><<<grid(2 * slots_), threads, 0, s_>>>(
          a, b, cap, union_key_[0].data(), union_value_[0].data(), dups_.data());
      check_launch("gtopk merge_kernel");
      const int items = static_cast<int>(2 * slots_), segments = static_cast<int>(nt_);
      // By gtopk_before's order, each tensor's union.
      sort(union_key_[0].data(), union_key_[1].data(), union_value_[0].data(),
           union_value_[1].data(), items, segments, seg, seg + nt_, 64);
      for (std::size_t t = 0; t < nt_; ++t) {
        const std::size_t at = 2 * cap_[t];
        if (len[t] >= large_segment) {
          sort_large(union_key_[0].data() + at, union_key_[1].data() + at,
                     union_value_[0].data() + at, union_value_[1].data() + at, len[t], 64);
        }
      }
      gtopk_impl::take_kernel<float><<<grid(slots_), threads, 0, s_>>>(
          a, b, cap, union_key_[1].data(), union_value_[1].data(), dups_.data(),
          taken_index_.data(), taken_value_.data());
      check_launch("gtopk take_kernel");
      // The k kept, by index (padding last), into the merged message's slots.
      sort(taken_index_.data(), out.index(), taken_value_.data(), out.value(),
           static_cast<int>(slots_), segments, seg + 2 * nt_, seg + 3 * nt_, 32);
      for (std::size_t t = 0; t < nt_; ++t) {
        const std::size_t kept = std::min(st.k[t], len[t]);
        if (kept >= large_segment) {
          sort_large(taken_index_.data() + cap_[t], out.index() + cap_[t],
                     taken_value_.data() + cap_[t], out.value() + cap_[t], kept, 32);
        }
      }
    }
    if (nt_) {
      gtopk_impl::merged_counts_kernel<float><<<grid(nt_), threads, 0, s_>>>(a, b, cap,
                                                                            dups_.data(), out);
      check_launch("gtopk merged_counts_kernel");
    } else {
      set_word(msg_[next_].data(), 0);
    }
    const unsigned long long bad = read_error_and_header(msg_[next_].data());
    if (bad != no_error) {
      const std::size_t t = tensor_at(cap_, bad);
      return detail::concat("gradcomp::device_gtopk: malformed payload: rank ", source,
                            " sent pick ", bad - cap_[t], " of tensor ", st.ids[t],
                            " out of order or outside the tensor; allowed: ascending and "
                            "distinct, in [", st.offsets[t], ", ", st.offsets[t] + st.sizes[t],
                            ") (the tensor's range of the flat buffer)");
    }
    for (std::size_t t = 0; t < nt_; ++t) have_[t] = header_[t + 1];
    const unsigned c = cur_;
    cur_ = next_;
    next_ = c;
    return {};
  }

  // One segmented sort (keys of `bits` bits, values), its scratch grown on demand.
  template <class K>
  void sort(const K* keys_in, K* keys_out, const std::uint32_t* values_in,
            std::uint32_t* values_out, int items, int segments, const int* begin, const int* end,
            int bits) {
    std::size_t bytes = 0;
    detail::cuda_check(cub::DeviceSegmentedRadixSort::SortPairs(
                           nullptr, bytes, keys_in, keys_out, values_in, values_out, items,
                           segments, begin, end, 0, bits, s_),
                       "cub::DeviceSegmentedRadixSort::SortPairs (size query)");
    if (bytes > sort_scratch_.size()) sort_scratch_.resize(bytes);
    detail::cuda_check(cub::DeviceSegmentedRadixSort::SortPairs(
                           sort_scratch_.data(), bytes, keys_in, keys_out, values_in, values_out,
                           items, segments, begin, end, 0, bits, s_),
                       "cub::DeviceSegmentedRadixSort::SortPairs");
  }

  // One tensor's segment of large_segment or more, sorted by all of the device's blocks
  // (cub::DeviceRadixSort; the segmented sort gives each segment one block).
  template <class K>
  void sort_large(const K* keys_in, K* keys_out, const std::uint32_t* values_in,
                  std::uint32_t* values_out, std::size_t items, int bits) {
    const auto n = static_cast<int>(items);
    std::size_t bytes = 0;
    detail::cuda_check(cub::DeviceRadixSort::SortPairs(nullptr, bytes, keys_in, keys_out,
                                                       values_in, values_out, n, 0, bits, s_),
                       "cub::DeviceRadixSort::SortPairs (size query)");
    if (bytes > sort_scratch_.size()) sort_scratch_.resize(bytes);
    detail::cuda_check(cub::DeviceRadixSort::SortPairs(sort_scratch_.data(), bytes, keys_in,
                                                       keys_out, values_in, values_out, n, 0,
                                                       bits, s_),
                       "cub::DeviceRadixSort::SortPairs");
  }

  // The tensor whose part of a layout (at: tensors + 1 running sums) holds position j.
  std::size_t tensor_at(const std::vector<std::size_t>& at, unsigned long long j) const {
    return static_cast<std::size_t>(std::upper_bound(at.begin(), at.end(), j) - at.begin() - 1);
  }

  // A message's header (status, counts) into header_, waited for.
  void read_header(const std::uint32_t* words) {
    header_.resize(nt_ + 1);
    download(header_.data(), words, nt_ + 1);
  }
  void set_word(std::uint32_t* at, std::uint32_t v) { upload(at, &v, 1); }
  void reset_errors() {
    detail::cuda_check(cudaMemsetAsync(errors_.data(), 0xff, sizeof(error_record), s_),
                       "cudaMemsetAsync");
  }
  // The check's error record and a message's header (into header_), with one wait.
  unsigned long long read_error_and_header(const std::uint32_t* words) {
    const std::size_t hb = (nt_ + 1) * sizeof(std::uint32_t);
    std::byte* p = pinned_.data(sizeof(error_record) + hb);
    detail::cuda_check(cudaMemcpyAsync(p, errors_.data(), sizeof(error_record),
                                       cudaMemcpyDeviceToHost, s_),
                       "cudaMemcpyAsync");
    detail::cuda_check(cudaMemcpyAsync(p + sizeof(error_record), words, hb,
                                       cudaMemcpyDeviceToHost, s_),
                       "cudaMemcpyAsync");
    detail::cuda_check(cudaStreamSynchronize(s_), "cudaStreamSynchronize");
    error_record e{};
    std::memcpy(&e, p, sizeof(e));
    header_.resize(nt_ + 1);
    std::memcpy(header_.data(), p + sizeof(error_record), hb);
    return e.first;
  }
  unsigned long long read_error() {
    error_record e{};
    download(&e, errors_.data(), 1);
    return e.first;
  }

  // Host to device from pageable memory (the copy has read it on return); device to host
  // through pinned memory, waited for.
  template <class U>
  void upload(U* to, const U* from, std::size_t n) {
    detail::cuda_check(cudaMemcpyAsync(to, from, n * sizeof(U), cudaMemcpyHostToDevice, s_),
                       "cudaMemcpyAsync");
  }
  template <class U>
  void download(U* to, const U* from, std::size_t n) {
    detail::cuda_check(cudaMemcpyAsync(pinned_.data(n * sizeof(U)), from, n * sizeof(U),
                                       cudaMemcpyDeviceToHost, s_),
                       "cudaMemcpyAsync");
    detail::cuda_check(cudaStreamSynchronize(s_), "cudaStreamSynchronize");
    std::memcpy(to, pinned_.data(n * sizeof(U)), n * sizeof(U));
  }

  // Pinned host memory, grown on demand (the header reads and small results).
  class pinned_bytes {
   public:
    std::byte* data(std::size_t bytes) {
      if (bytes > size_ || !p_) {
        void* p = nullptr;
        detail::cuda_check(cudaMallocHost(&p, std::max<std::size_t>(bytes, 64)), "cudaMallocHost");
        p_.reset(static_cast<std::byte*>(p));
        size_ = std::max<std::size_t>(bytes, 64);
      }
      return p_.get();
    }

   private:
    struct free_pinned {
      void operator()(std::byte* p) const noexcept { cudaFreeHost(p); }
    };
    std::unique_ptr<std::byte, free_pinned> p_;
    std::size_t size_ = 0;
  };

  cudaStream_t s_ = nullptr;
  std::size_t nt_ = 0;
  std::size_t slots_ = 0;
  std::vector<std::size_t> cap_, have_, global_at_;
  std::vector<std::uint32_t> counts_, header_;
  std::vector<int> sort_ints_;
  // Host copies of the device table of offsets, and where each part starts in it.
  std::vector<std::uint64_t> table_;
  device_buffer<std::uint64_t> table_dev_;
  std::size_t cap_off_ = 0, mine_at_off_ = 0, lo_off_ = 0, hi_off_ = 0, sort_off_ = 0,
              global_at_off_ = 0;
  // Three messages: this rank's set, the one received, the merge (cur_, recv_, next_ rotate).
  device_buffer<std::uint32_t> msg_[3];
  unsigned cur_ = 0, recv_ = 1, next_ = 2;
  device_buffer<std::uint64_t> union_key_[2];
  device_buffer<std::uint32_t> union_value_[2];
  device_buffer<std::uint32_t> taken_index_, taken_value_;
  device_buffer<unsigned> dups_, restored_;
  device_buffer<error_record> errors_;
  device_buffer<std::byte> sort_scratch_;
  device_buffer<std::uint32_t> global_picks_;
  device_buffer<float> global_values_, exact_;
  pinned_bytes pinned_;
};

}  // namespace cuda
}  // namespace gradcomp
