// gradcomp/detail/sgd_checkpoint.hpp: the checkpoint of sparsified_sgd and of its device twin
// device_sparsified_sgd (cuda/sparsified_sgd.cuh), written and read by this one code, so that
// either driver loads the other's: magic "GCKP", version, element size, the step counter, per
// tensor its id, size, feedback buffer count and buffers (keyed by id, in any order), then
// the velocity.
#pragma once

#include <cstddef>
#include <cstdint>
#include <istream>
#include <ostream>
#include <span>
#include <string_view>
#include <vector>

#include <gradcomp/detail/checkpoint.hpp>
#include <gradcomp/error.hpp>
#include <gradcomp/sgd.hpp>

namespace gradcomp::detail {

inline constexpr std::uint32_t sgd_checkpoint_magic = 0x504b4347;  // "GCKP" little-endian
inline constexpr std::uint32_t sgd_checkpoint_version = 1;

// buffers_of(t): tensor t's feedback buffers, as spans of const T.
template <class T, class BuffersOf>
void save_sgd_checkpoint(std::ostream& os, std::string_view driver, std::uint64_t step,
                         std::span<const tensor_spec> tensors, BuffersOf&& buffers_of,
                         std::span<const T> velocity) {
  put(os, sgd_checkpoint_magic);
  put(os, sgd_checkpoint_version);
  put(os, static_cast<std::uint32_t>(sizeof(T)));
  put(os, step);
  put(os, static_cast<std::uint32_t>(tensors.size()));
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const std::vector<std::span<const T>> buffers = buffers_of(t);
    put(os, tensors[t].id);
    put(os, static_cast<std::uint64_t>(tensors[t].size));
    put(os, static_cast<std::uint32_t>(buffers.size()));
    for (const std::span<const T> b : buffers) put_array(os, b);
  }
  put(os, static_cast<std::uint64_t>(velocity.size()));
  put_array(os, velocity);
  if (!os) throw error(concat("gradcomp::", driver, "::save_state: the stream failed while writing"));
}

// Reads a checkpoint into what the caller prepared: buffers_of(t) gives tensor t's buffers as
// spans of T of its size (their count is the feedback's), `velocity` has the driver's velocity
// size. Returns the step counter. Refuses (detail::fail_load: invalid_argument naming the
// driver) a checkpoint that does not match in any way; the caller keeps what was read only
// when this returns, so a refused checkpoint changes nothing.
template <class T, class BuffersOf>
std::uint64_t load_sgd_checkpoint(std::istream& is, std::string_view driver,
                                  std::span<const tensor_spec> tensors, BuffersOf&& buffers_of,
                                  std::span<T> velocity) {
  check_header(is, driver, "gradcomp", sgd_checkpoint_magic, sgd_checkpoint_version,
               static_cast<std::uint32_t>(sizeof(T)));
  const auto step = get<std::uint64_t>(is, driver);
  const auto count = get<std::uint32_t>(is, driver);
  if (count != tensors.size()) {
    fail_load(driver, concat("checkpoint has ", count, " tensors, this optimizer has ", tensors.size()));
  }
  std::vector<bool> seen(tensors.size(), false);
  for (std::uint32_t c = 0; c < count; ++c) {
    const auto id = get<std::uint32_t>(is, driver);
    const auto n = get<std::uint64_t>(is, driver);
    const auto nbuf = get<std::uint32_t>(is, driver);
    std::size_t t = 0;
    while (t < tensors.size() && tensors[t].id != id) ++t;
    if (t == tensors.size()) fail_load(driver, concat("checkpoint has unknown tensor id ", id));
    if (seen[t]) fail_load(driver, concat("checkpoint has tensor id ", id, " twice"));
    seen[t] = true;
    if (n != tensors[t].size) {
      fail_load(driver, concat("tensor ", id, " has ", n, " elements in the checkpoint, ",
                               tensors[t].size, " here"));
    }
    const std::vector<std::span<T>> buffers = buffers_of(t);
    if (nbuf != buffers.size()) {
      fail_load(driver, concat("tensor ", id, " has ", nbuf, " feedback buffers in the checkpoint, ",
                               buffers.size(), " here (another feedback policy?)"));
    }
    for (const std::span<T> b : buffers) get_array(is, b, driver);
  }
  const auto nvel = get<std::uint64_t>(is, driver);
  if (nvel != velocity.size()) {
    fail_load(driver, concat("checkpoint has a velocity of ", nvel, " elements, this optimizer ",
                             velocity.size(), " (momentum set differently?)"));
  }
  get_array(is, velocity, driver);
  return step;
}

}  // namespace gradcomp::detail
