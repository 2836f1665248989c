// Writes the seed corpus of the fuzz targets: a few small valid and invalid inputs per
// target, so that fuzzing starts from inputs that reach the decoders' bodies. Run once and
// commit the files:  gradcomp_make_corpus fuzz/corpus
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gradcomp/gradcomp.hpp>

namespace {

using namespace gradcomp;
namespace fs = std::filesystem;

void write(const fs::path& dir, const std::string& name, const std::vector<std::byte>& bytes) {
  fs::create_directories(dir);
  std::ofstream out(dir / name, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + (dir / name).string());
}

const std::vector<float> values{0.75f, -1.5f, 0.0f, 3.25f, -0.125f};

template <class Q>
payload make(const Q& q, index_layout layout) {
  payload p;
  p.layout = layout;
  p.count = static_cast<std::uint32_t>(values.size());
  if (layout == index_layout::sparse) {
    p.dense_size = 16;
    p.indices = {1, 4, 5, 9, 15};
  } else {
    p.dense_size = values.size();
  }
  q.encode(values, call_id{7, 1, 2}, p);
  return p;
}

std::vector<std::byte> wire(const payload& p) {
  std::vector<std::byte> w;
  encode_wire(p, w);
  return w;
}

void wire_seeds(const fs::path& dir) {
  write(dir, "identity_sparse", wire(make(identity{}, index_layout::sparse)));
  write(dir, "fp16_sparse", wire(make(fp16{}, index_layout::sparse)));
  write(dir, "bf16_sparse", wire(make(bf16{}, index_layout::sparse)));
  write(dir, "qsgd_sparse", wire(make(qsgd(7, 2), index_layout::sparse)));
  write(dir, "terngrad_sparse", wire(make(terngrad(2), index_layout::sparse)));
  write(dir, "scaled_sign_sparse", wire(make(scaled_sign(0), index_layout::sparse)));
  write(dir, "identity_dense", wire(make(identity{}, index_layout::dense)));
  write(dir, "qsgd_dense", wire(make(qsgd(1, 3), index_layout::dense)));
  write(dir, "scaled_sign_dense", wire(make(scaled_sign(2), index_layout::dense)));

  payload empty;
  write(dir, "empty", wire(empty));

  auto stream = wire(make(fp16{}, index_layout::sparse));
  const auto second = wire(make(terngrad(0), index_layout::dense));
  stream.insert(stream.end(), second.begin(), second.end());
  write(dir, "stream_of_two", stream);

  // Well-formed on the wire, refused by the decoder: a QSGD code above 2s.
  payload bad_code = make(qsgd(7, 2), index_layout::sparse);
  bad_code.values[0] = std::byte{0xff};
  write(dir, "qsgd_invalid_code", wire(bad_code));

  auto truncated = wire(make(bf16{}, index_layout::sparse));
  truncated.pop_back();
  write(dir, "truncated", truncated);

  auto version2 = wire(make(identity{}, index_layout::sparse));
  version2[4] = std::byte{2};
  write(dir, "version_2", version2);
}

// The input layout of fuzz_quantizer_decode.cpp.
struct decode_input {
  std::uint8_t flags = 0x0f;
  std::uint8_t id = 0;
  std::uint8_t bits = 0;
  std::uint32_t word0 = 0, word1 = 0;  // the parameter words, as on the wire
  std::uint16_t s0 = 0, s1 = 0;
  std::uint16_t count = 0;
  std::uint8_t side_count = 0;
  std::int8_t delta = 0;
  std::vector<float> side;
  std::vector<std::byte> values;

  std::vector<std::byte> bytes() const {
    std::vector<std::byte> b;
    auto put = [&b](std::uint64_t v, int n) {
      for (int i = 0; i < n; ++i) b.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xffu));
    };
    put(flags, 1);
    put(id, 1);
    put(bits, 1);
    put(word0, 4);
    put(word1, 4);
    put(s0, 2);
    put(s1, 2);
    put(count, 2);
    put(side_count, 1);
    put(static_cast<std::uint8_t>(delta), 1);
    for (float x : side) put(detail::float_to_bits(x), 4);
    b.insert(b.end(), values.begin(), values.end());
    return b;
  }
};

// s0, s1: the decoder settings as the target maps them (qsgd: levels 1 + s0, bucket 1 + s1;
// terngrad and scaled_sign: bucket s0).
template <class Q>
void decode_seeds(const fs::path& dir, const Q& q, std::uint16_t s0, std::uint16_t s1) {
  const payload p = make(q, index_layout::dense);
  decode_input in;
  in.id = static_cast<std::uint8_t>(p.quantizer);
  in.bits = p.bits_per_value;
  const detail::param_words words = detail::to_param_words(p.quantizer, p.params);
  in.word0 = words.word0;
  in.word1 = words.word1;
  in.s0 = s0;
  in.s1 = s1;
  in.count = static_cast<std::uint16_t>(p.count);
  in.side_count = static_cast<std::uint8_t>(p.side.size());
  in.side = p.side;
  in.values = p.values;
  write(dir, "valid", in.bytes());

  decode_input raw = in;  // every field given, all consistent
  raw.flags = 0;
  write(dir, "valid_raw_fields", raw.bytes());

  decode_input off = in;
  off.flags = 0x07;
  off.delta = -1;
  write(dir, "output_one_short", off.bytes());

  decode_input short_values = in;
  short_values.flags = 0x0b;
  short_values.values.pop_back();
  write(dir, "values_truncated", short_values.bytes());

  decode_input side = in;
  if (!side.side.empty()) {
    side.side[0] = -1.0f;
    write(dir, "side_negative", side.bytes());
  }
  decode_input other = raw;
  other.id = static_cast<std::uint8_t>(p.quantizer == quantizer_id::identity ? 2 : 1);
  write(dir, "other_quantizer", other.bytes());

  const unsigned used = static_cast<unsigned>((p.count * p.bits_per_value) % 8u);
  if (used != 0) {
    decode_input padding = in;
    padding.values.back() |= std::byte{0x80};
    write(dir, "padding_bits_set", padding.bytes());
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <corpus directory, e.g. fuzz/corpus>\n", argv[0]);
    return 2;
  }
  const fs::path root = argv[1];
  wire_seeds(root / "fuzz_wire_decode");
  decode_seeds(root / "fuzz_decode_identity", identity{}, 0, 0);
  decode_seeds(root / "fuzz_decode_fp16", fp16{}, 0, 0);
  decode_seeds(root / "fuzz_decode_bf16", bf16{}, 0, 0);
  decode_seeds(root / "fuzz_decode_qsgd", qsgd(7, 2), 6, 1);
  decode_seeds(root / "fuzz_decode_terngrad", terngrad(2), 2, 0);
  decode_seeds(root / "fuzz_decode_scaled_sign", scaled_sign(0), 0, 0);
  return 0;
}
