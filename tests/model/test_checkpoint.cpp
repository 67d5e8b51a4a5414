// Checkpoint reader and writer: the fixtures open with zero-copy views, and every malformed
// file is refused with an error that names the file and, where there is one, the tensor.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "model/checkpoint.h"
#include "model_test_util.h"

namespace fs = std::filesystem;
using uf::core::DType;
using uf::model::Checkpoint;
using uf::model::TensorData;

namespace {

const fs::path kTinyA = fs::path(UF_SHARED_DIR) / "fixtures" / "tiny-a";

// Each test's scratch folder.
struct TempDir : uf::model::testing::TempDir {
  TempDir() : uf::model::testing::TempDir("uf_ckpt_") {}
};

std::vector<uint8_t> iota_bytes(size_t n, uint8_t start = 0) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = uint8_t(start + i);
  return v;
}

// A raw safetensors file: 8-byte little-endian length, header text, data bytes.
void write_raw(const fs::path& p, const std::string& header, const std::vector<uint8_t>& data,
               std::optional<uint64_t> claimed_len = std::nullopt) {
  std::ofstream out(p, std::ios::binary);
  const uint64_t len = claimed_len.value_or(header.size());
  for (int i = 0; i < 8; ++i) out.put(char(uint8_t(len >> (8 * i))));
  out << header;
  out.write(reinterpret_cast<const char*>(data.data()), std::streamsize(data.size()));
}

std::string open_error(const fs::path& p) {
  try {
    Checkpoint::open(p);
  } catch (const uf::core::Error& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE((haystack).find(needle), std::string::npos) << "error was: " << (haystack)

// Two small tensors: "a" F32 [2,3] (24 bytes) then "b" BF16 [4] (8 bytes).
std::string two_tensor_header(const std::string& a_dtype = "F32",
                              const std::string& a_shape = "[2,3]",
                              const std::string& a_off = "[0,24]",
                              const std::string& b_off = "[24,32]") {
  return "{\"a\":{\"dtype\":\"" + a_dtype + "\",\"shape\":" + a_shape +
         ",\"data_offsets\":" + a_off +
         "},\"b\":{\"dtype\":\"BF16\",\"shape\":[4],\"data_offsets\":" + b_off + "}}";
}

}  // namespace

TEST(Checkpoint, OpensTinyAZeroCopy) {
  const auto ck = Checkpoint::open(kTinyA);
  EXPECT_EQ(ck.size(), 826u);
  EXPECT_EQ(ck.total_bytes(), 17660020u);
  const auto& e = ck.entry("layers.0.attn.wq_a.weight");
  EXPECT_EQ(e.view.dtype, DType::kF8E4M3);
  EXPECT_EQ(e.view.shape, (std::vector<int64_t>{128, 256}));
  EXPECT_EQ(e.view.nbytes, 128u * 256u);
  EXPECT_EQ(e.file, "model-00001-of-00003.safetensors");
  // The view points into the mapping at exactly the bytes the file holds there.
  std::ifstream in(kTinyA / e.file, std::ios::binary);
  uint64_t hl = 0;
  in.read(reinterpret_cast<char*>(&hl), 8);
  in.seekg(std::streamoff(8 + hl + e.begin));
  std::vector<char> buf(e.view.nbytes);
  in.read(buf.data(), std::streamsize(buf.size()));
  EXPECT_EQ(std::memcmp(buf.data(), e.view.data, buf.size()), 0);
  EXPECT_EQ(ck.get("layers.1.engram.embed.weight").dim(1), 64);
  EXPECT_TRUE(ck.has("layers.0.ffn.gate.bias_vl"));
  EXPECT_FALSE(ck.has("model.embed.weight"));
  const auto names = ck.names();
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  try {
    ck.entry("nope.weight");
    ADD_FAILURE();
  } catch (const uf::core::Error& err) {
    EXPECT_HAS(std::string(err.what()), "'nope.weight'");
  }
}

TEST(Checkpoint, WriterRoundTripsSingleFileAndShards) {
  TempDir d;
  // "y" (3 bytes) comes first: the writer must still place "x" (F32) 4-byte aligned.
  std::vector<TensorData> t = {{"y", DType::kI8, {3}, iota_bytes(3, 100)},
                               {"x", DType::kF32, {2, 2}, iota_bytes(16)},
                               {"empty", DType::kBF16, {0, 4}, {}}};
  uf::model::write_safetensors(d.path / "model.safetensors", t);
  auto ck = Checkpoint::open(d.path);
  ASSERT_EQ(ck.size(), 3u);
  EXPECT_EQ(ck.get("y").data[2], 102);
  EXPECT_EQ(ck.get("x").as<float>().size(), 4u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(ck.get("x").data) % 4, 0u);
  EXPECT_EQ(ck.get("x").data[5], 5);
  EXPECT_EQ(ck.get("empty").nbytes, 0u);
  // Same through a sharded index, and through the file path itself.
  uf::model::write_safetensors(d.path / "s1.safetensors", {t[1]});
  uf::model::write_safetensors(d.path / "s2.safetensors", {t[0]});
  uf::model::write_safetensors_index(d.path, {{"x", "s1.safetensors"}, {"y", "s2.safetensors"}},
                                     19);
  auto sh = Checkpoint::open(d.path);
  EXPECT_EQ(sh.size(), 2u);
  EXPECT_EQ(sh.entry("y").file, "s2.safetensors");
  EXPECT_EQ(Checkpoint::open(d.path / "s1.safetensors").size(), 1u);
  // The writer refuses data that does not match the shape.
  EXPECT_THROW(uf::model::write_safetensors(d.path / "bad.safetensors",
                                            {{"z", DType::kF32, {3}, iota_bytes(8)}}),
               uf::core::Error);
}

TEST(CheckpointMalformed, FileShorterThanLengthPrefix) {
  TempDir d;
  std::ofstream(d.path / "t.safetensors") << "abc";
  const auto err = open_error(d.path / "t.safetensors");
  EXPECT_HAS(err, "t.safetensors");
  EXPECT_HAS(err, "truncated");
}

TEST(CheckpointMalformed, HeaderLengthPastEof) {
  TempDir d;
  write_raw(d.path / "t.safetensors", two_tensor_header(), iota_bytes(32), 1000);
  const auto err = open_error(d.path / "t.safetensors");
  EXPECT_HAS(err, "t.safetensors");
  EXPECT_HAS(err, "header length 1000 runs past the end");
}

TEST(CheckpointMalformed, TruncatedDataNamesLastTensor) {
  TempDir d;
  write_raw(d.path / "t.safetensors", two_tensor_header(), iota_bytes(31));
  const auto err = open_error(d.path / "t.safetensors");
  EXPECT_HAS(err, "t.safetensors: tensor 'b'");
  EXPECT_HAS(err, "run past the end of the data section (31 bytes");
}

TEST(CheckpointMalformed, OverlappingOffsets) {
  TempDir d;
  write_raw(d.path / "t.safetensors", two_tensor_header("F32", "[2,3]", "[0,24]", "[20,28]"),
            iota_bytes(32));
  const auto err = open_error(d.path / "t.safetensors");
  EXPECT_HAS(err, "t.safetensors");
  EXPECT_HAS(err, "tensor 'b'");
  EXPECT_HAS(err, "overlaps tensor 'a'");
}

TEST(CheckpointMalformed, OutOfRangeOffsets) {
  TempDir d;
  write_raw(d.path / "t.safetensors",
            two_tensor_header("F32", "[2,3]", "[0,24]", "[18446744073709551608,0]"),
            iota_bytes(32));
  auto err = open_error(d.path / "t.safetensors");
  EXPECT_HAS(err, "tensor 'b'");
  write_raw(d.path / "u.safetensors", two_tensor_header("F32", "[2,3]", "[0,24]", "[24,-8]"),
            iota_bytes(32));
  err = open_error(d.path / "u.safetensors");
  EXPECT_HAS(err, "u.safetensors: tensor 'b': data_offsets[1] must be a non-negative integer");
}

TEST(CheckpointMalformed, UnknownDtype) {
  TempDir d;
  write_raw(d.path / "t.safetensors", two_tensor_header("F4_E2M1"), iota_bytes(32));
  const auto err = open_error(d.path / "t.safetensors");
  EXPECT_HAS(err, "t.safetensors: tensor 'a': unknown dtype 'F4_E2M1'");
}

TEST(CheckpointMalformed, ShapeByteSizeMismatch) {
  TempDir d;
  write_raw(d.path / "t.safetensors", two_tensor_header("F32", "[2,4]"), iota_bytes(32));
  const auto err = open_error(d.path / "t.safetensors");
  EXPECT_HAS(err, "t.safetensors: tensor 'a': shape [2, 4] of F32 needs 32 bytes");
}

TEST(CheckpointMalformed, DuplicateNames) {
  TempDir d;
  const std::string h =
      "{\"a\":{\"dtype\":\"I8\",\"shape\":[4],\"data_offsets\":[0,4]},"
      "\"a\":{\"dtype\":\"I8\",\"shape\":[4],\"data_offsets\":[4,8]}}";
  write_raw(d.path / "t.safetensors", h, iota_bytes(8));
  const auto err = open_error(d.path / "t.safetensors");
  EXPECT_HAS(err, "t.safetensors: tensor 'a' appears twice");
}

TEST(CheckpointMalformed, DuplicateAcrossShards) {
  TempDir d;
  uf::model::write_safetensors(d.path / "s1.safetensors", {{"w", DType::kI8, {2}, iota_bytes(2)}});
  uf::model::write_safetensors(d.path / "s2.safetensors", {{"w", DType::kI8, {2}, iota_bytes(2)},
                                                           {"v", DType::kI8, {2}, iota_bytes(2)}});
  uf::model::write_safetensors_index(d.path, {{"w", "s1.safetensors"}, {"v", "s2.safetensors"}}, 4);
  const auto err = open_error(d.path);
  EXPECT_HAS(err, "s2.safetensors: tensor 'w' is in this shard but");
  EXPECT_HAS(err, "maps it to s1.safetensors");
}

TEST(CheckpointMalformed, IndexedTensorMissingFromShard) {
  TempDir d;
  uf::model::write_safetensors(d.path / "s1.safetensors", {{"w", DType::kI8, {2}, iota_bytes(2)}});
  uf::model::write_safetensors_index(d.path, {{"w", "s1.safetensors"}, {"v", "s1.safetensors"}}, 2);
  const auto err = open_error(d.path);
  EXPECT_HAS(err, "tensor 'v' is listed for shard s1.safetensors but missing from it");
}

TEST(CheckpointMalformed, ShardTensorMissingFromIndex) {
  TempDir d;
  uf::model::write_safetensors(d.path / "s1.safetensors", {{"w", DType::kI8, {2}, iota_bytes(2)},
                                                           {"v", DType::kI8, {2}, iota_bytes(2)}});
  uf::model::write_safetensors_index(d.path, {{"w", "s1.safetensors"}}, 2);
  const auto err = open_error(d.path);
  EXPECT_HAS(err, "s1.safetensors: tensor 'v' is in the shard but not in");
}

TEST(CheckpointMalformed, IndexMapsTensorToOtherShard) {
  TempDir d;
  uf::model::write_safetensors(d.path / "s1.safetensors", {{"w", DType::kI8, {2}, iota_bytes(2)}});
  uf::model::write_safetensors(d.path / "s2.safetensors", {{"v", DType::kI8, {2}, iota_bytes(2)}});
  uf::model::write_safetensors_index(d.path, {{"w", "s2.safetensors"}, {"v", "s2.safetensors"}}, 4);
  const auto err = open_error(d.path);
  EXPECT_HAS(err, "tensor 'w' is listed for shard s2.safetensors but missing from it");
}

TEST(CheckpointMalformed, MissingShardFile) {
  TempDir d;
  uf::model::write_safetensors_index(d.path, {{"w", "gone.safetensors"}}, 2);
  const auto err = open_error(d.path);
  EXPECT_HAS(err, "gone.safetensors");
  EXPECT_HAS(err, "does not exist");
}

TEST(CheckpointMalformed, IndexPathOutsideFolder) {
  TempDir d;
  uf::model::write_safetensors_index(d.path, {{"w", "../x.safetensors"}}, 2);
  EXPECT_HAS(open_error(d.path), "tensor 'w' maps to '../x.safetensors', not a plain file name");
}

TEST(CheckpointMalformed, IndexTotalSizeMismatch) {
  TempDir d;
  uf::model::write_safetensors(d.path / "s1.safetensors", {{"w", DType::kI8, {2}, iota_bytes(2)}});
  uf::model::write_safetensors_index(d.path, {{"w", "s1.safetensors"}}, 3);
  EXPECT_HAS(open_error(d.path), "metadata.total_size is 3 but the shards' tensors hold 2 bytes");
}

TEST(CheckpointMalformed, NonUtf8Header) {
  TempDir d;
  std::string h = two_tensor_header();
  h.replace(h.find("\"b\""), 3, "\"\xff\"");
  write_raw(d.path / "t.safetensors", h, iota_bytes(32));
  const auto err = open_error(d.path / "t.safetensors");
  EXPECT_HAS(err, "t.safetensors: the safetensors header is not valid UTF-8");
  // Overlong encodings and surrogates are invalid too.
  for (std::string bad : {"\xc0\xaf", "\xed\xa0\x80", "\xe2\x82"}) {
    EXPECT_THROW(uf::model::parse_safetensors_header("{\"" + bad + "\":1}", 0, "f"),
                 uf::core::Error);
  }
  // Valid multi-byte UTF-8 names are fine.
  EXPECT_NO_THROW(uf::model::parse_safetensors_header(
      "{\"\xc3\xa9\xe2\x82\xac\":{\"dtype\":\"I8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1,
      "f"));
}

TEST(CheckpointMalformed, NonJsonHeader) {
  TempDir d;
  write_raw(d.path / "t.safetensors", "{\"a\": [1, 2", iota_bytes(32));
  auto err = open_error(d.path / "t.safetensors");
  EXPECT_HAS(err, "t.safetensors: the safetensors header is not valid JSON");
  write_raw(d.path / "u.safetensors", "[1,2]", {});
  err = open_error(d.path / "u.safetensors");
  EXPECT_HAS(err, "u.safetensors: the safetensors header is not a JSON object");
}

TEST(CheckpointMalformed, HoleAndTrailingBytes) {
  TempDir d;
  write_raw(d.path / "t.safetensors", two_tensor_header("F32", "[2,3]", "[0,24]", "[26,34]"),
            iota_bytes(34));
  EXPECT_HAS(open_error(d.path / "t.safetensors"),
             "bytes [24, 26) of the data section before tensor 'b'");
  write_raw(d.path / "u.safetensors", two_tensor_header(), iota_bytes(40));
  EXPECT_HAS(open_error(d.path / "u.safetensors"), "u.safetensors: the data section has 40 bytes");
}

TEST(CheckpointMalformed, BadEntryFields) {
  auto err_of = [](const std::string& h) {
    try {
      uf::model::parse_safetensors_header(h, 4, "f.safetensors");
    } catch (const uf::core::Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_HAS(err_of("{\"t\":{\"dtype\":\"I8\",\"shape\":[4]}}"), "tensor 't': 'data_offsets'");
  EXPECT_HAS(err_of("{\"t\":{\"dtype\":\"I8\",\"shape\":[4.5],\"data_offsets\":[0,4]}}"),
             "tensor 't': shape[0]");
  EXPECT_HAS(err_of("{\"t\":{\"dtype\":\"I8\",\"shape\":[4],\"data_offsets\":[0,4],\"x\":1}}"),
             "unknown key 'x'");
  EXPECT_HAS(err_of("{\"t\":{\"dtype\":\"I8\",\"shape\":[4294967296,4294967296,16],"
                    "\"data_offsets\":[0,4]}}"),
             "overflows");
  EXPECT_HAS(err_of("{\"__metadata__\":{\"k\":1}}"), "'__metadata__' value 'k'");
}
