// gradcomp/concepts.hpp: the whole contract between gradcomp's parts (the communicator concepts in
// detail/comm_concepts.hpp, which it includes).
//  - The five policy concepts (selector, quantizer, feedback, communicator, exchange) and the
//    compressor as the exchanges see it, each spelled from what the code calls, so that a type
//    that models a concept compiles wherever that concept is asked for.
//  - The optional abilities: a policy opts in by having the member named here, and
//    compressor<>, the SGD drivers and the exchanges detect it by these names only.
//  - Archetypes: the least that models each concept. Every shipped exchange is instantiated
//    with them right after its definition (body included), so an exchange that calls anything
//    a concept does not promise fails to compile there, not in a user's program.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include <gradcomp/context.hpp>
#include <gradcomp/detail/comm_concepts.hpp>
#include <gradcomp/detail/float16.hpp>
#include <gradcomp/sparse.hpp>

namespace gradcomp {

// ---------------------------------------------------------------------------------------
// Policies

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

// ---------------------------------------------------------------------------------------
// Communicators
// The communicator concepts (communicator, the optional point_to_point, bounds_receives and
// checks_thread_support, reduce_op and receive_limit) are in detail/comm_concepts.hpp, which
// the communication helpers under detail/ include without the rest of this contract.

// ---------------------------------------------------------------------------------------
// The compressor as the exchanges see it

enum class decompress_mode {
  overwrite,   // dense = decoded (zero where the payload has no coordinate)
  accumulate,  // dense += decoded
};

// What an exchange may use of the compressor it is handed (compressor<S, Q, F, T> models it):
// the element type of the dense output, whether payloads can be added as they are (then the
// quantizer names its sum_type), and decoding, to values in payload order or into a dense
// vector. Both decoders validate the payload before they write anything.
template <class C>
concept exchange_compressor =
    gradient_value<typename C::value_type> && quantizer<typename C::quantizer_type> &&
    requires(const C& c, const payload& p, std::span<float> values,
             std::span<typename C::value_type> dense) {
      { C::summable } -> std::convertible_to<bool>;
      { c.decode_values(p, values) } -> std::same_as<void>;
      { c.decompress(p, dense, decompress_mode::accumulate) } -> std::same_as<void>;
    } &&
    (!C::summable || summable_quantizer<typename C::quantizer_type>);

// ---------------------------------------------------------------------------------------
// Exchanges

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
// ranks of the decoded payloads (overwritten, dense).
template <class X, class Compressor, class Comm>
concept exchange =
    communicator<Comm> && exchange_compressor<Compressor> &&
    requires(X& x, Comm& comm, const Compressor& c, const payload& p,
             std::span<typename Compressor::value_type> out) {
      { x.exchange(comm, c, p, out) } -> std::same_as<exchange_stats>;
    };

// ---------------------------------------------------------------------------------------
// Optional abilities. Each is detected by the name below and nowhere else.

// Selector: settings that can be wrong (threshold's tau, RedSync's interval, topk's sample
// scale) are checked by `void check() const`, which compressor<> calls before the feedback
// state changes, since the selector only runs once the accumulation is done.
template <class S>
concept checks_settings = requires(const S& s) { s.check(); };

// Selector: `static constexpr bool shared_indices = true` says it picks the same indices on
// every rank for the same call (dense, randomk), so that payloads of a summable quantizer can
// be added position by position (dense_allreduce).
template <class S>
inline constexpr bool shared_indices_v = requires { requires S::shared_indices; };

// Selector: `static constexpr bool selects_all = true` says it always picks every coordinate
// (dense); its payloads use index_layout::dense and carry no index array.
template <class S>
inline constexpr bool selects_all_v = requires { requires S::selects_all; };

// Feedback: `accumulate_into(const state& from, state& to, g) const` writes the state after
// accumulating g to `to` and leaves `from` as it was (residual, dgc_momentum, no_feedback).
// A step that must be able to fail without changing anything compresses from the current
// state into a second one and keeps the second only when the step succeeds; a feedback
// without this ability costs a copy of its buffers per step there instead.
template <class F, class T = float>
concept stages_accumulation =
    requires(const F& f, const typename F::template state<T>& from,
             typename F::template state<T>& to, std::span<const T> g) {
      { f.accumulate_into(from, to, g) } -> std::same_as<std::span<const T>>;
    };

// Selector and feedback together: the feedback accumulates by e + g into a buffer it hands
// out (`in_place_accumulator(state&)`, and a const form for the state a step only reads:
// residual), and the selector can do that addition during its own scan
// (`select_accumulate_into(out, e, g, ctx, indices)`, out = e + g, out may be e: topk,
// gaussiank). compressor<> then fuses the two passes: one read of g and e, one write.
template <class S, class F, class T = float>
concept fuses_accumulation =
    !selects_all_v<S> &&
    requires(const F& f, typename F::template state<T>& st,
             const typename F::template state<T>& cst, S& s, std::span<T> out,
             std::span<const T> e, std::span<const T> g, const select_context& ctx,
             std::vector<std::uint32_t>& idx) {
      { f.in_place_accumulator(st) } -> std::same_as<std::span<T>>;
      { f.in_place_accumulator(cst) } -> std::same_as<std::span<const T>>;
      { s.select_accumulate_into(out, e, g, ctx, idx) } -> std::same_as<selection_stats>;
    };

// Optional, with fuses_accumulation: the selector's select_accumulate_into sets
// selection_stats::nonfinite when e + g holds a NaN or Inf (topk, gaussiank declare
// `static constexpr bool flags_nonfinite = true`). compressor<> then leaves a staged step's
// check for NaN and Inf to that pass instead of reading g first.
template <class S>
concept flags_nonfinite = requires { requires S::flags_nonfinite; };

// Feedback: `restore(state&, indices, values) const` takes back picks that an exchange left
// out (residual, dgc_momentum), so that they are sent later instead of lost.
template <class F, class T = float>
concept restores_picks =
    requires(const F& f, typename F::template state<T>& st, std::span<const std::uint32_t> idx,
             std::span<const float> values) { f.restore(st, idx, values); };

// Feedback: `static constexpr bool applies_momentum = true` says it applies momentum before
// compression (dgc_momentum), so the SGD driver must not apply it again.
template <class F>
inline constexpr bool applies_momentum_v = requires { requires F::applies_momentum; };

// Exchange: a five-argument exchange(comm, c, p, out, unused_picks&) reports the picks the
// aggregation left out (gtopk, auto_exchange); the drivers hand them to restore().
template <class X, class Compressor, class Comm>
concept exchange_with_unused =
    exchange<X, Compressor, Comm> &&
    requires(X& x, Comm& comm, const Compressor& c, const payload& p,
             std::span<typename Compressor::value_type> out, unused_picks& unused) {
      { x.exchange(comm, c, p, out, unused) } -> std::same_as<exchange_stats>;
    };

// Exchange: exchange_tensors(comm, c, payloads, outs, stats) takes every tensor of a step at
// once (topk_a2a, to fuse small tensors into buckets); sparsified_sgd then compresses all
// tensors first and calls it once.
template <class X, class Compressor, class Comm>
concept fuses_tensors =
    exchange<X, Compressor, Comm> &&
    requires(X& x, Comm& comm, const Compressor& c, std::span<const payload> payloads,
             std::span<const std::span<typename Compressor::value_type>> outs,
             std::span<exchange_stats> stats) { x.exchange_tensors(comm, c, payloads, outs, stats); };

// ---------------------------------------------------------------------------------------
// Archetypes: exactly what the concepts promise, and nothing more.

namespace archetypes {

template <class T, class... U>
concept one_of = (std::same_as<T, U> || ...);

struct communicator {
  int rank() const { return 0; }
  int size() const { return 1; }
  template <class T>
    requires one_of<T, float, double, half, bfloat16>
  void allreduce(std::span<T>, reduce_op) {}
  template <class T>
    requires one_of<T, std::byte, float, double>
  void allgatherv(std::span<const std::type_identity_t<T>>, std::vector<T>& recv,
                  std::vector<std::size_t>& counts) {
    recv.clear();
    counts.assign(1, 0);
  }
  template <class T>
    requires one_of<T, std::byte, index_value>
  void alltoallv(std::span<const std::type_identity_t<T>>, std::span<const std::size_t>,
                 std::vector<T>& recv, std::vector<std::size_t>& counts) {
    recv.clear();
    counts.assign(1, 0);
  }
  template <class T>
    requires one_of<T, std::byte, double, index_value>
  void broadcast(std::span<T>, int) {}
  void barrier() {}
};

template <bool Summable>
struct quantizer {
  static constexpr quantizer_id id = quantizer_id::identity;
  static constexpr bool summable = Summable;
  static constexpr bool prescale_before_sum = false;
  using sum_type = float;
  unsigned bits_per_value() const { return 32; }
  quantizer_params params() const { return {}; }
  void encode(std::span<const float>, const call_id&, payload&) const {}
  void decode(const payload&, std::span<float>) const {}
};

template <bool Summable>
struct compressor {
  using value_type = float;
  using quantizer_type = archetypes::quantizer<Summable>;
  static constexpr bool summable = Summable;
  void decode_values(const payload&, std::span<float>) const {}
  void decompress(const payload&, std::span<float>,
                  decompress_mode = decompress_mode::overwrite) const {}
};

// Calls every entry an exchange offers with the archetypes. Never called: naming it in
// `instantiates` below is what makes the compiler instantiate the exchange's bodies.
template <class X, bool Summable>
void exercise_exchange() {
  X x;
  communicator comm;
  const compressor<Summable> c;
  const payload p;
  std::vector<float> out;
  (void)x.exchange(comm, c, p, std::span<float>(out));
  if constexpr (exchange_with_unused<X, compressor<Summable>, communicator>) {
    unused_picks unused;
    (void)x.exchange(comm, c, p, std::span<float>(out), unused);
  }
  if constexpr (fuses_tensors<X, compressor<Summable>, communicator>) {
    const std::span<float> outs[] = {std::span<float>(out)};
    exchange_stats stats[1];
    x.exchange_tensors(comm, c, std::span<const payload>(&p, 1),
                       std::span<const std::span<float>>(outs), std::span<exchange_stats>(stats));
  }
}

template <auto F>
struct odr_use {
  static constexpr bool value = true;
};

// static_assert(archetypes::instantiates<X, summable>) after an exchange X: true, and compiles
// only if every body of X compiles with nothing but what the concepts promise.
template <class X, bool Summable>
inline constexpr bool instantiates = odr_use<&exercise_exchange<X, Summable>>::value;

}  // namespace archetypes

static_assert(communicator<archetypes::communicator>);
static_assert(exchange_compressor<archetypes::compressor<false>>);
static_assert(exchange_compressor<archetypes::compressor<true>>);

}  // namespace gradcomp
