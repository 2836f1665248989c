// gradcomp/cuda/sparsified_sgd.cuh: device_sparsified_sgd<Compressor, Exchange, Comm>, the
// device twin of sparsified_sgd: the same compressor<S, Q, F> type, exchange type, sgd_options,
// density_schedule, step_stats and checkpoint format, with parameters, gradients, feedback,
// velocity and the averaged gradient in device memory, and the exchange over a
// device_communicator (nccl_comm, or cuda::staged_comm over any host communicator).
//
// One step, every call on comm.stream() (the caller's gradient must be ready on it):
//   1. compress: the committed residual is copied into the staged one; per tensor, top-k of
//      e + g with the addition fused into the selection pass (on_device(topk)
//      .select_accumulate), the picks gathered and cleared in e (gather_and_clear), their
//      indices moved into the flat buffer's range; one check of the picks for NaN and Inf.
//      The selection statistics and that check come back in pinned memory: the one wait of
//      this phase (not one per tensor).
//   2. exchange (sparse_allgather's, in its device form): one gather of every rank's per-tensor
//      counts and a status (a rank whose gradient held NaN or Inf refuses the step there, so
//      that every rank throws and none waits), checked on the host (a count above its
//      tensor's size is refused on every rank before anything is sized by it); one allgatherv of all the step's indices and one of the
//      values, with the counts known; a check on the device that each rank's picks of each
//      tensor are ascending and inside the tensor (refused on every rank, naming the rank and
//      tensor, before anything is written); the rank-order sum by the deterministic sorted
//      scatter-add into the zeroed staged average; the division by the number of ranks.
//   3. commit: the SGD update (lr, momentum, Nesterov, weight decay) on the device, operation
//      for operation the host's; the staged residual and average become the committed ones.
// The host step's promises hold: the result is the host's bit for bit (same index sets, same
// rank-order sums, same rounding of each operation), and a step that throws (a non-finite
// gradient, a peer that failed, a rejected payload) leaves parameters, velocity, residual,
// average, statistics and step counter as they were: only staged buffers were written.
//
// Dense SGD as the same transaction: compressor<dense, identity, residual> with dense_allreduce
// sends every coordinate of e + g (the staged residual becomes e + g - (e + g) = 0, as the
// host's), and its phase 2 is the same gather of counts and statuses (each rank must announce
// every tensor's full size), then one allreduce of the flat buffer (the communicator's order of
// addition: ncclAllReduce, or the host communicator's through staged_comm, which is the host
// step's) and the division by the number of ranks. With a summable quantizer
// (compressor<dense, Q, residual>, Q fp16 or bf16) one kernel writes each value's code (fp16's
// divided by P before the sum, as the host's dense_allreduce does) and the staged residual
// e + g - decoded, the allreduce adds the codes (gradcomp::half or bfloat16: ncclFloat16 or
// ncclBfloat16), and the average is float(sum), divided by P for bf16.
//
// threshold in place of top-k: compressor<threshold, Q, residual> adds g into the staged
// residual in one pass over the flat buffer, selects {i : |e_i + g_i| >= tau} per tensor
// (on_device(threshold).select) into that tensor's own range of capacity buffers (a count is
// known only on the device), and gathers and clears the picks there; the counts come back
// with the statistics (a second wait of phase 1), and each tensor's picks and values move to
// their place in the step's buffers before the rest of phase 1 (offsets, encoding, the
// non-finite check) and phase 2, which needs no change: it already takes any count up to the
// tensor's size from every rank.
//
// Gaussian-k in place of top-k: compressor<gaussiank, Q, residual> selects per tensor with the
// device Gaussian-k (on_device(gaussiank).select_accumulate: the addition of g fused into its
// statistics pass, as top-k's, its target k at the step's density) into the capacity buffers,
// as threshold does; the rest of the step is threshold's. Its picks are the set its device
// threshold defines, which is the host's within float tolerance (cuda/dispatch/gaussiank.cuh):
// the device step equals the host step bit for bit wherever the two thresholds have no value
// of |e + g| between them, and its statistics name the device's threshold.
//
// Random-k in place of top-k: compressor<randomk, Q, residual> adds g into the staged residual in
// one pass, as threshold does, checks every coordinate of e + g for NaN and Inf (the picks do not
// depend on the values, so they need not hold the NaN or Inf that e + g holds; the value in the
// refusal is kept before the picks are cleared, the verdict read back with the statistics: one
// wait in compression), draws every tensor's k indices on the host meanwhile (randomk::draw, the
// host step's call_id) into pinned memory, copies them to the device at once, and goes on as
// top-k: the same counts on every rank, the host's bits. With dense_allreduce (unquantized, fp16
// or bf16, whose codes are added as dense's are), as every rank's indices are the same, phase 2
// gathers the counts and statuses, then every rank's hash of each tensor's indices (a rank with
// another seed, step or layout is refused on every rank before anything is reduced), allreduces
// the step's values and writes each sum divided by P at its index of the zeroed staged average
// (the host's dense_allreduce, whose bits these are where the communicator adds every element in
// rank order whatever the length, as for dense). dense_allreduce::check_agreement is not
// consulted: the counts and hashes are always gathered.
//
// Quantized top-k: with compressor<topk, Q, residual>, Q one of fp16, bf16, qsgd, terngrad and
// scaled_sign, phase 1 also encodes each tensor's picks on the device (on_device(q).encode,
// with the host step's call_id: seed, step, tensor id, rank), decodes its own payload, and
// keeps e = (e + g) - decoded at the picks, as the host's residual does. Phase 2 gathers the
// packed codes and the side values (their sizes follow from the counts on every rank) in place
// of the float values, checks every rank's tensors with the device decoder's checks, all
// launched together and read back with one wait (qsgd, terngrad and scaled_sign; fp16's and
// bf16's payloads cannot be malformed): a malformed payload is refused on every rank, naming
// the sender and the tensor, before anything is decoded; then decodes them into the values
// the scatter-add sums.
//
// DGC's momentum correction in place of the residual: compressor<S, Q, dgc_momentum> (S topk,
// threshold or randomk) keeps u and v per coordinate (committed and staged, as the residual),
// and phase 1 starts with one pass over the flat buffer (with clipping, one per tensor, after
// two small kernels for its scale) that writes the staged u = m u + s g and v = v + u from the
// committed ones (s: the tensor's clipping scale, clip / ||g|| where ||g|| exceeds clip_norm,
// else 1; ||g||^2 in a fixed order of its own, so the scale is the host's wherever the squares
// add up exactly and otherwise within its last bit) and refuses a non-finite v (a NaN or Inf in
// g, or an accumulation that overflowed, both refused by the host too; the refusal names the
// first such v's index and value, where the host names a non-finite g first, and with
// clipping an infinite g's v is NaN). Every selector then reads v as threshold reads e + g
// (top-k by its plain select), the picks are gathered and cleared in v and cleared in u
// (momentum factor masking), and a quantizer's error stays in v, as the host's
// dgc_momentum::update. Its options need momentum 0, as the host's (DGC applies momentum
// itself); checkpoints hold u and v per tensor, the host's.
//
// gTop-k in place of sparse_allgather: with gtopk (either gtopk_values), phase 2 gathers the
// counts and statuses (each tensor's k: the largest count any rank announced), then runs one
// merge tree for every tensor of the step on the device (cuda/gtopk.cuh: ceil(log2 P) rounds
// of sendrecv_known, the merges by binary-search placement and two segmented sorts, rank 0's
// broadcast of the global set, checked by every rank before anything is written): the staged
// average gets the global sums divided by P, and each rank's picks that are not global go back
// to the staged residual (DGC: v), as the host's restore. Picks and values are the host's, bit
// for bit, but for a NaN sum's bits and, with the exact sums, a communicator whose order of
// addition depends on the length (cuda/gtopk.cuh).
//
// TopK-A2A in place of sparse_allgather: with topk_a2a, every tensor of the step is one fused
// index space (the flat buffer) split into one shard per rank (topk_a2a_shard_begin), one
// bucket whatever the exchange's bucket_elements (the result is the same bit for bit; only the
// host's number of messages depends on it). Where each owner's picks start in this rank's
// ascending picks is found on the device (split_by_shard_kernel) and read back (a wait); the
// first collective gathers those P counts with the per-tensor counts and statuses, so that
// every rank holds the whole count matrix, checks it (check_topk_a2a_counts: each row adds up
// to the rank's picks, no entry beyond its shard) and sizes nothing by a peer's word beyond
// that. Then two alltoallv_known (the indices, and the values: decoded floats where quantized,
// as the host's pairs), a check on the device that each source's picks are ascending and
// inside this rank's shard, one gather of every rank's verdict (0, or 1 + the source it
// refused: a refusal fails the step on every rank, naming the sender, before anything is
// written), the owner's rank-order sum of its shard (the sorted scatter-add, the mean), and
// one allgatherv_known of the shards into the staged average. The host's bits: each index's
// values added in rank order, as sparse_allgather's.
//
// So far it runs compressor<S, Q, residual> with S one of topk, gaussiank, threshold and
// randomk, and compressor<S, Q, dgc_momentum> with S one of topk, threshold and randomk (float,
// Q any of the six quantizers; quantized Gaussian-k and Random-k as quantized top-k and
// threshold) with sparse_allgather, gtopk or topk_a2a, compressor<dense, Q, residual> (float, Q any of
// the six) with sparse_allgather (every coordinate's codes gathered, no indices sent: each
// rank's are every coordinate, written on the device; decoded and added in rank order as
// quantized top-k's), and compressor<dense, Q, residual> and
// compressor<randomk, Q, residual> (float; Q identity, fp16 or bf16) with dense_allreduce, with
// nonfinite_policy::error; any other configuration fails to compile with a static_assert that
// says so (the policy: invalid_argument when the driver is made). Not measured on the device
// (seconds in step_stats are 0) and not split into phases; the sparse selectors' contraction
// is NaN (the device selection does not add up ||e + g||^2; dense's is 1, as the host's).
// bytes_sent counts 8 bytes a pick (quantized: 4 for its index, then the packed codes and 4
// bytes a side value; dense over dense_allreduce: 4 a value, 2 a code; dense over
// sparse_allgather: the packed codes and 4 bytes a side value, no indices) and 8 a count (Random-k over
// dense_allreduce: 4 a value or 2 a code, 8 a count and 8 a hash; gtopk: 8 a count, then
// 4 + 8 k a message and a broadcast, and 4 k for the exact sums; topk_a2a: 8 a count, then
// for the step 8 for each of the P counts to the owners and the verdict, 8 a pick sent to
// another rank and 4 an element of this rank's shard, shared among the tensors by size).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <istream>
#include <memory>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <gradcomp/compressor.hpp>
#include <gradcomp/cuda/dispatch/launch.cuh>
#include <gradcomp/cuda/dispatch/sgd.cuh>
#include <gradcomp/cuda/feedback.cuh>
#include <gradcomp/cuda/gtopk.cuh>
#include <gradcomp/cuda/kernels/step_kernels.cuh>
#include <gradcomp/cuda/memory.cuh>
#include <gradcomp/cuda/quantize.cuh>
#include <gradcomp/cuda/select.cuh>
#include <gradcomp/cuda/sparse.cuh>
#include <gradcomp/detail/sgd_checkpoint.hpp>
#include <gradcomp/device.hpp>
#include <gradcomp/engine/tensor_record.hpp>
#include <gradcomp/error.hpp>
#include <gradcomp/exchange/dense_allreduce.hpp>
#include <gradcomp/exchange/gtopk.hpp>
#include <gradcomp/exchange/sparse_allgather.hpp>
#include <gradcomp/exchange/topk_a2a.hpp>
#include <gradcomp/feedback/dgc_momentum.hpp>
#include <gradcomp/feedback/residual.hpp>
#include <gradcomp/quantize.hpp>
#include <gradcomp/select/dense.hpp>
#include <gradcomp/select/gaussiank.hpp>
#include <gradcomp/select/randomk.hpp>
#include <gradcomp/select/threshold.hpp>
#include <gradcomp/select/topk.hpp>
#include <gradcomp/sgd.hpp>

namespace gradcomp {

// What the device step needs of a communicator: the host-visible gather of small counts, and
// an allgatherv of device memory (indices, values, a quantizer's packed bytes) whose counts
// every rank already holds.
template <class C>
concept device_communicator =
    requires(C& c, const C& cc, std::span<const std::uint64_t> mine, std::vector<std::size_t>& out,
             device_span<const std::uint32_t> si, device_span<std::uint32_t> ri,
             device_span<const float> sf, device_span<float> rf,
             device_span<const std::byte> sb, device_span<std::byte> rb,
             std::span<const std::size_t> n) {
      { cc.rank() } -> std::convertible_to<int>;
      { cc.size() } -> std::convertible_to<int>;
      { cc.stream() } -> std::same_as<cudaStream_t>;
      c.gather_counts(mine, out);
      c.allgatherv_known(si, ri, n);
      c.allgatherv_known(sf, rf, n);
      c.allgatherv_known(sb, rb, n);
    };

// What dense_allreduce adds: an allreduce (sum) of device memory, in place, of floats or of a
// summable quantizer's sum type W.
template <class C, class W = float>
concept device_allreduce_communicator =
    device_communicator<C> && requires(C& c, device_span<W> x) { c.allreduce(x, reduce_op::sum); };

// What topk_a2a adds: an alltoallv of device memory (indices and values) whose counts every
// rank already holds, with a bound on any block that is the same on every rank, returning -1
// or the first rank whose block had another size.
template <class C>
concept device_a2a_communicator =
    device_communicator<C> &&
    requires(C& c, device_span<const std::uint32_t> si, device_span<std::uint32_t> ri,
             device_span<const float> sf, device_span<float> rf, std::span<const std::size_t> n,
             std::size_t limit) {
      { c.alltoallv_known(si, n, ri, n, limit) } -> std::convertible_to<int>;
      { c.alltoallv_known(sf, n, rf, n, limit) } -> std::convertible_to<int>;
    };

// What graph_step captures into a CUDA graph: a device_communicator whose device collectives
// only queue work on its stream (nccl_comm says so with graph_capturable). Over any other
// communicator graph_step queues the same work without a capture.
template <class C>
concept device_graph_communicator = device_communicator<C> && requires {
  requires C::graph_capturable;
};

namespace detail {
// What the allreduce paths add: a summable quantizer's sum_type; float for any other (whose
// configurations the driver refuses before this is used).
template <class Q>
struct device_sum_type {
  using type = float;
};
template <class Q>
  requires requires { typename Q::sum_type; }
struct device_sum_type<Q> {
  using type = typename Q::sum_type;
};
}  // namespace detail

template <class Compressor, class Exchange, class Comm>
class device_sparsified_sgd {
  // The dense path: every coordinate, added by an allreduce (else a sparse selector's picks
  // over sparse_allgather).
  using selector_t = typename Compressor::selector_type;
  using quantizer_t = typename Compressor::quantizer_type;
  using feedback_t = typename Compressor::feedback_type;
  static constexpr bool dense_path = std::is_same_v<selector_t, dense>;
  // Dense SGD over sparse_allgather (a quantizer whose codes cannot be added: qsgd, terngrad,
  // scaled_sign; or any other): every rank's codes gathered, decoded and added in rank order.
  static constexpr bool dense_gathered = dense_path && std::is_same_v<Exchange, sparse_allgather>;
  // DGC's momentum correction (dgc_momentum): the state is u and v; v + (m u + g) is added in
  // one pass over the flat buffer before any selection, which reads v; the picks are cleared
  // in v (gather_and_clear, as in a residual) and in u (momentum factor masking).
  static constexpr bool is_dgc = std::is_same_v<feedback_t, dgc_momentum>;
  static constexpr bool is_threshold = std::is_same_v<selector_t, threshold>;
  static constexpr bool is_gaussiank = std::is_same_v<selector_t, gaussiank>;
  static constexpr bool is_randomk = std::is_same_v<selector_t, randomk>;
  // threshold and Random-k select from e + g added beforehand in one pass over the flat buffer;
  // top-k and Gaussian-k add g into e inside their selection pass (select_accumulate).
  // (With DGC every selector reads v, added beforehand.)
  static constexpr bool accumulates_first = is_threshold || is_randomk || is_dgc;
  // The check for NaN and Inf reads the flat e + g (position j = flat index j): dense sends
  // every coordinate, and Random-k's picks do not depend on the values, so they need not hold
  // a NaN or Inf that e + g holds. The others' picks hold one whenever e + g does, and the
  // check reads only them. DGC's accumulation pass checks every v it writes.
  static constexpr bool checks_flat_values = dense_path || is_randomk || is_dgc;
  // Random-k over dense_allreduce: every rank picks the same indices (the draw depends on the
  // seed, step, tensor and k alone), so the values are added by one allreduce.
  static constexpr bool reduces_picks = is_randomk && std::is_same_v<Exchange, dense_allreduce>;
  // gTop-k: the picks merged up a tree, the global set broadcast (cuda/gtopk.cuh).
  static constexpr bool tree_exchange = std::is_same_v<Exchange, gtopk>;
  // TopK-A2A: the picks sent to their shards' owners, the owners' sums gathered.
  static constexpr bool a2a_exchange = std::is_same_v<Exchange, topk_a2a>;
  // threshold and Gaussian-k: each tensor's count is known only once its selection has run on
  // the device.
  static constexpr bool variable_count = is_threshold || is_gaussiank;
  // Top-k's picks encoded by a quantizer on the device (else sent as floats).
  static constexpr bool quantized = !std::is_same_v<quantizer_t, identity>;
  // What graph_step runs: unquantized top-k with a residual over sparse_allgather, whose every
  // count is k (known on every rank before the step) and whose checks can all run on the device.
  static constexpr bool fixed_k = std::is_same_v<selector_t, topk> && !quantized &&
                                  std::is_same_v<feedback_t, gradcomp::residual> &&
                                  std::is_same_v<Exchange, sparse_allgather>;
  // The allreduce paths (dense and Random-k over dense_allreduce) add the values as they travel:
  // floats, or a summable quantizer's codes (fp16's gradcomp::half, bf16's bfloat16), each
  // code divided by the number of ranks first where the quantizer says so (fp16).
  static constexpr bool allreduces = (dense_path && !dense_gathered) || reduces_picks;
  // Whether each code is divided by the number of ranks before the sum (fp16), and not after.
  // (false for a quantizer that is not summable: over sparse_allgather its codes are gathered,
  // not added; over an allreduce it is refused below with no follow-on errors.)
  static constexpr bool prescaled = [] {
    if constexpr (Compressor::summable) return quantizer_t::prescale_before_sum;
    return false;
  }();
  using sum_t = typename detail::device_sum_type<quantizer_t>::type;
  static_assert((std::is_same_v<selector_t, topk> || variable_count || is_randomk || dense_path) &&
                    (std::is_same_v<feedback_t, gradcomp::residual> || (is_dgc && !dense_path)) &&
                    std::is_same_v<typename Compressor::value_type, float>,
                "device_sparsified_sgd<C, X, Comm> runs C = compressor<S, Q, F> with S one of "
                "topk, gaussiank, threshold and randomk and F residual (dgc_momentum: but "
                "gaussiank), or compressor<dense, Q, residual> (float) so far; other "
                "selectors and feedback run in sparsified_sgd on the host.");
  static_assert(std::is_same_v<quantizer_t, identity> || std::is_same_v<quantizer_t, fp16> ||
                    std::is_same_v<quantizer_t, bf16> || std::is_same_v<quantizer_t, qsgd> ||
                    std::is_same_v<quantizer_t, terngrad> ||
                    std::is_same_v<quantizer_t, scaled_sign>,
                "device_sparsified_sgd<C, X, Comm>: C's quantizer has no device form (identity, "
                "fp16, bf16, qsgd, terngrad and scaled_sign have).");
  static_assert(!allreduces || Compressor::summable,
                "device_sparsified_sgd<compressor<S, Q, residual>, dense_allreduce, ...> (S "
                "dense or randomk) needs a summable Q (identity, fp16 or bf16), as the host's "
                "dense_allreduce; with another Q the dense step runs over sparse_allgather.");
  static_assert(dense_path ? std::is_same_v<Exchange, dense_allreduce> || dense_gathered
                           : std::is_same_v<Exchange, sparse_allgather> || reduces_picks ||
                                 tree_exchange || a2a_exchange,
                "device_sparsified_sgd<C, X, Comm> runs X = sparse_allgather, gtopk and topk_a2a "
                "with topk, gaussiank, threshold and randomk, X = dense_allreduce with dense and "
                "randomk, and X = sparse_allgather with dense so far.");
  static_assert(!(is_gaussiank && is_dgc),
                "device_sparsified_sgd<compressor<gaussiank, Q, dgc_momentum>, ...> does not run "
                "so far (its device threshold is the host's only within float tolerance, and "
                "DGC's v is off the grid its tests rely on); it runs in sparsified_sgd on the host.");
  static_assert(!reduces_picks || !is_dgc,
                "device_sparsified_sgd<compressor<randomk, Q, dgc_momentum>, dense_allreduce, "
                "...> does not run so far (sparse_allgather does); it runs in sparsified_sgd on "
                "the host.");
  static_assert(device_communicator<Comm>,
                "device_sparsified_sgd<C, X, Comm>: Comm is not a gradcomp::device_communicator "
                "(nccl_comm, or cuda::staged_comm over a host communicator).");
  static_assert(!tree_exchange || device_tree_communicator<Comm>,
                "device_sparsified_sgd<C, gtopk, Comm>: Comm has no sendrecv_known, broadcast "
                "and allreduce of device memory (nccl_comm and cuda::staged_comm have them).");
  static_assert(!a2a_exchange || device_a2a_communicator<Comm>,
                "device_sparsified_sgd<C, topk_a2a, Comm>: Comm has no alltoallv_known of device "
                "memory (nccl_comm and cuda::staged_comm have it).");
  static_assert(!allreduces || device_allreduce_communicator<Comm, sum_t>,
                "device_sparsified_sgd<C, dense_allreduce, Comm>: Comm has no allreduce of "
                "device memory of C's sum type (float, or fp16's gradcomp::half, bf16's "
                "gradcomp::bfloat16; nccl_comm and cuda::staged_comm have them).");

 public:
  using value_type = float;
  using T = float;

  // Tensors with ids 0, 1, ... in the order of layer_sizes.
  device_sparsified_sgd(Comm& comm, const std::vector<std::size_t>& layer_sizes,
                        Compressor c = {}, Exchange x = {}, sgd_options opt = {},
                        density_schedule schedule = density_schedule::constant(1.0))
      : device_sparsified_sgd(comm, detail::tensor_specs(layer_sizes), std::move(c), std::move(x),
                              opt, schedule) {}

  device_sparsified_sgd(Comm& comm, std::span<const tensor_spec> tensors, Compressor c,
                        Exchange x, sgd_options opt, density_schedule schedule)
      : comm_(&comm), tensors_(tensors.begin(), tensors.end()), compressor_(std::move(c)),
        exchange_(std::move(x)), opt_(opt), schedule_(schedule) {
    detail::check_sgd_options(driver_name, opt_);
    if constexpr (is_dgc) {  // in the host driver's order: its options, then the feedback's
      if (opt_.momentum != 0.0) {
        detail::throw_invalid_argument(
            driver_name, "momentum", opt_.momentum,
            "0 with dgc_momentum feedback (it applies momentum before compression)");
      }
      compressor_.feedback().check();
    }
    offsets_ = detail::tensor_offsets(driver_name, tensors_);
    for (const tensor_spec& t : tensors_) {
      detail::check_tensor_size(driver_name, t, dense_path);
      ids_.push_back(t.id);
      sizes_.push_back(t.size);
    }
    total_ = detail::total_size(tensors_);
    if ((!dense_path || dense_gathered) &&
        static_cast<std::uint64_t>(total_) > (std::uint64_t{1} << 32)) {
      detail::throw_invalid_argument(driver_name, "the total of the tensor sizes", total_,
                                     "<= 2^32 (the device step's picks are 32-bit indices "
                                     "into the flat buffer)");
    }
    if (a2a_exchange && static_cast<std::uint64_t>(total_) >= (std::uint64_t{1} << 32)) {
      detail::throw_invalid_argument(driver_name, "the total of the tensor sizes", total_,
                                     "< 2^32 with topk_a2a (its picks are counted in 32 bits)");
    }
    if (tree_exchange && total_ > cuda::device_gtopk::max_total) {
      detail::throw_invalid_argument(driver_name, "the total of the tensor sizes", total_,
                                     detail::concat("<= ", cuda::device_gtopk::max_total,
                                                    " with gtopk (2^30 - 1: its device merge "
                                                    "sorts up to twice that many picks, counted "
                                                    "in an int)"));
    }
    if constexpr (requires { compressor_.selector().check(); }) compressor_.selector().check();
    if (compressor_.nonfinite() != nonfinite_policy::error) {
      // The host's residual keeps e - v = NaN where a pick v is NaN or infinite; the device's
      // gather_and_clear leaves 0. Until they agree, only the default policy runs here.
      detail::throw_invalid_argument(driver_name, "the compressor's nonfinite policy",
                                     "propagate", "nonfinite_policy::error on the device");
    }
    for (auto& e : residual_) zeroed(e, total_);
    if constexpr (is_dgc) {
      for (auto& u : momentum_) zeroed(u, total_);
    }
    if constexpr (is_dgc || is_randomk) refused_value_.resize(1);
    for (auto& a : average_) zeroed(a, total_);
    if (opt_.momentum > 0.0) zeroed(velocity_, total_);
    stats_dev_.resize(std::max<std::size_t>(tensors_.size(), 1));
    errors_dev_.resize(2);
    void* pinned = nullptr;
    detail::cuda_check(cudaMallocHost(&pinned, pinned_bytes()), "cudaMallocHost");
    pinned_.reset(static_cast<std::byte*>(pinned));
    cudaEvent_t event = nullptr;
    detail::cuda_check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                       "cudaEventCreateWithFlags");
    event_.reset(event);
    if constexpr (is_randomk) {
      detail::cuda_check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                         "cudaEventCreateWithFlags");
      drawn_copied_.reset(event);
    }
    // The zeroed buffers are ready before the first step's work is queued.
    detail::cuda_check(cudaStreamSynchronize(stream()), "cudaStreamSynchronize");
  }

  device_sparsified_sgd(const device_sparsified_sgd&) = delete;
  device_sparsified_sgd& operator=(const device_sparsified_sgd&) = delete;
  // A copy out of Random-k's pinned draws may still be queued (a step that threw after it):
  // the buffer is freed only once it is done.
  ~device_sparsified_sgd() {
    if (drawn_pending_) cudaEventSynchronize(drawn_copied_.get());
  }

  // One synchronous step on every rank: exchange_step(grads), then commit_step(params).
  // params and grads: device memory, size() elements, not overlapping.
  const step_stats& step(device_span<T> params, device_span<const T> grads) {
    check_size("params.size()", params.size());
    exchange_step(grads);
    return commit_step(params);
  }

  // Compresses and exchanges every tensor into staged buffers; changes nothing observable.
  void exchange_step(device_span<const T> grads) { exchange_staged(grads); }

  // exchange_step(grads) with the quantizers' and Random-k's draws made from `draw` (its seed,
  // step and rank; the tensor id is each tensor's) in place of (seed, this step, this rank):
  // for a driver that steps this one on its own schedule and draws as its host twin does
  // (cuda/periodic_averaging.cuh: a round's call_id is the host periodic_averaging's).
  void exchange_step(device_span<const T> grads, const call_id& draw) {
    draw_ = draw;
    try {
      exchange_staged(grads);
    } catch (...) {
      draw_.reset();
      throw;
    }
    draw_.reset();
  }

  // Applies the staged update to params (asynchronously, on the stream) and keeps the staged
  // state. Cannot fail once its argument is checked, but for a failed launch of the update
  // kernel (a CUDA error), which leaves everything as it was.
  const step_stats& commit_step(device_span<T> params) {
    check_size("params.size()", params.size());
    require_staged("device_sparsified_sgd::commit_step");
    update(params, staged_average());
    return keep_staged();
  }

  // Keeps the staged state, as commit_step, with no update: averaged_gradient() is then the
  // step's mean over ranks, for a caller that applies it itself (cuda/periodic_averaging.cuh).
  // Cannot fail once a staged step is there.
  const step_stats& commit_exchange() {
    require_staged("device_sparsified_sgd::commit_exchange");
    return keep_staged();
  }

  // Zeroes the committed feedback state (the residual; DGC's u and v), on the stream: the
  // next step starts without what earlier steps kept (periodic_averaging's error_feedback =
  // false).
  void clear_feedback() {
    if (!total_) return;
    const cudaStream_t s = stream();
    detail::cuda_check(cudaMemsetAsync(residual_[committed_].data(), 0, total_ * sizeof(T), s),
                       "cudaMemsetAsync");
    if constexpr (is_dgc) {
      detail::cuda_check(cudaMemsetAsync(momentum_[committed_].data(), 0, total_ * sizeof(T), s),
                         "cudaMemsetAsync");
    }
  }

  void discard_step() noexcept { staged_ready_ = false; }

  // step(params, grads) with every check on the device and one wait, at the end, for
  // compressor<topk, identity, residual> over sparse_allgather: the same parameters, residual,
  // average and selection statistics bit for bit, and the same transaction (a step that throws
  // changes nothing on any rank), but for the bytes counted. Every count is k, known on every
  // rank, so nothing is gathered first: each rank's status word (0, 1 where its picks held NaN
  // or Inf, 2 where a selection did not pick its k), its picks and its values are gathered
  // with sizes every rank knows (one
  // ncclAllGather each on nccl_comm); each rank checks every rank's status and picks on the
  // device (ascending, inside their tensor) into a verdict, which an allreduce (max) makes every
  // rank's; the sum runs either way (the scatter-add never writes outside the buffer, and a
  // refused step's staged average is discarded), the SGD update only where the verdict is 0
  // (the kernel reads it). The statistics,
  // the checks' results and the verdict come back in pinned memory; the host then throws or
  // commits. Over a communicator whose collectives can be captured (device_graph_communicator:
  // nccl_comm) and with capture_graphs(true) (the default), the whole step is captured in a
  // CUDA graph and replayed after: one graph per parity of the double-buffered state, captured
  // on its second call with the same k, params.data(), grads.data(), buffers and selector
  // settings (the first runs uncaptured, a warm-up for NCCL and CUB), and again when one of
  // them changes. On the legacy default stream nothing is captured.
  // params and grads must then stay where they are for the replays to read them; the caller's
  // gradient must be ready on stream(). Every rank must call graph_step (not step) at the same
  // steps, with the same layout and density schedule: the layout, each tensor's k, the step
  // and the schedule are agreed (a gather of counts, one more wait) on the first call, after
  // load_state and whenever k changes, and a rank that differs is refused on every rank then.
  // Whether a rank agrees is its own decision: every rank must load a checkpoint (or make its
  // driver) before the same graph_step call, or the ranks' collectives do not match (over
  // NCCL a hang, not a refusal). The bytes counted per tensor are 8 a pick
  // and, with tensor 0, 4 for the status word.
  const step_stats& graph_step(device_span<T> params, device_span<const T> grads) {
    static_assert(fixed_k,
                  "device_sparsified_sgd::graph_step runs compressor<topk, identity, residual> "
                  "over sparse_allgather (a fixed k, every check on the device); the other "
                  "configurations run step().");
    static_assert(device_allreduce_communicator<Comm, std::uint32_t>,
                  "device_sparsified_sgd::graph_step: Comm has no allreduce of device "
                  "std::uint32_t (nccl_comm and cuda::staged_comm have it).");
    staged_ready_ = false;
    check_size("params.size()", params.size());
    check_size("grads.size()", grads.size());
    const double rho = schedule_.at(step_);
    prepare_fixed_k(grads, rho);
    bool launched = false;
    if constexpr (device_graph_communicator<Comm>) {
      // (The legacy default stream cannot be captured: its work is queued as it is.)
      if (capture_ && stream() != nullptr && stream() != cudaStreamLegacy) {
        launched = launch_fixed_k_graph(params, grads, rho);
      }
    }
    if (!launched) queue_fixed_k(params, grads, rho);
    wait();
    return finish_fixed_k(rho);
  }

  // Whether graph_step captures its step in a CUDA graph where the communicator allows it (the
  // default), or queues the same work without a capture every time.
  void capture_graphs(bool on) noexcept { capture_ = on; }
  // How many CUDA graphs graph_step has captured so far.
  [[nodiscard]] std::size_t graph_captures() const noexcept { return graph_captures_; }

  [[nodiscard]] const step_stats& last_stats() const noexcept { return stats_; }
  [[nodiscard]] std::uint64_t steps_done() const noexcept { return step_; }
  [[nodiscard]] std::size_t size() const noexcept { return total_; }
  [[nodiscard]] std::size_t total_bytes_sent() const noexcept { return total_bytes_sent_; }
  [[nodiscard]] std::size_t total_bytes_received() const noexcept { return total_bytes_received_; }
  [[nodiscard]] const std::vector<tensor_spec>& tensors() const noexcept { return tensors_; }
  [[nodiscard]] Compressor& compressor() noexcept { return compressor_; }
  // The exchange policy object (sparsified_sgd's accessor of the same name).
  [[nodiscard]] Exchange& exchange() noexcept { return exchange_; }
  [[nodiscard]] cudaStream_t stream() const { return comm_->stream(); }
  // Device memory, valid until the next commit_step (read it on the stream, or after it).
  [[nodiscard]] device_span<const T> averaged_gradient() const noexcept {
    return {average_[committed_].data(), total_};
  }
  // Tensor t's residual (with dgc_momentum feedback: its v).
  [[nodiscard]] device_span<const T> residual(std::size_t tensor_index) const {
    return {residual_[committed_].data() + offsets_.at(tensor_index), tensors_[tensor_index].size};
  }
  // Tensor t's feedback state in the order of the host state's buffers(): residual {e},
  // dgc_momentum {u, v}.
  [[nodiscard]] std::vector<device_span<const T>> feedback_buffers(std::size_t tensor_index) const {
    const std::size_t at = offsets_.at(tensor_index), n = tensors_[tensor_index].size;
    if constexpr (is_dgc) {
      return {device_span<const T>(momentum_[committed_].data() + at, n),
              device_span<const T>(residual_[committed_].data() + at, n)};
    } else {
      return {device_span<const T>(residual_[committed_].data() + at, n)};
    }
  }
  [[nodiscard]] device_span<const T> velocity() const noexcept {
    return {velocity_.data(), velocity_.size()};
  }

  // Checkpoints in sparsified_sgd's format (either driver loads the other's): the step
  // counter, every tensor's residual keyed by tensor id, the velocity. Both wait for the stream.
  void save_state(std::ostream& os) const {
    const std::vector<T> e = download(residual_[committed_].data(), total_);
    const std::vector<T> u = download(momentum_[committed_].data(), is_dgc ? total_ : 0);
    const std::vector<T> v = download(velocity_.data(), velocity_.size());
    detail::save_sgd_checkpoint<T>(
        os, driver_name, step_, tensors_,
        [&](std::size_t t) {  // residual keeps one buffer, dgc_momentum u and v
          const std::span<const T> et(e.data() + offsets_[t], tensors_[t].size);
          if constexpr (is_dgc) {
            return std::vector<std::span<const T>>{{u.data() + offsets_[t], tensors_[t].size}, et};
          } else {
            return std::vector<std::span<const T>>{et};
          }
        },
        std::span<const T>(v));
  }

  // Accepts the tensors in any order; checks ids, sizes, element type and buffer counts, and
  // changes nothing unless all of it matches.
  void load_state(std::istream& is) {
    std::vector<T> e(total_);
    std::vector<T> u(is_dgc ? total_ : 0);
    std::vector<T> v(velocity_.size());
    const std::uint64_t step = detail::load_sgd_checkpoint<T>(
        is, driver_name, tensors_,
        [&](std::size_t t) {
          const std::span<T> et(e.data() + offsets_[t], tensors_[t].size);
          if constexpr (is_dgc) {
            return std::vector<std::span<T>>{{u.data() + offsets_[t], tensors_[t].size}, et};
          } else {
            return std::vector<std::span<T>>{et};
          }
        },
        std::span<T>(v));
    // Everything read and checked: now the device state.
    upload(residual_[committed_].data(), e);
    upload(momentum_[committed_].data(), u);
    upload(velocity_.data(), v);
    detail::cuda_check(cudaStreamSynchronize(stream()), "cudaStreamSynchronize");
    step_ = step;
    staged_ready_ = false;
    fixed_.agreed = false;  // graph_step agrees on the step again
  }

 private:
  static constexpr std::string_view driver_name = "device_sparsified_sgd";
  static constexpr unsigned threads = 256;
  static constexpr std::size_t max_blocks = 4096;
  // DGC's clipping: the blocks of each tensor's sum of squares (a fixed grid, so that the sums
  // are the same in every run).
  static constexpr unsigned clip_blocks = 256;

  // exchange_step's work, with draw_ set (or not) by the caller.
  void exchange_staged(device_span<const T> grads) {
    staged_ready_ = false;
    check_size("grads.size()", grads.size());
    const double rho = schedule_.at(step_);
    if constexpr (dense_gathered) {
      compress_dense(grads, rho);
      exchange_picks();
    } else if constexpr (dense_path) {
      compress_dense(grads, rho);
      exchange_dense();
    } else {
      compress(grads, rho);
      if constexpr (reduces_picks) {
        exchange_reduced_picks();
      } else if constexpr (tree_exchange) {
        exchange_tree();
      } else if constexpr (a2a_exchange) {
        exchange_a2a();
      } else {
        exchange_picks();
      }
    }
    staged_ready_ = true;
  }

  void require_staged(std::string_view where) const {
    if (!staged_ready_) {
      detail::throw_invalid_argument(where, "state", "no staged step",
                                     "a successful exchange_step() first");
    }
  }

  const step_stats& keep_staged() {
    committed_ ^= 1u;
    stats_ = std::move(staged_stats_);
    total_bytes_sent_ += stats_.bytes_sent;
    total_bytes_received_ += stats_.bytes_received;
    ++step_;
    staged_ready_ = false;
    return stats_;
  }

  void check_size(const char* what, std::size_t n) const {
    if (n != total_) {
      detail::throw_invalid_argument("device_sparsified_sgd::step", what, n,
                                     detail::concat("the total of the tensor sizes (", total_, ")"));
    }
  }

  // graph_step's verdict (every rank's) and this rank's refused received pick (its entry, or
  // cuda::no_error, and the flat index it held), read back at the end of the step.
  struct fixed_k_report {
    std::uint32_t verdict = 0;
    std::uint32_t own = 0;  // this rank's status word
    std::uint64_t detail[2] = {};
  };

  // Pinned host memory: a selection_stats per tensor, the two error records, graph_step's
  // report.
  std::size_t pinned_bytes() const {
    return stats_dev_.size() * sizeof(selection_stats) + 2 * sizeof(cuda::error_record) +
           sizeof(fixed_k_report);
  }
  fixed_k_report* report_host() const {
    return reinterpret_cast<fixed_k_report*>(pinned_.get() + stats_dev_.size() * sizeof(selection_stats) +
                                             2 * sizeof(cuda::error_record));
  }
  selection_stats* stats_host() const { return reinterpret_cast<selection_stats*>(pinned_.get()); }
  cuda::error_record* errors_host() const {
    return reinterpret_cast<cuda::error_record*>(pinned_.get() + stats_dev_.size() * sizeof(selection_stats));
  }

  // n zeros (no allocation for n = 0: the spans of an empty buffer are never read).
  void zeroed(device_buffer<T>& b, std::size_t n) {
    b.resize(n);
    if (n) {
      detail::cuda_check(cudaMemsetAsync(b.data(), 0, n * sizeof(T), stream()), "cudaMemsetAsync");
    }
  }
  device_span<T> staged_residual() const { return {residual_[committed_ ^ 1u].data(), total_}; }
  device_span<T> staged_momentum() const { return {momentum_[committed_ ^ 1u].data(), total_}; }
  device_span<T> staged_average() const { return {average_[committed_ ^ 1u].data(), total_}; }

  template <class U>
  std::vector<U> download(const U* p, std::size_t n) const {
    return detail::download_on(stream(), p, n);
  }
  template <class U>
  void upload(U* p, const std::vector<U>& v) const {
    detail::upload_on(stream(), p, v);
  }

  // Waits for what the stream has queued so far (the step's one event).
  void wait() const {
    detail::cuda_check(cudaEventRecord(event_.get(), stream()), "cudaEventRecord");
    detail::cuda_check(cudaEventSynchronize(event_.get()), "cudaEventSynchronize");
  }

  // Never empty: a temp_storage with a null pointer is a size query, not a call.
  void grow_scratch(std::size_t bytes) {
    bytes = std::max<std::size_t>(bytes, 256);
    if (bytes > scratch_.size()) scratch_.resize(bytes);
  }
  temp_storage scratch() const { return temp_storage{scratch_.data(), scratch_.size()}; }

  // The end of phase 1: the check's first non-finite value comes back (with what the stream
  // queued before it), the one wait; a non-finite gradient is refused in the exchange's first
  // collective, so that every rank learns of it and none waits for this one.
  void take_refusal() {
    detail::cuda_check(cudaMemcpyAsync(errors_host(), errors_dev_.data(), sizeof(cuda::error_record),
                                       cudaMemcpyDeviceToHost, stream()),
                       "cudaMemcpyAsync");
    wait();
    refusal_.clear();
    if (errors_host()[0].first != cuda::no_error) refusal_ = nonfinite_message(errors_host()[0].first);
  }

  // The step's count of each tensor (top-k's k at density rho, or every coordinate; for
  // threshold and Gaussian-k, until their counts come back, each tensor's size) into k_, then
  // set_layout().
  void set_counts(double rho) {
    const std::size_t nt = tensors_.size();
    k_.resize(nt);
    for (std::size_t t = 0; t < nt; ++t) {
      k_[t] = dense_path || variable_count ? tensors_[t].size
                                           : k_for_density(tensors_[t].size, rho);
    }
    set_layout();
  }

  // The running sums of k_ into k_at_ (where each tensor's picks start in picks_ and values_)
  // and, quantized, where each tensor's codes and side values start.
  void set_layout() {
    const std::size_t nt = tensors_.size();
    k_at_.assign(nt + 1, 0);
    for (std::size_t t = 0; t < nt; ++t) k_at_[t + 1] = k_at_[t] + k_[t];
    if constexpr (quantized) {
      bytes_at_.assign(nt + 1, 0);
      side_at_.assign(nt + 1, 0);
      for (std::size_t t = 0; t < nt; ++t) {
        const encoded_size z = device_encoded_size(compressor_.quantizer(), k_[t]);
        bytes_at_[t + 1] = bytes_at_[t] + z.packed_bytes;
        side_at_[t + 1] = side_at_[t] + z.side_count;
      }
    }
  }

  // Phase 1: the picks of every tensor into picks_ / values_, the residual staged. Top-k's
  // counts are known before the selection; threshold's and Gaussian-k's come back with the
  // statistics, so their picks are first written at each tensor's offset in the capacity
  // buffers, then packed.
  void compress(device_span<const T> grads, double rho) {
    const std::size_t nt = tensors_.size();
    set_counts(rho);
    size_compression(grads, rho);
    queue_compression(grads, rho);
    // threshold's and Gaussian-k's statistics came back in pack_selected (their counts are k_).
    if constexpr (!variable_count) {
      detail::cuda_check(cudaMemcpyAsync(stats_host(), stats_dev_.data(),
                                         nt * sizeof(selection_stats), cudaMemcpyDeviceToHost,
                                         stream()),
                         "cudaMemcpyAsync");
    }
    take_refusal();  // with the statistics: compression's one wait (threshold's and Gaussian-k's second)
    if constexpr (!variable_count) {
      for (std::size_t t = 0; t < nt; ++t) {
        detail::check_invariant(stats_host()[t].count == k_[t],
                                "device_sparsified_sgd: top-k picked k coordinates");
      }
    }
    reset_staged_stats(rho);
  }

  // A new step's statistics, before its tensors are added.
  void reset_staged_stats(double rho) {
    staged_stats_ = step_stats{};
    staged_stats_.step = step_;
    staged_stats_.target_density = rho;
    staged_stats_.n = total_;
  }

  // Phase 1's buffers for the counts in k_ (set_counts), and the scratch every call of
  // queue_compression needs (the size queries depend on n and k only). An empty tensor is
  // left out for top-k, Gaussian-k and Random-k (its statistics stay 0, the host's for
  // k = 0), not for threshold (whose statistics name tau whatever the size, as the host's).
  void size_compression(device_span<const T> grads, double rho) {
    const std::size_t nt = tensors_.size();
    const gradcomp::residual fb{};
    const device_span<T> e = staged_residual();
    if constexpr (variable_count) {
      cap_picks_.resize(std::max<std::size_t>(total_, 1));
      cap_values_.resize(std::max<std::size_t>(total_, 1));
    } else {
      size_outputs();
    }
    for (std::size_t t = 0; t < nt; ++t) {
      if (tensors_[t].size == 0 && !is_threshold) continue;
      temp_storage q;
      select_tensor(q, e, grads, t, rho);
      grow_scratch(q.bytes);
      q = temp_storage{};
      on_device(fb).gather_and_clear(q, tensor(e, t), selected_picks(t), stats_dev_.data() + t,
                                     selected_values(t), stream(), device_validation::trusted);
      grow_scratch(q.bytes);
      if constexpr (quantized && !variable_count) encode_own(t, rho, /*size_query=*/true);
    }
  }

  // Phase 1's work on the stream, sized by size_compression: the residual staged, every
  // tensor's picks and values (threshold and Gaussian-k: one wait for their counts, in
  // pack_selected), and the check of the picks (or of the flat e + g) for NaN and Inf into
  // errors_dev_[0]. Allocates nothing for top-k, unquantized (graph_step captures it).
  void queue_compression(device_span<const T> grads, double rho) {
    const cudaStream_t s = stream();
    const std::size_t nt = tensors_.size();
    // The picks gathered from e (DGC: v) and cleared there, as a residual's.
    const gradcomp::residual fb{};
    const device_span<T> e = staged_residual();
    if (nt) {
      detail::cuda_check(cudaMemsetAsync(stats_dev_.data(), 0, nt * sizeof(selection_stats), s),
                         "cudaMemsetAsync");
    }
    detail::cuda_check(cudaMemsetAsync(errors_dev_.data(), 0xff, 2 * sizeof(cuda::error_record), s),
                       "cudaMemsetAsync");
    if (total_) {
      if constexpr (is_dgc) {
        accumulate_dgc(grads);
      } else {
        detail::cuda_check(cudaMemcpyAsync(e.data(), residual_[committed_].data(),
                                           total_ * sizeof(T), cudaMemcpyDeviceToDevice, s),
                           "cudaMemcpyAsync");
        // threshold and Random-k select from e + g, added first (top-k and Gaussian-k add it
        // inside their selection pass).
        if constexpr (accumulates_first) {
          cuda::feedback_impl::launch_accumulate(e.data(), grads.data(), total_, s);
        }
      }
    }
    if constexpr (is_randomk) {
      // Every coordinate of e + g is checked, and the first non-finite one's value kept before
      // gather_and_clear zeroes the picks in e (the refusal's message names it); the verdict
      // comes back with the statistics, in compression's one wait. (DGC's accumulation checked
      // v and kept its value already.) The host draws the picks while the device works.
      if (total_ && !is_dgc) {
        cuda::step_impl::first_nonfinite_kernel<T>
            <<<cuda::grid_for(total_, threads, max_blocks), threads, 0, s>>>(e.data(), total_,
                                                                            errors_dev_.data());
        cuda::check_launch("first_nonfinite_kernel");
        cuda::step_impl::keep_reported_kernel<T><<<1, 1, 0, s>>>(e.data(), errors_dev_.data(),
                                                                 refused_value_.data());
        cuda::check_launch("keep_reported_kernel");
      }
      draw_random_picks(rho);
    }
    for (std::size_t t = 0; t < nt; ++t) {
      if (tensors_[t].size == 0 && !is_threshold) continue;
      temp_storage tmp = scratch();
      select_tensor(tmp, e, grads, t, rho);
      tmp = scratch();
      on_device(fb).gather_and_clear(tmp, tensor(e, t), selected_picks(t), stats_dev_.data() + t,
                                     selected_values(t), s, device_validation::trusted);
      if constexpr (!variable_count) {
        if constexpr (quantized) encode_own(t, rho, /*size_query=*/false);
        add_offset(t);
      }
    }
    if constexpr (variable_count) pack_selected(rho);
    const std::size_t picks = k_at_[nt];
    if constexpr (is_dgc) {
      // Momentum factor masking: u = 0 at the picks (now flat indices).
      if (picks) {
        cuda::step_impl::clear_at_kernel<T, std::uint32_t>
            <<<cuda::grid_for(picks, threads, max_blocks), threads, 0, s>>>(
                staged_momentum().data(), picks_.data(), picks);
        cuda::check_launch("clear_at_kernel");
      }
    }
    if constexpr (quantized) {
      // e = (e + g) - decoded at the picks (now flat indices), where gather_and_clear left 0.
      if (picks) {
        cuda::step_impl::keep_error_kernel<T, std::uint32_t>
            <<<cuda::grid_for(picks, threads, max_blocks), threads, 0, s>>>(
                e.data(), picks_.data(), values_.data(), decoded_.data(), picks);
        cuda::check_launch("keep_error_kernel");
      }
    }
    if (picks && !is_randomk && !is_dgc) {
      cuda::step_impl::first_nonfinite_kernel<T>
          <<<cuda::grid_for(picks, threads, max_blocks), threads, 0, s>>>(values_.data(), picks,
                                                                          errors_dev_.data());
      cuda::check_launch("first_nonfinite_kernel");
    }
  }

  // DGC: the staged u and v from the committed ones and g (dgc_momentum::accumulate_into's
  // operations), over the flat buffer at once or, clipping, tensor by tensor with its scale
  // (from two small reductions of its g: the host's rule, its sum of squares in another order,
  // which is exact where the squares add up exactly, as for multiples of 1/8, and otherwise may
  // differ in its last bit). The first non-finite v goes to errors_dev_[0] and its value to
  // refused_value_, before the picks are cleared.
  void accumulate_dgc(device_span<const T> grads) {
    const cudaStream_t s = stream();
    const dgc_momentum& fb = compressor_.feedback();
    const auto m = static_cast<T>(fb.momentum);
    const unsigned c = committed_, st = committed_ ^ 1u;
    const auto launch = [&](std::size_t at, std::size_t n, const T* scale) {
      cuda::step_impl::dgc_accumulate_kernel<T><<<cuda::grid_for(n, threads, max_blocks), threads, 0, s>>>(
          momentum_[st].data() + at, residual_[st].data() + at, momentum_[c].data() + at,
          residual_[c].data() + at, grads.data() + at, n, m, scale, at, errors_dev_.data());
      cuda::check_launch("dgc_accumulate_kernel");
    };
    if (fb.clip_norm > 0.0) {
      const std::size_t nt = tensors_.size();
      clip_scales_.resize(nt);
      clip_partials_.resize(nt * clip_blocks);
      for (std::size_t t = 0; t < nt; ++t) {
        const std::size_t n = tensors_[t].size;
        if (n == 0) continue;
        double* partial = clip_partials_.data() + t * clip_blocks;
        cuda::step_impl::square_sum_kernel<T, threads><<<clip_blocks, threads, 0, s>>>(
            grads.data() + offsets_[t], n, partial);
        cuda::check_launch("square_sum_kernel");
        cuda::step_impl::clip_scale_kernel<T, threads><<<1, threads, 0, s>>>(
            partial, clip_blocks, fb.clip_norm, clip_scales_.data() + t);
        cuda::check_launch("clip_scale_kernel");
        launch(offsets_[t], n, clip_scales_.data() + t);
      }
    } else {
      launch(0, total_, nullptr);
    }
    cuda::step_impl::keep_reported_kernel<T><<<1, 1, 0, s>>>(residual_[st].data(), errors_dev_.data(),
                                                             refused_value_.data());
    cuda::check_launch("keep_reported_kernel");
  }

  // The step's output buffers for the counts in k_ (picks, values, and what a quantizer needs).
  void size_outputs() {
    const std::size_t nt = tensors_.size();
    const std::size_t picks = k_at_[nt];
    picks_.resize(std::max<std::size_t>(picks, 1));
    values_.resize(std::max<std::size_t>(picks, 1));
    if constexpr (quantized) {
      packed_.resize(std::max<std::size_t>(bytes_at_[nt], 1));
      side_.resize(std::max<std::size_t>(side_at_[nt], 1));
      decoded_.resize(std::max<std::size_t>(picks, 1));
      // Random-k over dense_allreduce: the codes the allreduce adds (sized before any
      // collective, as every buffer of the step).
      if constexpr (reduces_picks) sums_.resize(std::max<std::size_t>(picks, 1));
    }
  }

  // Tensor t's selection from the staged residual: top-k's or Gaussian-k's of e + g with the
  // addition fused (e becomes e + g), or threshold's picks of e (already e + g). Gaussian-k's
  // target is k at density rho (k_[t] is its capacity, the tensor's size, until the counts
  // come back). Random-k's picks are already in place (draw_random_picks): only its
  // statistics, the host's (k, threshold 0), are written, for gather_and_clear to read.
  void select_tensor(temp_storage& tmp, device_span<T> e, device_span<const T> grads,
                     std::size_t t, double rho) {
    if constexpr (is_randomk) {
      if (tmp.is_size_query()) return;  // no scratch
      cuda::select_impl::write_stats_kernel<<<1, 1, 0, stream()>>>(stats_dev_.data() + t, k_[t],
                                                                    0.0, 0, false);
      cuda::check_launch("write_stats_kernel");
    } else if constexpr (is_threshold) {
      on_device(compressor_.selector())
          .select(tmp, device_span<const T>(tensor(e, t)), context(t, rho), selected_picks(t),
                  stats_dev_.data() + t, stream());
    } else if constexpr (is_dgc) {
      // Top-k of v, accumulated beforehand (accumulate_dgc).
      on_device(compressor_.selector())
          .select(tmp, device_span<const T>(tensor(e, t)), context(t, rho), selected_picks(t),
                  stats_dev_.data() + t, stream());
    } else {
      select_context ctx = context(t, rho);
      if constexpr (is_gaussiank) ctx.k = k_for_density(tensors_[t].size, rho);
      on_device(compressor_.selector())
          .select_accumulate(tmp, tensor(e, t), tensor(grads, t), ctx,
                             selected_picks(t), stats_dev_.data() + t, stream());
    }
  }

  // Where tensor t's selection writes its picks and values: their place in the step's buffers
  // (top-k, Random-k), or the tensor's own range of the capacity buffers (threshold,
  // Gaussian-k).
  device_span<std::uint32_t> selected_picks(std::size_t t) const {
    if constexpr (variable_count) return {cap_picks_.data() + offsets_[t], tensors_[t].size};
    return picks_of(t);
  }
  device_span<T> selected_values(std::size_t t) const {
    if constexpr (variable_count) return {cap_values_.data() + offsets_[t], tensors_[t].size};
    return values_of(t);
  }

  // Random-k: every tensor's k indices, the host's draw (randomk::draw, from the host step's
  // call_id: they do not depend on the values), into pinned memory at the tensor's place in
  // picks_, then one asynchronous copy into picks_, after which drawn_copied_ is recorded. The
  // pinned buffer is written or replaced only once the previous copy out of it is done (that
  // event; normally long past: the step that queued it waited after it, unless it threw first).
  void draw_random_picks(double rho) {
    const std::size_t nt = tensors_.size();
    const std::size_t picks = k_at_[nt];
    pick_hash_.assign(nt, 0);
    if (drawn_pending_) {
      detail::cuda_check(cudaEventSynchronize(drawn_copied_.get()), "cudaEventSynchronize");
      drawn_pending_ = false;
    }
    if (picks > drawn_capacity_) {
      void* p = nullptr;
      detail::cuda_check(cudaMallocHost(&p, picks * sizeof(std::uint32_t)), "cudaMallocHost");
      drawn_.reset(static_cast<std::byte*>(p));
      drawn_capacity_ = picks;
    }
    auto* drawn = reinterpret_cast<std::uint32_t*>(drawn_.get());
    for (std::size_t t = 0; t < nt; ++t) {
      randomk::draw(sampler_, tensors_[t].size, k_[t], context(t, rho).id, drawn + k_at_[t]);
      if constexpr (reduces_picks) {
        pick_hash_[t] = hash_of(tensors_[t].size, drawn + k_at_[t], k_[t]);
      }
    }
    if (picks) {  // else every tensor is empty (and drawn may be null: nothing is drawn)
      detail::cuda_check(cudaMemcpyAsync(picks_.data(), drawn, picks * sizeof(std::uint32_t),
                                         cudaMemcpyHostToDevice, stream()),
                         "cudaMemcpyAsync");
      const cudaError_t recorded = cudaEventRecord(drawn_copied_.get(), stream());
      if (recorded != cudaSuccess) cudaStreamSynchronize(stream());  // the copy done, or failed
      detail::cuda_check(recorded, "cudaEventRecord");
      drawn_pending_ = true;
    }
  }

  // A tensor's size n and picks (its own indices, before add_offset) as one number, which
  // ranks that would add their values at the same indices must agree on.
  static std::uint64_t hash_of(std::size_t n, const std::uint32_t* idx, std::size_t k) {
    std::uint64_t h = detail::mix64(detail::mix64(0x5bd1e995u ^ n) ^ k);
    for (std::size_t j = 0; j < k; ++j) h = detail::mix64(h ^ idx[j]);
    return h;
  }

  // Tensor t's picks (in picks_) become indices of the flat buffer.
  void add_offset(std::size_t t) {
    if (offsets_[t] == 0 || k_[t] == 0) return;
    cuda::step_impl::add_offset_kernel<std::uint32_t>
        <<<cuda::grid_for(k_[t], threads, max_blocks), threads, 0, stream()>>>(
            picks_of(t).data(), k_[t], static_cast<std::uint32_t>(offsets_[t]));
    cuda::check_launch("add_offset_kernel");
  }

  // threshold and Gaussian-k: the counts come back (one wait), become k_, and each tensor's
  // picks and values move from its range of the capacity buffers to its place in picks_ /
  // values_; then the offsets, and a quantizer's encoding.
  void pack_selected(double rho) {
    const cudaStream_t s = stream();
    const std::size_t nt = tensors_.size();
    detail::cuda_check(cudaMemcpyAsync(stats_host(), stats_dev_.data(),
                                       nt * sizeof(selection_stats), cudaMemcpyDeviceToHost, s),
                       "cudaMemcpyAsync");
    wait();
    for (std::size_t t = 0; t < nt; ++t) {
      const std::size_t c = stats_host()[t].count;
      detail::check_invariant(c <= tensors_[t].size,
                              "device_sparsified_sgd: the selection picked at most n coordinates");
      k_[t] = c;
    }
    set_layout();
    size_outputs();
    for (std::size_t t = 0; t < nt; ++t) {
      if (k_[t] == 0) continue;
      detail::cuda_check(
          cudaMemcpyAsync(picks_of(t).data(), cap_picks_.data() + offsets_[t],
                          k_[t] * sizeof(std::uint32_t), cudaMemcpyDeviceToDevice, s),
          "cudaMemcpyAsync");
      detail::cuda_check(cudaMemcpyAsync(values_of(t).data(), cap_values_.data() + offsets_[t],
                                         k_[t] * sizeof(T), cudaMemcpyDeviceToDevice, s),
                         "cudaMemcpyAsync");
    }
    if constexpr (quantized) {
      for (std::size_t t = 0; t < nt; ++t) encode_own(t, rho, /*size_query=*/true);
      for (std::size_t t = 0; t < nt; ++t) encode_own(t, rho, /*size_query=*/false);
    }
    for (std::size_t t = 0; t < nt; ++t) add_offset(t);
  }

  // Tensor t's picks (values_of(t)) encoded into its part of packed_ / side_ with the host
  // step's call_id, and decoded again into decoded_ (what every receiver will add, and what
  // the residual loses). With size_query, only the scratch both calls need.
  void encode_own(std::size_t t, double rho, bool size_query) {
    if (k_[t] == 0) return;
    const cudaStream_t s = stream();
    const auto q = on_device(compressor_.quantizer());
    const device_encoded enc = encoded_of(t);
    const device_span<const T> values = values_of(t);
    const device_span<float> decoded(decoded_.data() + k_at_[t], k_[t]);
    temp_storage tmp;
    if (size_query) {
      q.encode(tmp, values, context(t, rho).id, enc, s);
      grow_scratch(tmp.bytes);
      tmp = temp_storage{};
      q.decode(tmp, enc, decoded, s, device_validation::trusted);
      grow_scratch(tmp.bytes);
      return;
    }
    tmp = scratch();
    q.encode(tmp, values, context(t, rho).id, enc, s);
    tmp = scratch();
    q.decode(tmp, enc, decoded, s, device_validation::trusted);
  }

  // The first collective of phase 2: every rank's count for each tensor (k_) and its status
  // (1 where it refused its gradient, else 0) into counts_ (row r: rank r's). A rank that
  // refused fails the step on every rank: itself with its own refusal, the others naming it.
  // The same collective carries `extra` (as many values from every rank; topk_a2a's counts
  // for the shards' owners), every rank's into extras_ (row r: rank r's).
  void gather_counts_and_status(std::span<const std::uint64_t> extra = {}) {
    const std::size_t nt = tensors_.size();
    const auto ranks = static_cast<std::size_t>(comm_->size());
    const auto me = static_cast<std::size_t>(comm_->rank());
    mine_.assign(k_.begin(), k_.end());
    mine_.push_back(refusal_.empty() ? 0 : 1);
    mine_.insert(mine_.end(), extra.begin(), extra.end());
    comm_->gather_counts(std::span<const std::uint64_t>(mine_), counts_);
    const std::size_t row = nt + 1 + extra.size();
    for (std::size_t r = 0; r < ranks; ++r) {
      const std::size_t status = counts_[r * row + nt];
      if (status == 0) continue;
      if (r == me && status == 1) throw nonfinite_error(refusal_);
      throw communicator_error(detail::concat(
          "gradcomp::device_sparsified_sgd: rank ", r,
          status == 1 ? " refused its gradient (NaN or Inf, nonfinite_policy::error)"
                      : " sent an unknown status",
          "; the step changes nothing on any rank"));
    }
    if (extra.empty()) return;
    // Rows of nt + 1 in counts_, as every other reader expects.
    extras_.resize(ranks * extra.size());
    for (std::size_t r = 0; r < ranks; ++r) {
      std::copy_n(counts_.begin() + static_cast<std::ptrdiff_t>(r * row + nt + 1), extra.size(),
                  extras_.begin() + static_cast<std::ptrdiff_t>(r * extra.size()));
      if (r == 0) continue;  // row 0 is in place
      std::copy_n(counts_.begin() + static_cast<std::ptrdiff_t>(r * row), nt + 1,
                  counts_.begin() + static_cast<std::ptrdiff_t>(r * (nt + 1)));
    }
    counts_.resize(ranks * (nt + 1));
  }

  // After gather_counts_and_status: a count above its tensor's size is refused on every rank
  // (each holds the same counts) before anything is sized by it; each rank's total into
  // rank_total_.
  void check_counts_fit() {
    const std::size_t nt = tensors_.size();
    const auto ranks = static_cast<std::size_t>(comm_->size());
    rank_total_.assign(ranks, 0);
    for (std::size_t r = 0; r < ranks; ++r) {
      for (std::size_t t = 0; t < nt; ++t) {
        const std::size_t c = counts_[r * (nt + 1) + t];
        if (c > tensors_[t].size) {
          throw communicator_error(detail::concat(
              "gradcomp::device_sparsified_sgd: rank ", r, " announced ", c, " picks of tensor ",
              tensors_[t].id, "; allowed: at most its ", tensors_[t].size, " elements. Nothing "
              "was received"));
        }
        rank_total_[r] += c;
      }
    }
  }

  // Phase 2 with gtopk: the counts and statuses (each tensor's k: the largest count any rank
  // announced, as the host's), then the device tree (cuda::device_gtopk) over this rank's
  // picks and their values (decoded, where quantized): the staged average, and the picks left
  // out given back to the staged feedback.
  void exchange_tree() {
    const std::size_t nt = tensors_.size();
    const auto ranks = static_cast<std::size_t>(comm_->size());
    gather_counts_and_status();
    check_counts_fit();
    tree_k_.assign(nt, 0);
    for (std::size_t t = 0; t < nt; ++t) {
      for (std::size_t r = 0; r < ranks; ++r) {
        tree_k_[t] = std::max(tree_k_[t], counts_[r * (nt + 1) + t]);
      }
    }
    cuda::gtopk_step st;
    st.ids = ids_;
    st.offsets = offsets_;
    st.sizes = sizes_;
    st.k = tree_k_;
    st.mine_at = std::span<const std::size_t>(k_at_);
    st.picks = picks_.data();
    if constexpr (quantized) {
      st.values = decoded_.data();
    } else {
      st.values = values_.data();
    }
    st.feedback = staged_residual().data();
    st.average = staged_average().data();
    st.total = total_;
    tree_.run(*comm_, stream(), exchange_.values(), st, tree_results_);
    for (std::size_t t = 0; t < nt; ++t) {
      tensor_stats ts = selection_stats_of(t);
      // 8 bytes a count (and the status) in the first collective, then the tree's.
      ts.bytes_sent = 8 + tree_results_[t].bytes_sent;
      ts.bytes_received = 8 * (ranks - 1) + tree_results_[t].bytes_received;
      ts.restored = tree_results_[t].restored;
      ts.exchange = "gtopk";
      detail::add_tensor(staged_stats_, ts);
    }
    detail::finish_totals(staged_stats_);
  }

  // graph_step, before its work is queued (or captured): each tensor's k at density rho; where
  // it differs from the last agreed k (or none was), every rank's layout and k agreed (one
  // gather of counts and a wait: a rank that differs is refused on every rank, before anything
  // is sized by it), the table of the received segments and each k uploaded, the graphs
  // dropped, and every buffer and the scratch the step uses sized, so that nothing is
  // allocated while a capture runs. (They depend on n and k only, and grow only: step() at the
  // same k leaves them large enough.)
  void prepare_fixed_k(device_span<const T> grads, double rho) {
    const std::size_t nt = tensors_.size();
    const auto ranks = static_cast<std::size_t>(comm_->size());
    set_counts(rho);
    const std::size_t picks = k_at_[nt];
    if (!fixed_.agreed || fixed_.k != k_) {
      fixed_.agreed = false;
      fixed_.graphs[0] = {};
      fixed_.graphs[1] = {};
      agree_fixed_layout(picks);
      const std::size_t segments = ranks * nt;
      std::vector<std::uint64_t> seg_host(3 * segments + 1, 0);
      std::uint64_t* start = seg_host.data();
      std::uint64_t* lo = start + segments + 1;
      std::uint64_t* hi = lo + segments;
      for (std::size_t r = 0; r < ranks; ++r) {
        for (std::size_t t = 0; t < nt; ++t) {
          start[r * nt + t] = r * picks + k_at_[t];
          lo[r * nt + t] = offsets_[t];
          hi[r * nt + t] = offsets_[t] + tensors_[t].size;
        }
      }
      start[segments] = ranks * picks;
      fixed_.seg.resize(seg_host.size());
      upload(fixed_.seg.data(), seg_host);
      const std::vector<std::uint64_t> k_host(k_.begin(), k_.end());
      fixed_.kdev.resize(std::max<std::size_t>(nt, 1));
      upload(fixed_.kdev.data(), k_host);
      detail::cuda_check(cudaStreamSynchronize(stream()), "cudaStreamSynchronize");  // the tables
      fixed_.ones.assign(ranks, 1);
      fixed_.blocks.assign(ranks, picks);
      size_compression(grads, rho);
      recv_picks_.resize(std::max<std::size_t>(ranks * picks, 1));
      recv_values_.resize(std::max<std::size_t>(ranks * picks, 1));
      fixed_.words.resize(ranks + 2);
      fixed_.detail.resize(2);
      reserve_sum(ranks * picks);
      fixed_.k = k_;
      fixed_.agreed = true;
    }
  }

  // Every rank's total of picks and a hash of its layout, k, step and density schedule,
  // gathered (a wait); a rank whose either differs from this rank's is refused on every rank
  // (each compares every row). With the step and the schedule agreed, k changes at the same
  // step on every rank after it, so every rank comes back here at the same call.
  void agree_fixed_layout(std::size_t picks) {
    const std::size_t nt = tensors_.size();
    std::uint64_t h = detail::mix64(0x6a09e667u ^ nt);
    for (std::size_t t = 0; t < nt; ++t) {
      h = detail::mix64(h ^ tensors_[t].size);
      h = detail::mix64(h ^ k_[t]);
    }
    h = detail::mix64(h ^ step_);
    h = detail::mix64(h ^ std::bit_cast<std::uint64_t>(schedule_.final_density()));
    h = detail::mix64(h ^ schedule_.warmup_epochs());
    h = detail::mix64(h ^ schedule_.steps_per_epoch());
    mine_.assign({picks, h});
    comm_->gather_counts(std::span<const std::uint64_t>(mine_), counts_);
    const auto ranks = static_cast<std::size_t>(comm_->size());
    for (std::size_t r = 0; r < ranks; ++r) {
      if (counts_[2 * r] == picks && counts_[2 * r + 1] == h) continue;
      throw communicator_error(detail::concat(
          "gradcomp::device_sparsified_sgd::graph_step: rank ", r, " has ", counts_[2 * r],
          " picks in all and another layout, k, step or density schedule than this rank's (",
          picks, " picks); graph_step needs the same tensor sizes, step and density schedule "
          "on every rank. The step changes nothing on any rank"));
    }
  }

  // graph_step's work on the stream, nothing waited for here (the host communicators of
  // cuda::staged_comm wait inside their calls): compression (queue_compression), the status
  // word, the three gathers, the device check and verdict, the sum, the agreement on the
  // verdict and the update under it, and the copies of what the host reads. Allocates
  // nothing: prepare_fixed_k sized it all. The topk selector's settings are read here: a graph
  // keeps those it was captured with.
  void queue_fixed_k(device_span<T> params, device_span<const T> grads, double rho) {
    const cudaStream_t s = stream();
    const std::size_t nt = tensors_.size();
    const auto ranks = static_cast<std::size_t>(comm_->size());
    const std::size_t picks = k_at_[nt];
    const std::size_t received = ranks * picks;
    std::uint32_t* own = fixed_.words.data();
    std::uint32_t* all = own + 1;
    std::uint32_t* verdict = own + ranks + 1;
    queue_compression(grads, rho);
    cuda::step_impl::status_word_kernel<std::uint32_t><<<1, 1, 0, s>>>(
        errors_dev_.data(), stats_dev_.data(), fixed_.kdev.data(), nt, own);
    cuda::check_launch("status_word_kernel");
    comm_->allgatherv_known(device_span<const std::uint32_t>(own, 1),
                            device_span<std::uint32_t>(all, ranks),
                            std::span<const std::size_t>(fixed_.ones));
    comm_->allgatherv_known(device_span<const std::uint32_t>(picks_.data(), picks),
                            device_span<std::uint32_t>(recv_picks_.data(), received),
                            std::span<const std::size_t>(fixed_.blocks));
    comm_->allgatherv_known(device_span<const T>(values_.data(), picks),
                            device_span<T>(recv_values_.data(), received),
                            std::span<const std::size_t>(fixed_.blocks));
    if (received) {
      const std::size_t segments = ranks * nt;
      cuda::step_impl::validate_received_kernel<std::uint32_t>
          <<<cuda::grid_for(received, threads, max_blocks), threads, 0, s>>>(
              recv_picks_.data(), received, fixed_.seg.data(), fixed_.seg.data() + segments + 1,
              fixed_.seg.data() + 2 * segments + 1, static_cast<unsigned>(segments),
              errors_dev_.data() + 1);
      cuda::check_launch("validate_received_kernel");
    }
    cuda::step_impl::fixed_k_verdict_kernel<std::uint32_t><<<1, 1, 0, s>>>(
        all, static_cast<unsigned>(ranks), own, static_cast<unsigned>(comm_->rank()),
        errors_dev_.data() + 1, picks, recv_picks_.data(), verdict, fixed_.detail.data());
    cuda::check_launch("fixed_k_verdict_kernel");
    // Run whatever the verdict (a graph cannot skip it): an index out of range is never written
    // by the scatter-add, and a refused step's staged average is discarded.
    sum_received(received, 0, total_);
    comm_->allreduce(device_span<std::uint32_t>(verdict, 1), reduce_op::max);
    cuda::launch_sgd_update(params.data(), staged_average().data(), velocity_.data(), total_, opt_,
                            s, verdict);
    fixed_k_report* rep = report_host();
    if (nt) {
      detail::cuda_check(cudaMemcpyAsync(stats_host(), stats_dev_.data(),
                                         nt * sizeof(selection_stats), cudaMemcpyDeviceToHost, s),
                         "cudaMemcpyAsync");
    }
    detail::cuda_check(cudaMemcpyAsync(errors_host(), errors_dev_.data(),
                                       2 * sizeof(cuda::error_record), cudaMemcpyDeviceToHost, s),
                       "cudaMemcpyAsync");
    detail::cuda_check(cudaMemcpyAsync(&rep->verdict, verdict, sizeof(std::uint32_t),
                                       cudaMemcpyDeviceToHost, s),
                       "cudaMemcpyAsync");
    detail::cuda_check(cudaMemcpyAsync(&rep->own, own, sizeof(std::uint32_t),
                                       cudaMemcpyDeviceToHost, s),
                       "cudaMemcpyAsync");
    detail::cuda_check(cudaMemcpyAsync(rep->detail, fixed_.detail.data(), sizeof(rep->detail),
                                       cudaMemcpyDeviceToHost, s),
                       "cudaMemcpyAsync");
  }

  // graph_step over a device_graph_communicator: the graph of the committed state's parity,
  // launched; captured first where it was not yet for these buffers, this k and these selector
  // settings. The first call with a new key returns false without capturing, and the caller
  // runs that step uncaptured: a warm-up, so that the communicator's and CUB's first-call work
  // (NCCL's connections, kernel attributes) is done before any capture.
  bool launch_fixed_k_graph(device_span<T> params, device_span<const T> grads, double rho) {
    const cudaStream_t s = stream();
    const fixed_graph_key key{{params.data(), grads.data(), picks_.data(), values_.data(),
                               recv_picks_.data(), recv_values_.data(), scratch_.data(),
                               fixed_.seg.data(), fixed_.words.data(), fixed_.detail.data(),
                               fixed_.kdev.data()},
                              selector_settings()};
    fixed_graph& g = fixed_.graphs[committed_];
    if (!(g.key == key)) {
      g = {};
      g.key = key;
      return false;
    }
    if (!g.exec) {
      detail::cuda_check(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal),
                         "cudaStreamBeginCapture");
      cudaGraph_t graph = nullptr;
      try {
        queue_fixed_k(params, grads, rho);
      } catch (...) {
        cudaStreamEndCapture(s, &graph);  // ends the capture; its error is the one thrown
        if (graph) cudaGraphDestroy(graph);
        throw;
      }
      detail::cuda_check(cudaStreamEndCapture(s, &graph), "cudaStreamEndCapture");
      cudaGraphExec_t exec = nullptr;
      const cudaError_t made = cudaGraphInstantiate(&exec, graph, 0);
      cudaGraphDestroy(graph);
      detail::cuda_check(made, "cudaGraphInstantiate");
      g.exec.reset(exec);
      ++graph_captures_;
    }
    detail::cuda_check(cudaGraphLaunch(g.exec.get(), s), "cudaGraphLaunch");
    return true;
  }

  // The topk selector's settings as one number (a graph keeps those of its capture).
  std::uint64_t selector_settings() const {
    const topk& sel = compressor_.selector();
    std::uint64_t h = detail::mix64(std::bit_cast<std::uint64_t>(sel.sample_scale));
    for (const std::uint64_t x :
         {std::uint64_t{sel.min_sample}, std::uint64_t{sel.max_sample},
          std::bit_cast<std::uint64_t>(sel.bracket_sigmas), std::uint64_t{sel.bracket_margin},
          std::bit_cast<std::uint64_t>(sel.candidate_budget_factor),
          std::uint64_t{sel.min_candidate_budget}, std::uint64_t{sel.heap_max_k},
          static_cast<std::uint64_t>(sel.method)}) {
      h = detail::mix64(h ^ x);
    }
    return h;
  }

  // graph_step after its one wait: this rank's own refusal (a NaN or Inf in its picks), or
  // the verdict every rank holds, is thrown (nothing was updated: the update kernel read the
  // verdict), or the staged state is kept.
  const step_stats& finish_fixed_k(double rho) {
    const std::size_t nt = tensors_.size();
    const auto ranks = static_cast<std::size_t>(comm_->size());
    const std::size_t picks = k_at_[nt];
    const fixed_k_report rep = *report_host();
    if (errors_host()[0].first != cuda::no_error) {
      throw nonfinite_error(nonfinite_message(errors_host()[0].first));
    }
    detail::check_invariant(rep.own != 2, "device_sparsified_sgd: top-k picked k coordinates");
    if (rep.verdict > 3 * ranks) {
      throw communicator_error(detail::concat(
          "gradcomp::device_sparsified_sgd::graph_step: the ranks' verdicts reduced to ",
          rep.verdict, "; allowed: 0 to ", 3 * ranks, ". The step changes nothing on any rank"));
    }
    if (rep.verdict != 0) {
      const std::size_t r = ranks - 1 - (rep.verdict - 1) / 3;
      const unsigned kind = (rep.verdict - 1) % 3;
      if (kind == 2 && rep.detail[0] != cuda::no_error && picks && rep.detail[0] / picks == r) {
        const std::size_t within = rep.detail[0] % picks;
        const auto t = static_cast<std::size_t>(
            std::upper_bound(k_at_.begin(), k_at_.end(), within) - k_at_.begin() - 1);
        throw payload_error(detail::concat(
            "gradcomp::device_sparsified_sgd::graph_step: the picks of rank ", r, " for tensor ",
            tensors_[t].id, " are not a selection: its pick ", within - k_at_[t],
            " is flat index ", rep.detail[1], "; allowed: ascending and distinct, in [",
            offsets_[t], ", ", offsets_[t] + tensors_[t].size,
            ") (the tensor's range of the flat buffer). The step changes nothing on any rank"));
      }
      throw communicator_error(detail::concat(
          "gradcomp::device_sparsified_sgd::graph_step: rank ", r,
          kind == 0   ? " refused its gradient (NaN or Inf, nonfinite_policy::error)"
          : kind == 1 ? " sent an unknown status (or its selection failed)"
                      : "'s picks were refused by a rank that received them (not ascending, or "
                        "outside their tensor)",
          "; the step changes nothing on any rank"));
    }
    // (Each tensor's count is k: the status word said so before the update ran.)
    reset_staged_stats(rho);
    for (std::size_t t = 0; t < nt; ++t) {
      tensor_stats ts = selection_stats_of(t);
      ts.bytes_sent = 8 * k_[t] + (t == 0 ? 4 : 0);
      ts.bytes_received = (ranks - 1) * ts.bytes_sent;
      ts.exchange = "sparse_allgather";
      detail::add_tensor(staged_stats_, ts);
    }
    detail::finish_totals(staged_stats_);
    return keep_staged();
  }

  // Phase 2: every rank's picks into the staged average.
  void exchange_picks() {
    const std::size_t nt = tensors_.size();
    const auto ranks = static_cast<std::size_t>(comm_->size());
    const auto me = static_cast<std::size_t>(comm_->rank());
    gather_counts_and_status();
    check_counts_fit();
    if constexpr (dense_gathered) {
      require_own_counts("values", "sparse_allgather with the dense selector takes every "
                         "rank's whole tensor, so allowed: exactly its ", " elements");
    }
    std::size_t received = 0;
    for (const std::size_t c : rank_total_) received += c;
    // (Dense: every rank's picks are every coordinate, neither sent nor written.)
    if constexpr (!dense_gathered) recv_picks_.resize(std::max<std::size_t>(received, 1));
    recv_values_.resize(std::max<std::size_t>(received, 1));
    if constexpr (quantized) size_encoded();
    const std::size_t picks = k_at_[nt];
    if constexpr (!dense_gathered) {
      comm_->allgatherv_known(device_span<const std::uint32_t>(picks_.data(), picks),
                              device_span<std::uint32_t>(recv_picks_.data(), received),
                              std::span<const std::size_t>(rank_total_));
    }
    if constexpr (quantized) {
      gather_encoded();
    } else {
      comm_->allgatherv_known(device_span<const T>(values_.data(), picks),
                              device_span<T>(recv_values_.data(), received),
                              std::span<const std::size_t>(rank_total_));
    }
    if constexpr (!dense_gathered) validate_received(received);
    if constexpr (quantized) decode_received();

    if constexpr (dense_gathered) {
      // Rank r's values of the flat buffer at [r total, (r + 1) total): their sum in rank
      // order from 0, divided by P, in one pass (the host's order; no sort needed).
      if (total_) {
        cuda::step_impl::rank_sum_kernel<T><<<cuda::grid_for(total_, threads, max_blocks), threads, 0, stream()>>>(
            staged_average().data(), recv_values_.data(), total_, static_cast<unsigned>(ranks));
        cuda::check_launch("rank_sum_kernel");
      }
    } else {
      sum_received(received, 0, total_);
    }

    for (std::size_t t = 0; t < nt; ++t) {
      tensor_stats ts;
      if constexpr (dense_gathered) {
        ts = dense_stats_of(t);
      } else {
        ts = selection_stats_of(t);
      }
      ts.bytes_sent = wire_bytes(k_[t]);
      for (std::size_t r = 0; r < ranks; ++r) {
        if (r != me) ts.bytes_received += wire_bytes(counts_[r * (nt + 1) + t]);
      }
      ts.exchange = "sparse_allgather";
      detail::add_tensor(staged_stats_, ts);
    }
    detail::finish_totals(staged_stats_);
  }

  // The staged average's [from, from + n) = the mean over the ranks of the `received` picks
  // and values in recv_picks_ / recv_values_ (checked: every index inside that range), each
  // index's values added in the order received (the ranks' order) by the deterministic
  // sorted scatter-add into zeros, then divided by the number of ranks: sparse_allgather's
  // sum, and topk_a2a's over an owner's shard.
  void sum_received(std::size_t received, std::size_t from, std::size_t n) {
    const cudaStream_t s = stream();
    const device_span<T> avg = staged_average();
    if (n) {
      detail::cuda_check(cudaMemsetAsync(avg.data() + from, 0, n * sizeof(T), s), "cudaMemsetAsync");
    }
    if (received) {
      const device_span<const std::uint32_t> idx(recv_picks_.data(), received);
      const device_span<const float> val(recv_values_.data(), received);
      reserve_sum(received);
      temp_storage tmp = scratch();
      cuda::scatter_add_sorted(tmp, idx, val, avg, s, device_validation::trusted);
    }
    const auto ranks = static_cast<std::size_t>(comm_->size());
    if (ranks > 1 && n) {
      cuda::step_impl::average_kernel<T, T><<<cuda::grid_for(n, threads, max_blocks), threads, 0, s>>>(
          avg.data() + from, avg.data() + from, n, static_cast<T>(ranks));
      cuda::check_launch("average_kernel");
    }
  }

  // The scratch sum_received needs for `received` entries (a size query; allocated here, so
  // that a caller can do it before a collective after which a failure would be this rank's
  // alone).
  void reserve_sum(std::size_t received) {
    if (!received) return;
    temp_storage q;
    cuda::scatter_add_sorted(q, device_span<const std::uint32_t>(recv_picks_.data(), received),
                             device_span<const float>(recv_values_.data(), received),
                             staged_average(), stream(), device_validation::trusted);
    grow_scratch(q.bytes);
  }

  // Phase 2 with topk_a2a (one bucket: every tensor of the step): where each owner's picks
  // start (on the device, one wait), those counts gathered with the per-tensor counts and
  // statuses and checked as a matrix on every rank, the picks and their values (decoded,
  // where quantized) to their shards' owners, the owner's check of what it received and every
  // rank's verdict gathered, the owner's mean of its shard, and the shards gathered into the
  // staged average.
  void exchange_a2a() {
    const cudaStream_t s = stream();
    const std::size_t nt = tensors_.size();
    const auto ranks = static_cast<std::size_t>(comm_->size());
    const auto me = static_cast<std::size_t>(comm_->rank());
    const std::size_t picks = k_at_[nt];
    detail::check_invariant(picks < (std::uint64_t{1} << 32),
                            "device_sparsified_sgd: fewer than 2^32 picks (the constructor "
                            "keeps topk_a2a's total below 2^32)");
    a2a_bounds_.resize(ranks + 1);
    a2a_shards_.resize(ranks);
    for (std::size_t j = 0; j <= ranks; ++j) a2a_bounds_[j] = topk_a2a_shard_begin(total_, ranks, j);
    for (std::size_t j = 0; j < ranks; ++j) a2a_shards_[j] = a2a_bounds_[j + 1] - a2a_bounds_[j];
    a2a_dev_.resize(2 * (ranks + 1));
    upload(a2a_dev_.data(), a2a_bounds_);
    cuda::step_impl::split_by_shard_kernel<std::uint32_t>
        <<<cuda::grid_for(ranks + 1, threads, max_blocks), threads, 0, s>>>(
            picks_.data(), static_cast<std::uint32_t>(picks), a2a_dev_.data(),
            static_cast<unsigned>(ranks), a2a_dev_.data() + ranks + 1);
    cuda::check_launch("split_by_shard_kernel");
    const std::vector<std::uint64_t> cut = download(a2a_dev_.data() + ranks + 1, ranks + 1);
    a2a_send_.resize(ranks);
    for (std::size_t j = 0; j < ranks; ++j) a2a_send_[j] = cut[j + 1] - cut[j];

    gather_counts_and_status(std::span<const std::uint64_t>(a2a_send_));
    check_counts_fit();
    const std::string lie =
        check_topk_a2a_counts(std::span<const std::size_t>(extras_), rank_total_, total_);
    if (!lie.empty()) throw communicator_error(lie + ". Nothing was received");
    a2a_recv_.resize(ranks);
    std::size_t received = 0;
    for (std::size_t r = 0; r < ranks; ++r) {
      a2a_recv_[r] = extras_[r * ranks + me];
      received += a2a_recv_[r];
    }
    const std::span<const std::size_t> send_counts(extras_.data() + me * ranks, ranks);
    // No block is longer than the longest shard (check_topk_a2a_counts): a bound every rank
    // computes alike.
    const std::size_t block_limit = *std::max_element(a2a_shards_.begin(), a2a_shards_.end());
    recv_picks_.resize(std::max<std::size_t>(received, 1));
    recv_values_.resize(std::max<std::size_t>(received, 1));
    const T* values = values_.data();
    if constexpr (quantized) values = decoded_.data();
    const int short_picks = comm_->alltoallv_known(
        device_span<const std::uint32_t>(picks_.data(), picks), send_counts,
        device_span<std::uint32_t>(recv_picks_.data(), received), std::span<const std::size_t>(a2a_recv_),
        block_limit);
    const int short_values = comm_->alltoallv_known(
        device_span<const T>(values, picks), send_counts,
        device_span<T>(recv_values_.data(), received), std::span<const std::size_t>(a2a_recv_),
        block_limit);

    // The owner's verdict: 0, or 1 + the rank whose block it refused.
    std::string refused;
    std::uint64_t verdict = 0;
    const std::uint64_t begin = a2a_bounds_[me], end = a2a_bounds_[me + 1];
    if (short_picks >= 0 || short_values >= 0) {
      const int r = short_picks >= 0 ? short_picks : short_values;
      verdict = 1 + static_cast<std::uint64_t>(r);
      refused = detail::concat("gradcomp::device_sparsified_sgd (topk_a2a): malformed payload: "
                               "rank ", r, " sent a block of another size than the ",
                               a2a_recv_[static_cast<std::size_t>(r)], " picks it announced "
                               "for rank ", me, ". Nothing was written");
    } else if (received) {
      std::uint64_t* start = segment_table(ranks);
      std::uint64_t* lo = start + ranks + 1;
      std::uint64_t* hi = lo + ranks;
      for (std::size_t r = 0, at = 0; r < ranks; at += a2a_recv_[r], ++r) {
        start[r] = at;
        lo[r] = begin;
        hi[r] = end;
      }
      start[ranks] = received;
      const unsigned long long bad = first_bad_pick(received, ranks);
      if (bad != cuda::no_error) {
        const std::size_t r = segment_at(ranks, bad);
        const std::vector<std::uint32_t> got = download(recv_picks_.data() + bad, 1);
        verdict = 1 + r;
        refused = detail::concat(
            "gradcomp::device_sparsified_sgd (topk_a2a): malformed payload: rank ", r,
            " sent flat index ", got[0], " as its pick ", bad - start[r], " for rank ", me,
            "; allowed: ascending and distinct, in this rank's shard [", begin, ", ", end,
            "). Nothing was written");
      }
    }
    // (The owner's sum needs no allocation after the verdicts: a failure there would be this
    // rank's alone, with the others waiting in the gather of the shards.)
    reserve_sum(received);
    const std::uint64_t mine[] = {verdict};
    comm_->gather_counts(std::span<const std::uint64_t>(mine), a2a_verdicts_);
    if (!refused.empty()) throw payload_error(refused);
    for (std::size_t q = 0; q < ranks; ++q) {
      const std::size_t v = a2a_verdicts_[q];
      if (v == 0) continue;
      throw communicator_error(detail::concat(
          "gradcomp::device_sparsified_sgd (topk_a2a): rank ", q,
          v > ranks ? detail::concat(" sent the unknown verdict ", v, " on the picks it received")
                    : detail::concat(" refused the picks rank ", v - 1, " sent it (its own "
                                     "exception says why)"),
          "; no rank applied this exchange"));
    }

    // The owner's mean of its shard, then every shard into every rank's staged average.
    sum_received(received, begin, end - begin);
    const device_span<T> avg = staged_average();
    comm_->allgatherv_known(device_span<const T>(avg.data() + begin, end - begin), avg,
                            std::span<const std::size_t>(a2a_shards_));

    // The step's messages (the counts for the owners and the verdict, 8 bytes each; the pairs
    // to and from other ranks, 8 bytes each; this rank's shard out, the others' in), shared
    // among the tensors by size; each tensor's count on its own.
    const std::size_t pairs_out = picks - send_counts[me];
    const std::size_t pairs_in = received - a2a_recv_[me];
    const std::size_t sent = 8 * (ranks + 1) + 8 * pairs_out + sizeof(T) * (end - begin);
    const std::size_t got = 8 * (ranks + 1) * (ranks - 1) + 8 * pairs_in +
                            sizeof(T) * (total_ - (end - begin));
    a2a_sent_.resize(nt);
    a2a_got_.resize(nt);
    share_by_size(sizes_, sent, a2a_sent_);
    share_by_size(sizes_, got, a2a_got_);
    for (std::size_t t = 0; t < nt; ++t) {
      tensor_stats ts = selection_stats_of(t);
      ts.bytes_sent = 8 + a2a_sent_[t];
      ts.bytes_received = 8 * (ranks - 1) + a2a_got_[t];
      ts.exchange = "topk_a2a";
      detail::add_tensor(staged_stats_, ts);
    }
    detail::finish_totals(staged_stats_);
  }

  // Tensor t's statistics from its selection's (stats_host(), read back in phase 1).
  tensor_stats selection_stats_of(std::size_t t) const {
    const selection_stats& sel = stats_host()[t];
    tensor_stats ts;
    ts.id = tensors_[t].id;
    ts.n = tensors_[t].size;
    ts.selected = sel.count;
    ts.density = ts.n ? static_cast<double>(sel.count) / static_cast<double>(ts.n) : 0.0;
    ts.threshold = sel.threshold;
    ts.iterations = sel.iterations;
    ts.fallback = sel.fallback;
    return ts;
  }

  // What a tensor's c picks cost on the wire: an index and a value each (quantized: an index
  // each, the packed codes and the side values), and the count. Dense over sparse_allgather
  // sends no indices.
  std::size_t wire_bytes(std::size_t c) const {
    const std::size_t index_bytes = dense_gathered ? 0 : 4 * c;
    if constexpr (quantized) {
      const encoded_size z = device_encoded_size(compressor_.quantizer(), c);
      return index_bytes + z.packed_bytes + sizeof(float) * z.side_count + 8;
    } else {
      return index_bytes + 4 * c + 8;
    }
  }

  // The dense selector's statistics, as the host's: every coordinate (threshold 0, no
  // fallback, no iterations), and the contraction 1 (a dense payload keeps all of e + g).
  tensor_stats dense_stats_of(std::size_t t) const {
    tensor_stats ts;
    ts.id = tensors_[t].id;
    ts.n = tensors_[t].size;
    ts.selected = ts.n;
    ts.density = ts.n ? 1.0 : 0.0;
    ts.contraction = 1.0;
    return ts;
  }

  // Every rank's packed codes and side values: their sizes, computed from the gathered counts
  // (already checked against the tensor sizes) on every rank alike, and the receive buffers,
  // sized before the step's first transfer is queued.
  void size_encoded() {
    const std::size_t nt = tensors_.size();
    const std::size_t ranks = rank_total_.size();
    rank_bytes_.assign(ranks, 0);
    rank_side_.assign(ranks, 0);
    recv_bytes_ = recv_sides_ = 0;
    for (std::size_t r = 0; r < ranks; ++r) {
      for (std::size_t t = 0; t < nt; ++t) {
        const encoded_size z =
            device_encoded_size(compressor_.quantizer(), counts_[r * (nt + 1) + t]);
        rank_bytes_[r] += z.packed_bytes;
        rank_side_[r] += z.side_count;
      }
      recv_bytes_ += rank_bytes_[r];
      recv_sides_ += rank_side_[r];
    }
    recv_packed_.resize(std::max<std::size_t>(recv_bytes_, 1));
    recv_side_.resize(std::max<std::size_t>(recv_sides_, 1));
    decode_errors_.resize(std::max<std::size_t>(3 * ranks * nt, 1));
  }

  // The two allgathervs of them, into the buffers size_encoded() made.
  void gather_encoded() {
    const std::size_t nt = tensors_.size();
    comm_->allgatherv_known(device_span<const std::byte>(packed_.data(), bytes_at_[nt]),
                            device_span<std::byte>(recv_packed_.data(), recv_bytes_),
                            std::span<const std::size_t>(rank_bytes_));
    comm_->allgatherv_known(device_span<const float>(side_.data(), side_at_[nt]),
                            device_span<float>(recv_side_.data(), recv_sides_),
                            std::span<const std::size_t>(rank_side_));
  }

  // Every rank's tensors decoded, in the order of the received picks, into recv_values_. First
  // the decoder's checks (side values, padding, codes) of every rank's every tensor, its own
  // included, launched together and read back with one wait: a malformed one is refused on
  // every rank alike (each holds the same bytes), naming the first such rank and tensor, before
  // anything is decoded or the average written. Then the decodes, trusted.
  void decode_received() {
    const cudaStream_t s = stream();
    const std::size_t nt = tensors_.size();
    const std::size_t ranks = rank_total_.size();
    const auto q = on_device(compressor_.quantizer());
    namespace qi = cuda::quantize_impl;
    // Calls f(r, t, rule, in, out) for every rank's every tensor with picks, in received order.
    // Each segment's sizes are device_encoded_size's, as size_encoded() laid the receive
    // buffers out; the decoder's rule must expect the same.
    const auto each_segment = [&](auto&& f) {
      std::size_t at = 0, byte_at = 0, side_at = 0;
      for (std::size_t r = 0; r < ranks; ++r) {
        for (std::size_t t = 0; t < nt; ++t) {
          const std::size_t c = counts_[r * (nt + 1) + t];
          const qi::decode_rule rule = q.rule(c);
          const encoded_size z = device_encoded_size(compressor_.quantizer(), c);
          detail::check_invariant(
              z.packed_bytes == detail::packed_size(c, rule.bits) && z.side_count == rule.side_count,
              "device_sparsified_sgd: a segment's encoded size is the decoder's");
          const device_encoded_view in(
              device_span<const std::byte>(recv_packed_.data() + byte_at, z.packed_bytes),
              device_span<const float>(recv_side_.data() + side_at, z.side_count));
          if (c != 0) f(r, t, rule, in, device_span<float>(recv_values_.data() + at, c));
          at += c;
          byte_at += z.packed_bytes;
          side_at += z.side_count;
        }
      }
    };
    bool checked = false;
    const std::size_t records = 3 * ranks * nt;
    detail::cuda_check(cudaMemsetAsync(decode_errors_.data(), 0xff,
                                       records * sizeof(cuda::error_record), s),
                       "cudaMemsetAsync");
    each_segment([&](std::size_t r, std::size_t t, const qi::decode_rule& rule,
                     const device_encoded_view& in, device_span<float>) {
      checked = checked || qi::decode_can_fail(rule);
      qi::launch_decode_check(rule, in, decode_errors_.data() + 3 * (r * nt + t), s);
    });
    if (checked) {
      const std::vector<cuda::error_record> found = download(decode_errors_.data(), records);
      each_segment([&](std::size_t r, std::size_t t, const qi::decode_rule& rule,
                       const device_encoded_view&, device_span<float>) {
        try {
          qi::throw_decode_error(rule, found.data() + 3 * (r * nt + t));
        } catch (const payload_error& e) {
          throw payload_error(detail::concat(
              "gradcomp::device_sparsified_sgd: the quantized values of rank ", r, " for tensor ",
              tensors_[t].id, " are not a payload of this quantizer (", e.what(),
              "). Nothing was written"));
        }
      });
    }
    // Checked: the decodes need no more waits. (Their scratch: a size query, then the work.)
    for (const bool size_query : {true, false}) {
      each_segment([&](std::size_t, std::size_t, const qi::decode_rule&,
                       const device_encoded_view& in, device_span<float> out) {
        temp_storage tmp = size_query ? temp_storage{} : scratch();
        q.decode(tmp, in, out, s, device_validation::trusted);
        if (size_query) grow_scratch(tmp.bytes);
      });
    }
  }

  // Phase 1 of the dense path: values_ = e + g over the flat buffer (every tensor's coordinates
  // in order, k_ = the tensor sizes), the staged residual e + g - (e + g) = 0, as the host's
  // residual keeps after sending every coordinate; one check of the values for NaN and Inf
  // (queued after the encoding, which writes staged buffers only; read back before anything
  // is sent). Over dense_allreduce with fp16 or bf16, each value's code into sums_ (divided
  // by P first for fp16); over sparse_allgather with a quantizer, each tensor encoded and
  // decoded (encode_own); either way the staged residual e + g - decoded, as the host's.
  void compress_dense(device_span<const T> grads, double rho) {
    const cudaStream_t s = stream();
    set_counts(rho);
    values_.resize(std::max<std::size_t>(total_, 1));
    detail::cuda_check(cudaMemsetAsync(errors_dev_.data(), 0xff, 2 * sizeof(cuda::error_record), s),
                       "cudaMemsetAsync");
    if (total_) {
      detail::cuda_check(cudaMemcpyAsync(values_.data(), residual_[committed_].data(),
                                         total_ * sizeof(T), cudaMemcpyDeviceToDevice, s),
                         "cudaMemcpyAsync");
      cuda::feedback_impl::launch_accumulate(values_.data(), grads.data(), total_, s);
      if constexpr (dense_gathered && quantized) {
        // Every tensor's codes (the host encoder's, with the host step's call_id) and its own
        // decoded values; the residual keeps e + g - decoded.
        const std::size_t nt = tensors_.size();
        packed_.resize(std::max<std::size_t>(bytes_at_[nt], 1));
        side_.resize(std::max<std::size_t>(side_at_[nt], 1));
        decoded_.resize(total_);
        for (std::size_t t = 0; t < nt; ++t) encode_own(t, rho, /*size_query=*/true);
        for (std::size_t t = 0; t < nt; ++t) encode_own(t, rho, /*size_query=*/false);
        cuda::step_impl::subtract_kernel<T><<<cuda::grid_for(total_, threads, max_blocks), threads, 0, s>>>(
            staged_residual().data(), values_.data(), decoded_.data(), total_);
        cuda::check_launch("subtract_kernel");
      } else if constexpr (quantized) {
        sums_.resize(total_);
        encode_sums(values_.data(), staged_residual().data(), total_);
      } else {
        detail::cuda_check(cudaMemsetAsync(staged_residual().data(), 0, total_ * sizeof(T), s),
                           "cudaMemsetAsync");
      }
      cuda::step_impl::first_nonfinite_kernel<T>
          <<<cuda::grid_for(total_, threads, max_blocks), threads, 0, s>>>(values_.data(), total_,
                                                                          errors_dev_.data());
      cuda::check_launch("first_nonfinite_kernel");
    }
    take_refusal();
    staged_stats_ = step_stats{};
    staged_stats_.step = step_;
    staged_stats_.target_density = rho;
    staged_stats_.n = total_;
  }

  // x's codes into sums_ (fp16, bf16: the host's dense_allreduce's contributions) and, with e,
  // the residual's e = x - decoded.
  void encode_sums(const T* x, T* e, std::size_t n) {
    const float prescale = prescaled ? static_cast<float>(comm_->size()) : 0.0f;
    cuda::step_impl::summable_encode_kernel<sum_t, T>
        <<<cuda::grid_for(n, threads, max_blocks), threads, 0, stream()>>>(x, e, sums_.data(), n,
                                                                          prescale);
    cuda::check_launch("summable_encode_kernel");
  }

  // What the allreduce adds (values_, or the codes in sums_), and what its sum is divided by:
  // the number of ranks, or 1 where each code was divided before the sum (fp16).
  sum_t* allreduced() {
    if constexpr (quantized) {
      return sums_.data();
    } else {
      return values_.data();
    }
  }
  T sum_divisor() const {
    return prescaled ? T(1) : static_cast<T>(comm_->size());
  }

  // Phase 2 of the dense path: the counts and statuses (each rank must announce every tensor's
  // full size, refused on every rank before the allreduce otherwise), one allreduce of the
  // values (or codes), the division by the number of ranks into the staged average.
  void exchange_dense() {
    const cudaStream_t s = stream();
    const std::size_t nt = tensors_.size();
    const auto ranks = static_cast<std::size_t>(comm_->size());
    gather_counts_and_status();
    // (k_ holds every tensor's size here.)
    require_own_counts("values", "dense_allreduce adds every rank's whole tensor, so allowed: "
                       "exactly its ", " elements");
    if (total_) {
      comm_->allreduce(device_span<sum_t>(allreduced(), total_), reduce_op::sum);
      cuda::step_impl::average_kernel<T, sum_t><<<cuda::grid_for(total_, threads, max_blocks), threads, 0, s>>>(
          staged_average().data(), allreduced(), total_, sum_divisor());
      cuda::check_launch("average_kernel");
    }
    for (std::size_t t = 0; t < nt; ++t) {
      tensor_stats ts = dense_stats_of(t);
      // The reduced buffer (as the host's dense_allreduce counts it) and 8 bytes a count.
      ts.bytes_sent = sizeof(sum_t) * ts.n + 8;
      ts.bytes_received = sizeof(sum_t) * ts.n + 8 * (ranks - 1);
      ts.exchange = "dense_allreduce";
      detail::add_tensor(staged_stats_, ts);
    }
    detail::finish_totals(staged_stats_);
  }

  // The allreduce exchanges' check of the gathered counts: every rank must announce this
  // rank's count (k_) of every tensor, else every rank refuses the step (each holds the same
  // counts) before anything is reduced. The message: rank r announced c <what> of tensor id;
  // <rule><k_[t]><unit>.
  void require_own_counts(std::string_view what, std::string_view rule,
                          std::string_view unit) const {
    const std::size_t nt = tensors_.size();
    const auto ranks = static_cast<std::size_t>(comm_->size());
    for (std::size_t r = 0; r < ranks; ++r) {
      for (std::size_t t = 0; t < nt; ++t) {
        const std::size_t c = counts_[r * (nt + 1) + t];
        if (c != k_[t]) {
          throw communicator_error(detail::concat(
              "gradcomp::device_sparsified_sgd: rank ", r, " announced ", c, " ", what,
              " of tensor ", tensors_[t].id, "; ", rule, k_[t], unit, ". Nothing was ",
              dense_gathered ? "received" : "reduced"));
        }
      }
    }
  }

  // Phase 2 of Random-k over dense_allreduce: the counts and statuses (each rank must announce
  // this rank's k of every tensor), then each rank's hash of each tensor's picks (which must
  // be this rank's: a rank with another seed, step or layout would add its values at other
  // indices), both refused on every rank before the allreduce; one allreduce of the values
  // (every tensor's k, in the flat buffer's order), each sum divided by the number of ranks
  // at its index of the zeroed staged average. As the host's dense_allreduce: the sum, then
  // out[index] = sum / P. With fp16 or bf16 the codes are added (their decoded values, which
  // compression kept, encoded again: the same codes; fp16's divided by P first) and
  // out[index] = float(sum) (fp16) or float(sum) / P (bf16).
  void exchange_reduced_picks() {
    const cudaStream_t s = stream();
    const std::size_t nt = tensors_.size();
    const auto ranks = static_cast<std::size_t>(comm_->size());
    gather_counts_and_status();
    require_own_counts("picks", "dense_allreduce adds every rank's Random-k values at the same "
                       "indices, so allowed: exactly this rank's ", "");
    comm_->gather_counts(std::span<const std::uint64_t>(pick_hash_), hashes_);
    for (std::size_t r = 0; r < ranks; ++r) {
      for (std::size_t t = 0; t < nt; ++t) {
        if (hashes_[r * nt + t] != pick_hash_[t]) {
          throw communicator_error(detail::concat(
              "gradcomp::device_sparsified_sgd: rank ", r, " picked other Random-k indices of "
              "tensor ", tensors_[t].id, " than this rank (another seed, step or layout); "
              "dense_allreduce adds the values at indices every rank shares, so allowed: the "
              "same indices on every rank. Nothing was reduced"));
        }
      }
    }
    const std::size_t picks = k_at_[nt];
    const device_span<T> avg = staged_average();
    if (total_) {
      detail::cuda_check(cudaMemsetAsync(avg.data(), 0, total_ * sizeof(T), s), "cudaMemsetAsync");
    }
    if (picks) {
      if constexpr (quantized) encode_sums(decoded_.data(), nullptr, picks);
      comm_->allreduce(device_span<sum_t>(allreduced(), picks), reduce_op::sum);
      cuda::step_impl::scatter_divide_kernel<T, std::uint32_t, sum_t>
          <<<cuda::grid_for(picks, threads, max_blocks), threads, 0, s>>>(
              avg.data(), picks_.data(), allreduced(), picks, sum_divisor());
      cuda::check_launch("scatter_divide_kernel");
    }
    for (std::size_t t = 0; t < nt; ++t) {
      tensor_stats ts = selection_stats_of(t);
      // The reduced values or codes (as the host's dense_allreduce counts them), 8 bytes a
      // count and 8 a hash.
      ts.bytes_sent = sizeof(sum_t) * k_[t] + 16;
      ts.bytes_received = sizeof(sum_t) * k_[t] + 16 * (ranks - 1);
      ts.exchange = "dense_allreduce";
      detail::add_tensor(staged_stats_, ts);
    }
    detail::finish_totals(staged_stats_);
  }

  // Each rank's picks of each tensor: ascending, inside the tensor's range of the flat buffer.
  void validate_received(std::size_t received) {
    if (!received) return;
    const std::size_t nt = tensors_.size();
    const std::size_t ranks = rank_total_.size();
    const std::size_t segments = ranks * nt;
    std::uint64_t* start = segment_table(segments);
    std::uint64_t* lo = start + segments + 1;
    std::uint64_t* hi = lo + segments;
    for (std::size_t r = 0, at = 0; r < ranks; ++r) {
      for (std::size_t t = 0; t < nt; ++t) {
        const std::size_t sgm = r * nt + t;
        start[sgm] = at;
        lo[sgm] = offsets_[t];
        hi[sgm] = offsets_[t] + tensors_[t].size;
        at += counts_[r * (nt + 1) + t];
      }
    }
    start[segments] = received;
    const unsigned long long bad = first_bad_pick(received, segments);
    if (bad == cuda::no_error) return;
    const std::size_t sgm = segment_at(segments, bad);
    const std::size_t r = sgm / nt, t = sgm % nt;
    const std::vector<std::uint32_t> got = download(recv_picks_.data() + bad, 1);
    throw payload_error(detail::concat(
        "gradcomp::device_sparsified_sgd: the picks of rank ", r, " for tensor ", tensors_[t].id,
        " are not a selection: its pick ", bad - start[sgm], " is flat index ", got[0],
        "; allowed: ascending and distinct, in [", lo[sgm], ", ", hi[sgm],
        ") (the tensor's range of the flat buffer). Nothing was written"));
  }

  // The table of received segments in seg_host_, zeroed: start[0..segments] (the caller sets
  // each segment's first entry and, last, the number received), then lo[segments] and
  // hi[segments] (the range each segment's picks must lie in). Returns start.
  std::uint64_t* segment_table(std::size_t segments) {
    seg_host_.assign(3 * segments + 1, 0);
    return seg_host_.data();
  }
  // The segment of received entry j in segment_table's table.
  std::size_t segment_at(std::size_t segments, std::uint64_t j) const {
    std::size_t sgm = 0;
    while (sgm + 1 < segments && seg_host_[sgm + 1] <= j) ++sgm;
    return sgm;
  }

  // The first of the `received` picks in recv_picks_ that is outside its segment's range or
  // not above the one before it in the segment (segment_table's table), or cuda::no_error;
  // one wait.
  unsigned long long first_bad_pick(std::size_t received, std::size_t segments) {
    const cudaStream_t s = stream();
    seg_dev_.resize(seg_host_.size());
    upload(seg_dev_.data(), seg_host_);
    cuda::step_impl::validate_received_kernel<std::uint32_t>
        <<<cuda::grid_for(received, threads, max_blocks), threads, 0, s>>>(
            recv_picks_.data(), received, seg_dev_.data(), seg_dev_.data() + segments + 1,
            seg_dev_.data() + 2 * segments + 1, static_cast<unsigned>(segments),
            errors_dev_.data() + 1);
    cuda::check_launch("validate_received_kernel");
    detail::cuda_check(cudaMemcpyAsync(errors_host() + 1, errors_dev_.data() + 1,
                                       sizeof(cuda::error_record), cudaMemcpyDeviceToHost, s),
                       "cudaMemcpyAsync");
    wait();
    return errors_host()[1].first;
  }

  // Phase 3: params -= lr * update.
  void update(device_span<T> params, device_span<const T> g) {
    cuda::launch_sgd_update(params.data(), g.data(), velocity_.data(), total_, opt_, stream());
  }

  // What a non-finite pick at position j of the step's picks is refused with. Where the check
  // reads the flat e + g (checks_flat_values), position j is flat index j: the dense path's
  // values_ are the whole flat buffer; Random-k's check reads the staged residual e + g, and
  // DGC's v, whose refused value compress() or accumulate_dgc kept in refused_value_ before
  // gather_and_clear could zero it.
  std::string nonfinite_message(unsigned long long j) const {
    std::size_t flat = static_cast<std::size_t>(j);
    std::size_t t = 0;
    std::vector<T> value;
    if constexpr (checks_flat_values) {
      t = static_cast<std::size_t>(std::upper_bound(offsets_.begin(), offsets_.end(), flat) -
                                   offsets_.begin() - 1);
      if constexpr (is_dgc || is_randomk) {
        value = download(refused_value_.data(), 1);  // kept by accumulate_dgc or compress
      } else {
        value = download((dense_path ? values_.data() : staged_residual().data()) + j, 1);
      }
    } else {
      t = static_cast<std::size_t>(
          std::upper_bound(k_at_.begin(), k_at_.end(), static_cast<std::size_t>(j)) -
          k_at_.begin() - 1);
      value = download(values_.data() + j, 1);
      flat = std::size_t{download(picks_.data() + j, 1)[0]};
    }
    return detail::concat(
        "gradcomp::device_sparsified_sgd::step: the gradient or the accumulated gradient "
        "(feedback state + gradient) of tensor ", tensors_[t].id, " holds ", value[0],
        " at index ", flat - offsets_[t],
        "; nonfinite_policy::error (the default) rejects it before any state changes, on "
        "every rank");
  }

  template <class U>
  static device_span<U> tensor_of(device_span<U> all, std::size_t at, std::size_t n) {
    return device_span<U>(all.data() + at, n);
  }
  template <class U>
  device_span<U> tensor(device_span<U> all, std::size_t t) const {
    return tensor_of(all, offsets_[t], tensors_[t].size);
  }
  device_span<std::uint32_t> picks_of(std::size_t t) const {
    return {picks_.data() + k_at_[t], k_[t]};
  }
  device_span<T> values_of(std::size_t t) const { return {values_.data() + k_at_[t], k_[t]}; }
  device_encoded encoded_of(std::size_t t) const {
    return {device_span<std::byte>(packed_.data() + bytes_at_[t], bytes_at_[t + 1] - bytes_at_[t]),
            device_span<float>(side_.data() + side_at_[t], side_at_[t + 1] - side_at_[t])};
  }
  select_context context(std::size_t t, double rho) const {
    if (draw_) {
      return select_context{k_[t], rho,
                            call_id{draw_->seed, draw_->step, tensors_[t].id, draw_->rank}};
    }
    return select_context{k_[t], rho,
                          call_id{opt_.seed, step_, tensors_[t].id,
                                  static_cast<std::uint32_t>(comm_->rank())}};
  }

  Comm* comm_;
  std::vector<tensor_spec> tensors_;
  std::vector<std::size_t> offsets_;
  std::vector<std::uint32_t> ids_;    // tensors_' ids and sizes, as spans for gtopk and topk_a2a
  std::vector<std::size_t> sizes_;
  std::size_t total_ = 0;
  Compressor compressor_;
  Exchange exchange_;
  sgd_options opt_;
  density_schedule schedule_;
  // [committed_]: the state; [committed_ ^ 1]: what a step in flight writes.
  device_buffer<T> residual_[2];  // e (with dgc_momentum: v)
  device_buffer<T> momentum_[2];  // dgc_momentum's u (else empty)
  device_buffer<T> average_[2];
  unsigned committed_ = 0;
  device_buffer<T> velocity_;
  // Per step, reused.
  std::vector<std::size_t> k_, k_at_;
  device_buffer<std::uint32_t> picks_;
  device_buffer<T> values_;
  device_buffer<selection_stats> stats_dev_;
  device_buffer<cuda::error_record> errors_dev_;
  device_buffer<std::byte> scratch_;
  std::vector<std::uint64_t> mine_;
  std::string refusal_;  // this step's non-finite gradient, or empty
  std::vector<std::size_t> counts_, rank_total_;
  device_buffer<std::uint32_t> recv_picks_;
  device_buffer<T> recv_values_;
  // Quantized top-k: this rank's codes and side values (tensor t's at bytes_at_[t] and
  // side_at_[t]), its own decoded picks, and every rank's codes and side values received.
  std::vector<std::size_t> bytes_at_, side_at_, rank_bytes_, rank_side_;
  std::size_t recv_bytes_ = 0, recv_sides_ = 0;  // the sums of rank_bytes_ and rank_side_
  device_buffer<std::byte> packed_, recv_packed_;
  device_buffer<float> side_, recv_side_, decoded_;
  // fp16 and bf16 over dense_allreduce: the codes the allreduce adds.
  device_buffer<sum_t> sums_;
  device_buffer<cuda::error_record> decode_errors_;  // 3 per rank and tensor
  // threshold and Gaussian-k: each tensor's picks and values at its offset, before they are
  // packed.
  device_buffer<std::uint32_t> cap_picks_;
  device_buffer<T> cap_values_;
  std::vector<std::uint64_t> seg_host_;
  device_buffer<std::uint64_t> seg_dev_;
  // topk_a2a: every rank's counts for the shards' owners (row r: rank r's, from
  // gather_counts_and_status), the shards' bounds and lengths, this rank's counts out and in,
  // the verdicts, the device's bounds and cuts, each tensor's share of the bytes.
  std::vector<std::size_t> extras_;
  std::vector<std::uint64_t> a2a_bounds_, a2a_send_;
  std::vector<std::size_t> a2a_shards_, a2a_recv_, a2a_verdicts_, a2a_sent_, a2a_got_;
  device_buffer<std::uint64_t> a2a_dev_;
  // gtopk: the device tree, each tensor's k, and what the tree cost and restored.
  cuda::device_gtopk tree_;
  std::vector<std::size_t> tree_k_;
  std::vector<cuda::gtopk_tensor_result> tree_results_;
  // DGC: each tensor's clipping scale and its partial sums of squares; the value of a refused
  // (non-finite) v.
  device_buffer<T> clip_scales_;
  device_buffer<double> clip_partials_;
  device_buffer<T> refused_value_;
  struct free_pinned {
    void operator()(std::byte* p) const noexcept { cudaFreeHost(p); }
  };
  struct destroy_event {
    void operator()(cudaEvent_t e) const noexcept { cudaEventDestroy(e); }
  };
  std::unique_ptr<std::byte, free_pinned> pinned_;
  // Random-k: the step's draws (pinned, drawn_capacity_ indices) and Floyd's scratch.
  std::unique_ptr<std::byte, free_pinned> drawn_;
  std::size_t drawn_capacity_ = 0;
  // Recorded after the copy out of drawn_; drawn_pending_ until a later step has waited for it.
  std::unique_ptr<std::remove_pointer_t<cudaEvent_t>, destroy_event> drawn_copied_;
  bool drawn_pending_ = false;
  detail::floyd_sampler sampler_;
  std::vector<std::uint64_t> pick_hash_;  // this rank's hash of each tensor's picks
  std::vector<std::size_t> hashes_;       // every rank's (Random-k over dense_allreduce)
  static_assert(sizeof(std::size_t) == sizeof(std::uint64_t), "the hashes come back as size_t");
  std::unique_ptr<std::remove_pointer_t<cudaEvent_t>, destroy_event> event_;
  // graph_step: the k agreed on with every rank, the block counts of its gathers, the table of
  // the received segments (host and device), the status words and verdict ([0] this rank's,
  // [1, P] every rank's, [P + 1] the verdict), the refused pick, and a captured graph per
  // parity of committed_, with the buffers it was captured on.
  struct destroy_graph_exec {
    void operator()(cudaGraphExec_t g) const noexcept { cudaGraphExecDestroy(g); }
  };
  struct fixed_graph_key {
    const void* at[11] = {};
    std::uint64_t settings = 0;
    bool operator==(const fixed_graph_key&) const = default;
  };
  struct fixed_graph {
    std::unique_ptr<std::remove_pointer_t<cudaGraphExec_t>, destroy_graph_exec> exec;
    fixed_graph_key key;
  };
  struct fixed_k_state {
    bool agreed = false;
    std::vector<std::size_t> k, ones, blocks;
    device_buffer<std::uint64_t> seg, kdev;  // the segment table, each tensor's k
    device_buffer<std::uint32_t> words;
    device_buffer<std::uint64_t> detail;
    fixed_graph graphs[2];
  };
  fixed_k_state fixed_;
  bool capture_ = true;
  std::size_t graph_captures_ = 0;
  step_stats stats_;
  step_stats staged_stats_;
  bool staged_ready_ = false;
  std::uint64_t step_ = 0;
  std::optional<call_id> draw_;  // exchange_step(grads, draw)'s, while its exchange runs
  std::size_t total_bytes_sent_ = 0;
  std::size_t total_bytes_received_ = 0;
};

}  // namespace gradcomp
