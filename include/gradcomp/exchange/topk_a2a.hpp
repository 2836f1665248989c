// gradcomp/exchange/topk_a2a.hpp: TopKA2A. Rank j owns shard j of the index space; every rank
// sends each of its (index, value) pairs to the shard's owner with one alltoallv, the owner
// adds them into its dense shard in rank order, and one allgatherv of the shards gives every
// rank the dense mean. Small tensors can be fused into buckets (one alltoallv and one
// allgatherv per bucket), with the bucket size found by a binary search on measured time.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <gradcomp/concepts.hpp>
#include <gradcomp/detail/exchange_common.hpp>
#include <gradcomp/detail/rank_mean.hpp>
#include <gradcomp/detail/timer.hpp>
#include <gradcomp/error.hpp>
#include <gradcomp/exchange/agreement.hpp>
#include <gradcomp/sparse.hpp>

namespace gradcomp {

// First index of shard j when n indices are split over p owners: floor(j n / p).
inline std::uint64_t topk_a2a_shard_begin(std::uint64_t n, std::uint64_t p, std::uint64_t j) {
  return j * n / p;  // n <= 2^32 and p < 2^31: no overflow
}

// Tensor t's part of a fused exchange among tensors of the given sizes (their total: total):
// its size over the total, or an equal part where every size is 0.
inline double size_fraction(std::span<const std::size_t> sizes, std::size_t t, std::size_t total) {
  return total ? static_cast<double>(sizes[t]) / static_cast<double>(total)
               : 1.0 / static_cast<double>(sizes.size());
}

// amount shared among tensors of the given sizes in proportion to them (size_fraction), each
// share rounded down and the last one taking what the rounding left: how a fused exchange's
// bytes are counted per tensor (topk_a2a's buckets here, the device step's one bucket in
// cuda/sparsified_sgd.cuh).
inline void share_by_size(std::span<const std::size_t> sizes, std::size_t amount,
                          std::span<std::size_t> out) {
  detail::check_invariant(out.size() == sizes.size(), "share_by_size: one share per tensor");
  std::size_t total = 0, given = 0;
  for (const std::size_t n : sizes) total += n;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    if (t + 1 == sizes.size()) {
      out[t] = amount - given;
      break;
    }
    out[t] = static_cast<std::size_t>(static_cast<double>(amount) * size_fraction(sizes, t, total));
    given += out[t];
  }
}

// The device step's check of the count matrix it gathers before anything is sent
// (cuda/sparsified_sgd.cuh, topk_a2a in one bucket over n elements): matrix[r * p + j] is what
// rank r announced it sends to shard j's owner, totals[r] its picks of every tensor (announced
// in the same gather and checked against the tensor sizes). A row must add up to its total
// (each pick goes to exactly one owner), and no entry may exceed its shard's length (a rank
// sends an owner at most one pick per element of the shard), so that no receive is sized
// beyond what the tensors allow. Returns the first problem, naming the rank, or an empty
// string: every rank holds the same matrix and refuses alike, before anything is received.
inline std::string check_topk_a2a_counts(std::span<const std::size_t> matrix,
                                         std::span<const std::size_t> totals, std::uint64_t n) {
  const std::size_t p = totals.size();
  detail::check_invariant(matrix.size() == p * p, "check_topk_a2a_counts: a p x p matrix");
  for (std::size_t r = 0; r < p; ++r) {
    std::size_t sum = 0;
    for (std::size_t j = 0; j < p; ++j) {
      const std::size_t c = matrix[r * p + j];
      const std::uint64_t shard = topk_a2a_shard_begin(n, p, j + 1) - topk_a2a_shard_begin(n, p, j);
      if (c > shard) {
        return detail::concat("gradcomp::topk_a2a: rank ", r, " announced ", c,
                              " picks for rank ", j, "'s shard; allowed: at most its ", shard,
                              " elements");
      }
      sum += c;
    }
    if (sum != totals[r]) {
      return detail::concat("gradcomp::topk_a2a: rank ", r, " announced ", sum,
                            " picks for the shards' owners and ", totals[r],
                            " picks of its tensors; allowed: the same number");
    }
  }
  return {};
}

// Buckets of consecutive tensors: a tensor joins the current bucket while the bucket's total
// stays <= bucket_elements; a tensor larger than that is a bucket of its own, and
// bucket_elements == 0 leaves every tensor alone. Returns the first tensor of each bucket,
// then sizes.size(). No bucket exceeds 2^32 elements (the fused index is a uint32).
inline std::vector<std::size_t> plan_buckets(std::span<const std::size_t> sizes,
                                             std::size_t bucket_elements) {
  const std::size_t cap = std::min<std::size_t>(bucket_elements, std::size_t{1} << 32);
  std::vector<std::size_t> starts;
  std::size_t fill = 0;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    if (starts.empty() || fill + sizes[t] > cap || fill + sizes[t] < fill) {
      starts.push_back(t);
      fill = 0;
    }
    fill += sizes[t];
  }
  starts.push_back(sizes.size());
  return starts;
}

class topk_a2a {
 public:
  // bucket_elements: sparsified_sgd fuses consecutive tensors into buckets of at most this
  // many elements (0: every tensor on its own). tune_bucket_elements() finds a good value.
  topk_a2a() = default;
  explicit topk_a2a(std::size_t bucket_elements) : bucket_elements_(bucket_elements) {}

  [[nodiscard]] std::size_t bucket_elements() const noexcept { return bucket_elements_; }
  void set_bucket_elements(std::size_t e) noexcept { bucket_elements_ = e; }

  // out = mean over ranks of the decoded payloads, added in rank order (bit-identical to
  // sparse_allgather's result and on every rank). The pairs carry fp32 decoded values, 8
  // bytes each, whatever the quantizer. bytes_sent counts the header, the pairs sent to other
  // ranks and this rank's shard; bytes_received the others' headers, pairs and shards.
  template <class Compressor, communicator Comm>
  exchange_stats exchange(Comm& comm, const Compressor& c, const payload& p,
                          std::span<typename Compressor::value_type> out) {
    using T = typename Compressor::value_type;
    const payload* ps[] = {&p};
    const std::span<T> outs[] = {out};
    return exchange_fused(comm, c, std::span<const payload* const>(ps),
                          std::span<const std::span<T>>(outs));
  }

  // Several tensors in one fused index space (tensor t at offset size_0 + ... + size_(t-1)):
  // one alltoallv and one allgatherv in all. Each out[t] gets exactly what exchange() would
  // give it alone, bit for bit; only the number of messages changes.
  template <class Compressor, communicator Comm>
  exchange_stats exchange_fused(Comm& comm, const Compressor& c,
                                std::span<const payload* const> payloads,
                                std::span<const std::span<typename Compressor::value_type>> outs) {
    detail::stopwatch clock;
    exchange_header mine;
    const local_check local = check_locally([&] { mine = prepare(c, payloads, outs); });
    const auto headers =
        agree_on_header(comm, "topk_a2a", mine, agree::dense_size | agree::tensor_sizes,
                        header_scratch_, local.error, local.is_payload);
    exchange_stats st = exchange_agreed(comm, outs);
    st.bytes_sent += exchange_header_bytes;
    st.bytes_received += exchange_header_bytes * (headers.size() - 1);
    st.seconds = clock.lap();
    return st;
  }

  // sparsified_sgd's entry: tensors fused into buckets by bucket_elements(). A bucket's bytes
  // and seconds are shared among its tensors in proportion to their sizes.
  template <class Compressor, communicator Comm>
  void exchange_tensors(Comm& comm, const Compressor& c, std::span<const payload> payloads,
                        std::span<const std::span<typename Compressor::value_type>> outs,
                        std::span<exchange_stats> stats) {
    using T = typename Compressor::value_type;
    if (payloads.size() != outs.size() || stats.size() != outs.size()) {
      // payloads[t] and stats[t] are used for every t < outs.size(). The other ranks are about
      // to agree on the first bucket's header: this rank takes part in that allgather with its
      // error, so that they throw communicator_error instead of waiting for it.
      std::string why;
      try {
        detail::throw_invalid_argument(
            "topk_a2a::exchange_tensors", "payloads.size(), stats.size()",
            detail::concat(payloads.size(), ", ", stats.size()),
            detail::concat("both outs.size() (", outs.size(), ")"));
      } catch (const invalid_argument& e) {
        why = e.what();
      }
      if (!outs.empty()) {
        exchange_header h;
        h.algorithm = exchange_id::topk_a2a;
        (void)agree_on_header(comm, "topk_a2a", h, agree::dense_size | agree::tensor_sizes,
                              header_scratch_, why);
      }
      throw invalid_argument(why);
    }
    sizes_.resize(outs.size());
    for (std::size_t t = 0; t < outs.size(); ++t) sizes_[t] = outs[t].size();
    const auto starts = plan_buckets(sizes_, bucket_elements_);
    std::vector<const payload*> ps;
    for (std::size_t b = 0; b + 1 < starts.size(); ++b) {
      const std::size_t first = starts[b], last = starts[b + 1];
      ps.clear();
      for (std::size_t t = first; t < last; ++t) ps.push_back(&payloads[t]);
      const exchange_stats bucket = exchange_fused(
          comm, c, std::span<const payload* const>(ps), std::span<const std::span<T>>(outs.subspan(first, last - first)));
      std::size_t total = 0;
      for (std::size_t t = first; t < last; ++t) total += sizes_[t];
      const std::span<const std::size_t> in_bucket(sizes_.data() + first, last - first);
      sent_.resize(last - first);
      received_bytes_.resize(last - first);
      share_by_size(in_bucket, bucket.bytes_sent, sent_);
      share_by_size(in_bucket, bucket.bytes_received, received_bytes_);
      for (std::size_t t = first; t < last; ++t) {
        exchange_stats& s = stats[t];
        s = exchange_stats{};
        s.name = bucket.name;
        s.seconds = bucket.seconds * size_fraction(in_bucket, t - first, total);
        s.bytes_sent = sent_[t - first];
        s.bytes_received = received_bytes_[t - first];
      }
    }
  }

  // Decodes this rank's payloads into fused pairs and returns its header; throws
  // invalid_argument or payload_error on bad input (then nothing was exchanged).
  template <class Compressor>
  exchange_header prepare(const Compressor& c, std::span<const payload* const> payloads,
                          std::span<const std::span<typename Compressor::value_type>> outs) {
    if (payloads.size() != outs.size()) {
      detail::throw_invalid_argument("topk_a2a::exchange_fused", "outs.size()", outs.size(),
                                     detail::concat("payloads.size() (", payloads.size(), ")"));
    }
    pairs_.clear();
    sizes_.resize(outs.size());
    std::uint64_t offset = 0, count = 0;
    for (std::size_t t = 0; t < outs.size(); ++t) {
      const payload& p = *payloads[t];
      detail::check_out_size("topk_a2a::exchange", detail::concat("outs[", t, "].size()"),
                             outs[t].size(), p);
      detail::decode_pairs("topk_a2a::exchange", c, p, decoded_, tensor_pairs_);
      for (const auto& e : tensor_pairs_) {
        pairs_.push_back(index_value{static_cast<std::uint32_t>(offset + e.index), e.value});
      }
      sizes_[t] = outs[t].size();
      offset += outs[t].size();
      count += p.count;
      if (offset > wire_max_dense_size) {
        detail::throw_invalid_argument("topk_a2a::exchange_fused", "total elements", offset,
                                       "<= 2^32 (fused indices are uint32)");
      }
    }
    exchange_header h;
    h.algorithm = exchange_id::topk_a2a;
    h.value_size = static_cast<std::uint8_t>(sizeof(typename Compressor::value_type));
    h.dense_size = offset;
    h.count = static_cast<std::uint32_t>(std::min<std::uint64_t>(count, UINT32_MAX));
    h.hash = detail::fnv1a(std::span<const std::size_t>(sizes_));
    return h;
  }

  // The exchange after the ranks agreed on their headers, with prepare() done.
  template <class T, communicator Comm>
  exchange_stats exchange_agreed(Comm& comm, std::span<const std::span<T>> outs) {
    const auto p = static_cast<std::uint64_t>(comm.size());
    const auto r = static_cast<std::uint64_t>(comm.rank());
    std::uint64_t n = 0;
    for (const auto& o : outs) n += o.size();
    exchange_stats st;
    st.name = "topk_a2a";

    // Pairs are sorted by fused index, so each owner's pairs are one run.
    send_counts_.assign(p, 0);
    {
      std::size_t j = 0;
      for (std::uint64_t s = 0; s < p; ++s) {
        const std::uint64_t end = topk_a2a_shard_begin(n, p, s + 1);
        const std::size_t from = j;
        while (j < pairs_.size() && pairs_[j].index < end) ++j;
        send_counts_[s] = j - from;
      }
    }
    // A rank sends an owner at most one pair per element of its shard, and no shard is longer
    // than ceil(n / p): a peer that announces more is refused before anything is sized by it.
    const receive_limit widest{static_cast<std::size_t>((n + p - 1) / p)};
    detail::alltoallv_within(comm, std::span<const index_value>(pairs_),
                             std::span<const std::size_t>(send_counts_), received_, recv_counts_,
                             widest);
    st.bytes_sent += (pairs_.size() - send_counts_[r]) * sizeof(index_value);
    st.bytes_received += (received_.size() - recv_counts_[r]) * sizeof(index_value);

    // Owner: scatter-add in source rank order (the order alltoallv delivers), then the mean.
    const std::uint64_t begin = topk_a2a_shard_begin(n, p, r);
    const std::uint64_t end = topk_a2a_shard_begin(n, p, r + 1);
    detail::check_invariant(recv_counts_.size() == p, "topk_a2a: one receive count per rank");
    std::vector<T>& shard = scratch<T>().shard;
    std::vector<T>& dense = scratch<T>().dense;
    shard.resize(end - begin);
    // A message this rank rejects fails the exchange on every rank, never only here: the rank
    // still takes part in the allgatherv below, with a shard one element too long, and every
    // rank throws once it has seen that.
    const std::string rejected = reduce_shard(std::span<const index_value>(received_),
                                              std::span<const std::size_t>(recv_counts_), begin,
                                              std::span<T>(shard));
    if (!rejected.empty()) shard.push_back(T(0));

    // A shard one element too long is how a rank says it rejected a message.
    detail::allgatherv_within(comm, std::span<const T>(shard), dense, shard_counts_,
                              receive_limit{widest.per_rank + 1}, "topk_a2a (shards)");
    if (!rejected.empty()) throw payload_error(rejected);
    for (std::uint64_t s = 0; s < p; ++s) {
      if (shard_counts_[s] != topk_a2a_shard_begin(n, p, s + 1) - topk_a2a_shard_begin(n, p, s)) {
        throw communicator_error(detail::concat(
            "gradcomp::topk_a2a: rank ", s, " rejected a message it received (its own exception "
            "says which); no rank applied this exchange"));
      }
    }
    detail::check_invariant(dense.size() == n, "topk_a2a: the gathered shards do not add up to n");
    st.bytes_sent += shard.size() * sizeof(T);
    st.bytes_received += (dense.size() - shard.size()) * sizeof(T);
    copy_out(std::span<const T>(dense), outs);
    return st;
  }

  // The gathered dense mean into the tensors' outputs, in order (their sizes add up to
  // dense.size()); an output beyond the caches with streaming stores, which skip reading it
  // first (detail/stream_store.hpp). Public so that gradcomp_bench measures exactly this.
  template <class T>
  static void copy_out(std::span<const T> dense, std::span<const std::span<T>> outs) {
    std::size_t at = 0;
    bool streamed = false;
    for (const auto& o : outs) {
      detail::check_invariant(o.size() <= dense.size() - at, "topk_a2a: outputs beyond the mean");
      if (o.size() * sizeof(T) >= detail::stream_min_bytes) {
        detail::stream_copy(o.data(), dense.data() + at, o.size());
        streamed = true;
      } else {
        std::copy_n(dense.begin() + static_cast<std::ptrdiff_t>(at), o.size(), o.begin());
      }
      at += o.size();
    }
    if (streamed) detail::stream_fence();
  }

  // The owner's local work after the alltoallv: shard = the mean over counts.size() ranks of
  // the pairs in `received` (counts[s] pairs from rank s, in rank order), added in rank order
  // into shard, which covers the indices [begin, begin + shard.size()). Each pair is checked
  // first: inside the shard, strictly increasing per rank (a repeated index would be added
  // twice, one outside written out of bounds). Returns the first problem found, or an empty
  // string; on a problem the shard is left as it was. The sum runs region by region
  // (detail::rank_order_mean). Public so that gradcomp_bench measures exactly this
  // (exchange_local/topk_a2a).
  template <class T>
  static std::string reduce_shard(std::span<const index_value> received,
                                  std::span<const std::size_t> counts, std::uint64_t begin,
                                  std::span<T> shard) {
    std::size_t received_total = 0;
    bool fits = true;
    for (const std::size_t c : counts) {
      fits = fits && c <= received.size() - received_total;
      if (fits) received_total += c;
    }
    if (!fits || received_total != received.size()) {
      return "gradcomp::topk_a2a::exchange: the receive counts do not add up to the pairs received";
    }
    const std::uint64_t end = begin + shard.size();
    // Every pair is checked before the shard is written.
    thread_local std::vector<detail::rank_pairs> runs;
    thread_local std::vector<std::size_t> cursor;
    runs.resize(counts.size());
    std::size_t pos = 0;
    for (std::size_t from = 0; from < counts.size(); ++from) {
      runs[from] = {received.data() + pos, counts[from]};
      for (std::size_t j = 0; j < counts[from]; ++j, ++pos) {
        const index_value& e = received[pos];
        // The ranks agreed on the tensor sizes, so such a pair can only be a corrupt message.
        if (e.index < begin || e.index >= end) {
          return detail::concat("gradcomp::topk_a2a::exchange: malformed payload: rank ", from,
                                " sent index ", e.index, " outside this rank's shard [", begin,
                                ", ", end, ")");
        }
        if (j > 0 && e.index <= received[pos - 1].index) {
          return detail::concat("gradcomp::topk_a2a::exchange: malformed payload: rank ", from,
                                " sent index ", e.index, " after ", received[pos - 1].index,
                                "; each rank's indices must be strictly increasing");
        }
      }
    }
    if (counts.empty()) {
      std::fill(shard.begin(), shard.end(), T(0));
    } else {
      detail::rank_order_mean<T>(shard, begin, std::span<const detail::rank_pairs>(runs), cursor);
    }
    return {};
  }

 private:
  // The shard and the gathered dense vector, kept between exchanges (a fresh n-element vector
  // per call costs its page faults, about as much as the pass itself).
  template <class T>
  struct buffers {
    std::vector<T> shard, dense;
  };
  template <class T>
  buffers<T>& scratch() {
    if constexpr (std::is_same_v<T, double>) {
      return double_;
    } else {
      return float_;
    }
  }

  std::size_t bucket_elements_ = 0;
  std::vector<std::byte> header_scratch_;
  std::vector<float> decoded_;
  std::vector<index_value> tensor_pairs_, pairs_, received_;
  std::vector<std::size_t> sizes_, send_counts_, recv_counts_, shard_counts_;
  std::vector<std::size_t> sent_, received_bytes_;  // a bucket's bytes, per tensor
  buffers<float> float_;
  buffers<double> double_;
};

static_assert(exchange<topk_a2a, archetypes::compressor<false>, archetypes::communicator>);
// The bodies too: calling anything the concepts do not promise fails to compile here.
static_assert(fuses_tensors<topk_a2a, archetypes::compressor<false>, archetypes::communicator>);
static_assert(archetypes::instantiates<topk_a2a, false>);

// What tune_bucket_elements() tried: each candidate bucket size and its agreed time.
struct bucket_tuning {
  std::size_t best = 0;
  std::vector<std::pair<std::size_t, double>> probes;
};

// Finds the bucket size among lo, 2 lo, 4 lo, ..., <= hi whose measured time is least, by a
// binary search on the slope: at the middle candidate m, if t(m) <= t(next) the best is at or
// below m, else above. That takes about 2 log2(log2(hi / lo)) measurements and assumes the
// time is unimodal in the bucket size (fewer messages on one side, less overlap and larger
// buffers on the other). seconds_for(bucket) runs the work with that bucket size (for
// example a few sparsified_sgd steps with exchange().set_bucket_elements(bucket)) and
// returns its time; it is called `repeats` times per candidate and the least time kept, then
// the ranks agree on the largest of their times (an allreduce), so all take the same branch.
// Every rank must call it with the same lo and hi.
template <communicator Comm, class Measure>
bucket_tuning tune_bucket_elements(Comm& comm, std::size_t lo, std::size_t hi,
                                   Measure&& seconds_for, unsigned repeats = 3) {
  if (lo == 0 || hi < lo) {
    detail::throw_invalid_argument("tune_bucket_elements", "lo, hi",
                                   detail::concat(lo, ", ", hi), "1 <= lo <= hi");
  }
  if (repeats == 0) detail::throw_invalid_argument("tune_bucket_elements", "repeats", 0, ">= 1");
  std::vector<std::size_t> candidates;
  for (std::size_t b = lo; b <= hi; b *= 2) {
    candidates.push_back(b);
    if (b > hi / 2) break;
  }
  bucket_tuning result;
  std::vector<double> times(candidates.size(), -1.0);
  auto time_of = [&](std::size_t i) {
    if (times[i] < 0.0) {
      double best = 0.0;
      for (unsigned rep = 0; rep < repeats; ++rep) {
        const double t = static_cast<double>(seconds_for(candidates[i]));
        best = rep == 0 ? t : std::min(best, t);
      }
      double agreed[] = {best};
      comm.allreduce(std::span<double>(agreed), reduce_op::max);
      times[i] = agreed[0];
      result.probes.emplace_back(candidates[i], agreed[0]);
    }
    return times[i];
  };
  std::size_t a = 0, b = candidates.size() - 1;
  while (a < b) {
    const std::size_t m = a + (b - a) / 2;
    if (time_of(m) <= time_of(m + 1)) {
      b = m;
    } else {
      a = m + 1;
    }
  }
  result.best = candidates[a];
  return result;
}

}  // namespace gradcomp
