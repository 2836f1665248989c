// gradcomp/schedule/merged.hpp: merged-gradient sparsification (MGS, after MG-WFBP). Neighbouring
// layers are exchanged as one sparsified group when that saves more in start-up latency than
// it costs in waiting for the later layer's gradient. plan_merged_groups() is the pure planning
// step (cost model in, groups out); merged_tensors() turns a plan into the tensors that
// sparsified_sgd or layerwise_sgd run over.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include <gradcomp/context.hpp>
#include <gradcomp/error.hpp>
#include <gradcomp/exchange/cost_model.hpp>
#include <gradcomp/sgd.hpp>

namespace gradcomp {

// What one group's communication costs: selection over all its elements, then a sparse
// allgather of its payload (k = density * elements index/value pairs of 8 bytes plus the
// 40-byte wire header) among `ranks` ranks over `link`, every byte at beta: the groups go out
// one after another during the backward pass, with no idle time that a burst
// (link_model::burst_bytes) could be counted on.
struct merge_cost {
  link_model link{};
  int ranks = 2;
  double density = 0.001;
  double select_seconds_per_element = 0.0;

  [[nodiscard]] double seconds(std::size_t elements) const {
    const double k = static_cast<double>(k_for_density(elements, density));
    exchange_shape shape;
    shape.ranks = static_cast<std::size_t>(ranks);
    shape.n = elements;
    shape.k = k;
    shape.k_max = static_cast<std::size_t>(k);
    shape.payload_bytes = 8.0 * k + 40.0;
    link_model paced = link;
    paced.burst_bytes = 0.0;
    return select_seconds_per_element * static_cast<double>(elements) +
           cost::sparse_allgather(shape, paced);
  }
};

// Layers [first, first + count), forward order.
struct layer_group {
  std::size_t first = 0;
  std::size_t count = 0;
};

struct merge_plan {
  std::vector<layer_group> groups;  // forward order, covering every layer once
  // Modelled time from the start of the backward pass to the end of the last group's
  // communication, for this plan and with every layer on its own.
  double predicted_seconds = 0.0;
  double unmerged_seconds = 0.0;

  // The group whose gradient is complete once layer `layer`'s backward pass is done (the
  // backward pass runs from the last layer to the first, so that is the group's first layer),
  // or nothing while the group still waits for earlier layers.
  [[nodiscard]] std::optional<std::size_t> completes(std::size_t layer) const {
    for (std::size_t g = 0; g < groups.size(); ++g) {
      if (groups[g].first == layer) return g;
    }
    return std::nullopt;
  }
};

// Walks the layers from the last to the first, as the backward pass produces them. Layer l
// joins the group being built when the merged communication would finish strictly earlier
// than closing the group and sending l on its own; otherwise l starts a new group. Groups
// communicate one after the other, each once its last-computed layer is done (an exchange
// thread, as layerwise_sgd runs them). backward_seconds[l] is layer l's own backward time.
inline merge_plan plan_merged_groups(std::span<const std::size_t> sizes,
                                     std::span<const double> backward_seconds,
                                     const merge_cost& cost) {
  if (backward_seconds.size() != sizes.size()) {
    detail::throw_invalid_argument("plan_merged_groups", "backward_seconds.size()",
                                   backward_seconds.size(),
                                   detail::concat("sizes.size() (", sizes.size(), ")"));
  }
  if (cost.ranks < 1) detail::throw_invalid_argument("plan_merged_groups", "ranks", cost.ranks, ">= 1");
  (void)k_for_density(1, cost.density);
  if (!(cost.select_seconds_per_element >= 0.0) || !(cost.link.alpha >= 0.0) ||
      !(cost.link.beta >= 0.0)) {
    detail::throw_invalid_argument("plan_merged_groups", "cost",
                                   detail::concat(cost.link.alpha, ", ", cost.link.beta, ", ",
                                                  cost.select_seconds_per_element),
                                   "alpha, beta and the selection cost >= 0");
  }
  merge_plan plan;
  const std::size_t layers = sizes.size();
  if (layers == 0) return plan;

  double now = 0.0;  // backward time elapsed when layer l is done
  double prev_end = 0.0;             // the closed groups' communication ends
  double cur_end = 0.0;              // the open group's, as it stands
  double alone_end = 0.0;            // every layer on its own
  std::size_t cur_elements = 0;
  std::size_t cur_first = layers;  // the open group is [cur_first, cur_last]
  std::size_t cur_last = layers;
  std::vector<layer_group> reversed;
  for (std::size_t step = 0; step < layers; ++step) {
    const std::size_t l = layers - 1 - step;
    if (!(backward_seconds[l] >= 0.0)) {
      detail::throw_invalid_argument("plan_merged_groups", "backward_seconds", backward_seconds[l],
                                     ">= 0");
    }
    now += backward_seconds[l];
    alone_end = std::max(now, alone_end) + cost.seconds(sizes[l]);
    if (step == 0) {
      cur_first = cur_last = l;
      cur_elements = sizes[l];
      cur_end = now + cost.seconds(sizes[l]);
      continue;
    }
    const double merged = std::max(now, prev_end) + cost.seconds(cur_elements + sizes[l]);
    const double separate = std::max(now, cur_end) + cost.seconds(sizes[l]);
    if (merged < separate) {
      cur_first = l;
      cur_elements += sizes[l];
      cur_end = merged;
    } else {
      reversed.push_back({cur_first, cur_last - cur_first + 1});
      prev_end = cur_end;
      cur_first = cur_last = l;
      cur_elements = sizes[l];
      cur_end = separate;
    }
  }
  reversed.push_back({cur_first, cur_last - cur_first + 1});
  plan.groups.assign(reversed.rbegin(), reversed.rend());
  plan.predicted_seconds = cur_end;
  plan.unmerged_seconds = alone_end;
  return plan;
}

// The plan's groups as tensors of a flat buffer that holds the layers back to back: group g
// has the id of its first layer and the sum of its layers' sizes.
inline std::vector<tensor_spec> merged_tensors(const merge_plan& plan,
                                               std::span<const tensor_spec> layers) {
  std::vector<tensor_spec> out;
  std::size_t expect = 0;
  for (const layer_group& g : plan.groups) {
    if (g.first != expect || g.count == 0 || g.first + g.count > layers.size()) {
      detail::throw_invalid_argument("merged_tensors", "plan", detail::concat("group at ", g.first),
                                     "consecutive non-empty groups covering the layers");
    }
    tensor_spec t{layers[g.first].id, 0};
    for (std::size_t l = g.first; l < g.first + g.count; ++l) t.size += layers[l].size;
    out.push_back(t);
    expect = g.first + g.count;
  }
  if (expect != layers.size()) {
    detail::throw_invalid_argument("merged_tensors", "plan", detail::concat(expect, " layers"),
                                   detail::concat("all ", layers.size(), " layers"));
  }
  return out;
}

}  // namespace gradcomp
