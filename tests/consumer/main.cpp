// Built by the consumer tests (tests/consumer/*/CMakeLists.txt) exactly as an
// outside project would build it: only through gradcomp::gradcomp. It compresses a
// gradient, sends it through the wire format and checks what comes back.
#include <gradcomp/gradcomp.hpp>

#include <cstdio>
#include <vector>

int main() {
  using namespace gradcomp;
  std::printf("gradcomp %d.%d.%d\n", version.major, version.minor, version.patch);

  std::vector<float> g(1000);
  for (std::size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>(i % 17) - 8.0f;
  compressor<topk, identity, residual> c;
  auto state = c.make_state(g.size());
  payload p;
  c.compress(g, state, {0.01, {}}, p);
  std::vector<std::byte> bytes;
  encode_wire(p, bytes);
  std::vector<float> dense(g.size());
  c.decompress(decode_wire(bytes), dense);
  for (std::size_t i = 0; i < g.size(); ++i) {
    if (dense[i] + state.e[i] != g[i]) {
      std::printf("mismatch at %zu\n", i);
      return 1;
    }
  }
  std::printf("sent %u of %zu values in %zu bytes\n", p.count, g.size(), bytes.size());
  return 0;
}
