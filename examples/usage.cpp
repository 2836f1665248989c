#include <cstdio>
#include <vector>

#include <gradcomp/gradcomp.hpp>

int main() {
  using namespace gradcomp;
  // Exact top-k at density 0.01, fp32 values, residual error feedback, sparse allgather.
  using topk_sgd = sparsified_sgd<compressor<topk, identity, residual>, sparse_allgather,
                                  in_process_comm>;

  run_in_process(4, [](in_process_comm& comm) {  // 4 workers as threads
    std::vector<float> params(10000, 0.0f), grads(params.size());
    topk_sgd sgd(comm, /*layer sizes=*/{6000, 4000}, {}, {}, sgd_options{.lr = 0.1},
                 density_schedule::constant(0.01));
    for (int step = 0; step < 3; ++step) {
      for (std::size_t i = 0; i < grads.size(); ++i)  // your backward pass goes here
        grads[i] = static_cast<float>((i * 7919 + step * 31 + comm.rank()) % 1000) - 500.0f;
      const step_stats& s = sgd.step(params, grads);
      if (comm.rank() == 0)
        std::printf("step %d: sent %zu of %zu coordinates in %zu bytes\n", step, s.selected,
                    s.n, s.bytes_sent);
    }
  });

  // The same policies one level down: compress one tensor into a payload and its bytes.
  compressor<gaussiank, qsgd, residual> c(gaussiank{}, qsgd::with_bits(4));
  std::vector<float> g(4096, 0.5f);
  g[7] = 9.0f;
  auto state = c.make_state(g.size());
  payload p;
  c.compress(g, state, {.density = 0.001, .id = {.seed = 1, .step = 0, .tensor_id = 0}}, p);
  std::vector<std::byte> wire;
  encode_wire(p, wire);  // what crosses the process boundary
  std::printf("gaussiank+qsgd: %u values, %zu bytes on the wire\n", p.count, wire.size());
}
