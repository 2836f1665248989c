// expect: dense_allreduce needs a summable payload
// Top-k payloads differ in their indices from rank to rank and QSGD values cannot be added
// without decoding: a dense allreduce of them must not compile.
#include <span>
#include <vector>

#include <gradcomp/comm/in_process.hpp>
#include <gradcomp/exchange/dense_allreduce.hpp>
#include <gradcomp/feedback/residual.hpp>
#include <gradcomp/quantize/qsgd.hpp>
#include <gradcomp/select/topk.hpp>
#include <gradcomp/step.hpp>

using namespace gradcomp;

void run(in_process_comm& comm) {
  sparsified_sgd<compressor<topk, qsgd, residual>, dense_allreduce, in_process_comm> sgd(comm, {100});
  std::vector<float> theta(100), g(100);
  sgd.step(theta, g);
}
