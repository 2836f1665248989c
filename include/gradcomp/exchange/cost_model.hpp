// gradcomp/exchange/cost_model.hpp: the cost model of each exchange (alpha seconds per
// message, beta seconds per byte, and the local work priced per element streamed, per pair
// scattered and per pair merged), the choice of the cheapest, and measure_link(), which
// measures all of them on a communicator.
//
// One topic a header: exchange/link_model.hpp (the link and the exchanges' shapes),
// exchange/cost_formulas.hpp (the formulas and predict()), exchange/measure_link.hpp
// (measuring a link on a communicator) and exchange/link_median.hpp (medians of calibrations).
#pragma once

#include <gradcomp/exchange/cost_formulas.hpp>
#include <gradcomp/exchange/link_median.hpp>
#include <gradcomp/exchange/link_model.hpp>
#include <gradcomp/exchange/measure_link.hpp>
