// gradcomp_bench: how fast each selector, quantizer and compression step is, against the
// baselines that bound it (a streaming read, a copy, std::nth_element, std::partial_sort).
//
// Names (Google Benchmark arguments, see bench/README.md):
//   select/<selector>[_<dist>]/n:<n>/ppm:<density in parts per million>
//   step/<compressor>[_<dist>]/n:<n>/ppm:<ppm>      one rank's accumulate + select + encode,
//                                                   staged (as the drivers run it)
//   step_in_place/topk_residual/n:<n>/ppm:<ppm>     the same in place (one feedback state)
//   step_pass/topk_residual/n:<n>/ppm:<ppm>         the staged top-k step's fused pass alone
//   select_residual/<selector>/n:<n>/ppm:<ppm>      select on an error-feedback residual
//   quantize/<quantizer>_encode/n:<n>, quantize/<quantizer>_decode/n:<n>
//   quantize/draws/n:<n>                            the stochastic encoders' uniforms alone
//   exchange_local/sparse_allgather/n:<n>/ppm:<ppm>/ranks:<P>  decode + add P payloads, mean
//   exchange_local/topk_a2a/n:<n>/ppm:<ppm>/ranks:<P>  decode, scatter-add into a shard, copy out
//   exchange_local/gtopk/n:<n>/ppm:<ppm>/ranks:<P>     the root's merges and output
//   baseline/{stream_read,copy,memcpy,output_pass,accumulate}/n:<n>,
//   baseline/{nth_element,partial_sort}/n:<n>/ppm:<ppm>
// <dist> is absent for normal input, `_laplace` or `_t3` (Student-t, 3 degrees of freedom) for
// the heavy-tailed ones. Every benchmark reports bytes_per_second for n * 4 bytes (the
// gradient it looks at), so GB/s compare across families like inverse times.
// Everything is single-threaded. The context names the host path that ran (gradcomp_host_isa:
// portable, baseline, avx2 or avx512; GRADCOMP_HOST_ISA caps it) and the one the CPU offers.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <gradcomp/gradcomp.hpp>

#include "baselines.hpp"
#include "inputs.hpp"

namespace {

namespace gb = gradcomp_bench;
using gradcomp::payload;
using gradcomp::select_context;
using gradcomp::selection_stats;

constexpr std::int64_t sizes[] = {std::int64_t{1} << 20, 25557032, std::int64_t{1} << 27};
constexpr std::int64_t ppms[] = {100, 1000, 10000};

std::size_t k_of(std::int64_t n, std::int64_t ppm) {
  return gradcomp::k_for_density(static_cast<std::size_t>(n), static_cast<double>(ppm) * 1e-6);
}

double min_of(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }

std::span<const float> view(const std::vector<float>& v) { return v; }

// What every benchmark reports besides time: the bytes of g it looked at per call, and per call
// on average the count it selected, how often it fell back (for topk: a bracket miss that
// radix select finished) and its refinement rounds.
// With the target k known, also how often the count lay in Gaussian-k's band [2k/3, 4k/3].
struct tally {
  std::size_t k = 0;
  double selected = 0;
  double fallbacks = 0;
  double rounds = 0;
  double in_band = 0;

  void add(const selection_stats& st) {
    selected += static_cast<double>(st.count);
    fallbacks += st.fallback ? 1.0 : 0.0;
    rounds += st.iterations;
    in_band += 3 * st.count >= 2 * k && 3 * st.count <= 4 * k ? 1.0 : 0.0;
  }

  void report(benchmark::State& state, std::int64_t n, bool with_selection = true) const {
    state.SetBytesProcessed(state.iterations() * n * static_cast<std::int64_t>(sizeof(float)));
    if (!with_selection) return;
    using C = benchmark::Counter;
    state.counters["selected"] = C(selected, C::kAvgIterations);
    state.counters["misses"] = C(fallbacks, C::kAvgIterations);
    state.counters["rounds"] = C(rounds, C::kAvgIterations);
    if (k > 0) state.counters["in_band"] = C(in_band, C::kAvgIterations);
  }
};

// ---------------------------------------------------------------------------------------
// Selectors

// The fixed-threshold selector gets the k-th largest |g| of the first buffer as tau, so that
// it selects about k like the others; every other selector is used as constructed.
template <class Selector>
void prepare(Selector&, const gb::input_set&, std::size_t) {}

void prepare(gradcomp::threshold& sel, const gb::input_set& in, std::size_t k) {
  gradcomp::topk exact;
  std::vector<std::uint32_t> idx;
  sel.tau = exact.select(view(in[0]), select_context{k, 0.0, {}}, idx).threshold;
}

template <class Selector>
void bench_select(benchmark::State& state, gb::dist d) {
  const std::int64_t n = state.range(0);
  const std::int64_t ppm = state.range(1);
  const auto& in = gb::inputs(static_cast<std::size_t>(n), d);
  Selector sel{};
  select_context ctx{k_of(n, ppm), static_cast<double>(ppm) * 1e-6, {.seed = 7}};
  prepare(sel, in, ctx.k);
  std::vector<std::uint32_t> idx;
  sel.select(view(in[0]), ctx, idx);  // scratch grows here, not in the timed loop
  tally t{.k = ctx.k};
  std::size_t it = 1;
  for (auto _ : state) {
    ctx.id.step = it;  // random policies draw afresh each call, as in training
    t.add(sel.select(view(in[it++]), ctx, idx));
    benchmark::DoNotOptimize(idx.data());
    benchmark::ClobberMemory();
  }
  t.report(state, n);
}

// Selection on an error-feedback residual: the accumulated vector e + g a running job selects
// from, whose largest values were sent in earlier steps, so that its tail is not the normal
// input's. Snapshots of exact top-k's residual at the benchmark's density after a few steps
// of independent normal gradients, as many as there are input buffers; made once per
// (n, ppm) and kept.
const std::vector<std::vector<float>>& residual_inputs(std::int64_t n, std::int64_t ppm) {
  static std::vector<std::pair<std::pair<std::int64_t, std::int64_t>,
                               std::vector<std::vector<float>>>> made;
  for (const auto& [key, set] : made) {
    if (key == std::pair{n, ppm}) return set;
  }
  const std::size_t buffers = gb::inputs(static_cast<std::size_t>(n), gb::dist::normal).size();
  const std::size_t warmup = 6;
  std::vector<float> e(static_cast<std::size_t>(n), 0.0f);
  std::vector<float> g(e.size());
  std::vector<std::vector<float>> set;
  gradcomp::topk sel;
  std::vector<std::uint32_t> idx;
  const select_context ctx{k_of(n, ppm), 0.0, {}};
  for (std::size_t step = 0; set.size() < buffers; ++step) {
    gb::fill(g, gb::dist::normal, 1000 + step);  // streams the input sets do not use
    for (std::size_t i = 0; i < e.size(); ++i) e[i] += g[i];
    if (step >= warmup) set.push_back(e);
    sel.select(view(e), ctx, idx);
    for (const std::uint32_t i : idx) e[i] = 0.0f;
  }
  made.emplace_back(std::pair{n, ppm}, std::move(set));
  return made.back().second;
}

template <class Selector>
void bench_select_residual(benchmark::State& state, Selector proto) {
  const std::int64_t n = state.range(0);
  const std::int64_t ppm = state.range(1);
  const auto& in = residual_inputs(n, ppm);
  Selector sel = std::move(proto);
  select_context ctx{k_of(n, ppm), static_cast<double>(ppm) * 1e-6, {.seed = 7}};
  std::vector<std::uint32_t> idx;
  sel.select(view(in[0]), ctx, idx);
  tally t{.k = ctx.k};
  std::size_t it = 1;
  for (auto _ : state) {
    ctx.id.step = it;
    t.add(sel.select(view(in[it++ % in.size()]), ctx, idx));
    benchmark::DoNotOptimize(idx.data());
    benchmark::ClobberMemory();
  }
  t.report(state, n);
}

// ---------------------------------------------------------------------------------------
// Compression steps: compressor<>::compress on one tensor, feedback state carried from call
// to call as in training (so the residual is that of a running job, not zero). `step/` is the
// staged form every driver runs (sparsified_sgd, the PyTorch hook, PQASGD): from one feedback
// state into a second, the two swapped after each call, so that a failed step changes nothing.
// `step_in_place/` is compress(g, st, ...), which keeps one state and reads g once more first.

template <class Compressor>
void bench_step(benchmark::State& state, gb::dist d, Compressor proto, bool staged) {
  const std::int64_t n = state.range(0);
  const std::int64_t ppm = state.range(1);
  const auto& in = gb::inputs(static_cast<std::size_t>(n), d);
  Compressor c = std::move(proto);
  auto st = c.make_state(static_cast<std::size_t>(n));
  auto next = c.make_state(static_cast<std::size_t>(n));
  payload p;
  gradcomp::compress_context ctx{static_cast<double>(ppm) * 1e-6, {.seed = 7}};
  auto step = [&](std::span<const float> g) {
    if (!staged) return c.compress(g, st, ctx, p);
    const gradcomp::compress_stats s = c.compress(g, std::as_const(st), next, ctx, p);
    std::swap(st, next);
    return s;
  };
  step(view(in[0]));
  step(view(in[1]));  // both states written once
  tally t{.k = k_of(n, ppm)};
  double select_s = 0.0;
  double encode_s = 0.0;
  std::size_t it = 2;
  for (auto _ : state) {
    ctx.id.step = it;
    const gradcomp::compress_stats s = step(view(in[it++]));
    t.add(s.selection);
    select_s += s.seconds_accumulate + s.seconds_select;
    encode_s += s.seconds_encode;
    benchmark::DoNotOptimize(p.values.data());
    benchmark::ClobberMemory();
  }
  t.report(state, n);
  // Where the step's time went, by its own stopwatch (compress_stats), in ms per call.
  using C = benchmark::Counter;
  state.counters["select_ms"] = C(select_s * 1e3, C::kAvgIterations);
  state.counters["encode_ms"] = C(encode_s * 1e3, C::kAvgIterations);
}

// The fused pass of step/topk_residual alone: detail::bracket_pass over e + g, e the feedback
// state a step leaves (a select_residual snapshot with its top k sent, so zeroed) and g the
// next input, written into a second buffer with streaming stores, the energy and the
// non-finite check on, in the widest clone: what topk::select_accumulate_into runs between its
// sample and its exact finish. The bracket is the one topk samples for that (e, g) pair, taken
// before the timed loop. Counter `candidates`: the bracket's values per call (sure and
// candidates together; a call that misses counts 0, and `misses` counts it).
void bench_topk_pass(benchmark::State& state) {
  namespace gd = gradcomp::detail;
  const auto n = static_cast<std::size_t>(state.range(0));
  const std::int64_t ppm = state.range(1);
  const auto& in = gb::inputs(n, gb::dist::normal);
  const std::size_t k = k_of(state.range(0), ppm);
  gradcomp::topk sel;
  // The snapshots are the vectors a job selects from; what its feedback keeps is each one with
  // the selected values sent (the identity quantizer's residual: zero).
  std::vector<std::vector<float>> res = residual_inputs(state.range(0), ppm);
  std::vector<std::uint32_t> idx;
  for (auto& e : res) {
    sel.select(view(e), select_context{k, 0.0, {}}, idx);
    for (const std::uint32_t i : idx) e[i] = 0.0f;
  }
  const gd::topk_bracket_plan plan = sel.bracket_plan(n, k);
  std::vector<float> out(n, 0.0f);
  std::vector<std::pair<std::uint32_t, std::uint32_t>> brackets;
  std::vector<std::uint32_t> keys(plan.s);
  for (std::size_t i = 0; i < res.size(); ++i) {
    const auto src = gd::accumulating_source<float>(out, view(res[i]), view(in[i]), nullptr, nullptr);
    brackets.push_back(gd::sample_bracket<float>(src, plan, keys.data()));
  }
  std::vector<std::uint32_t> sure(k + gd::scan_block);
  std::vector<std::uint32_t> cand(plan.budget + gd::scan_block);
  std::vector<std::uint32_t> cand_keys(plan.budget + gd::scan_block);
  double found = 0.0;
  double misses = 0.0;
  std::size_t it = 0;
  for (auto _ : state) {
    const std::size_t i = it++ % res.size();
    double energy = 0.0;
    bool nonfinite = false;
    const auto src =
        gd::accumulating_source<float>(out, view(res[i]), view(in[i]), &energy, &nonfinite);
    gd::bracket_lists<float> lists{sure.data(), k, cand.data(), cand_keys.data(), plan.budget};
    bool ok = false;
    gd::run_active([&](auto) {
      ok = gd::bracket_pass<float>(src, brackets[i].first, brackets[i].second, lists);
    });
    gd::stream_fence();
    found += static_cast<double>(lists.n_sure + lists.n_cand);
    misses += ok ? 0.0 : 1.0;
    benchmark::DoNotOptimize(energy);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(n * sizeof(float)));
  using C = benchmark::Counter;
  state.counters["candidates"] = C(found, C::kAvgIterations);
  state.counters["misses"] = C(misses, C::kAvgIterations);
}

// ---------------------------------------------------------------------------------------
// Quantizers on n dense values.

void prepare_payload(payload& p, std::size_t n) {
  p.clear();
  p.layout = gradcomp::index_layout::dense;
  p.dense_size = n;
  p.count = static_cast<std::uint32_t>(n);
}

template <class Quantizer>
void bench_encode(benchmark::State& state, Quantizer q) {
  const std::int64_t n = state.range(0);
  const auto& in = gb::inputs(static_cast<std::size_t>(n), gb::dist::normal);
  payload p;
  prepare_payload(p, static_cast<std::size_t>(n));
  q.encode(view(in[0]), {.seed = 7}, p);
  std::size_t it = 1;
  for (auto _ : state) {
    q.encode(view(in[it]), {.seed = 7, .step = it}, p);
    ++it;
    benchmark::DoNotOptimize(p.values.data());
    benchmark::ClobberMemory();
  }
  tally{}.report(state, n, false);
}

template <class Quantizer>
void bench_decode(benchmark::State& state, Quantizer q) {
  const std::int64_t n = state.range(0);
  const auto& in = gb::inputs(static_cast<std::size_t>(n), gb::dist::normal);
  // One payload per input buffer, so that decoding also rotates through memory.
  std::vector<payload> ps(in.size());
  for (std::size_t b = 0; b < in.size(); ++b) {
    prepare_payload(ps[b], static_cast<std::size_t>(n));
    q.encode(view(in[b]), {.seed = 7, .step = b}, ps[b]);
  }
  std::vector<float> out(static_cast<std::size_t>(n), 0.0f);
  std::size_t it = 0;
  for (auto _ : state) {
    q.decode(ps[it++ % ps.size()], out);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  tally{}.report(state, n, false);
}

// ---------------------------------------------------------------------------------------
// The exchanges' local work: what one rank does once the network has delivered the others'
// data, measured on the exchange's own code with the payloads made here.

// sparse_allgather: decode the P wire payloads in rank order and add them into the dense
// output, then divide by P (sparse_allgather::combine, exactly what exchange() runs after its
// allgatherv). Each rank's payload holds k random indices (Random-k with a seed per rank: as
// spread over the tensor as top-k's picks of different ranks, and independent between ranks)
// with fp32 values. Counter `pairs`: P x k decoded per call.
void bench_allgather_local(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const std::size_t k = k_of(state.range(0), state.range(1));
  const auto ranks = static_cast<std::size_t>(state.range(2));
  const auto& in = gb::inputs(n, gb::dist::normal);
  using gradcomp::compressor;
  compressor<gradcomp::randomk, gradcomp::identity, gradcomp::no_feedback> c;
  auto st = c.make_state(n);
  std::vector<std::byte> blocks;
  std::vector<std::size_t> counts;
  payload p;
  std::vector<std::byte> one;
  for (std::size_t r = 0; r < ranks; ++r) {
    const double density = static_cast<double>(k) / static_cast<double>(n);
    c.compress(view(in[r]), st, {density, {.seed = 7 + r, .step = 1}}, p);
    one.clear();
    gradcomp::encode_wire(p, one);
    blocks.insert(blocks.end(), one.begin(), one.end());
    counts.push_back(one.size());
  }
  gradcomp::sparse_allgather x;
  std::vector<float> out(n);
  x.combine(c, std::span<const std::byte>(blocks), std::span<const std::size_t>(counts),
            std::span<float>(out));
  for (auto _ : state) {
    x.combine(c, std::span<const std::byte>(blocks), std::span<const std::size_t>(counts),
              std::span<float>(out));
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  tally{}.report(state, static_cast<std::int64_t>(n), false);
  state.counters["pairs"] = static_cast<double>(ranks * k);
}

// The P ranks' payloads of the exchanges' local work: k random indices per rank (Random-k with a
// seed per rank), fp32 values, and each decoded into (index, value) pairs sorted by index.
struct rank_payloads {
  gradcomp::compressor<gradcomp::randomk, gradcomp::identity, gradcomp::no_feedback> c;
  std::vector<payload> payloads;
  std::vector<std::vector<gradcomp::index_value>> pairs;

  rank_payloads(std::size_t n, std::size_t k, std::size_t ranks) {
    const auto& in = gb::inputs(n, gb::dist::normal);
    auto st = c.make_state(n);
    std::vector<float> scratch;
    const double density = static_cast<double>(k) / static_cast<double>(n);
    for (std::size_t r = 0; r < ranks; ++r) {
      payloads.emplace_back();
      c.compress(view(in[r % in.size()]), st, {density, {.seed = 7 + r, .step = 1}}, payloads.back());
      pairs.emplace_back();
      gradcomp::detail::decode_pairs("bench", c, payloads.back(), scratch, pairs.back());
    }
  }
};

// topk_a2a: rank 0's local work. Decode its own payload into pairs (topk_a2a::prepare), add the
// pairs that the P ranks sent to its shard [0, n/P) in rank order and divide
// (topk_a2a::reduce_shard), and copy the gathered dense mean into the output
// (topk_a2a::copy_out). Counter `pairs`:
// the pairs added into the shard per call (about k: each rank sends k/P of its k).
void bench_a2a_local(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const std::size_t k = k_of(state.range(0), state.range(1));
  const auto ranks = static_cast<std::size_t>(state.range(2));
  const rank_payloads rp(n, k, ranks);
  const std::uint64_t end = gradcomp::topk_a2a_shard_begin(n, ranks, 1);
  std::vector<gradcomp::index_value> received;
  std::vector<std::size_t> counts;
  for (const auto& pairs : rp.pairs) {
    const auto mine = std::partition_point(
        pairs.begin(), pairs.end(), [&](const gradcomp::index_value& e) { return e.index < end; });
    received.insert(received.end(), pairs.begin(), mine);
    counts.push_back(static_cast<std::size_t>(mine - pairs.begin()));
  }
  gradcomp::topk_a2a x;
  std::vector<float> shard(end), dense(n, 0.5f), out(n);
  // Vectors, not arrays: with a size it can see, GCC 12 warns (falsely) in prepare's resize.
  const std::vector<const payload*> own = {&rp.payloads[0]};
  const std::vector<std::span<float>> outs = {std::span<float>(out)};
  for (auto _ : state) {
    x.prepare(rp.c, std::span<const payload* const>(own), std::span<const std::span<float>>(outs));
    const std::string problem = gradcomp::topk_a2a::reduce_shard(
        std::span<const gradcomp::index_value>(received), std::span<const std::size_t>(counts), 0,
        std::span<float>(shard));
    if (!problem.empty()) {
      state.SkipWithError(problem.c_str());
      break;
    }
    gradcomp::topk_a2a::copy_out(std::span<const float>(dense),
                                 std::span<const std::span<float>>(outs));
    benchmark::DoNotOptimize(shard.data());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  tally{}.report(state, static_cast<std::int64_t>(n), false);
  state.counters["pairs"] = static_cast<double>(received.size());
}

// gtopk: the root's local work, the longest of any rank's. Decode its own payload
// (gtopk::prepare), merge it with each subtree's set in ceil(log2 P) rounds keeping the top k
// (detail::gtopk_merge, what exchange() runs per round), then write the dense output: zeros and
// the k global values divided by P (gtopk_values::tree). The subtrees' sets are made here by
// the same merges. Counter `pairs`: the pairs that go into the root's merges per call.
void bench_gtopk_local(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const std::size_t k = k_of(state.range(0), state.range(1));
  const auto ranks = static_cast<std::size_t>(state.range(2));
  rank_payloads rp(n, k, ranks);
  std::vector<std::vector<gradcomp::index_value>> sets = rp.pairs, from_subtree;
  std::vector<gradcomp::index_value> merged;
  double pairs = 0.0;  // going into the root's merges: its set and the subtree's, every round
  for (std::size_t step = 1; step < ranks; step *= 2) {
    for (std::size_t r = 0; r + step < ranks; r += 2 * step) {
      if (r == 0) {
        from_subtree.push_back(sets[step]);
        pairs += static_cast<double>(sets[0].size() + sets[step].size());
      }
      gradcomp::detail::gtopk_merge(sets[r], sets[r + step], k, merged);
      sets[r].swap(merged);
    }
  }
  gradcomp::gtopk x;
  std::vector<gradcomp::index_value> current;
  std::vector<float> out(n);
  const float divisor = static_cast<float>(ranks);
  for (auto _ : state) {
    x.prepare(rp.c, rp.payloads[0]);
    current = rp.pairs[0];
    for (const auto& s : from_subtree) {
      gradcomp::detail::gtopk_merge(current, s, k, merged);
      current.swap(merged);
    }
    std::fill(out.begin(), out.end(), 0.0f);
    for (const auto& e : current) out[e.index] = e.value / divisor;
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  tally{}.report(state, static_cast<std::int64_t>(n), false);
  state.counters["pairs"] = pairs;
}

// ---------------------------------------------------------------------------------------
// Baselines (normal input only: their cost does not depend on the distribution).

// One streaming pass over a dense output of n floats (written, not read): the least any
// exchange's local work costs, since every exchange writes its n-value result.
void bench_output_pass(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  std::vector<float> out(n, 1.0f);
  float v = 0.0f;
  for (auto _ : state) {
    std::fill(out.begin(), out.end(), v);
    v += 1.0f;
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  tally{}.report(state, static_cast<std::int64_t>(n), false);
}

// The staged step's unavoidable traffic: next = e + g, the two states alternating as in
// bench_step.
void bench_accumulate(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const auto& in = gb::inputs(n, gb::dist::normal);
  std::vector<float> e(n, 0.25f), next(n, 0.0f);
  std::size_t it = 0;
  for (auto _ : state) {
    gb::accumulate_streamed(e, view(in[it++]), next);
    e.swap(next);
    benchmark::DoNotOptimize(e.data());
    benchmark::ClobberMemory();
  }
  tally{}.report(state, static_cast<std::int64_t>(n), false);
}

void bench_stream_read(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const auto& in = gb::inputs(static_cast<std::size_t>(n), gb::dist::normal);
  std::size_t it = 0;
  for (auto _ : state) benchmark::DoNotOptimize(gb::sum_abs(view(in[it++])));
  tally{}.report(state, n, false);
}

// quantize/draws: the uniforms a stochastic encoder (TernGrad, QSGD) draws, one per value
// (counter_rng::uniform), summed and nothing else, on the active path: the AVX2 form of
// detail/host_simd/draws_avx2.hpp, the generic clone's 16 lanes, or the portable loop. What
// bounds those encoders where the draw's 64-bit multiplies are dear (AVX2 has none).
float draw_sum(std::uint64_t key, std::size_t n) {
  namespace d = gradcomp::detail;
#if GRADCOMP_VECTOR_EXTENSIONS && GRADCOMP_HOST_DISPATCH
  if (d::active_host_isa() == d::host_isa::avx2) return d::avx2::uniform_sum(key, n);
#endif
#if GRADCOMP_VECTOR_EXTENSIONS
  if (d::active_host_isa() != d::host_isa::portable) {
    float total = 0.0f;
    d::run_active([&](auto) {
      d::simd16::f32 acc{};
      for (std::size_t i = 0; i + d::simd16::width <= n; i += d::simd16::width) {
        d::simd16::f32 u;
        d::simd16::uniform(key, i, u);
        acc += u;
      }
      for (std::size_t j = 0; j < d::simd16::width; ++j) total += acc[j];
    });
    return total;
  }
#endif
  const d::counter_rng rng{key};
  float total = 0.0f;
  for (std::size_t i = 0; i < n; ++i) total += rng.uniform(i);
  return total;
}

void bench_draws(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  std::uint64_t key = 0x5eed;
  for (auto _ : state) benchmark::DoNotOptimize(draw_sum(key++, n));
  tally{}.report(state, state.range(0), false);
}

template <bool Libc>
void bench_copy(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const auto& in = gb::inputs(static_cast<std::size_t>(n), gb::dist::normal);
  std::vector<float> dst(static_cast<std::size_t>(n), 1.0f);
  std::size_t it = 0;
  for (auto _ : state) {
    const auto& src = in[it++];
    if constexpr (Libc) {
      std::memcpy(dst.data(), src.data(), src.size() * sizeof(float));
    } else {
      gb::copy_floats(src, dst);
    }
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  tally{}.report(state, n, false);
}

template <bool PartialSort>
void bench_textbook_topk(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const std::size_t k = k_of(n, state.range(1));
  const auto& in = gb::inputs(static_cast<std::size_t>(n), gb::dist::normal);
  std::vector<float> scratch(static_cast<std::size_t>(n), 0.0f);
  std::vector<std::uint32_t> idx(k);
  std::size_t it = 0;
  tally t;
  for (auto _ : state) {
    if constexpr (PartialSort) {
      gb::topk_partial_sort(view(in[it++]), k, scratch, idx);
    } else {
      gb::topk_nth_element(view(in[it++]), k, scratch, idx);
    }
    benchmark::DoNotOptimize(idx.data());
    benchmark::ClobberMemory();
    t.selected += static_cast<double>(idx.size());
  }
  t.report(state, n);
}

// ---------------------------------------------------------------------------------------
// Registration: n outermost, then the distribution, so that each input set is built once
// (see gb::inputs).

template <class F>
benchmark::internal::Benchmark* add(const std::string& name, F&& f, std::int64_t n) {
  auto* b = benchmark::RegisterBenchmark(name.c_str(), std::forward<F>(f));
  b->ArgNames({"n"})->Arg(n)->Unit(benchmark::kMillisecond)->ComputeStatistics("min", min_of);
  return b;
}

template <class F>
void add_ppm(const std::string& name, F f, std::int64_t n) {
  for (const std::int64_t ppm : ppms) {
    auto* b = benchmark::RegisterBenchmark(name.c_str(), f);
    b->ArgNames({"n", "ppm"})->Args({n, ppm})->Unit(benchmark::kMillisecond);
    b->ComputeStatistics("min", min_of);
  }
}

template <class Selector>
void add_selector(const std::string& name, std::int64_t n, gb::dist d) {
  add_ppm("select/" + name + gb::suffix(d),
          [d](benchmark::State& s) { bench_select<Selector>(s, d); }, n);
}

template <class Compressor>
void add_step(const std::string& name, std::int64_t n, gb::dist d, Compressor c,
              bool staged = true) {
  add_ppm((staged ? "step/" : "step_in_place/") + name + gb::suffix(d),
          [d, c, staged](benchmark::State& s) { bench_step(s, d, c, staged); }, n);
}

template <class Quantizer>
void add_quantizer(const std::string& name, std::int64_t n, Quantizer q) {
  add("quantize/" + name + "_encode", [q](benchmark::State& s) { bench_encode(s, q); }, n);
  add("quantize/" + name + "_decode", [q](benchmark::State& s) { bench_decode(s, q); }, n);
}

void register_all() {
  using namespace gradcomp;
  for (const std::int64_t n : sizes) {
    for (const gb::dist d : gb::all_dists) {
      if (d == gb::dist::normal) {
        add("baseline/stream_read", bench_stream_read, n);
        add("baseline/copy", bench_copy<false>, n);
        add("baseline/memcpy", bench_copy<true>, n);
        add("baseline/output_pass", bench_output_pass, n);
        add("baseline/accumulate", bench_accumulate, n);
        add("quantize/draws", bench_draws, n);
        add_ppm("baseline/nth_element", bench_textbook_topk<false>, n);
        add_ppm("baseline/partial_sort", bench_textbook_topk<true>, n);
      }
      add_selector<topk>("topk", n, d);
      add_selector<gaussiank>("gaussiank", n, d);
      add_selector<randomk>("randomk", n, d);
      add_selector<threshold>("threshold", n, d);
      add_selector<dgc_sampling>("dgc_sampling", n, d);
      add_selector<redsync>("redsync", n, d);
      add_selector<dense>("dense", n, d);

      add_step("topk_residual", n, d, compressor<topk, identity, residual>{});
      add_step("gaussiank_residual", n, d, compressor<gaussiank, identity, residual>{});
      add_step("gaussiank_published_residual", n, d,
               compressor<gaussiank, identity, residual>(gaussiank::published()));
      add_step("randomk_residual", n, d, compressor<randomk, identity, residual>{});
      add_step("topk_qsgd_residual", n, d,
               compressor<topk, qsgd, residual>(topk{}, qsgd::with_bits(4)));
      if (d == gb::dist::normal) {
        add_step("topk_residual", n, d, compressor<topk, identity, residual>{}, false);
      }

      if (d == gb::dist::normal && n < (std::int64_t{1} << 27)) {
        for (const std::int64_t ppm : {std::int64_t{1000}, std::int64_t{10000}}) {
          for (const std::int64_t ranks : {4, 16, 64}) {
            using family = std::pair<const char*, void (*)(benchmark::State&)>;
            for (const auto& [name, f] : {family{"exchange_local/sparse_allgather", bench_allgather_local},
                                          family{"exchange_local/topk_a2a", bench_a2a_local},
                                          family{"exchange_local/gtopk", bench_gtopk_local}}) {
              auto* b = benchmark::RegisterBenchmark(name, f);
              b->ArgNames({"n", "ppm", "ranks"})->Args({n, ppm, ranks});
              b->Unit(benchmark::kMillisecond)->ComputeStatistics("min", min_of);
            }
          }
        }
        add_ppm("step_pass/topk_residual", bench_topk_pass, n);
        add_ppm("select_residual/topk",
                [](benchmark::State& s) { bench_select_residual(s, topk{}); }, n);
        add_ppm("select_residual/gaussiank",
                [](benchmark::State& s) { bench_select_residual(s, gaussiank{}); }, n);
        add_ppm("select_residual/gaussiank_published", [](benchmark::State& s) {
          bench_select_residual(s, gaussiank::published());
        }, n);
      }
      if (d == gb::dist::normal) {
        add_quantizer("identity", n, identity{});
        add_quantizer("fp16", n, fp16{});
        add_quantizer("bf16", n, bf16{});
        add_quantizer("qsgd4", n, qsgd::with_bits(4));
        add_quantizer("terngrad", n, terngrad{});
        add_quantizer("scaled_sign", n, scaled_sign{});
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  // Which host path the vector loops ran in (GRADCOMP_HOST_ISA caps it), so that a JSON says
  // what it measured: the detected path, the ceiling and the one that ran.
  namespace gd = gradcomp::detail;
  benchmark::AddCustomContext("gradcomp_host_isa", gd::host_isa_name(gd::active_host_isa()));
  benchmark::AddCustomContext("gradcomp_host_isa_detected",
                              gd::host_isa_name(gd::detected_host_isa()));
  register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
