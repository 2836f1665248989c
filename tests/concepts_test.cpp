// For each concept, one type that models it and one that does not (missing or mistyped
// member), so the concepts keep meaning what the composition points need.
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <gradcomp/concepts.hpp>

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

struct fake_compressor {
  using value_type = float;
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
  CHECK(true);
}

TEST_CASE("exchange concept") {
  static_assert(exchange<good_exchange, fake_compressor, archetypes::communicator>);
  static_assert(!exchange<exchange_without_stats, fake_compressor, archetypes::communicator>);
  static_assert(!exchange<good_exchange, fake_compressor, comm_without_alltoallv>);
  CHECK(true);
}

TEST_CASE("selector traits") {
  static_assert(shared_indices_v<dense_like> && selects_all_v<dense_like>);
  static_assert(!shared_indices_v<not_shared> && !selects_all_v<not_shared>);
  static_assert(!shared_indices_v<good_selector> && !selects_all_v<good_selector>);
  CHECK(true);
}
