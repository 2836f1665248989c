// gradcomp/schedule.hpp: the training schedules (includes only): layer-wise LAGS-SGD, merged
// gradient groups, and periodic quantized averaging (PQASGD).
#pragma once

#include <gradcomp/schedule/layerwise.hpp>
#include <gradcomp/schedule/merged.hpp>
#include <gradcomp/schedule/periodic_averaging.hpp>
