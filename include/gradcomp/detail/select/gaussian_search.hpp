// gradcomp/detail/select/gaussian_search.hpp: one correction of Gaussian-k's threshold, shared
// by the host selector and the device dispatch so that both take the same steps.
#pragma once

#include <cmath>

#include <gradcomp/config.hpp>

namespace gradcomp::detail {

// The closest thresholds seen on either side of the band: `low` selected more than 4k/3,
// `high` fewer than 2k/3; 0 while none has been seen on that side.
struct gaussian_bracket {
  double low = 0.0;
  double high = 0.0;
};

// The next threshold after `thr` selected too few (too_few) or too many. The published form
// halves or multiplies by 1.5; the banded form does the same until both sides have been seen
// and then bisects geometrically between the closest thresholds on either side, so that it
// closes in on the band instead of stepping over it.
GRADCOMP_HOST_DEVICE double gaussian_correction(double thr, bool too_few, bool banded,
                                                gaussian_bracket& br) {
  if (banded) {
    if (too_few) {
      br.high = thr;
    } else {
      br.low = thr;
    }
    if (br.low > 0.0 && br.high > 0.0) return ::sqrt(br.low) * ::sqrt(br.high);
  }
  return too_few ? thr * 0.5 : thr * 1.5;
}

}  // namespace gradcomp::detail
