// python/src/cuda_engine.hpp: gradcomp.torch's engine for CUDA buckets (CudaEngine), built into
// _torch_ext where the torch it is built against has CUDA (setup.py defines
// GRADCOMP_TORCH_CUDA). The same contract as the host engine (runtime::bucket_engine, Engine
// in torch_ext.cpp), so that gradcomp.torch's state, bucket tracking and checkpoints drive
// either: run() writes the mean over ranks over the bucket, the new feedback state waits for
// commit(), discard() forgets it, state()/set_state() move it through CPU tensors. The
// commit and discard are the host drivers' transaction, by bucket id as in the host engine
// (detail::bucket_slots), over device tensors: each bucket keeps a committed and a staged
// residual, a step writes the staged one from the committed one, and commit() swaps the two.
//
// A bucket stays on the device from end to end: the residual feedback and the top-k selection
// (one fused pass adds the gradient into a copy of the feedback state), the gather of the
// picked values, the exchange of (index, value) pairs over the process group with CUDA tensors
// (alltoall_base, which NCCL and gloo both take with uneven splits), and the rank-order mean,
// bit for bit the host's. The host sees one small copy per bucket (the selection's
// statistics and the energies, for the non-finite check and the contraction), the bucket's
// agreement (runtime::settle_bucket: a rank that fails still takes part, every rank learns of
// it) and the ranks' pick counts.
//
// Streams: every kernel and torch operation runs on the stream that is current when run() is
// called (set_stream() passes its handle for gradcomp's kernels; torch's operations use it as
// the current stream), so the caller orders the bucket after the backward pass that filled it.
//
// So far the CUDA path runs selector 'topk', 'gaussiank', 'gaussiank_published', 'threshold'
// or 'randomk' with feedback 'residual' or 'dgc' (DGC's momentum correction, with 'topk', with
// its clipping by the bucket's L2 norm where dgc_clip_norm > 0) and exchange 'allgather'
// (sparsified SGD with error feedback, or TopK-SGD with DGC, the picked values sent as floats
// or 16-bit codes), and selector 'dense' with feedback 'residual' and exchange 'allreduce'
// (every coordinate's code, added in rank order on the device as process_group_comm adds them:
// exchange_dense), each with quantizer 'fp32', 'fp16' or 'bf16'; any other configuration is
// refused when the engine is made, naming what is allowed. Top-k and threshold pick the
// host's index set, and Random-k's picks are the host's own draw. Gaussian-k's statistics
// are summed on the device in another order than the host's, so its threshold differs from
// the host's in the last bits, and where a count lands on the other side of a band edge the
// two take different corrections: its picks are not the host's (the device's own result is
// the same in every run). With 'dgc' a bucket's state is u and v, kept as one tensor of 2 n
// (u, then v) per slot. With fp16 or bf16 the picks' values are encoded on the device after
// the statistics, decoded again, and the feedback keeps what the codes lost (e, or v, = value
// - decoded at the picks), as the host's compressor does; the ranks send (index, code) pairs
// of 6 bytes and every rank decodes all of them before the mean.
#pragma once

#ifdef GRADCOMP_TORCH_CUDA

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/types.h>

#include <gradcomp/context.hpp>
#include <gradcomp/detail/comm_common.hpp>
#include <gradcomp/detail/nonfinite.hpp>
#include <gradcomp/engine/staged_feedback.hpp>
#include <gradcomp/error.hpp>
#include <gradcomp/runtime/bucket_engine.hpp>
#include <gradcomp/runtime/registry.hpp>
#include <gradcomp/select/gaussiank.hpp>
#include <gradcomp/select/randomk.hpp>
#include <gradcomp/select/threshold.hpp>
#include <gradcomp/select/topk.hpp>
#include <gradcomp/torch/process_group.hpp>
#include <gradcomp/torch/tensor.hpp>

#include "cuda_bucket.hpp"

namespace gradcomp::torch_cuda {

namespace rt = gradcomp::runtime;

// Refuses a configuration the CUDA path does not run, naming what it runs.
inline void check_cuda_config(const rt::engine_config& c) {
  const bool quantizer = c.quantizer == "fp32" || c.quantizer == "fp16" || c.quantizer == "bf16";
  const bool feedback = c.feedback == "residual" || c.feedback == "dgc";
  const bool selector = c.selector == "topk" || c.selector == "gaussiank" ||
                        c.selector == "gaussiank_published" || c.selector == "threshold" ||
                        c.selector == "randomk";
  const bool sparse = selector && feedback && c.exchange == "allgather";
  const bool dense = c.selector == "dense" && c.feedback == "residual" && c.exchange == "allreduce";
  if (!quantizer || !(sparse || dense)) {
    throw invalid_argument(detail::concat(
        "gradcomp: CUDA buckets run selector 'topk', 'gaussiank', 'gaussiank_published', "
        "'threshold' or 'randomk' with feedback 'residual' or 'dgc' (with 'topk') and exchange "
        "'allgather', or selector 'dense' with feedback 'residual' and exchange 'allreduce', "
        "each with quantizer 'fp32', 'fp16' or 'bf16', so far; this state has selector '",
        c.selector, "', quantizer '", c.quantizer, "', feedback '", c.feedback, "', exchange '",
        c.exchange, "' (allowed on CUDA: those; every combination runs on CPU buckets)"));
  }
}

class cuda_engine {
 public:
  // `device`: the CUDA device index the buckets live on.
  cuda_engine(c10::intrusive_ptr<c10d::ProcessGroup> group, rt::engine_config config, int device)
      : config_(checked(std::move(config))),
        device_(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device))),
        // The agreement and the counts are a few bytes through the host; over a backend that
        // moves CUDA tensors only (NCCL) they are staged through the device.
        comm_(group, group->getBackendName() == "gloo" ? std::optional<c10::Device>()
                                                       : std::optional<c10::Device>(device_)) {
    rt::with_selector(config_, [&](auto s) {
      using S = decltype(s);
      if constexpr (std::is_same_v<S, topk> || std::is_same_v<S, gaussiank> ||
                    std::is_same_v<S, threshold> || std::is_same_v<S, randomk>) {
        sel_ = s;
      }
    });
  }

  // The stream gradcomp's kernels run on (cudaStream_t as an integer; 0: the legacy default
  // stream), the one current in torch when run() is called.
  void set_stream(std::uintptr_t stream) { stream_ = reinterpret_cast<cudaStream_t>(stream); }

  // The host engine's run(): g (a contiguous float32 CUDA tensor on the engine's device) is
  // compressed with bucket `bucket`'s feedback state, exchanged, and overwritten with the mean
  // over ranks; the new feedback state waits for commit().
  tensor_stats run(std::int64_t bucket, const at::Tensor& g, std::uint64_t step, double density,
                   std::span<const rt::tensor_label> labels) {
    using clock = std::chrono::steady_clock;
    if (bucket < 0 || bucket > std::int64_t{0xffffffff}) {
      detail::throw_invalid_argument("CudaEngine.run", "bucket", bucket, "0 <= bucket < 2^32");
    }
    check_bucket(g);
    if (step != pending_step_) feedback_.discard();
    pending_step_ = step;
    skipped_ = false;
    const auto id = static_cast<std::uint32_t>(bucket);
    const std::size_t n = static_cast<std::size_t>(g.numel());
    const auto t0 = clock::now();

    rt::bucket_record mine{step, id, rt::bucket_outcome::ok, {}};
    std::exception_ptr local;
    std::size_t slot = 0;
    at::Tensor indices, values, codes;
    selection_stats sel_stats;
    double kept = 0.0, rest = 0.0;
    std::size_t k = 0;
    auto t_encode = t0;  // when the selection's statistics were back (then the codes were made)
    try {
      k = k_for_density(n, density);
      // The bucket's new feedback state: its staged residual, from the committed one (a
      // second run of a bucket in one step, which the hook never does, replaces the first).
      slot = slot_for(bucket, n);
      feedback_.stage(slot, false);
      // The residual's e (a copy of the committed one, then compressed in place), or DGC's v
      // (written from the committed u and v).
      at::Tensor& staged = feedback_.staged(slot);
      const auto len = static_cast<std::int64_t>(n);
      if (!dgc_) staged.copy_(feedback_.committed(slot));
      at::Tensor e = dgc_ ? staged.narrow(0, len, len) : staged;
      if (n > 0 && dense_) {
        // Every coordinate (selector 'dense'): x = e + g in place, its energy (the non-finite
        // check; the contraction is 1: everything is sent) back to the host, then each
        // coordinate's code, e keeping what the code lost (dense_allreduce's compressor).
        k = n;
        accumulate(e.data_ptr<float>(), g.data_ptr<float>(), n, stream_);
        at::Tensor sums = at::empty({static_cast<std::int64_t>(2 + energy_partials())},
                                    g.options().dtype(at::kDouble));
        energies(e.data_ptr<float>(), n, e.data_ptr<float>(), 0, sums.data_ptr<double>(),
                 sums.data_ptr<double>() + 2, stream_);
        const at::Tensor host = sums.narrow(0, 0, 2).to(at::kCPU);
        kept = host.data_ptr<double>()[0];
        rest = 0.0;
        sel_stats = selection_stats{};
        sel_stats.count = n;
        t_encode = clock::now();
        if (!std::isfinite(kept)) {
          mine.outcome = rt::bucket_outcome::nonfinite;
          mine.message = nonfinite_message(id, g, labels, e, at::empty({0}, g.options()),
                                           at::empty({0}, g.options().dtype(at::kInt)));
          local = std::make_exception_ptr(nonfinite_error(mine.message));
        } else {
          codes = bytes_on_device(n * pick_code_bytes(code_));
          encode_dense(code_, e.data_ptr<float>(),
                       reinterpret_cast<std::byte*>(codes.data_ptr<std::uint8_t>()), n,
                       comm_.size(), stream_);
        }
      } else if (n > 0) {
        // Gaussian-k and threshold pick as many as their thresholds pass, written by the
        // device into the statistics: room for n (k where Gaussian-k caps at k), the values
        // zeroed beyond what they write so that the energies can read them all.
        const gaussiank* const gk = std::get_if<gaussiank>(&sel_);
        const threshold* const th = std::get_if<threshold>(&sel_);
        const bool variable = gk != nullptr || th != nullptr;
        const std::size_t capacity = th != nullptr || (gk != nullptr && !gk->cap_at_k) ? n : k;
        const auto cap = static_cast<std::int64_t>(capacity);
        indices = at::empty({cap}, g.options().dtype(at::kInt));
        values = variable ? at::zeros({cap}, g.options()) : at::empty({cap}, g.options());
        at::Tensor d_stats = at::zeros({static_cast<std::int64_t>(sizeof(selection_stats))},
                                       g.options().dtype(at::kByte));
        auto* const idx = reinterpret_cast<std::uint32_t*>(indices.data_ptr<std::int32_t>());
        auto* const sel_stats_dev = reinterpret_cast<selection_stats*>(d_stats.data_ptr());
        if (dgc_) {
          const at::Tensor& committed = feedback_.committed(slot);
          const topk& sel = std::get<topk>(sel_);  // 'dgc' goes with 'topk' (check_config)
          at::Tensor scratch =
              bytes_on_device(compress_dgc_scratch(sel, n, k, config_.dgc_clip_norm));
          compress_dgc(sel, scratch.data_ptr(), static_cast<std::size_t>(scratch.numel()),
                       staged.data_ptr<float>(), e.data_ptr<float>(), committed.data_ptr<float>(),
                       committed.data_ptr<float>() + n, g.data_ptr<float>(), n, k,
                       static_cast<float>(config_.dgc_momentum), config_.dgc_clip_norm, idx,
                       values.data_ptr<float>(), sel_stats_dev, stream_);
        } else if (const randomk* const rk = std::get_if<randomk>(&sel_)) {
          // The host engine's picks: randomk::draw for its call_id (seed, step, bucket, rank;
          // they do not depend on the values), drawn and copied by the device form.
          const call_id cid{config_.seed, step, id, static_cast<std::uint32_t>(comm_.rank())};
          at::Tensor scratch = bytes_on_device(compress_scratch(*rk, n, k));
          compress(*rk, cid, scratch.data_ptr(), static_cast<std::size_t>(scratch.numel()),
                   e.data_ptr<float>(), g.data_ptr<float>(), n, k, idx, values.data_ptr<float>(),
                   sel_stats_dev, stream_);
        } else if (th != nullptr) {
          at::Tensor scratch = bytes_on_device(compress_scratch(*th, n, capacity));
          compress(*th, scratch.data_ptr(), static_cast<std::size_t>(scratch.numel()),
                   e.data_ptr<float>(), g.data_ptr<float>(), n, capacity, idx,
                   values.data_ptr<float>(), sel_stats_dev, stream_);
        } else if (gk != nullptr) {
          at::Tensor scratch = bytes_on_device(compress_scratch(*gk, n, k, capacity));
          compress(*gk, scratch.data_ptr(), static_cast<std::size_t>(scratch.numel()),
                   e.data_ptr<float>(), g.data_ptr<float>(), n, k, capacity, idx,
                   values.data_ptr<float>(), sel_stats_dev, stream_);
        } else {
          const topk& sel = std::get<topk>(sel_);
          at::Tensor scratch = bytes_on_device(compress_scratch(sel, n, k));
          compress(sel, scratch.data_ptr(), static_cast<std::size_t>(scratch.numel()),
                   e.data_ptr<float>(), g.data_ptr<float>(), n, k, idx, values.data_ptr<float>(),
                   sel_stats_dev, stream_);
        }
        // ||sent||^2 and ||e + g - sent||^2 in double (DGC: of v; their sum is ||e + g||^2:
        // the contraction, and a NaN or Inf anywhere in e + g), one read of each, with the
        // statistics: one copy to the host.
        at::Tensor sums = at::empty({static_cast<std::int64_t>(2 + energy_partials())},
                                    g.options().dtype(at::kDouble));
        energies(values.data_ptr<float>(), capacity, e.data_ptr<float>(), n,
                 sums.data_ptr<double>(), sums.data_ptr<double>() + 2, stream_);
        at::Tensor host = at::cat({d_stats, sums.narrow(0, 0, 2).view(at::kByte)}).to(at::kCPU);
        const auto* bytes = host.data_ptr<std::uint8_t>();
        std::memcpy(&sel_stats, bytes, sizeof(selection_stats));
        double pair[2];
        std::memcpy(pair, bytes + sizeof(selection_stats), sizeof(pair));
        kept = pair[0];
        rest = pair[1];
        t_encode = clock::now();
        if (variable) {
          // The count, as the selection wrote it.
          if (sel_stats.count > capacity) {
            throw std::logic_error(detail::concat("gradcomp: CudaEngine.run: the selection wrote ",
                                                  sel_stats.count, " picks into room for ",
                                                  capacity));
          }
          k = sel_stats.count;
          indices = indices.narrow(0, 0, static_cast<std::int64_t>(k));
          values = values.narrow(0, 0, static_cast<std::int64_t>(k));
        }
        if (!std::isfinite(kept + rest)) {
          mine.outcome = rt::bucket_outcome::nonfinite;
          mine.message = nonfinite_message(id, g, labels, e, values, indices);
          local = std::make_exception_ptr(nonfinite_error(mine.message));
        } else if (code_ != pick_code::fp32) {
          // The values' codes, and what they lost kept in e (or v): after the statistics,
          // which are of the values themselves, as the host's.
          codes = bytes_on_device(k * pick_code_bytes(code_));
          at::Tensor decoded = at::empty({static_cast<std::int64_t>(k)}, g.options());
          at::Tensor scratch = bytes_on_device(quantize_picks_scratch(code_, k));
          quantize_picks(code_, scratch.data_ptr(), static_cast<std::size_t>(scratch.numel()),
                         values.data_ptr<float>(), k,
                         reinterpret_cast<std::byte*>(codes.data_ptr<std::uint8_t>()),
                         decoded.data_ptr<float>(), e.data_ptr<float>(), idx, stream_);
        }
      } else {
        t_encode = clock::now();
      }
    } catch (const std::exception& ex) {
      local = std::current_exception();
      mine.outcome = rt::bucket_outcome::failed;
      mine.message = ex.what();
    }
    const auto t1 = clock::now();
    if (rt::settle_bucket(comm_, mine, local, config_.skip_nonfinite, record_scratch_,
                          [this] { feedback_.discard(); })) {
      g.fill_(std::numeric_limits<float>::quiet_NaN());
      skipped_ = true;
      return detail::tensor_stats_of(id, n, compress_stats{}, exchange_stats{}, 0);
    }
    std::size_t received = 0;
    try {
      received = dense_ ? exchange_dense(codes, n, g)
                        : exchange(indices, code_ == pick_code::fp32 ? values : codes, k, n, g);
    } catch (...) {
      feedback_.discard();
      throw;
    }
    feedback_.stage(slot);
    const auto t2 = clock::now();

    compress_stats cs;
    cs.n = n;
    cs.selection = sel_stats;
    cs.selection.count = k;
    const double energy = kept + rest;
    if (energy > 0.0 && std::isfinite(energy)) cs.contraction = std::min(kept / energy, 1.0);
    if (dense_) cs.contraction = 1.0;  // everything is sent, whatever its energy (the host's)
    // The encoding's time is what its launches took on the host (the kernels are asynchronous:
    // their time goes to the exchange's, which waits for them).
    cs.seconds_select = std::chrono::duration<double>(t_encode - t0).count();
    cs.seconds_encode = std::chrono::duration<double>(t1 - t_encode).count();
    exchange_stats xs;
    xs.name = dense_ ? "dense_allreduce" : "sparse_allgather";
    // dense_allreduce: this rank's reduced buffer, as the host's counts it.
    xs.bytes_sent = dense_ ? n * pick_code_bytes(code_) : k * pick_bytes();
    xs.bytes_received = dense_ ? received : received * pick_bytes();
    xs.seconds = std::chrono::duration<double>(t2 - t1).count();
    return detail::tensor_stats_of(id, n, cs, xs, 0);
  }

  // As the host engine's fail(): takes part in the bucket's agreement as failed.
  [[noreturn]] void fail(std::int64_t bucket, std::uint64_t step, std::string message) {
    rt::fail_bucket(comm_, bucket, step, std::move(message), config_.skip_nonfinite,
                    record_scratch_, [this] { feedback_.discard(); });
  }

  [[nodiscard]] bool skipped() const noexcept { return skipped_; }

  void commit() noexcept { feedback_.commit(); }
  void discard() noexcept { feedback_.discard(); }
  void clear() { feedback_.clear(); }
  // As the host engine's drop(): forgets bucket `bucket`'s residual and frees its memory.
  void drop(std::int64_t bucket) { feedback_.drop(bucket, at::Tensor(), at::Tensor()); }
  // The feedback's buffers per bucket: residual e; dgc u, v.
  [[nodiscard]] std::size_t buffer_count() const noexcept { return dgc_ ? 2 : 1; }

  // The committed feedback state of `bucket` as CPU tensors (none before its first step): e,
  // or u and v.
  std::vector<at::Tensor> state(std::int64_t bucket) const {
    const auto i = feedback_.find(bucket);
    if (!i) return {};
    const at::Tensor host = feedback_.committed(*i).to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
    if (!dgc_) return {host};
    const std::int64_t n = host.numel() / 2;
    return {host.narrow(0, 0, n).clone(), host.narrow(0, n, n).clone()};
  }

  // Replaces the committed feedback state of `bucket` with `buffers` (CPU or CUDA float32, of
  // one length): e, or u and v.
  void set_state(std::int64_t bucket, const std::vector<at::Tensor>& buffers) {
    if (buffers.size() != buffer_count()) {
      detail::throw_invalid_argument("CudaEngine.set_state", "len(buffers)", buffers.size(),
                                     dgc_ ? "2 (the dgc feedback's buffer count: u, v)"
                                          : "1 (the residual feedback's buffer count)");
    }
    for (std::size_t j = 0; j < buffers.size(); ++j) {
      const at::Tensor& b = buffers[j];
      if (!b.defined() || b.scalar_type() != at::kFloat || b.dim() != 1 ||
          b.numel() != buffers[0].numel()) {
        throw invalid_argument(detail::concat(
            "gradcomp: CudaEngine.set_state: argument 'buffers[", j, "]' is ",
            torch_views::describe(b), "; allowed: a one-dimensional float32 tensor",
            j > 0 ? " as long as buffers[0]" : ""));
      }
    }
    const auto here = [&](const at::Tensor& b) {
      return b.to(device_, at::kFloat, /*non_blocking=*/false, /*copy=*/true).contiguous();
    };
    at::Tensor state = dgc_ ? at::cat({here(buffers[0]), here(buffers[1])}) : here(buffers[0]);
    at::Tensor staged = at::empty_like(state);
    const auto n = static_cast<std::size_t>(buffers[0].numel());
    feedback_.put(bucket, std::move(state), std::move(staged), n);
  }

  [[nodiscard]] int rank() const noexcept { return comm_.rank(); }
  [[nodiscard]] int size() const noexcept { return comm_.size(); }

 private:
  // An (index, value) pair on the wire: uint32, and the value as float32 or a 16-bit code.
  [[nodiscard]] std::size_t pick_bytes() const noexcept { return 4 + pick_code_bytes(code_); }

  static pick_code code_of(const std::string& quantizer) {
    if (quantizer == "fp16") return pick_code::fp16;
    return quantizer == "bf16" ? pick_code::bf16 : pick_code::fp32;
  }

  static rt::engine_config checked(rt::engine_config c) {
    rt::check_config(c);
    check_cuda_config(c);
    return c;
  }

  void check_bucket(const at::Tensor& g) const {
    if (!g.defined() || !g.is_cuda() || g.device() != device_ || g.scalar_type() != at::kFloat ||
        g.layout() != c10::kStrided || !g.is_contiguous()) {
      throw invalid_argument(detail::concat(
          "gradcomp: CudaEngine.run: argument 'grad' is ", torch_views::describe(g),
          "; allowed: a contiguous float32 tensor on ", device_.str()));
    }
  }

  at::Tensor bytes_on_device(std::size_t bytes) const {
    return at::empty({static_cast<std::int64_t>(bytes)},
                     at::TensorOptions().device(device_).dtype(at::kByte));
  }

  // Bucket `bucket`'s slot in feedback_, made at its first step (zeros committed; dgc: u and
  // v, 2 n); a bucket whose size changed is refused with the host engine's text.
  std::size_t slot_for(std::int64_t bucket, std::size_t n) {
    return feedback_.slot_for(bucket, n, [&] {
      const auto options = at::TensorOptions().device(device_).dtype(at::kFloat);
      const auto len = static_cast<std::int64_t>(dgc_ ? 2 * n : n);
      return std::pair{at::zeros({len}, options), at::empty({len}, options)};
    });
  }

  // The host engine's refusal text, from a host copy of g (only on this error path). With a
  // finite g the accumulation overflowed (e + g, or DGC's v; `acc`: it after its picks were
  // cleared, with the values and indices sent): the host compressor's text, naming the
  // accumulation's first non-finite element.
  static std::string nonfinite_message(std::uint32_t id, const at::Tensor& g,
                                       std::span<const rt::tensor_label> labels,
                                       const at::Tensor& acc, const at::Tensor& values,
                                       const at::Tensor& indices) {
    const at::Tensor host = g.to(at::kCPU);
    const std::span<const float> h(host.data_ptr<float>(), static_cast<std::size_t>(host.numel()));
    std::string fallback = detail::concat("gradcomp: the gradient of bucket ", id,
                                          " holds a nan or inf; non-finite gradients are "
                                          "refused before any rank's state changes");
    if (detail::first_nonfinite(h) == h.size()) {
      at::Tensor whole = acc.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
      whole.index_put_({indices.to(at::kCPU).to(at::kLong)}, values.to(at::kCPU));
      const std::span<const float> a(whole.data_ptr<float>(),
                                     static_cast<std::size_t>(whole.numel()));
      const std::size_t bad = detail::first_nonfinite(a);
      fallback = detail::concat(
          "gradcomp::compressor::compress: the accumulated gradient (feedback state + gradient) "
          "of tensor ", id, " overflowed to ", bad < a.size() ? a[bad] : 0.0f, " at index ", bad,
          "; nonfinite_policy::error (the default) rejects it");
    }
    return rt::name_nonfinite(id, h, labels, fallback);
  }

  // Every rank's picks to every rank, then g = their rank-order mean. `values`: the k values
  // (float32), or their 16-bit codes (bytes). Returns the picks received from the other ranks.
  // g is written only once everything has arrived and been checked; on any error nothing of g
  // has changed.
  std::size_t exchange(const at::Tensor& indices, const at::Tensor& values, std::size_t k,
                       std::size_t n, const at::Tensor& g) {
    if (n == 0) return 0;
    const auto p = static_cast<std::size_t>(comm_.size());
    const auto r = static_cast<std::size_t>(comm_.rank());
    // The counts first, through the host: a rank that announces more picks than the bucket
    // has elements is refused on every rank before anything is sized by it.
    std::vector<std::uint64_t> counts(p);
    const std::uint64_t mine = k;
    comm_.allgather<std::uint64_t>(std::span<const std::uint64_t>(&mine, 1),
                                   std::span<std::uint64_t>(counts));
    detail::check_announced("CudaEngine.run (pick counts)", counts, 1, receive_limit{n},
                            static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) /
                                pick_bytes());
    std::size_t total = 0;
    for (const std::uint64_t c : counts) total += static_cast<std::size_t>(c);
    // One block per rank: its indices (4 bytes each), then its values or codes.
    const std::size_t pick = pick_bytes();
    const auto value_bytes = static_cast<std::int64_t>(pick_code_bytes(code_));
    at::Tensor block = at::cat({indices.view(at::kByte), values.view(at::kByte)});
    at::Tensor all_bytes;
    if (p == 1) {
      all_bytes = block;
    } else {
      at::Tensor send = block.repeat({static_cast<std::int64_t>(p)});
      all_bytes = bytes_on_device(total * pick);
      std::vector<std::int64_t> to_each(p, static_cast<std::int64_t>(k * pick)), from_each(p);
      for (std::size_t s = 0; s < p; ++s) {
        from_each[s] = static_cast<std::int64_t>(counts[s] * pick);
      }
      if (total > 0 || k > 0) {
        comm_.alltoall_tensors(all_bytes, send, std::move(from_each), std::move(to_each),
                               "the exchange of a CUDA bucket");
      }
    }
    std::vector<at::Tensor> idx_parts, val_parts;
    std::int64_t at_byte = 0;
    for (std::size_t s = 0; s < p; ++s) {
      const auto c = static_cast<std::int64_t>(counts[s]);
      idx_parts.push_back(all_bytes.narrow(0, at_byte, 4 * c));
      val_parts.push_back(all_bytes.narrow(0, at_byte + 4 * c, value_bytes * c));
      at_byte += (4 + value_bytes) * c;
    }
    const at::Tensor all_idx = at::cat(idx_parts).view(at::kInt);
    at::Tensor all_val = at::cat(val_parts);
    if (code_ == pick_code::fp32) {
      all_val = all_val.view(at::kFloat);
    } else {
      // Every rank's codes decoded at once (each code on its own: the same values as rank by
      // rank), in rank order as they arrived.
      at::Tensor decoded = at::empty({static_cast<std::int64_t>(total)}, g.options());
      const at::Tensor scratch = bytes_on_device(decode_picks_scratch(code_, total));
      decode_picks(code_, scratch.data_ptr(), static_cast<std::size_t>(scratch.numel()),
                   reinterpret_cast<const std::byte*>(all_val.data_ptr<std::uint8_t>()), total,
                   decoded.data_ptr<float>(), stream_);
      all_val = decoded;
    }
    if (mean_.numel() < static_cast<std::int64_t>(n)) {
      mean_ = at::empty({static_cast<std::int64_t>(n)}, g.options());
    }
    at::Tensor out = mean_.narrow(0, 0, static_cast<std::int64_t>(n));
    const at::Tensor scratch = bytes_on_device(combine_scratch(total, n));
    combine(scratch.data_ptr(), static_cast<std::size_t>(scratch.numel()),
            reinterpret_cast<const std::uint32_t*>(all_idx.data_ptr<std::int32_t>()),
            all_val.data_ptr<float>(), total, out.data_ptr<float>(), n, static_cast<int>(p),
            stream_);
    g.copy_(out);
    return total - static_cast<std::size_t>(counts[r]);
  }

  // Selector 'dense' over 'allreduce': every rank's codes added in rank order, then
  // g = float(sum) / P (fp16: float(sum), its codes divided by P before). The sizes first,
  // through the host: a rank whose bucket has another size is refused on every rank before
  // the allreduce. Then process_group_comm::allreduce's scheme on the device: rank s gets
  // share s of every rank's codes (one alltoall_base), folds them in rank order, and every rank
  // gets every folded share (a second one): the host engine's sum, bit for bit. Returns the
  // bytes of this rank's reduced buffer (what the host's dense_allreduce counts as received).
  // g is written only once everything has arrived; on any error nothing of g has changed.
  std::size_t exchange_dense(const at::Tensor& codes, std::size_t n, const at::Tensor& g) {
    const auto p = static_cast<std::size_t>(comm_.size());
    std::vector<std::uint64_t> sizes(p);
    const std::uint64_t mine = n;
    comm_.allgather<std::uint64_t>(std::span<const std::uint64_t>(&mine, 1),
                                   std::span<std::uint64_t>(sizes));
    for (std::size_t s = 0; s < p; ++s) {
      if (sizes[s] != n) {
        throw communicator_error(detail::concat(
            "gradcomp: CudaEngine.run: rank ", s, " has a bucket of ", sizes[s],
            " elements where this rank's has ", n, "; exchange 'allreduce' adds every rank's "
            "whole bucket, so allowed: ", n, ". Nothing was exchanged"));
      }
    }
    if (n == 0) return 0;
    const std::size_t w = pick_code_bytes(code_);
    at::Tensor sum = codes;
    if (p > 1) {
      const auto r = static_cast<std::size_t>(comm_.rank());
      const std::size_t begin = detail::share_begin(n, p, r);
      const std::size_t m = detail::share_begin(n, p, r + 1) - begin;
      std::vector<std::int64_t> share_bytes(p), mine_each(p, static_cast<std::int64_t>(m * w));
      for (std::size_t s = 0; s < p; ++s) {
        share_bytes[s] = static_cast<std::int64_t>(
            (detail::share_begin(n, p, s + 1) - detail::share_begin(n, p, s)) * w);
      }
      at::Tensor send = codes;
      at::Tensor shares = bytes_on_device(p * m * w);
      comm_.alltoall_tensors(shares, send, mine_each, share_bytes,
                             "the allreduce of a CUDA bucket (shares)");
      at::Tensor folded = bytes_on_device(std::max<std::size_t>(m * w, 1));
      fold_shares(code_, reinterpret_cast<const std::byte*>(shares.data_ptr<std::uint8_t>()), m,
                  static_cast<int>(p), reinterpret_cast<std::byte*>(folded.data_ptr<std::uint8_t>()),
                  stream_);
      at::Tensor out_folded = folded.narrow(0, 0, static_cast<std::int64_t>(m * w)).repeat(
          {static_cast<std::int64_t>(p)});
      sum = bytes_on_device(n * w);
      comm_.alltoall_tensors(sum, out_folded, share_bytes, mine_each,
                             "the allreduce of a CUDA bucket (gather)");
    }
    if (mean_.numel() < static_cast<std::int64_t>(n)) {
      mean_ = at::empty({static_cast<std::int64_t>(n)}, g.options());
    }
    at::Tensor out = mean_.narrow(0, 0, static_cast<std::int64_t>(n));
    const float divisor = code_ == pick_code::fp16 ? 1.0f : static_cast<float>(p);
    average_codes(code_, reinterpret_cast<const std::byte*>(sum.data_ptr<std::uint8_t>()), n,
                  divisor, out.data_ptr<float>(), stream_);
    g.copy_(out);
    return n * w;
  }

  rt::engine_config config_;
  bool dgc_ = config_.feedback == "dgc";  // DGC's momentum correction (else the residual)
  bool dense_ = config_.selector == "dense";  // every coordinate, over 'allreduce'

  pick_code code_ = code_of(config_.quantizer);  // how the picked values travel
  c10::Device device_;
  process_group_comm comm_;
  std::variant<topk, gaussiank, threshold, randomk> sel_;  // the selector (check_cuda_config's)
  cudaStream_t stream_ = nullptr;
  detail::bucket_slots<at::Tensor> feedback_;  // every bucket's committed and staged residual
  std::uint64_t pending_step_ = 0;
  at::Tensor mean_;
  std::vector<std::byte> record_scratch_;
  bool skipped_ = false;
};

}  // namespace gradcomp::torch_cuda

#endif  // GRADCOMP_TORCH_CUDA
