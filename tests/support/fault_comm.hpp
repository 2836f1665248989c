// A communicator wrapper for fault injection: it counts every call this rank makes (the
// collectives and sendrecv), and at one chosen call either throws instead of making it, or
// corrupts what this rank sends in it. Used in-process (tests/reliability/) and under MPI
// (tests/mpi/mpi_faults.cpp) with every driver and exchange.
//
// Corruption is structural, so that a receiver can notice it: the first four bytes of a byte
// message (the magic of a payload or exchange header) are inverted, and the first (index,
// value) pair of a pair message gets an index no tensor has. Messages of values (allreduce
// operands, dense shards) carry no structure to check: corrupting them changes numbers, not
// validity, and the wrapper reports such a call as `value_message`.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <gradcomp/concepts.hpp>
#include <gradcomp/error.hpp>
#include <gradcomp/sparse.hpp>

namespace gradcomp_test {

enum class fault_kind {
  none,
  throw_before,  // the call throws communicator_error before reaching the inner communicator
  corrupt,       // the call goes through with this rank's outgoing data corrupted
};

// What happened at the armed call.
enum class fault_effect {
  not_reached,    // the call count never got there
  thrown,         // throw_before fired
  corrupted,      // structural data was corrupted
  value_message,  // the call only carries values: corrupting it would not be detectable
  nothing_sent,   // this rank sends nothing in that call (a receiver, or an empty message)
};

template <class Inner>
class fault_comm {
 public:
  explicit fault_comm(Inner& inner) : inner_(&inner) {}

  // Points the wrapper at another communicator (a fresh in-process world after a failure).
  void rebind(Inner& inner) { inner_ = &inner; }
  Inner& inner() { return *inner_; }

  // Fault the call numbered `at` from now (0-based); counting restarts.
  void arm(fault_kind kind, std::size_t at) {
    kind_ = kind;
    at_ = at;
    calls_ = 0;
    effect_ = fault_effect::not_reached;
    fault_call_.clear();
  }
  void disarm() { arm(fault_kind::none, 0); }
  // Calls made since the last arm().
  [[nodiscard]] std::size_t calls() const noexcept { return calls_; }
  [[nodiscard]] fault_effect effect() const noexcept { return effect_; }
  // The call that was faulted, e.g. "allgatherv<bytes>".
  [[nodiscard]] const std::string& fault_call() const noexcept { return fault_call_; }
  // Called before a throw_before fault throws (in-process: fail the world, so that the other
  // ranks stop waiting for this one).
  std::function<void(std::string_view)> on_throw;

  int rank() const { return inner_->rank(); }
  int size() const { return inner_->size(); }

  template <class T>
  void allreduce(std::span<T> data, gradcomp::reduce_op op) {
    if (hit(name<T>("allreduce"))) effect_ = fault_effect::value_message;
    inner_->allreduce(data, op);
  }
  template <class T>
  void allgatherv(std::span<const std::type_identity_t<T>> send, std::vector<T>& recv,
                  std::vector<std::size_t>& counts) {
    if (hit(name<T>("allgatherv"))) {
      std::vector<T> copy(send.begin(), send.end());
      corrupt(std::span<T>(copy));
      inner_->allgatherv(std::span<const T>(copy), recv, counts);
      return;
    }
    inner_->allgatherv(send, recv, counts);
  }
  template <class T>
  void alltoallv(std::span<const std::type_identity_t<T>> send,
                 std::span<const std::size_t> send_counts, std::vector<T>& recv,
                 std::vector<std::size_t>& counts) {
    if (hit(name<T>("alltoallv"))) {
      std::vector<T> copy(send.begin(), send.end());
      corrupt(std::span<T>(copy));
      inner_->alltoallv(std::span<const T>(copy), send_counts, recv, counts);
      return;
    }
    inner_->alltoallv(send, send_counts, recv, counts);
  }
  template <class T>
  void broadcast(std::span<T> data, int root) {
    if (hit(name<T>("broadcast"))) {
      // The root's data is corrupted where it lies, as if it had been corrupted before the
      // send: every rank, the root included, then holds the same corrupted message.
      if (root == rank()) {
        corrupt(data);
      } else {
        effect_ = fault_effect::nothing_sent;
      }
    }
    inner_->broadcast(data, root);
  }
  void barrier() {
    if (hit("barrier")) effect_ = fault_effect::nothing_sent;
    inner_->barrier();
  }
  template <class T>
    requires gradcomp::point_to_point<Inner, T>
  void sendrecv(std::span<const std::type_identity_t<T>> send, int dest, std::vector<T>& recv,
                int source) {
    if (hit(name<T>("sendrecv"))) {
      std::vector<T> copy(send.begin(), send.end());
      if (dest >= 0) {
        corrupt(std::span<T>(copy));
      } else {
        effect_ = fault_effect::nothing_sent;
      }
      inner_->sendrecv(std::span<const T>(copy), dest, recv, source);
      return;
    }
    inner_->sendrecv(send, dest, recv, source);
  }

 private:
  template <class T>
  static std::string name(const char* call) {
    if constexpr (std::is_same_v<T, std::byte>) return std::string(call) + "<bytes>";
    if constexpr (std::is_same_v<T, gradcomp::index_value>) return std::string(call) + "<pairs>";
    return std::string(call) + "<values>";
  }

  // Whether this call is the armed one; throws for throw_before.
  bool hit(const std::string& call) {
    const std::size_t index = calls_++;
    if (kind_ == fault_kind::none || index != at_) return false;
    fault_call_ = call;
    if (kind_ == fault_kind::throw_before) {
      effect_ = fault_effect::thrown;
      const std::string what = "injected fault at call " + std::to_string(index) + " (" + call + ")";
      if (on_throw) on_throw(what);
      throw gradcomp::communicator_error("gradcomp_test::fault_comm: " + what);
    }
    return true;
  }

  template <class T>
  void corrupt(std::span<T> data) {
    if (data.empty()) {
      effect_ = fault_effect::nothing_sent;
      return;
    }
    if constexpr (std::is_same_v<T, std::byte>) {
      for (std::size_t i = 0; i < data.size() && i < 4; ++i) data[i] = ~data[i];
      effect_ = fault_effect::corrupted;
    } else if constexpr (std::is_same_v<T, gradcomp::index_value>) {
      data[0].index = 0xfffffff0u;
      effect_ = fault_effect::corrupted;
    } else {
      effect_ = fault_effect::value_message;
    }
  }

  Inner* inner_;
  fault_kind kind_ = fault_kind::none;
  std::size_t at_ = 0;
  std::size_t calls_ = 0;
  fault_effect effect_ = fault_effect::not_reached;
  std::string fault_call_;
};

}  // namespace gradcomp_test
