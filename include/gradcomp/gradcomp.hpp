// gradcomp/gradcomp.hpp: the umbrella header; it only includes. Pick single headers
// (gradcomp/select/topk.hpp, gradcomp/quantize/qsgd.hpp, ...) to compile less.
#pragma once

#include <gradcomp/comm/in_process.hpp>
#include <gradcomp/compressor.hpp>
#include <gradcomp/concepts.hpp>
#include <gradcomp/config.hpp>
#include <gradcomp/context.hpp>
#include <gradcomp/device.hpp>
#include <gradcomp/error.hpp>
#include <gradcomp/exchange.hpp>
#include <gradcomp/feedback.hpp>
#include <gradcomp/quantize.hpp>
#include <gradcomp/schedule.hpp>
#include <gradcomp/select.hpp>
#include <gradcomp/sgd.hpp>
#include <gradcomp/sparse.hpp>
#include <gradcomp/sparsified_sgd.hpp>
#include <gradcomp/wire.hpp>
