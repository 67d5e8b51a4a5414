#pragma once
// Errors: one exception type that carries a sentence a user can act on (what and where).

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace uf::core {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// UF_CHECK(cond, "format {}", args...) throws uf::core::Error with the formatted message.
#define UF_CHECK(cond, ...)                                           \
  do {                                                                \
    if (!(cond)) throw ::uf::core::Error(::fmt::format(__VA_ARGS__)); \
  } while (0)

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace uf::core
