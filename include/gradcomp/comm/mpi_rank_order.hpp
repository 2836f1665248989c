// gradcomp/comm/mpi_rank_order.hpp: mpi_comm's rank-order allreduce (mpi_reduction::rank_order),
// the sums bit-identical to a sequential loop over ranks: per chunk of the buffer an alltoallv
// hands every rank its share of every rank's chunk, the rank folds them in rank order
// (detail::combine, the one fold rule), and an in-place allgatherv spreads the folded shares.
// Also the scratch buffers it keeps between calls. Needs <mpi.h>; link MPI::MPI_CXX.
#pragma once

#include <algorithm>
#include <any>
#include <cstddef>
#include <memory>
#include <mutex>
#include <span>
#include <utility>
#include <vector>

#include <gradcomp/comm/mpi_request.hpp>
#include <gradcomp/detail/comm_common.hpp>

namespace gradcomp::detail {

// Scratch buffers of the rank-order allreduce, kept between calls: a fresh one per call (P
// shares of a chunk, up to chunk_elements values: 64 MB of floats) is mapped anew each time
// and costs a page fault per page, more than the fold itself. A request takes the largest
// free buffer of its element type at its first chunk and gives it back when its last chunk is
// gathered (or when its state is destroyed), so the pool holds, per element type, one buffer
// per request in flight at once (at most four: start() keeps four slots), each as large as
// the largest chunk it served. They are freed with the mpi_comm (which holds the pool).
struct mpi_scratch_pool {
  std::mutex mutex;
  std::vector<std::any> free;  // each a std::vector<T>
};
template <class T>
struct mpi_scratch_lease {
  std::shared_ptr<mpi_scratch_pool> pool;
  std::vector<T> buf;
  bool held = false;
  mpi_scratch_lease() = default;
  mpi_scratch_lease(const mpi_scratch_lease&) = delete;
  mpi_scratch_lease& operator=(const mpi_scratch_lease&) = delete;
  ~mpi_scratch_lease() { give_back(); }
  // At least `n` elements at data(): a buffer from the pool on first use, grown (never
  // shrunk, so no pass re-fills what it already holds) when too small.
  void reserve(std::size_t n) {
    if (!held && pool) {
      const std::lock_guard lock(pool->mutex);
      auto& f = pool->free;
      auto best = f.end();
      std::size_t best_size = 0;
      for (auto it = f.begin(); it != f.end(); ++it) {
        const auto* v = std::any_cast<std::vector<T>>(&*it);
        if (v && (best == f.end() || v->size() > best_size)) {
          best = it;
          best_size = v->size();
        }
      }
      if (best != f.end()) {
        buf = std::move(*std::any_cast<std::vector<T>>(&*best));
        f.erase(best);
      }
    }
    held = true;
    if (buf.size() < n) {
      buf.clear();  // nothing to keep: skip the copy of the old contents
      buf.resize(n);
    }
  }
  T* data() noexcept { return buf.data(); }
  void give_back() noexcept {
    if (!held || !pool) return;
    held = false;
    try {
      const std::lock_guard lock(pool->mutex);
      pool->free.emplace_back(std::move(buf));
    } catch (...) {
      // No memory for the pool's entry: the buffer is freed instead, as it was before.
    }
    buf = {};
  }
};

// The phases of one rank-order allreduce of `data` over `size` ranks, for mpi_comm::start():
// even phases scatter chunk phase/2 (of `chunk` elements, at most INT_MAX), odd phases fold
// and gather it. `type` is a byte type of sizeof(T); the shares come from `scratch`.
template <class T>
mpi_poster mpi_rank_order_allreduce(std::span<T> data, reduce_op op, int size, int rank,
                                    std::size_t chunk, MPI_Datatype type,
                                    std::shared_ptr<mpi_scratch_pool> scratch) {
  struct state_data {
    mpi_scratch_lease<T> shares;  // P blocks of this rank's share of the current chunk
    std::vector<int> sc, sd, rc, rd;
    std::size_t chunk_at = 0, chunk_len = 0;
  };
  const auto p = static_cast<std::size_t>(size);
  const auto r = static_cast<std::size_t>(rank);
  auto d = std::make_shared<state_data>();
  d->shares.pool = std::move(scratch);
  for (auto* v : {&d->sc, &d->sd, &d->rc, &d->rd}) v->resize(p);
  return [d, data, op, p, r, chunk, type](std::vector<MPI_Request>& reqs, int phase, MPI_Comm c) {
    // Even phases scatter chunk phase/2, odd phases gather it.
    const std::size_t round = static_cast<std::size_t>(phase) / 2;
    if (phase % 2 == 0) {
      if (round * chunk >= data.size()) {
        d->shares.give_back();  // the last chunk is folded and gathered
        return false;
      }
      d->chunk_at = round * chunk;
      d->chunk_len = std::min(chunk, data.size() - d->chunk_at);
      const std::size_t n = d->chunk_len;
      const std::size_t mine = detail::share_begin(n, p, r + 1) - detail::share_begin(n, p, r);
      d->shares.reserve(p * mine);
      for (std::size_t s = 0; s < p; ++s) {
        d->sd[s] = static_cast<int>(detail::share_begin(n, p, s));
        d->sc[s] = static_cast<int>(detail::share_begin(n, p, s + 1)) - d->sd[s];
        d->rc[s] = static_cast<int>(mine);
        d->rd[s] = static_cast<int>(s * mine);
      }
      reqs.emplace_back();
      detail::mpi_check(MPI_Ialltoallv(data.data() + d->chunk_at, d->sc.data(), d->sd.data(),
                                       type, d->shares.data(), d->rc.data(), d->rd.data(), type,
                                       c, &reqs.back()),
                        "MPI_Ialltoallv (allreduce shares)");
      return true;
    }
    const std::size_t n = d->chunk_len;
    const std::size_t begin = detail::share_begin(n, p, r);
    const std::size_t mine = detail::share_begin(n, p, r + 1) - begin;
    T* acc = d->shares.data();  // block of rank 0
    for (std::size_t s = 1; s < p; ++s) detail::combine(acc, acc + s * mine, mine, op);
    std::copy_n(acc, mine, data.data() + d->chunk_at + begin);
    reqs.emplace_back();
    detail::mpi_check(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL,
                                      data.data() + d->chunk_at, d->sc.data(), d->sd.data(),
                                      type, c, &reqs.back()),
                      "MPI_Iallgatherv (allreduce shares)");
    return true;
  };
}

}  // namespace gradcomp::detail
