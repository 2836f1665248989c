// gradcomp/exchange.hpp: all exchanges.
#pragma once

#include <gradcomp/exchange/dense_allreduce.hpp>
#include <gradcomp/exchange/sparse_allgather.hpp>
