// gradcomp::cuda alone compiles gradcomp's device code: exact top-k on the GPU against the
// same selector on the host. Without a CUDA device it only says so: compiling was the test.
#include <cstdio>
#include <vector>

#include <gradcomp/cuda.cuh>

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("gradcomp::cuda: compiled; no CUDA device here to run it on\n");
    return 0;
  }
  using namespace gradcomp;
  const std::size_t n = 1 << 16, k = 64;
  std::vector<float> g(n);
  for (std::size_t i = 0; i < n; ++i) g[i] = static_cast<float>((i * 7919) % 1000) - 500.0f;
  topk sel;
  std::vector<std::uint32_t> host;
  sel.select(std::span<const float>(g), select_context{k, 0.0, {}}, host);

  device_buffer<float> d_g(n);
  device_buffer<std::uint32_t> d_idx(k);
  device_buffer<selection_stats> d_stats(1);
  detail::cuda_check(cudaMemcpy(d_g.data(), g.data(), n * sizeof(float), cudaMemcpyHostToDevice),
                     "cudaMemcpy");
  temp_storage tmp;
  const device_span<const float> dg{d_g.data(), n};
  const device_span<std::uint32_t> di{d_idx.data(), k};
  on_device(sel).select(tmp, dg, select_context{k, 0.0, {}}, di, d_stats.data());
  device_buffer<std::byte> scratch(tmp.bytes);
  tmp.ptr = scratch.data();
  on_device(sel).select(tmp, dg, select_context{k, 0.0, {}}, di, d_stats.data());
  std::vector<std::uint32_t> device(k);
  detail::cuda_check(cudaMemcpy(device.data(), d_idx.data(), k * 4, cudaMemcpyDeviceToHost),
                     "cudaMemcpy");
  std::printf("gradcomp::cuda: device top-k %s the host's\n", device == host ? "equals" : "DIFFERS from");
  return device == host ? 0 : 1;
}
