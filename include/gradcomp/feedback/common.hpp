// gradcomp/feedback/common.hpp: argument checks shared by the feedback policies.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include <gradcomp/error.hpp>

namespace gradcomp::detail {

inline void check_feedback_size(std::string_view where, std::size_t got, std::size_t state_size) {
  if (got != state_size) {
    throw_invalid_argument(where, "g.size()", got,
                           concat("the size the feedback state was made for (", state_size, ")"));
  }
}

// update()/restore() get the indices that were sent and their decoded values; both come
// from gradcomp itself, but a caller may pass its own, so they are checked before writing.
inline void check_sent(std::string_view where, std::span<const std::uint32_t> idx,
                       std::size_t decoded_size, std::size_t n) {
  if (idx.size() != decoded_size) {
    throw_invalid_argument(where, "decoded.size()", decoded_size,
                           concat("equal to indices.size() (", idx.size(), ")"));
  }
  for (std::uint32_t i : idx) {
    if (i >= n) throw_invalid_argument(where, "index", i, concat("< n (n = ", n, ")"));
  }
}

}  // namespace gradcomp::detail
