#pragma once
// Results of KV-sharing calls. The directory and the transfer are on the request path, where a
// failure must turn into "recompute the prompt", so they return a Status instead of throwing.

#include <string>
#include <utility>

namespace uf::kv {

enum class StatusCode {
  kOk,
  kNotFound,     // no such session / snapshot
  kStale,        // the (epoch, seq) a caller read is no longer current
  kUnavailable,  // Redis or the peer cannot be reached (retry later, or recompute)
  kTimeout,      // a wait ran past its deadline
  kMismatch,     // manifest version, fingerprint or token prefix does not fit this request
  kCorrupt,      // bytes failed BLAKE3 verification or a message failed to parse
  kInvalid,      // the caller passed something unusable
  kInternal,     // an unexpected error from a library
};

const char* status_code_name(StatusCode code);

class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status ok() { return {}; }

  bool is_ok() const { return code_ == StatusCode::kOk; }
  explicit operator bool() const { return is_ok(); }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "STALE: ..." style text for logs.
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

}  // namespace uf::kv

// Returns early with the status of `expr` when it is not OK.
#define UF_KV_TRY(expr)                               \
  do {                                                \
    ::uf::kv::Status uf_kv_status_ = (expr);          \
    if (!uf_kv_status_.is_ok()) return uf_kv_status_; \
  } while (0)
