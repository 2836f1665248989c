// expect: Q is not a gradcomp::quantizer: it needs id, summable
// A quantizer without decode(): compressor<> names the missing requirement.
#include <cstdint>
#include <span>

#include <gradcomp/feedback/residual.hpp>
#include <gradcomp/select/topk.hpp>
#include <gradcomp/step.hpp>

struct my_quantizer {
  static constexpr gradcomp::quantizer_id id = gradcomp::quantizer_id::identity;
  static constexpr bool summable = false;
  unsigned bits_per_value() const { return 32; }
  gradcomp::quantizer_params params() const { return {}; }
  void encode(std::span<const float>, const gradcomp::call_id&, gradcomp::payload&) const {}
};

gradcomp::compressor<gradcomp::topk, my_quantizer, gradcomp::residual> c;
