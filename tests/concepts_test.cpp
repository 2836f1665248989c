// For each concept, one type that models it and one that does not (missing or mistyped
// member), so the concepts keep meaning what the composition points need.
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <gradcomp/concepts.hpp>
#include <gradcomp/feedback.hpp>
#include <gradcomp/select.hpp>

namespace {

using namespace gradcomp;

struct good_selector {
  template <gradient_value T>
  selection_stats select(std::span<const T>, const select_context&, std::vector<std::uint32_t>& idx) {
    idx.clear();
    return {};
  }
};
struct selector_without_stats {  // returns the count instead of selection_stats
  template <class T>
  std::size_t select(std::span<const T>, const select_context&, std::vector<std::uint32_t>&) {
    return 0;
  }
};
struct selector_float_only {
  selection_stats select(std::span<const float>, const select_context&, std::vector<std::uint32_t>&) {
    return {};
  }
};

struct good_quantizer {
  static constexpr quantizer_id id = quantizer_id::identity;
  static constexpr bool summable = false;
  unsigned bits_per_value() const { return 32; }
  quantizer_params params() const { return {}; }
  void encode(std::span<const float>, const call_id&, payload&) const {}
  void decode(const payload&, std::span<float>) const {}
};
struct quantizer_without_decode {
  static constexpr quantizer_id id = quantizer_id::identity;
  static constexpr bool summable = false;
  unsigned bits_per_value() const { return 32; }
  quantizer_params params() const { return {}; }
  void encode(std::span<const float>, const call_id&, payload&) const {}
};
struct summable_without_sum_type : good_quantizer {
  static constexpr bool summable = true;
};
struct good_summable : good_quantizer {
  static constexpr bool summable = true;
  static constexpr bool prescale_before_sum = false;
  using sum_type = float;
};

struct good_feedback {
  template <gradient_value T>
  struct state {
    std::vector<T> e;
    std::vector<std::span<T>> buffers() { return {std::span<T>(e)}; }
  };
  template <gradient_value T>
  state<T> make_state(std::size_t n) const { return {std::vector<T>(n)}; }
  template <gradient_value T>
  std::span<const T> accumulate(state<T>& s, std::span<const T>) const { return s.e; }
  template <gradient_value T>
  void update(state<T>&, std::span<const std::uint32_t>, std::span<const float>) const {}
};
struct feedback_without_state_buffers {
  template <gradient_value T>
  struct state {};
  template <gradient_value T>
  state<T> make_state(std::size_t) const { return {}; }
  template <gradient_value T>
  std::span<const T> accumulate(state<T>&, std::span<const T> g) const { return g; }
  template <gradient_value T>
  void update(state<T>&, std::span<const std::uint32_t>, std::span<const float>) const {}
};

struct comm_without_alltoallv {
  int rank() const { return 0; }
  int size() const { return 1; }
  template <class T>
  void allreduce(std::span<T>, reduce_op) {}
  template <class T>
  void allgatherv(std::span<const T>, std::vector<T>&, std::vector<std::size_t>&) {}
  template <class T>
  void broadcast(std::span<T>, int) {}
  void barrier() {}
};
// Reduces float and double only: the exchanges also add fp16 and bf16 payloads.
struct comm_float_double_only : comm_without_alltoallv {
  template <class T>
    requires std::same_as<T, float> || std::same_as<T, double>
  void allreduce(std::span<T>, reduce_op) {}
  template <class T>
  void alltoallv(std::span<const T>, std::span<const std::size_t>, std::vector<T>&,
                 std::vector<std::size_t>&) {}
};
// Moves bytes only: gTop-k and TopKA2A move (index, value) pairs.
struct comm_bytes_only_alltoallv : comm_without_alltoallv {
  template <class T>
    requires std::same_as<T, std::byte>
  void alltoallv(std::span<const T>, std::span<const std::size_t>, std::vector<T>&,
                 std::vector<std::size_t>&) {}
};

// Has the element type, but nothing to decode with: not what an exchange can use.
struct fake_compressor {
  using value_type = float;
};
struct compressor_without_decompress {
  using value_type = float;
  using quantizer_type = good_quantizer;
  static constexpr bool summable = false;
  void decode_values(const payload&, std::span<float>) const {}
};
// Claims summable payloads, with a quantizer that names no sum type.
struct summable_compressor_without_sum_type : archetypes::compressor<false> {
  using quantizer_type = summable_without_sum_type;
  static constexpr bool summable = true;
};
struct good_exchange {
  template <class C, class Comm>
  exchange_stats exchange(Comm&, const C&, const payload&, std::span<typename C::value_type>) {
    return {};
  }
};
struct exchange_without_stats {
  template <class C, class Comm>
  void exchange(Comm&, const C&, const payload&, std::span<typename C::value_type>) {}
};

struct dense_like {
  static constexpr bool shared_indices = true;
  static constexpr bool selects_all = true;
};
struct not_shared {
  static constexpr bool shared_indices = false;
};

}  // namespace

TEST_CASE("selector concept") {
  static_assert(selector<good_selector>);
  static_assert(selector<good_selector, double>);
  static_assert(!selector<selector_without_stats>);
  static_assert(selector<selector_float_only, float>);
  static_assert(!selector<selector_float_only, double>);
  static_assert(!selector<good_selector, int>);  // gradients are float or double
  CHECK(true);
}

TEST_CASE("quantizer concept") {
  static_assert(quantizer<good_quantizer>);
  static_assert(!quantizer<quantizer_without_decode>);
  static_assert(!summable_quantizer<good_quantizer>);
  static_assert(!summable_quantizer<summable_without_sum_type>);
  static_assert(summable_quantizer<good_summable>);
  CHECK(true);
}

TEST_CASE("feedback concept") {
  static_assert(feedback<good_feedback>);
  static_assert(feedback<good_feedback, double>);
  static_assert(!feedback<feedback_without_state_buffers>);
  CHECK(true);
}

TEST_CASE("communicator concept") {
  static_assert(communicator<archetypes::communicator>);
  static_assert(!communicator<comm_without_alltoallv>);
  static_assert(!communicator<comm_float_double_only>);
  static_assert(!communicator<comm_bytes_only_alltoallv>);
  static_assert(!point_to_point<archetypes::communicator, std::byte>);
  CHECK(true);
}

TEST_CASE("exchange_compressor concept") {
  static_assert(exchange_compressor<archetypes::compressor<false>>);
  static_assert(exchange_compressor<archetypes::compressor<true>>);
  static_assert(!exchange_compressor<fake_compressor>);
  static_assert(!exchange_compressor<compressor_without_decompress>);
  static_assert(!exchange_compressor<summable_compressor_without_sum_type>);
  CHECK(true);
}

TEST_CASE("exchange concept") {
  using arch = archetypes::compressor<false>;
  static_assert(exchange<good_exchange, arch, archetypes::communicator>);
  static_assert(!exchange<exchange_without_stats, arch, archetypes::communicator>);
  static_assert(!exchange<good_exchange, arch, comm_without_alltoallv>);
  static_assert(!exchange<good_exchange, fake_compressor, archetypes::communicator>);
  static_assert(!exchange_with_unused<good_exchange, arch, archetypes::communicator>);
  static_assert(!fuses_tensors<good_exchange, arch, archetypes::communicator>);
  CHECK(true);
}

TEST_CASE("selector traits") {
  static_assert(shared_indices_v<dense_like> && selects_all_v<dense_like>);
  static_assert(!shared_indices_v<not_shared> && !selects_all_v<not_shared>);
  static_assert(!shared_indices_v<good_selector> && !selects_all_v<good_selector>);
  CHECK(true);
}

TEST_CASE("optional abilities of the shipped policies") {
  // Settings a selector checks before the state changes.
  static_assert(checks_settings<topk> && checks_settings<threshold> && checks_settings<redsync>);
  static_assert(!checks_settings<good_selector>);
  // The fused accumulate-and-select pass: a selector that adds while it scans, and a feedback
  // that accumulates in place; dense selects everything, so it never fuses.
  static_assert(fuses_accumulation<topk, residual> && fuses_accumulation<gaussiank, residual>);
  static_assert(fuses_accumulation<topk, residual, double>);
  static_assert(!fuses_accumulation<randomk, residual> && !fuses_accumulation<dense, residual>);
  static_assert(!fuses_accumulation<topk, no_feedback> && !fuses_accumulation<topk, dgc_momentum>);
  // Picks an exchange left out go back to these feedbacks, and are dropped by no_feedback.
  static_assert(restores_picks<residual> && restores_picks<dgc_momentum, double>);
  static_assert(!restores_picks<no_feedback>);
  static_assert(applies_momentum_v<dgc_momentum> && !applies_momentum_v<residual>);
  static_assert(shared_indices_v<randomk> && shared_indices_v<dense> && !shared_indices_v<topk>);
  static_assert(selects_all_v<dense> && !selects_all_v<randomk>);
  CHECK(true);
}
