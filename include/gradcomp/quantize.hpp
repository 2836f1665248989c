// gradcomp/quantize.hpp: every shipped quantizer: identity (fp32), fp16, bf16, qsgd,
// terngrad and scaled_sign. It only includes.
#pragma once

#include <gradcomp/quantize/bf16.hpp>
#include <gradcomp/quantize/fp16.hpp>
#include <gradcomp/quantize/identity.hpp>
#include <gradcomp/quantize/qsgd.hpp>
#include <gradcomp/quantize/scaled_sign.hpp>
#include <gradcomp/quantize/terngrad.hpp>
