// gradcomp/feedback.hpp: all error-feedback policies.
#pragma once

#include <gradcomp/feedback/dgc_momentum.hpp>
#include <gradcomp/feedback/none.hpp>
#include <gradcomp/feedback/residual.hpp>
