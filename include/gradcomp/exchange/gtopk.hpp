// gradcomp/exchange/gtopk.hpp: gTop-k (Shi et al., global top-k sparsification). The ranks'
// picks move up a binomial tree in ceil(log2 P) rounds of pairwise merges (equal indices
// added, the top-k of the union kept); the root broadcasts the global top-k. Local picks that
// are not in the global set are handed back to the feedback. Any P, not only powers of two.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <string>
#include <vector>

#include <gradcomp/concepts.hpp>
#include <gradcomp/detail/exchange_common.hpp>
#include <gradcomp/detail/timer.hpp>
#include <gradcomp/error.hpp>
#include <gradcomp/exchange/agreement.hpp>
#include <gradcomp/sparse.hpp>

namespace gradcomp {

// What gtopk writes at the global indices.
enum class gtopk_values {
  // The published algorithm: the sums the merge tree carried to the root. A rank's value at a
  // global index is missing from it when a merge below the root dropped that index and a
  // rank in another subtree brought it back; such a value is neither applied nor restored.
  tree,
  // After the tree, one allreduce of the k values at the global indices: each global value
  // is the sum of all P ranks' values there, so every pick is either applied or restored to
  // the feedback and nothing is lost. Costs one more allreduce of k + 1 values (k the
  // largest count, known to every rank; the last counts the ranks that refused their copy of
  // the global set, which still join it, so that none is left waiting).
  exact,
};

namespace detail {

// |value| order with NaN above every number, ties to the lower index: a strict total order on
// pairs with distinct indices, so the kept set never depends on the sort algorithm.
inline bool gtopk_before(const index_value& a, const index_value& b) noexcept {
  const bool an = std::isnan(a.value), bn = std::isnan(b.value);
  if (an != bn) return an;
  if (!an) {
    const float ma = std::fabs(a.value), mb = std::fabs(b.value);
    if (ma != mb) return ma > mb;
  }
  return a.index < b.index;
}

// out = the top k of the union of a and b (both sorted by index, distinct indices each), equal
// indices added as a.value + b.value; out is sorted by index. out must not alias a or b.
inline void gtopk_merge(std::span<const index_value> a, std::span<const index_value> b,
                        std::size_t k, std::vector<index_value>& out) {
  out.clear();
  out.reserve(a.size() + b.size());
  std::size_t i = 0, j = 0;
  while (i < a.size() || j < b.size()) {
    if (j == b.size() || (i < a.size() && a[i].index < b[j].index)) {
      out.push_back(a[i++]);
    } else if (i == a.size() || b[j].index < a[i].index) {
      out.push_back(b[j++]);
    } else {
      out.push_back(index_value{a[i].index, a[i].value + b[j].value});
      ++i;
      ++j;
    }
  }
  if (out.size() <= k) return;
  std::nth_element(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(k), out.end(),
                   gtopk_before);
  out.resize(k);
  std::sort(out.begin(), out.end(),
            [](const index_value& x, const index_value& y) { return x.index < y.index; });
}

// Pairs received from rank `from` (a subtree's merge, or the broadcast global set) before they
// are merged or written: at most k of them, indices strictly increasing and < n. A corrupted or
// foreign message then throws payload_error on the receiving rank (the others fail with
// communicator_error) instead of writing out of bounds or merging duplicates.
inline void check_received_pairs(std::span<const index_value> pairs, std::size_t n,
                                 std::size_t k, int from) {
  if (pairs.size() > k) {
    throw_payload_error("gtopk::exchange", "rank ", from, " sent ", pairs.size(),
                        " pairs; at most k = ", k, " are allowed");
  }
  for (std::size_t j = 0; j < pairs.size(); ++j) {
    const std::uint32_t i = pairs[j].index;
    if (i >= n || (j > 0 && i <= pairs[j - 1].index)) {
      throw_payload_error("gtopk::exchange", "rank ", from, " sent index ", i, " at position ",
                          j, "; indices must be strictly increasing and < n (n = ", n, ")");
    }
  }
}

}  // namespace detail

class gtopk {
 public:
  gtopk() = default;
  explicit gtopk(gtopk_values values) : values_(values) {
    if (values != gtopk_values::tree && values != gtopk_values::exact) {
      detail::throw_invalid_argument("gtopk", "values", static_cast<int>(values),
                                     "gtopk_values::tree (0) or gtopk_values::exact (1)");
    }
  }

  [[nodiscard]] gtopk_values values() const noexcept { return values_; }
  // Size of the last global set (<= k).
  [[nodiscard]] std::size_t last_global_count() const noexcept { return global_.size(); }

  // As the five-argument form; the picks left out are dropped (the four-argument exchange
  // concept has nowhere to return them). sparsified_sgd calls the five-argument form.
  template <class Compressor, communicator Comm>
  exchange_stats exchange(Comm& comm, const Compressor& c, const payload& p,
                          std::span<typename Compressor::value_type> out) {
    unused_picks dropped;
    return exchange(comm, c, p, out, dropped);
  }

  // k is the largest count any rank sent (the target k for exact top-k). On return, out
  // (dense, overwritten) holds at each global index g the value sum at g divided by P (see
  // gtopk_values for which sum), zero elsewhere; every rank gets bit-identical out. `unused`
  // receives this rank's picks whose index is not global, with their decoded values.
  // bytes_sent / bytes_received count the header, the pairs this rank sent / received in the
  // tree, the broadcast of the global set (sent by the root, received by the others) and, for
  // gtopk_values::exact, the k + 1 allreduced values.
  template <class Compressor, communicator Comm>
  exchange_stats exchange(Comm& comm, const Compressor& c, const payload& p,
                          std::span<typename Compressor::value_type> out, unused_picks& unused) {
    detail::stopwatch clock;
    const local_check local = check_locally([&] {
      detail::check_out_size("gtopk::exchange", "out.size()", out.size(), p);
      detail::decode_pairs("gtopk::exchange", c, p, decoded_, mine_);
    });
    const auto headers =
        agree_on_header(comm, "gtopk", header_of(p, exchange_id::gtopk, sizeof(out[0])),
                        agree::dense_size, header_scratch_, local.error, local.is_payload);
    exchange_stats st = exchange_agreed(comm, headers, out, unused);
    st.bytes_sent += exchange_header_bytes;
    st.bytes_received += exchange_header_bytes * (headers.size() - 1);
    st.seconds = clock.lap();
    return st;
  }

  // The exchange after the ranks agreed on `headers` (auto_exchange's entry): this rank's
  // decoded picks must be in place (prepare()).
  template <class Compressor>
  void prepare(const Compressor& c, const payload& p) {
    detail::decode_pairs("gtopk::exchange", c, p, decoded_, mine_);
  }

  template <class T, communicator Comm>
  exchange_stats exchange_agreed(Comm& comm, const std::vector<exchange_header>& headers,
                                 std::span<T> out, unused_picks& unused) {
    const int ranks = comm.size();
    const int r = comm.rank();
    std::size_t k = 0;
    for (const auto& h : headers) k = std::max<std::size_t>(k, h.count);
    exchange_stats st;
    st.name = "gtopk";

    // Up the tree: in round j (step 2^j) rank r sends to r - step when r % 2step == step, and
    // receives from r + step when r % 2step == 0. Every rank calls pairwise() every round,
    // which a communicator without point-to-point turns into one alltoallv. Each message
    // starts with a status pair (index 0: fine, 1: a rank below failed), so that a message
    // that some rank rejects fails the exchange on every rank: the failure travels up to the
    // root, the root broadcasts it, and every rank throws after the broadcast. No rank leaves
    // early while the others wait for it.
    std::string failure;  // this rank's own rejection of a message, if any
    bool below_failed = false;
    current_ = mine_;
    for (int step = 1; step < ranks; step *= 2) {
      const int dest = r % (2 * step) == step ? r - step : -1;
      const int source = r % (2 * step) == 0 && r + step < ranks ? r + step : -1;
      outgoing_.clear();
      if (dest >= 0) {
        const bool failed = !failure.empty() || below_failed;
        outgoing_.push_back(index_value{failed ? status_failed : status_ok, 0.0f});
        if (!failed) outgoing_.insert(outgoing_.end(), current_.begin(), current_.end());
      }
      // A message is a status pair and at most k pairs.
      detail::pairwise(comm, std::span<const index_value>(outgoing_), dest, received_, source,
                       receive_limit{k + 1});
      st.bytes_sent += outgoing_.size() * sizeof(index_value);
      st.bytes_received += received_.size() * sizeof(index_value);
      if (source < 0 || !failure.empty() || below_failed) continue;
      if (received_.empty() || received_[0].index > status_failed) {
        failure = detail::concat("gradcomp::gtopk::exchange: malformed payload: rank ", source,
                                 " sent a message without a valid status pair");
        continue;
      }
      if (received_[0].index == status_failed) {
        below_failed = true;
        continue;
      }
      const std::span<const index_value> pairs = std::span<const index_value>(received_).subspan(1);
      try {
        detail::check_received_pairs(pairs, out.size(), k, source);
      } catch (const payload_error& e) {
        failure = e.what();
        continue;
      }
      detail::gtopk_merge(current_, pairs, k, merged_);
      current_.swap(merged_);
    }

    // Down: one broadcast of k + 1 pairs, the first holding the count and the status, so that
    // its size is known to every rank beforehand.
    global_.assign(k + 1, index_value{0, 0.0f});
    if (r == 0) {
      if (failure.empty() && !below_failed) {
        detail::check_invariant(current_.size() <= k, "gtopk: the root holds more than k pairs");
        global_[0].index = static_cast<std::uint32_t>(current_.size());
        std::copy(current_.begin(), current_.end(), global_.begin() + 1);
      } else {
        global_[0].value = 1.0f;  // failed: no global set
      }
    }
    comm.broadcast(std::span<index_value>(global_), 0);
    const std::size_t bcast_bytes = global_.size() * sizeof(index_value);
    (r == 0 ? st.bytes_sent : st.bytes_received) += ranks > 1 ? bcast_bytes : 0;
    const T divisor = static_cast<T>(ranks);
    if (values_ == gtopk_values::tree) {
      const std::size_t g = accept_global(failure, k, out.size());
      std::fill(out.begin(), out.end(), T(0));
      for (std::size_t i = 0; i < g; ++i) out[global_[i].index] = static_cast<T>(global_[i].value) / divisor;
    } else {
      // Every rank joins the allreduce before it throws, so that a copy of the broadcast
      // corrupted on its way to one rank only fails the exchange on every rank (none waits in
      // the allreduce for a rank that left). Its length, k + 1, is known to every rank
      // whatever its copy says: this rank's value at each global index, or zero (padding after
      // the g global ones), summed over ranks in rank order; the last element counts the ranks
      // that could not use their copy.
      std::size_t g = 0;
      std::exception_ptr refused;
      try {
        g = accept_global(failure, k, out.size());
      } catch (...) {
        refused = std::current_exception();
      }
      std::vector<T> sums(k + 1, T(0));
      std::size_t j = 0;
      for (std::size_t i = 0; i < g; ++i) {
        while (j < mine_.size() && mine_[j].index < global_[i].index) ++j;
        if (j < mine_.size() && mine_[j].index == global_[i].index) {
          sums[i] = static_cast<T>(mine_[j].value);
        }
      }
      if (refused) sums[k] = T(1);
      comm.allreduce(std::span<T>(sums), reduce_op::sum);
      st.bytes_sent += (k + 1) * sizeof(T);
      st.bytes_received += (k + 1) * sizeof(T);
      if (refused) std::rethrow_exception(refused);
      if (sums[k] != T(0)) {
        throw communicator_error(
            "gradcomp::gtopk: a rank could not use the broadcast global set; no rank applied "
            "this exchange");
      }
      std::fill(out.begin(), out.end(), T(0));
      for (std::size_t i = 0; i < g; ++i) out[global_[i].index] = sums[i] / divisor;
    }
    const std::size_t g = global_.size();

    // Picks whose index is not global go back to the feedback.
    unused.clear();
    std::size_t i = 0;
    for (const auto& e : mine_) {
      while (i < g && global_[i].index < e.index) ++i;
      if (i < g && global_[i].index == e.index) continue;
      unused.indices.push_back(e.index);
      unused.values.push_back(e.value);
    }
    return st;
  }

  // The last global set, sorted by index, with the tree's values.
  [[nodiscard]] std::span<const index_value> last_global() const noexcept { return global_; }

 private:
  static constexpr std::uint32_t status_ok = 0;
  static constexpr std::uint32_t status_failed = 1;

  // The broadcast copy in global_ (a count-and-status pair, then k pairs) checked: this rank's
  // own refusal of a message in the tree (payload_error), a failure the root broadcast
  // (communicator_error), a count above k or pairs out of order or range (payload_error);
  // else global_ becomes the g global pairs, and g is returned.
  std::size_t accept_global(const std::string& failure, std::size_t k, std::size_t n) {
    if (!failure.empty()) throw payload_error(failure);
    if (global_[0].value != 0.0f) {
      throw communicator_error(
          "gradcomp::gtopk: a rank rejected a message in the merge tree (its own exception says "
          "which); no rank applied this exchange");
    }
    const std::size_t g = global_[0].index;
    if (g > k) {
      detail::throw_payload_error("gtopk::exchange", "rank 0 broadcast a global set of ", g,
                                  " pairs; at most k = ", k, " are allowed");
    }
    global_.erase(global_.begin());
    global_.resize(g);
    // Checked before out is written: the indices below are written to.
    detail::check_received_pairs(global_, n, k, 0);
    return g;
  }

  gtopk_values values_ = gtopk_values::tree;
  std::vector<std::byte> header_scratch_;
  std::vector<float> decoded_;
  std::vector<index_value> mine_, current_, outgoing_, received_, merged_, global_;
};

static_assert(exchange_with_unused<gtopk, archetypes::compressor<false>, archetypes::communicator>);
// The bodies too: calling anything the concepts do not promise fails to compile here.
static_assert(archetypes::instantiates<gtopk, false>);

}  // namespace gradcomp
