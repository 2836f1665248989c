// gradcomp/detail/checkpoint.hpp: the raw reads and writes of the drivers' checkpoints
// (sparsified_sgd, periodic_averaging): values in the machine's byte order, each read checked
// so that a truncated stream is refused, with the message naming the driver.
#pragma once

#include <cstdint>
#include <istream>
#include <ostream>
#include <span>
#include <string>
#include <string_view>

#include <gradcomp/error.hpp>

namespace gradcomp::detail {

// "gradcomp::<driver>::load_state: <why>; the optimizer state is unchanged".
[[noreturn]] inline void fail_load(std::string_view driver, const std::string& why) {
  throw invalid_argument(concat("gradcomp::", driver, "::load_state: ", why,
                                "; the optimizer state is unchanged"));
}

template <class V>
void put(std::ostream& os, V v) {
  os.write(reinterpret_cast<const char*>(&v), sizeof(V));
}

template <class T>
void put_array(std::ostream& os, std::span<const T> a) {
  os.write(reinterpret_cast<const char*>(a.data()), static_cast<std::streamsize>(a.size_bytes()));
}

template <class V>
V get(std::istream& is, std::string_view driver) {
  V v{};
  if (!is.read(reinterpret_cast<char*>(&v), sizeof(V))) fail_load(driver, "the checkpoint is truncated");
  return v;
}

template <class T>
void get_array(std::istream& is, std::span<T> a, std::string_view driver) {
  if (!is.read(reinterpret_cast<char*>(a.data()), static_cast<std::streamsize>(a.size_bytes()))) {
    fail_load(driver, "the checkpoint is truncated");
  }
}

// The header every driver's checkpoint starts with: magic, format version, element size.
// `what` names the checkpoint in the bad-magic message ("gradcomp", "gradcomp
// periodic_averaging").
inline void check_header(std::istream& is, std::string_view driver, std::string_view what,
                         std::uint32_t magic, std::uint32_t version, std::uint32_t element_size) {
  if (get<std::uint32_t>(is, driver) != magic) {
    fail_load(driver, concat("not a ", what, " checkpoint (bad magic)"));
  }
  if (const auto v = get<std::uint32_t>(is, driver); v != version) {
    fail_load(driver, concat("checkpoint version ", v, " is not supported (this build reads version ",
                             version, ")"));
  }
  if (const auto sz = get<std::uint32_t>(is, driver); sz != element_size) {
    fail_load(driver, concat("checkpoint holds ", sz, "-byte values, this optimizer uses ",
                             element_size, "-byte values"));
  }
}

}  // namespace gradcomp::detail
