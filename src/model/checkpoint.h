#pragma once
// A safetensors checkpoint: one file or shards with `model.safetensors.index.json`, memory-mapped,
// with zero-copy tensor views. Every structural problem is an error that names the file and the
// tensor (truncated file, header length past EOF, overlapping or out-of-range offsets, unknown
// dtype, shape/byte-size mismatch, duplicate names, a tensor missing from the index, a header
// that is not UTF-8 JSON).
//
// Views point into the mapping. A file that orders tensors by decreasing element size (the
// Python safetensors writer, write_safetensors, the fixtures) yields views aligned to their
// element size; the reader accepts other files too, so code that needs alignment must check.

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.h"

namespace uf::model {

struct TensorEntry {
  std::string name;
  std::string file;  // shard file name (relative to the checkpoint folder)
  core::TensorView view;
  uint64_t begin = 0;  // byte offsets inside the file's data section
  uint64_t end = 0;
};

class MappedFile;  // an mmap'ed file, owned by the checkpoint

class Checkpoint {
 public:
  // `path` is a folder (with an index, or a single model.safetensors) or one .safetensors file.
  static Checkpoint open(const std::filesystem::path& path);
  // A checkpoint over tensors held in memory elsewhere (model/synthetic.h's random weights): the
  // views must outlive the checkpoint; `dir` only names it. Throws on a duplicate name.
  static Checkpoint from_views(std::filesystem::path dir, std::vector<TensorEntry> entries);

  Checkpoint(Checkpoint&&) noexcept;
  Checkpoint& operator=(Checkpoint&&) noexcept;
  ~Checkpoint();

  bool has(std::string_view name) const;
  const TensorEntry& entry(std::string_view name) const;     // throws naming the tensor
  const core::TensorView& get(std::string_view name) const;  // entry(name).view
  std::vector<std::string> names() const;                    // sorted
  size_t size() const;                                       // number of tensors
  uint64_t total_bytes() const;                              // sum of tensor data bytes
  const std::filesystem::path& dir() const { return dir_; }
  // Every tensor by name (sorted), for whole-checkpoint walks (inspect, contract checks).
  const std::map<std::string, TensorEntry, std::less<>>& tensors() const { return tensors_; }

 private:
  Checkpoint() = default;
  std::filesystem::path dir_;
  std::vector<std::unique_ptr<MappedFile>> files_;
  std::map<std::string, TensorEntry, std::less<>> tensors_;
};

// Parses a safetensors header (the JSON after the 8-byte length) against a data section of
// `data_size` bytes; `file` names the file in errors. Exposed for the fuzzer and the tests.
std::vector<TensorEntry> parse_safetensors_header(std::string_view header, uint64_t data_size,
                                                  const std::string& file);

// Writes safetensors files (the tiny-model generator and tests that build malformed files).
struct TensorData {
  std::string name;
  core::DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};
void write_safetensors(const std::filesystem::path& file, const std::vector<TensorData>& tensors);
// Writes `model.safetensors.index.json` for shards already written in `dir`.
void write_safetensors_index(const std::filesystem::path& dir,
                             const std::map<std::string, std::string>& weight_map,
                             uint64_t total_size);

}  // namespace uf::model
