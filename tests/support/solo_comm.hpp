// A communicator of one rank, for single-process runs of sparsified_sgd without threads.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include <gradcomp/concepts.hpp>

namespace gradcomp_test {

struct solo_comm {
  int rank() const { return 0; }
  int size() const { return 1; }
  template <class T>
  void allreduce(std::span<T>, gradcomp::reduce_op) {}
  template <class T>
  void allgatherv(std::span<const T> send, std::vector<T>& recv, std::vector<std::size_t>& counts) {
    recv.assign(send.begin(), send.end());
    counts.assign(1, send.size());
  }
  template <class T>
  void alltoallv(std::span<const T> send, std::span<const std::size_t>, std::vector<T>& recv,
                 std::vector<std::size_t>& counts) {
    recv.assign(send.begin(), send.end());
    counts.assign(1, send.size());
  }
  template <class T>
  void broadcast(std::span<T>, int) {}
  void barrier() {}
};
static_assert(gradcomp::communicator<solo_comm>);

}  // namespace gradcomp_test
