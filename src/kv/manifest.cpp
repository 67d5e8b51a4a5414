#include "kv/manifest.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

namespace uf::kv {
namespace {

constexpr char kMagic[8] = {'U', 'F', 'K', 'V', 'M', 'A', 'N', 'I'};

class Reader {
 public:
  explicit Reader(std::span<const uint8_t> d) : d_(d) {}
  size_t offset() const { return off_; }
  size_t left() const { return d_.size() - off_; }

  template <typename T>
  Status get(T& v, const char* field) {
    if (left() < sizeof(T)) return truncated(field, sizeof(T));
    std::memcpy(&v, d_.data() + off_, sizeof(T));
    off_ += sizeof(T);
    return Status::ok();
  }
  Status bytes(void* dst, size_t n, const char* field) {
    if (left() < n) return truncated(field, n);
    if (n) std::memcpy(dst, d_.data() + off_, n);
    off_ += n;
    return Status::ok();
  }
  Status truncated(const char* field, uint64_t need) const {
    return {StatusCode::kCorrupt,
            fmt::format("KV manifest is truncated at byte {}: field '{}' needs {} bytes, {} left",
                        off_, field, need, left())};
  }

 private:
  std::span<const uint8_t> d_;
  size_t off_ = 0;
};

Status read_string(Reader& r, std::string& s, size_t max, const char* field) {
  uint32_t len = 0;
  size_t at = r.offset();
  UF_KV_TRY(r.get(len, field));
  if (len > max)
    return {StatusCode::kCorrupt, fmt::format("KV manifest field '{}' at byte {} has length {}, "
                                              "above the limit of {}",
                                              field, at, len, max)};
  s.resize(len);
  return r.bytes(s.data(), len, field);
}

}  // namespace

Manifest make_manifest(std::string fingerprint, std::span<const int32_t> token_ids,
                       std::span<const uint8_t> bytes, std::string epoch, uint64_t seq,
                       unsigned hash_threads) {
  Manifest m;
  m.fingerprint = std::move(fingerprint);
  m.epoch = std::move(epoch);
  m.seq = seq;
  m.byte_size = bytes.size();
  m.blake3 = blake3_parallel(bytes.data(), bytes.size(), hash_threads);
  m.token_ids.assign(token_ids.begin(), token_ids.end());
  return m;
}

std::vector<uint8_t> serialize_manifest(const Manifest& m) {
  // Sized up front and filled with memcpy (vector::insert of small arrays trips GCC 12's
  // -Wstringop-overflow false positive).
  std::vector<uint8_t> out(8 + 4 + 4 + m.fingerprint.size() + 4 + m.epoch.size() + 8 + 8 + 32 + 8 +
                           4 * m.token_ids.size());
  uint8_t* p = out.data();
  auto put = [&p](const void* src, size_t n) {
    if (n) std::memcpy(p, src, n);  // little-endian hosts only (x86-64, aarch64 Linux)
    p += n;
  };
  uint32_t fp_len = static_cast<uint32_t>(m.fingerprint.size());
  uint32_t epoch_len = static_cast<uint32_t>(m.epoch.size());
  uint64_t n_tokens = m.token_ids.size();
  put(kMagic, 8);
  put(&m.format_version, 4);
  put(&fp_len, 4);
  put(m.fingerprint.data(), fp_len);
  put(&epoch_len, 4);
  put(m.epoch.data(), epoch_len);
  put(&m.seq, 8);
  put(&m.byte_size, 8);
  put(m.blake3.data(), 32);
  put(&n_tokens, 8);
  put(m.token_ids.data(), 4 * m.token_ids.size());
  return out;
}

Status parse_manifest(std::span<const uint8_t> data, Manifest& out, const ManifestLimits& limits) {
  Reader r(data);
  char magic[8];
  UF_KV_TRY(r.bytes(magic, 8, "magic"));
  if (std::memcmp(magic, kMagic, 8) != 0)
    return {StatusCode::kCorrupt, "KV manifest does not start with the magic 'UFKVMANI' (byte 0)"};
  UF_KV_TRY(r.get(out.format_version, "format_version"));
  if (out.format_version != kManifestVersion)
    return {StatusCode::kMismatch,
            fmt::format("KV manifest format version {} (byte 8) is not the supported version {}",
                        out.format_version, kManifestVersion)};
  UF_KV_TRY(read_string(r, out.fingerprint, limits.max_fingerprint_bytes, "fingerprint"));
  UF_KV_TRY(read_string(r, out.epoch, limits.max_epoch_bytes, "epoch"));
  UF_KV_TRY(r.get(out.seq, "seq"));
  size_t at = r.offset();
  UF_KV_TRY(r.get(out.byte_size, "byte_size"));
  if (out.byte_size > limits.max_byte_size)
    return {StatusCode::kCorrupt,
            fmt::format("KV manifest byte_size {} at byte {} is above the limit of {}",
                        out.byte_size, at, limits.max_byte_size)};
  UF_KV_TRY(r.bytes(out.blake3.data(), out.blake3.size(), "blake3"));
  uint64_t n = 0;
  at = r.offset();
  UF_KV_TRY(r.get(n, "token_count"));
  if (n > limits.max_tokens)
    return {StatusCode::kCorrupt,
            fmt::format("KV manifest token_count {} at byte {} is above the limit of {}", n, at,
                        limits.max_tokens)};
  if (r.left() / 4 < n) return r.truncated("token_ids", 4 * n);
  out.token_ids.resize(n);
  UF_KV_TRY(r.bytes(out.token_ids.data(), 4 * n, "token_ids"));
  if (r.left() != 0)
    return {StatusCode::kCorrupt, fmt::format("KV manifest has {} unexpected bytes after the "
                                              "token ids (from byte {})",
                                              r.left(), r.offset())};
  return Status::ok();
}

nlohmann::json manifest_summary(const Manifest& m) {
  return {{"format_version", m.format_version},
          {"fingerprint", m.fingerprint},
          {"epoch", m.epoch},
          {"seq", m.seq},
          {"byte_size", m.byte_size},
          {"blake3", to_hex(m.blake3)},
          {"tokens", m.token_ids.size()}};
}

ManifestCheck check_manifest(const Manifest& m, const ReceiverExpectations& expect) {
  ManifestCheck c;
  if (m.format_version != kManifestVersion) {
    c.status = {StatusCode::kMismatch,
                fmt::format("KV snapshot has manifest version {}, this server reads version {}",
                            m.format_version, kManifestVersion)};
    return c;
  }
  if (m.fingerprint != expect.fingerprint) {
    c.status = {StatusCode::kMismatch,
                fmt::format("KV snapshot fingerprint '{}' differs from this server's '{}' (model, "
                            "tokenizer, --max-seq, GPU count, KV dtype or numerics differ)",
                            m.fingerprint, expect.fingerprint)};
    return c;
  }
  if (m.byte_size > expect.limits.max_byte_size || m.token_ids.size() > expect.limits.max_tokens) {
    c.status = {StatusCode::kMismatch,
                fmt::format("KV snapshot of {} bytes and {} tokens exceeds this server's limits "
                            "({} bytes, {} tokens)",
                            m.byte_size, m.token_ids.size(), expect.limits.max_byte_size,
                            expect.limits.max_tokens)};
    return c;
  }
  auto mis = std::mismatch(m.token_ids.begin(), m.token_ids.end(), expect.request_tokens.begin(),
                           expect.request_tokens.end());
  c.common_prefix = static_cast<size_t>(mis.first - m.token_ids.begin());
  if (c.common_prefix < expect.min_common_prefix) {
    c.status = {StatusCode::kMismatch,
                fmt::format("KV snapshot shares only {} leading tokens with the request (at least "
                            "{} needed)",
                            c.common_prefix, expect.min_common_prefix)};
    return c;
  }
  return c;
}

Status verify_snapshot_bytes(const Manifest& m, std::span<const uint8_t> bytes,
                             unsigned hash_threads) {
  if (bytes.size() != m.byte_size)
    return {StatusCode::kCorrupt, fmt::format("KV snapshot has {} bytes, its manifest says {}",
                                              bytes.size(), m.byte_size)};
  Blake3Digest got = blake3_parallel(bytes.data(), bytes.size(), hash_threads);
  if (got != m.blake3)
    return {StatusCode::kCorrupt,
            fmt::format("KV snapshot of {} bytes fails BLAKE3 verification: got {}, manifest "
                        "says {}",
                        bytes.size(), to_hex(got), to_hex(m.blake3))};
  return Status::ok();
}

}  // namespace uf::kv
