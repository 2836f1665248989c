// gradcomp/torch/tensor.hpp: LibTorch tensors as the spans gradcomp's policies take. A view
// is only made of what gradcomp can read in place: a dense (strided), contiguous CPU tensor of
// the span's element type. Anything else is refused with an error that names the argument and
// the tensor's dtype, device and layout; nothing is ever copied behind the caller's back.
// Needs LibTorch (link torch; see docs/torch.md and docs/libtorch.md).
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

#include <torch/types.h>

#include <gradcomp/error.hpp>

namespace gradcomp::torch_views {

// The torch dtype that holds T (float: Float, double: Double).
template <class T>
constexpr c10::ScalarType scalar_type_of() {
  if constexpr (std::is_same_v<std::remove_const_t<T>, float>) return c10::ScalarType::Float;
  else if constexpr (std::is_same_v<std::remove_const_t<T>, double>) return c10::ScalarType::Double;
  else static_assert(sizeof(T) == 0, "gradcomp::torch_views: T must be float or double");
}

// "dtype float16, device cuda:0, layout strided, contiguous": what a message needs to say about
// a tensor so that the caller sees why it was refused.
inline std::string describe(const at::Tensor& t) {
  if (!t.defined()) return "an undefined tensor";
  return detail::concat("dtype ", c10::toString(t.scalar_type()), ", device ", t.device().str(),
                        ", layout ", t.layout(), t.layout() == c10::kStrided && t.is_contiguous()
                                                     ? ", contiguous"
                                                     : t.layout() == c10::kStrided
                                                           ? ", not contiguous"
                                                           : "");
}

// Why t cannot be viewed as a span of T, or an empty string when it can.
template <class T>
std::string why_not_viewable(const at::Tensor& t) {
  const auto want = scalar_type_of<T>();
  if (!t.defined()) return "the tensor is undefined";
  if (t.layout() != c10::kStrided) return "only dense (strided) tensors can be viewed";
  if (!t.device().is_cpu()) return "only CPU tensors can be viewed here";
  if (t.scalar_type() != want) {
    return detail::concat("the dtype must be ", c10::toString(want));
  }
  if (!t.is_contiguous()) return "the tensor must be contiguous (call .contiguous() first)";
  return {};
}

// t as a mutable span of T; `where` and `arg` name the call and the argument in the error.
template <class T>
std::span<T> as_span(const at::Tensor& t, std::string_view where, std::string_view arg) {
  if (auto why = why_not_viewable<T>(t); !why.empty()) {
    throw invalid_argument(detail::concat("gradcomp::", where, ": argument '", arg, "' is ",
                                          describe(t), "; ", why, " (allowed: a contiguous ",
                                          c10::toString(scalar_type_of<T>()),
                                          " CPU tensor with the strided layout)"));
  }
  return std::span<T>(t.data_ptr<std::remove_const_t<T>>(), static_cast<std::size_t>(t.numel()));
}

}  // namespace gradcomp::torch_views
