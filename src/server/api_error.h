#pragma once
// Errors the HTTP layer returns in OpenAI's shape:
//   {"error": {"message": ..., "type": ..., "param": ... | null, "code": ... | null}}
// Thrown by request parsing and validation; the routes turn them into responses.

#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

namespace uf::server {

class ApiError : public std::runtime_error {
 public:
  ApiError(int status, std::string type, const std::string& message, std::string param = {},
           std::string code = {})
      : std::runtime_error(message),
        status_(status),
        type_(std::move(type)),
        param_(std::move(param)),
        code_(std::move(code)) {}

  int status() const { return status_; }
  const std::string& type() const { return type_; }
  const std::string& param() const { return param_; }
  const std::string& code() const { return code_; }
  nlohmann::json to_json() const;

 private:
  int status_;
  std::string type_, param_, code_;
};

// 400 invalid_request_error naming the parameter.
ApiError invalid_request(const std::string& message, const std::string& param = {},
                         const std::string& code = {});

// The error body for any status (also used for 404/405/413/415/429/503 built outside parsing).
nlohmann::json error_body(const std::string& message, const std::string& type,
                          const std::string& param = {}, const std::string& code = {});

}  // namespace uf::server
