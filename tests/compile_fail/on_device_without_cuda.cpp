// expect: on_device\(policy\): no device form of this policy is visible here; .*include it and compile this file with nvcc
// Calling a policy's device form without <gradcomp/cuda.cuh> fails with one sentence that says
// where the device forms are, instead of an error about an incomplete type.
#include <cstdint>

#include <gradcomp/context.hpp>
#include <gradcomp/device.hpp>
#include <gradcomp/select/topk.hpp>

void select_on_device(gradcomp::temp_storage& tmp, gradcomp::device_span<const float> g,
                      gradcomp::device_span<std::uint32_t> indices,
                      gradcomp::selection_stats* stats) {
  gradcomp::topk sel;
  gradcomp::on_device(sel).select(tmp, g, gradcomp::select_context{}, indices, stats);
}
