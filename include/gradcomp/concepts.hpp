// gradcomp/concepts.hpp: the five policy concepts, spelled from what compressor<>,
// sparsified_sgd<> and the exchanges call. Every shipped policy is followed by a
// static_assert that it models its concept.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include <gradcomp/context.hpp>
#include <gradcomp/sparse.hpp>

namespace gradcomp {

// Gradient element types the host policies accept.
template <class T>
concept gradient_value = std::same_as<T, float> || std::same_as<T, double>;

// A selector picks coordinates of g: strictly increasing indices, written to `indices`
// (which it resizes), and reports what it did.
template <class S, class T = float>
concept selector = gradient_value<T> && requires(S& s, std::span<const T> g,
                                                 const select_context& ctx,
                                                 std::vector<std::uint32_t>& indices) {
  { s.select(g, ctx, indices) } -> std::same_as<selection_stats>;
};

// Selectors that pick the same indices on every rank for the same call (dense, randomk)
// declare `static constexpr bool shared_indices = true`; their payloads can be added
// position by position when the quantizer is summable.
template <class S>
inline constexpr bool shared_indices_v = requires { requires S::shared_indices; };

// Selectors that always pick every coordinate declare `static constexpr bool selects_all`;
// their payloads use index_layout::dense and carry no index array.
template <class S>
inline constexpr bool selects_all_v = requires { requires S::selects_all; };

// A quantizer encodes `count` float values into payload::values/side and decodes them back.
// Q::summable says whether two payloads with the same indices can be added without decoding
// (then Q::sum_type is the element type to add).
template <class Q>
concept quantizer = requires(const Q& q, std::span<const float> values, const call_id& id,
                             payload& out, const payload& in, std::span<float> decoded) {
  { Q::id } -> std::convertible_to<quantizer_id>;
  { Q::summable } -> std::convertible_to<bool>;
  { q.bits_per_value() } -> std::convertible_to<unsigned>;
  { q.params() } -> std::same_as<quantizer_params>;
  { q.encode(values, id, out) } -> std::same_as<void>;
  { q.decode(in, decoded) } -> std::same_as<void>;
};

// Summable quantizers name the element type that is added on the wire (decoding a value is
// float(sum_type)), and whether each contribution must be divided by P before the sum
// (fp16, whose sums overflow).
template <class Q>
concept summable_quantizer = quantizer<Q> && Q::summable && requires {
  typename Q::sum_type;
  { Q::prescale_before_sum } -> std::convertible_to<bool>;
};

// Error feedback: per-tensor state made by the policy; accumulate() turns a gradient into the
// vector to compress (e + g, or DGC's v), update() records what was sent (decoded values at
// the sent indices), so that nothing unsent is lost. buffers() exposes the state for
// checkpoints.
template <class F, class T = float>
concept feedback =
    gradient_value<T> &&
    requires(const F& f, typename F::template state<T>& st, std::span<const T> g,
             std::span<const std::uint32_t> idx, std::span<const float> decoded) {
      { f.template make_state<T>(std::size_t{}) } -> std::same_as<typename F::template state<T>>;
      { f.accumulate(st, g) } -> std::same_as<std::span<const T>>;
      { f.update(st, idx, decoded) } -> std::same_as<void>;
      { st.buffers() } -> std::convertible_to<std::vector<std::span<T>>>;
    };

enum class reduce_op { sum, max, min };

// A communicator among size() ranks. Collectives are blocking and must be called by every
// rank in the same order. Variable-size collectives resize the receive buffers and report
// per-rank counts (in elements).
template <class C>
concept communicator = requires(C& c, std::span<float> f, std::span<double> d,
                                std::span<std::byte> bytes, std::span<const std::byte> send,
                                std::span<const std::size_t> send_counts,
                                std::vector<std::byte>& recv,
                                std::vector<std::size_t>& recv_counts) {
  { c.rank() } -> std::convertible_to<int>;
  { c.size() } -> std::convertible_to<int>;
  c.allreduce(f, reduce_op::sum);
  c.allreduce(d, reduce_op::sum);
  c.allgatherv(send, recv, recv_counts);
  c.alltoallv(send, send_counts, recv, recv_counts);
  c.broadcast(bytes, 0);
  c.barrier();
};

// What an exchange reports for one tensor.
struct exchange_stats {
  std::size_t bytes_sent = 0;      // by this rank
  std::size_t bytes_received = 0;  // by this rank
  double seconds = 0.0;
  std::string_view name{};         // the algorithm that ran (auto_exchange: the one it chose)
  double predicted_seconds = 0.0;  // the cost model's forecast, where the exchange has one
};

// Coordinates this rank sent that the aggregation left out (gTop-k keeps only the global
// top-k): the step gives their decoded values back to the feedback, so nothing is lost.
struct unused_picks {
  std::vector<std::uint32_t> indices;
  std::vector<float> values;
  void clear() noexcept {
    indices.clear();
    values.clear();
  }
};

// An exchange combines every rank's payload for one tensor: `out` receives the mean over
// ranks of the decoded payloads (overwritten, dense). Compressor supplies decoding.
template <class X, class Compressor, class Comm>
concept exchange =
    communicator<Comm> &&
    requires(X& x, Comm& comm, const Compressor& c, const payload& p,
             std::span<typename Compressor::value_type> out) {
      { x.exchange(comm, c, p, out) } -> std::same_as<exchange_stats>;
    };

// An exchange that may drop some of this rank's picks reports them in `unused`; sparsified_sgd
// then calls the feedback's restore() for them when the feedback has one.
template <class X, class Compressor, class Comm>
concept exchange_with_unused =
    exchange<X, Compressor, Comm> &&
    requires(X& x, Comm& comm, const Compressor& c, const payload& p,
             std::span<typename Compressor::value_type> out, unused_picks& unused) {
      { x.exchange(comm, c, p, out, unused) } -> std::same_as<exchange_stats>;
    };

// Archetypes: the least a communicator and a compressor must offer, so that an exchange can
// be checked against its concept right where it is defined, before any real compressor or
// communicator is included.
namespace archetypes {

struct communicator {
  int rank() const { return 0; }
  int size() const { return 1; }
  template <class T>
  void allreduce(std::span<T>, reduce_op) {}
  template <class T>
  void allgatherv(std::span<const T>, std::vector<T>&, std::vector<std::size_t>&) {}
  template <class T>
  void alltoallv(std::span<const T>, std::span<const std::size_t>, std::vector<T>&,
                 std::vector<std::size_t>&) {}
  template <class T>
  void broadcast(std::span<T>, int) {}
  void barrier() {}
};

template <bool Summable>
struct compressor {
  using value_type = float;
  static constexpr bool summable = Summable;
};

}  // namespace archetypes

}  // namespace gradcomp
