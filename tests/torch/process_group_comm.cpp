// process_group_comm over gloo, with P ranks as processes: `process_group_comm --ranks P`
// forks P children that meet through a c10d::FileStore in a fresh temporary directory, each
// running every test case in the same order (so their collectives match) over a
// ProcessGroupGloo on loopback. The communicator passes the same property suites as mpi_comm
// (tests/support/comm_properties.hpp, exchange_properties.hpp); the tensor views refuse what
// they cannot view. The exit status is the worst over the ranks.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/torch.h>

#define DOCTEST_CONFIG_IMPLEMENT
#include "doctest_torch.hpp"

#include <gradcomp/runtime/bucket_engine.hpp>
#include <gradcomp/torch/process_group.hpp>
#include <gradcomp/torch/tensor.hpp>

#include "../support/comm_properties.hpp"
#include "../support/exchange_properties.hpp"
#include "../support/lying_peer.hpp"

namespace {

using namespace gradcomp;

// Forwards to gloo; once armed, it lies in one message of counts this rank sends (the
// (skip + 1)-th after arming): the alltoall_base of process_group_comm's allgatherv (8 bytes to
// each rank) or alltoallv (a row of size() counts to each rank). Counts of 8 * size() bytes per
// rank are tampered only at the entry for the next rank, so the lie reaches every rank's matrix.
class tampering_group final : public c10d::ProcessGroup {
 public:
  explicit tampering_group(c10::intrusive_ptr<c10d::ProcessGroup> inner)
      : c10d::ProcessGroup(inner->getRank(), inner->getSize()), inner_(std::move(inner)) {}

  void lie(std::uint64_t value, int skip) {
    lie_ = value;
    skip_ = skip;
    armed_ = true;
    lied_ = false;
    seen_ = 0;
  }
  // Whether it lied since lie().
  [[nodiscard]] bool lied() const { return lied_; }
  // Counts messages this rank sent since lie() without lying in them (lie(0, -1): count only).
  [[nodiscard]] int seen() const { return seen_; }
  void disarm() { armed_ = false; }

  const std::string getBackendName() const override { return inner_->getBackendName(); }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    return inner_->broadcast(tensors, opts);
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    return inner_->barrier(opts);
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& out, at::Tensor& in,
                                               std::vector<std::int64_t>& out_splits,
                                               std::vector<std::int64_t>& in_splits,
                                               const c10d::AllToAllOptions& opts) override {
    if (armed_ && is_counts(in, in_splits) && skip_ >= 0 && skip_-- == 0) {
      armed_ = false;
      lied_ = true;
      at::Tensor lying = in.clone();
      auto* words = reinterpret_cast<std::uint64_t*>(lying.data_ptr());
      const auto p = static_cast<std::size_t>(getSize());
      const auto row = static_cast<std::size_t>(in_splits[0]) / sizeof(std::uint64_t);
      const std::size_t at = row == 1 ? 0 : static_cast<std::size_t>(getRank() + 1) % p;
      for (std::size_t s = 0; s < p; ++s) words[s * row + at] = lie_;
      return inner_->alltoall_base(out, lying, out_splits, in_splits, opts);
    }
    if (armed_ && is_counts(in, in_splits)) ++seen_;
    return inner_->alltoall_base(out, in, out_splits, in_splits, opts);
  }

 private:
  bool is_counts(const at::Tensor& in, const std::vector<std::int64_t>& splits) const {
    const auto p = static_cast<std::int64_t>(getSize());
    if (splits.empty()) return false;
    const std::int64_t each = splits[0];
    if (each != 8 && each != 8 * p) return false;
    for (const auto x : splits) {
      if (x != each) return false;
    }
    return in.numel() == each * p;
  }

  c10::intrusive_ptr<c10d::ProcessGroup> inner_;
  std::uint64_t lie_ = 0;
  int skip_ = 0;
  int seen_ = 0;
  bool armed_ = false;
  bool lied_ = false;
};

c10::intrusive_ptr<tampering_group> the_tamperer;
std::unique_ptr<process_group_comm> the_comm;

process_group_comm& comm() { return *the_comm; }

c10::intrusive_ptr<c10d::ProcessGroup> make_group(const std::string& store_path, int rank, int size) {
  auto store = c10::make_intrusive<c10d::FileStore>(store_path, size);
  auto options = c10d::ProcessGroupGloo::Options::create(std::chrono::milliseconds(60000));
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

}  // namespace

TEST_CASE("tensor views: contiguous float32/float64 CPU tensors only, with a clear refusal") {
  at::Tensor f = at::arange(10, at::kFloat);
  const auto s = torch_views::as_span<float>(f, "test", "f");
  CHECK(s.size() == 10);
  CHECK(s[3] == 3.0f);
  CHECK(torch_views::as_span<double>(at::zeros({2, 3}, at::kDouble), "test", "d").size() == 6);
  CHECK(torch_views::as_span<float>(at::empty({0}, at::kFloat), "test", "e").empty());

  const std::string dtype = message_of([] { (void)torch_views::as_span<float>(at::zeros({4}, at::kDouble), "f", "grad"); });
  CHECK(dtype.find("'grad'") != std::string::npos);
  CHECK(dtype.find("dtype Double") != std::string::npos);
  CHECK(dtype.find("device cpu") != std::string::npos);
  CHECK(dtype.find("layout Strided") != std::string::npos);
  const std::string strided = message_of([] { (void)torch_views::as_span<float>(at::zeros({4, 4}).t(), "f", "g"); });
  CHECK(strided.find("not contiguous") != std::string::npos);
  const std::string sparse = message_of([] { (void)torch_views::as_span<float>(at::zeros({4, 4}).to_sparse(), "f", "g"); });
  CHECK(sparse.find("layout Sparse") != std::string::npos);
  const std::string half = message_of([] { (void)torch_views::as_span<float>(at::zeros({4}, at::kHalf), "f", "g"); });
  CHECK(half.find("dtype Half") != std::string::npos);
}

TEST_CASE("process_group_comm models the communicator concept over the whole group") {
  static_assert(communicator<process_group_comm>);
  CHECK(comm().backend() == "gloo");
  CHECK(comm().size() >= 1);
  CHECK_THROWS_AS(process_group_comm(c10::intrusive_ptr<c10d::ProcessGroup>()), invalid_argument);
}

TEST_CASE("rank-order allreduce over gloo is the sequential fold over ranks, bit for bit") {
  gradcomp_test::comm_properties::rank_order_allreduce(comm());
}

TEST_CASE("allgatherv, allgather, alltoallv, broadcast and barrier over gloo, empty contributions too") {
  gradcomp_test::comm_properties::variable_collectives(comm());
}

TEST_CASE("bad arguments throw invalid_argument before any message") {
  gradcomp_test::comm_properties::bad_arguments(comm());
}

TEST_CASE("every exchange over gloo equals the single-process reference") {
  gradcomp_test::exchange_properties::every_exchange_equals_reference(comm());
}

TEST_CASE("a P-rank gloo run of sparsified_sgd equals the P-thread in-process run") {
  gradcomp_test::exchange_properties::training_equals_in_process(comm());
}

TEST_CASE("a rank with another tensor size makes every rank throw over gloo, none hangs") {
  gradcomp_test::exchange_properties::disagreeing_size_throws_everywhere(comm());
}

TEST_CASE("bucket_engine over gloo equals bucket_engine in process, every exchange, steps carried") {
  namespace rt = gradcomp::runtime;
  const std::size_t n = 5003;
  for (const std::string ex : {"allreduce", "allgather", "gtopk", "a2a", "auto"}) {
    for (const std::string sel : {"topk", "randomk", "dgc"}) {
      rt::engine_config c;
      c.exchange = ex;
      c.selector = sel;
      c.feedback = sel == "dgc" ? "dgc" : "residual";
      c.quantizer = sel == "randomk" ? "fp16" : "fp32";
      if (c.exchange == "allreduce" && c.selector != "randomk") continue;  // not summable
      CAPTURE(ex);
      CAPTURE(sel);
      auto grad = [&](int rank, int step) {
        return gradcomp_test::make_input<float>(rank % 2 ? gradcomp_test::dist::laplace : gradcomp_test::dist::normal,
                                                n, static_cast<std::uint64_t>(1000 * step + rank));
      };
      // The exchange each step ran ('auto': the one it chose), over gloo and in process.
      std::vector<std::string> ran, ran_in_process;
      rt::bucket_engine<process_group_comm> mine(comm(), c);
      std::vector<std::vector<float>> got;
      for (int s = 0; s < 3; ++s) {
        auto g = grad(comm().rank(), s);
        ran.emplace_back(mine.run(7, std::span<float>(g), static_cast<std::uint64_t>(s), 0.01).exchange);
        mine.commit();
        got.push_back(g);
      }
      const std::string ran_s = gradcomp_test::joined(ran);
      CAPTURE(ran_s);
      // 'auto' measures its link once per engine, and gloo's link is not the in-process one,
      // so the two would choose for links of their own. The reference runs the exchange the
      // gloo engine chose, by name: auto's bits must be that exchange's.
      rt::engine_config reference = c;
      reference.exchange = gradcomp_test::registry_exchange_name(ran);
      std::vector<std::vector<std::vector<float>>> want(static_cast<std::size_t>(comm().size()));
      run_in_process(comm().size(), [&](in_process_comm& ic) {
        rt::bucket_engine<in_process_comm> e(ic, reference);
        for (int s = 0; s < 3; ++s) {
          auto g = grad(ic.rank(), s);
          const std::string_view x = e.run(7, std::span<float>(g), static_cast<std::uint64_t>(s), 0.01).exchange;
          e.commit();
          if (ic.rank() == 0) ran_in_process.emplace_back(x);
          want[static_cast<std::size_t>(ic.rank())].push_back(g);
        }
      });
      CHECK(ran == ran_in_process);
      for (int s = 0; s < 3; ++s) {
        CHECK(gradcomp_test::same_bits(got[static_cast<std::size_t>(s)],
                                       want[static_cast<std::size_t>(comm().rank())][static_cast<std::size_t>(s)]));
      }
    }
  }
}

TEST_CASE("counts a peer announces are bounded before anything is sized by them, on every rank") {
  if (comm().size() < 2) return;  // one rank announces nothing to anyone
  gradcomp_test::lying_peer::collectives_refused(comm(), *the_tamperer, 0xffffffffu,
                                                 std::uint64_t{1} << 62);
}

TEST_CASE("every message of counts in every exchange of a step refuses a lying peer") {
  if (comm().size() < 2) return;
  gradcomp_test::lying_peer::every_counts_message_refused(comm(), *the_tamperer, 0xffffffffu,
                                                          "announced 4294967295 elements");
}

int main(int argc, char** argv) {
  int ranks = 1;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::string(argv[i]) == "--ranks" && i + 1 < argc) {
      ranks = std::atoi(argv[++i]);
    } else {
      args.push_back(argv[i]);
    }
  }
  if (ranks < 1 || ranks > 64) {
    std::fprintf(stderr, "process_group_comm: --ranks must be 1..64\n");
    return 2;
  }
  char dir_template[] = "/tmp/gradcomp_pg_XXXXXX";
  const char* dir = mkdtemp(dir_template);
  if (dir == nullptr) {
    std::perror("process_group_comm: mkdtemp");
    return 2;
  }
  const std::string store = std::string(dir) + "/store";
  std::vector<pid_t> children;
  for (int r = 0; r < ranks; ++r) {
    const pid_t pid = fork();
    if (pid < 0) {
      std::perror("process_group_comm: fork");
      return 2;
    }
    if (pid == 0) {
      int status = 1;
      try {
        the_tamperer = c10::make_intrusive<tampering_group>(make_group(store, r, ranks));
        the_comm = std::make_unique<process_group_comm>(the_tamperer);
        doctest::Context context(static_cast<int>(args.size()), args.data());
        if (r != 0) context.setOption("minimal", true);
        status = context.run();
        the_comm.reset();
        the_tamperer.reset();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
      }
      std::fflush(nullptr);
      _exit(status);
    }
    children.push_back(pid);
  }
  int worst = 0;
  for (std::size_t r = 0; r < children.size(); ++r) {
    int status = 0;
    waitpid(children[r], &status, 0);
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (code != 0) std::fprintf(stderr, "process_group_comm: rank %zu exited with %d\n", r, code);
    worst = std::max(worst, code);
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return worst;
}
