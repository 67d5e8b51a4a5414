#include "model/checkpoint.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "core/json_file.h"

namespace uf::model {

using core::fail;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {
// A header longer than this is refused before it is parsed (the released shards' headers are a
// few hundred KB; the official Rust reader uses the same 100 MB bound).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
constexpr const char* kIndexName = "model.safetensors.index.json";
}  // namespace

class MappedFile {
 public:
  explicit MappedFile(const fs::path& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    UF_CHECK(fd_ >= 0, "cannot open checkpoint file {}: {}", path.string(), std::strerror(errno));
    struct stat st {};
    if (::fstat(fd_, &st) != 0) {
      ::close(fd_);
      fail("cannot stat checkpoint file {}: {}", path.string(), std::strerror(errno));
    }
    size_ = uint64_t(st.st_size);
    if (size_ > 0) {
      void* p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd_, 0);
      if (p == MAP_FAILED) {
        ::close(fd_);
        fail("cannot mmap checkpoint file {}: {}", path.string(), std::strerror(errno));
      }
      data_ = static_cast<const uint8_t*>(p);
    }
  }
  ~MappedFile() {
    if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
    if (fd_ >= 0) ::close(fd_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
  int fd_ = -1;
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

namespace {

// Returns the byte offset of the first invalid UTF-8 sequence, or npos.
size_t find_invalid_utf8(std::string_view s) {
  size_t i = 0;
  const auto* b = reinterpret_cast<const uint8_t*>(s.data());
  while (i < s.size()) {
    const uint8_t c = b[i];
    int n = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xe0) == 0xc0) {
      n = 1, cp = c & 0x1f;
    } else if ((c & 0xf0) == 0xe0) {
      n = 2, cp = c & 0x0f;
    } else if ((c & 0xf8) == 0xf0) {
      n = 3, cp = c & 0x07;
    } else {
      return i;
    }
    if (i + size_t(n) >= s.size()) return i;  // cut off mid-sequence
    for (int k = 1; k <= n; ++k) {
      if ((b[i + size_t(k)] & 0xc0) != 0x80) return i;
      cp = (cp << 6) | (b[i + size_t(k)] & 0x3f);
    }
    // Overlong forms, surrogates and values past U+10FFFF are invalid.
    static constexpr uint32_t kMin[4] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return i;
    i += size_t(n) + 1;
  }
  return std::string_view::npos;
}

uint64_t read_u64_le(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

uint64_t json_u64(const json& v, const std::string& what) {
  UF_CHECK(v.is_number_unsigned() || (v.is_number_integer() && v.get<int64_t>() >= 0),
           "{} must be a non-negative integer, got {}", what, v.dump());
  return v.get<uint64_t>();
}

bool is_plain_file_name(const std::string& f) {
  return !f.empty() && f.find('/') == std::string::npos && f.find('\\') == std::string::npos &&
         f != "." && f != "..";
}

}  // namespace

std::vector<TensorEntry> parse_safetensors_header(std::string_view header, uint64_t data_size,
                                                  const std::string& file) {
  const size_t bad = find_invalid_utf8(header);
  UF_CHECK(bad == std::string_view::npos,
           "{}: the safetensors header is not valid UTF-8 (byte {} of the header)", file, bad);
  // nlohmann keeps the last of duplicate keys silently: catch them in the parser callback.
  std::set<std::string> top_keys;
  std::string duplicate;
  auto cb = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && depth == 1 && duplicate.empty()) {
      const auto& k = parsed.get_ref<const std::string&>();
      if (!top_keys.insert(k).second) duplicate = k;
    }
    return true;
  };
  json j;
  try {
    j = json::parse(header.begin(), header.end(), cb);
  } catch (const json::exception& e) {
    fail("{}: the safetensors header is not valid JSON: {}", file, e.what());
  }
  UF_CHECK(duplicate.empty(), "{}: tensor '{}' appears twice in the safetensors header", file,
           duplicate);
  UF_CHECK(j.is_object(), "{}: the safetensors header is not a JSON object", file);

  std::vector<TensorEntry> out;
  out.reserve(j.size());
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      UF_CHECK(v.is_object(), "{}: '__metadata__' must be an object", file);
      for (auto m = v.begin(); m != v.end(); ++m)
        UF_CHECK(m.value().is_string(), "{}: '__metadata__' value '{}' must be a string", file,
                 m.key());
      continue;
    }
    const std::string where = fmt::format("{}: tensor '{}'", file, name);
    UF_CHECK(!name.empty(), "{}: a tensor has an empty name", file);
    UF_CHECK(v.is_object(), "{}: entry is not an object", where);
    for (auto k = v.begin(); k != v.end(); ++k)
      UF_CHECK(k.key() == "dtype" || k.key() == "shape" || k.key() == "data_offsets",
               "{}: unknown key '{}'", where, k.key());
    UF_CHECK(v.contains("dtype") && v["dtype"].is_string(), "{}: missing string 'dtype'", where);
    UF_CHECK(v.contains("shape") && v["shape"].is_array(), "{}: missing list 'shape'", where);
    UF_CHECK(
        v.contains("data_offsets") && v["data_offsets"].is_array() && v["data_offsets"].size() == 2,
        "{}: 'data_offsets' must be a list [begin, end]", where);
    const std::string dt = v["dtype"].get<std::string>();
    const auto dtype = core::dtype_from_name(dt);
    UF_CHECK(dtype.has_value(), "{}: unknown dtype '{}'", where, dt);

    TensorEntry e;
    e.name = name;
    e.file = file;
    e.view.dtype = *dtype;
    uint64_t numel = 1;
    for (size_t d = 0; d < v["shape"].size(); ++d) {
      const uint64_t n = json_u64(v["shape"][d], fmt::format("{}: shape[{}]", where, d));
      UF_CHECK(n <= uint64_t(INT64_MAX) && !__builtin_mul_overflow(numel, n, &numel),
               "{}: shape {} overflows", where, v["shape"].dump());
      e.view.shape.push_back(int64_t(n));
    }
    e.begin = json_u64(v["data_offsets"][0], where + ": data_offsets[0]");
    e.end = json_u64(v["data_offsets"][1], where + ": data_offsets[1]");
    UF_CHECK(e.begin <= e.end, "{}: data_offsets [{}, {}] end before they begin", where, e.begin,
             e.end);
    UF_CHECK(e.end <= data_size,
             "{}: data_offsets [{}, {}] run past the end of the data section ({} bytes; the file "
             "is truncated or the offsets are wrong)",
             where, e.begin, e.end, data_size);
    uint64_t nbytes = 0;
    UF_CHECK(!__builtin_mul_overflow(numel, uint64_t(core::dtype_size(*dtype)), &nbytes),
             "{}: shape {} overflows", where, v["shape"].dump());
    UF_CHECK(nbytes == e.end - e.begin,
             "{}: shape {} of {} needs {} bytes but data_offsets [{}, {}] hold {}", where,
             core::shape_string(e.view.shape), dt, nbytes, e.begin, e.end, e.end - e.begin);
    e.view.nbytes = size_t(nbytes);
    out.push_back(std::move(e));
  }

  // Tensors must tile the data section: no overlap, no hole, nothing left over (the
  // safetensors format rule; a hole or leftover bytes mean a damaged or foreign file).
  std::vector<const TensorEntry*> order;
  for (const auto& e : out) order.push_back(&e);
  std::sort(order.begin(), order.end(), [](const TensorEntry* a, const TensorEntry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t cursor = 0;
  const TensorEntry* prev = nullptr;
  for (const TensorEntry* e : order) {
    if (e->begin < cursor)
      fail("{}: tensor '{}' (bytes [{}, {})) overlaps tensor '{}' (bytes [{}, {}))", file, e->name,
           e->begin, e->end, prev->name, prev->begin, prev->end);
    if (e->begin > cursor)
      fail("{}: bytes [{}, {}) of the data section before tensor '{}' belong to no tensor", file,
           cursor, e->begin, e->name);
    if (e->end > cursor || !prev) prev = e;
    cursor = std::max(cursor, e->end);
  }
  UF_CHECK(cursor == data_size,
           "{}: the data section has {} bytes but its tensors end at byte {} ({} trailing bytes "
           "belong to no tensor)",
           file, data_size, cursor, data_size - cursor);
  return out;
}

Checkpoint::Checkpoint(Checkpoint&&) noexcept = default;
Checkpoint& Checkpoint::operator=(Checkpoint&&) noexcept = default;
Checkpoint::~Checkpoint() = default;

namespace {

// Maps one safetensors file, validates it and returns its entries with data pointers set.
std::vector<TensorEntry> load_file(const MappedFile& f, const std::string& file) {
  UF_CHECK(f.size() >= 8,
           "{} is truncated: {} bytes, too short for the 8-byte safetensors header length", file,
           f.size());
  const uint64_t header_len = read_u64_le(f.data());
  UF_CHECK(header_len <= f.size() - 8,
           "{}: the header length {} runs past the end of the file ({} bytes): truncated or not a "
           "safetensors file",
           file, header_len, f.size());
  UF_CHECK(header_len <= kMaxHeaderBytes, "{}: the header length {} exceeds the {} byte limit",
           file, header_len, kMaxHeaderBytes);
  const std::string_view header(reinterpret_cast<const char*>(f.data() + 8), header_len);
  const uint64_t data_start = 8 + header_len;
  auto entries = parse_safetensors_header(header, f.size() - data_start, file);
  for (auto& e : entries) e.view.data = f.data() + data_start + e.begin;
  return entries;
}

}  // namespace

Checkpoint Checkpoint::from_views(std::filesystem::path dir, std::vector<TensorEntry> entries) {
  Checkpoint ck;
  ck.dir_ = std::move(dir);
  for (auto& e : entries) {
    std::string name = e.name;
    UF_CHECK(ck.tensors_.emplace(name, std::move(e)).second,
             "checkpoint {}: tensor {} appears twice", ck.dir_.string(), name);
  }
  return ck;
}

Checkpoint Checkpoint::open(const std::filesystem::path& path) {
  Checkpoint ck;
  UF_CHECK(fs::exists(path), "checkpoint path {} does not exist", path.string());
  std::vector<std::string> shard_names;
  std::map<std::string, std::string> weight_map;
  std::optional<uint64_t> index_total;
  fs::path index_path;
  if (fs::is_directory(path)) {
    ck.dir_ = path;
    index_path = path / kIndexName;
    if (fs::exists(index_path)) {
      json idx = core::read_json_file(index_path, "the checkpoint index");
      UF_CHECK(idx.is_object() && idx.contains("weight_map") && idx["weight_map"].is_object(),
               "{}: missing the 'weight_map' object", index_path.string());
      for (auto it = idx["weight_map"].begin(); it != idx["weight_map"].end(); ++it) {
        UF_CHECK(it.value().is_string(), "{}: weight_map entry '{}' is not a file name",
                 index_path.string(), it.key());
        const auto f = it.value().get<std::string>();
        // Shards must sit in the checkpoint folder: never follow a path out of it.
        UF_CHECK(is_plain_file_name(f), "{}: tensor '{}' maps to '{}', not a plain file name",
                 index_path.string(), it.key(), f);
        weight_map[it.key()] = f;
        if (std::find(shard_names.begin(), shard_names.end(), f) == shard_names.end())
          shard_names.push_back(f);
      }
      if (idx.contains("metadata") && idx["metadata"].is_object() &&
          idx["metadata"].contains("total_size"))
        index_total =
            json_u64(idx["metadata"]["total_size"], index_path.string() + ": metadata.total_size");
      std::sort(shard_names.begin(), shard_names.end());
    } else if (fs::exists(path / "model.safetensors")) {
      shard_names.push_back("model.safetensors");
    } else {
      fail("{} has neither {} nor model.safetensors", path.string(), kIndexName);
    }
  } else {
    ck.dir_ = path.parent_path();
    shard_names.push_back(path.filename().string());
  }

  for (const auto& name : shard_names) {
    const fs::path p = ck.dir_ / name;
    UF_CHECK(fs::exists(p), "checkpoint shard {} listed in {} does not exist", p.string(),
             index_path.string());
    ck.files_.push_back(std::make_unique<MappedFile>(p));
    for (auto& e : load_file(*ck.files_.back(), p.string())) {
      e.file = name;
      if (!weight_map.empty()) {
        auto it = weight_map.find(e.name);
        UF_CHECK(it != weight_map.end(), "{}: tensor '{}' is in the shard but not in {}",
                 p.string(), e.name, index_path.string());
        UF_CHECK(it->second == name, "{}: tensor '{}' is in this shard but {} maps it to {}",
                 p.string(), e.name, index_path.string(), it->second);
      }
      auto [pos, inserted] = ck.tensors_.emplace(e.name, e);
      UF_CHECK(inserted, "tensor '{}' appears in both {} and {}", e.name, pos->second.file, name);
    }
  }
  for (const auto& [name, file] : weight_map)
    UF_CHECK(ck.tensors_.count(name), "{}: tensor '{}' is listed for shard {} but missing from it",
             index_path.string(), name, file);
  if (index_total)
    UF_CHECK(*index_total == ck.total_bytes(),
             "{}: metadata.total_size is {} but the shards' tensors hold {} bytes",
             index_path.string(), *index_total, ck.total_bytes());
  return ck;
}

bool Checkpoint::has(std::string_view name) const { return tensors_.find(name) != tensors_.end(); }

const TensorEntry& Checkpoint::entry(std::string_view name) const {
  auto it = tensors_.find(name);
  UF_CHECK(it != tensors_.end(), "tensor '{}' is not in the checkpoint {}", name, dir_.string());
  return it->second;
}

const core::TensorView& Checkpoint::get(std::string_view name) const { return entry(name).view; }

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& [name, e] : tensors_) out.push_back(name);
  return out;
}

size_t Checkpoint::size() const { return tensors_.size(); }

uint64_t Checkpoint::total_bytes() const {
  uint64_t n = 0;
  for (const auto& [name, e] : tensors_) n += e.end - e.begin;
  return n;
}

void write_safetensors(const std::filesystem::path& file, const std::vector<TensorData>& tensors) {
  // Largest elements first (as the Python safetensors writer does): with the 8-byte aligned data
  // section this keeps every tensor aligned to its element size, so views can be read in place.
  std::vector<const TensorData*> order;
  for (const auto& t : tensors) order.push_back(&t);
  std::stable_sort(order.begin(), order.end(), [](const TensorData* a, const TensorData* b) {
    return core::dtype_size(a->dtype) > core::dtype_size(b->dtype);
  });
  json header = json::object();
  header["__metadata__"] = {{"format", "pt"}};
  uint64_t offset = 0;
  for (const TensorData* tp : order) {
    const TensorData& t = *tp;
    UF_CHECK(!header.contains(t.name), "write_safetensors {}: duplicate tensor '{}'", file.string(),
             t.name);
    uint64_t numel = 1;
    for (int64_t d : t.shape) numel *= uint64_t(d);
    UF_CHECK(numel * core::dtype_size(t.dtype) == t.bytes.size(),
             "write_safetensors {}: tensor '{}' of shape {} {} needs {} bytes, got {}",
             file.string(), t.name, core::shape_string(t.shape), core::dtype_name(t.dtype),
             numel * core::dtype_size(t.dtype), t.bytes.size());
    header[t.name] = {{"dtype", std::string(core::dtype_name(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');  // keeps the data section 8-byte aligned
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  UF_CHECK(out, "cannot write {}", file.string());
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = uint8_t(uint64_t(h.size()) >> (8 * i));
  out.write(reinterpret_cast<const char*>(len), 8);
  out.write(h.data(), std::streamsize(h.size()));
  for (const TensorData* t : order)
    out.write(reinterpret_cast<const char*>(t->bytes.data()), std::streamsize(t->bytes.size()));
  UF_CHECK(out.good(), "error writing {}", file.string());
}

void write_safetensors_index(const std::filesystem::path& dir,
                             const std::map<std::string, std::string>& weight_map,
                             uint64_t total_size) {
  json j = {{"metadata", {{"total_size", total_size}}}, {"weight_map", weight_map}};
  std::ofstream out(dir / kIndexName, std::ios::trunc);
  UF_CHECK(out, "cannot write {}", (dir / kIndexName).string());
  out << j.dump(2) << "\n";
  UF_CHECK(out.good(), "error writing {}", (dir / kIndexName).string());
}

}  // namespace uf::model
