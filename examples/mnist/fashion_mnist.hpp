// examples/mnist/fashion_mnist.hpp: reads Fashion-MNIST from the gzip IDX files of Debian's
// dataset-fashion-mnist package (zlib). Pixels become floats in [0, 1].
#pragma once

#include <zlib.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

namespace fmnist {

inline constexpr std::size_t pixels = 28 * 28;
inline constexpr std::size_t classes = 10;

struct dataset {
  std::size_t count = 0;
  std::vector<float> images;          // count x pixels, row-major
  std::vector<std::uint8_t> labels;   // count, each < classes
};

struct fashion_mnist {
  dataset train;
  dataset test;
};

// GRADCOMP_FASHION_MNIST_DIR if set, else where the Debian package installs the files.
inline std::string default_dir() {
  if (const char* dir = std::getenv("GRADCOMP_FASHION_MNIST_DIR"); dir && *dir) return dir;
  return "/usr/share/datasets/fashion-mnist";
}

namespace detail {

inline std::vector<unsigned char> read_gzip(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) {
    throw std::runtime_error(
        "Fashion-MNIST not found: cannot open " + path +
        ". Install Debian's dataset-fashion-mnist package (apt-get install dataset-fashion-mnist), "
        "or set GRADCOMP_FASHION_MNIST_DIR to a directory holding its four *-ubyte.gz files.");
  }
  std::vector<unsigned char> out;
  unsigned char buf[1 << 16];
  for (;;) {
    const int got = gzread(f, buf, sizeof buf);
    if (got < 0) {
      gzclose(f);
      throw std::runtime_error("Fashion-MNIST: " + path + " is not a readable gzip file");
    }
    if (got == 0) break;
    out.insert(out.end(), buf, buf + got);
  }
  gzclose(f);
  return out;
}

inline std::uint32_t big_endian_u32(const std::vector<unsigned char>& b, std::size_t at) {
  return std::uint32_t{b[at]} << 24 | std::uint32_t{b[at + 1]} << 16 |
         std::uint32_t{b[at + 2]} << 8 | std::uint32_t{b[at + 3]};
}

// IDX: a big-endian magic 0x0000 08 <dims> (08: unsigned bytes), one u32 per dimension, data.
inline std::vector<unsigned char> read_idx(const std::string& path, std::uint32_t dims,
                                           std::vector<std::uint32_t>& shape) {
  std::vector<unsigned char> b = read_gzip(path);
  const std::size_t header = 4 + 4 * std::size_t{dims};
  if (b.size() < header || big_endian_u32(b, 0) != (0x0800u | dims)) {
    throw std::runtime_error("Fashion-MNIST: " + path + " is not an IDX file of unsigned bytes with " +
                             std::to_string(dims) + " dimensions");
  }
  shape.clear();
  std::size_t elements = 1;
  for (std::uint32_t d = 0; d < dims; ++d) {
    shape.push_back(big_endian_u32(b, 4 + 4 * std::size_t{d}));
    elements *= shape.back();
  }
  if (b.size() != header + elements) {
    throw std::runtime_error("Fashion-MNIST: " + path + " holds " + std::to_string(b.size() - header) +
                             " data bytes, its header says " + std::to_string(elements));
  }
  return std::vector<unsigned char>(b.begin() + static_cast<std::ptrdiff_t>(header), b.end());
}

// The first `limit` examples (all when limit is 0) of one split.
inline dataset read_split(const std::string& dir, const std::string& prefix, std::size_t limit) {
  std::vector<std::uint32_t> ishape, lshape;
  const auto images = read_idx(dir + "/" + prefix + "-images-idx3-ubyte.gz", 3, ishape);
  const auto labels = read_idx(dir + "/" + prefix + "-labels-idx1-ubyte.gz", 1, lshape);
  if (ishape[1] * ishape[2] != pixels || ishape[0] != lshape[0]) {
    throw std::runtime_error("Fashion-MNIST: " + prefix + " images and labels do not match (" +
                             std::to_string(ishape[0]) + " images of " + std::to_string(ishape[1]) +
                             "x" + std::to_string(ishape[2]) + ", " + std::to_string(lshape[0]) +
                             " labels)");
  }
  dataset d;
  d.count = ishape[0];
  if (limit && limit < d.count) d.count = limit;
  d.images.resize(d.count * pixels);
  for (std::size_t i = 0; i < d.images.size(); ++i) d.images[i] = static_cast<float>(images[i]) / 255.0f;
  d.labels.assign(labels.begin(), labels.begin() + static_cast<std::ptrdiff_t>(d.count));
  for (const auto y : d.labels) {
    if (y >= classes) throw std::runtime_error("Fashion-MNIST: a " + prefix + " label is out of range");
  }
  return d;
}

}  // namespace detail

// Throws std::runtime_error naming the package when the files are missing.
inline fashion_mnist load(const std::string& dir = default_dir(), std::size_t train_limit = 0,
                          std::size_t test_limit = 0) {
  return {detail::read_split(dir, "train", train_limit), detail::read_split(dir, "t10k", test_limit)};
}

}  // namespace fmnist
