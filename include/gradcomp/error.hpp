// gradcomp/error.hpp: the exceptions gradcomp throws at the host edge.
// Every message names what was wrong and, for arguments, the allowed range,
// so that a user can fix the call without reading the library.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace gradcomp {

// Root of the hierarchy: catch this to handle anything gradcomp throws.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A caller passed an argument outside its allowed range (k > n, density <= 0, spans of
// different sizes...). Thrown before any state is touched.
class invalid_argument : public error {
 public:
  using error::error;
};

// A byte payload or payload object is malformed (bad magic, unknown version or quantizer,
// truncated, index out of range, unsorted or duplicate indices...). Nothing is written.
class payload_error : public error {
 public:
  using error::error;
};

// A gradient holds NaN or +-Inf and the policy is nonfinite_policy::error (the default).
class nonfinite_error : public error {
 public:
  using error::error;
};

// A collective failed: ranks disagree on sizes, or another rank failed mid-step.
class communicator_error : public error {
 public:
  using error::error;
};

namespace detail {

template <class... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}

// "gradcomp::topk: argument 'k' = 12 is out of range; allowed: 0 <= k <= n (n = 10)"
template <class Value>
[[noreturn]] void throw_invalid_argument(std::string_view where, std::string_view arg,
                                         const Value& value, std::string_view allowed) {
  throw invalid_argument(concat("gradcomp::", where, ": argument '", arg, "' = ", value,
                                " is out of range; allowed: ", allowed));
}

template <class... Parts>
[[noreturn]] void throw_payload_error(std::string_view where, const Parts&... parts) {
  throw payload_error(concat("gradcomp::", where, ": malformed payload: ", parts...));
}

// Internal invariant; a failure is a gradcomp bug, reported with file:line. (The builtins,
// not std::source_location, which clang 14 with libstdc++ 12 cannot compile.)
inline void check_invariant(bool ok, const char* what, const char* file = __builtin_FILE(),
                            int line = __builtin_LINE()) {
  if (!ok) throw error(concat("gradcomp internal error: ", what, " (", file, ":", line, ")"));
}

}  // namespace detail
}  // namespace gradcomp
