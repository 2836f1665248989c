// gradcomp/select.hpp: every selector: exact Top-k, Gaussian-k, Random-k, fixed threshold,
// DGC sampling, RedSync and the dense identity.
#pragma once

#include <gradcomp/select/dense.hpp>
#include <gradcomp/select/dgc_sampling.hpp>
#include <gradcomp/select/gaussiank.hpp>
#include <gradcomp/select/randomk.hpp>
#include <gradcomp/select/redsync.hpp>
#include <gradcomp/select/threshold.hpp>
#include <gradcomp/select/topk.hpp>
