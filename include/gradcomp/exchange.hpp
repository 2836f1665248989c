// gradcomp/exchange.hpp: all exchanges, the header agreement they share and the cost model
// auto_exchange chooses by.
#pragma once

#include <gradcomp/exchange/agreement.hpp>
#include <gradcomp/exchange/auto.hpp>
#include <gradcomp/exchange/cost_model.hpp>
#include <gradcomp/exchange/dense_allreduce.hpp>
#include <gradcomp/exchange/gtopk.hpp>
#include <gradcomp/exchange/sparse_allgather.hpp>
#include <gradcomp/exchange/topk_a2a.hpp>
