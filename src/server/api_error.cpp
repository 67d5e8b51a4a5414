#include "server/api_error.h"

namespace uf::server {

nlohmann::json error_body(const std::string& message, const std::string& type,
                          const std::string& param, const std::string& code) {
  nlohmann::json e;
  e["message"] = message;
  e["type"] = type;
  e["param"] = param.empty() ? nlohmann::json(nullptr) : nlohmann::json(param);
  e["code"] = code.empty() ? nlohmann::json(nullptr) : nlohmann::json(code);
  return nlohmann::json{{"error", std::move(e)}};
}

nlohmann::json ApiError::to_json() const { return error_body(what(), type_, param_, code_); }

ApiError invalid_request(const std::string& message, const std::string& param,
                         const std::string& code) {
  return ApiError(400, "invalid_request_error", message, param, code);
}

}  // namespace uf::server
