// gradcomp/step.hpp: the compressor and the synchronous SGD driver together (includes only):
// compressor.hpp (compressor<S, Q, F>) and sparsified_sgd.hpp (sparsified_sgd<C, X, Comm>).
#pragma once

#include <gradcomp/compressor.hpp>
#include <gradcomp/sparsified_sgd.hpp>
