#include "core/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdio>
#include <mutex>

namespace uf::core {

void init_logging(const std::string& level) {
  static std::once_flag once;
  std::call_once(once, [] {
    auto logger = spdlog::stderr_color_mt("ultrafast");
    logger->set_pattern("%Y-%m-%d %H:%M:%S.%e %^%l%$ %v");
    spdlog::set_default_logger(logger);
  });
  spdlog::level::level_enum lvl = spdlog::level::from_str(level);
  if (lvl == spdlog::level::off && level != "off") lvl = spdlog::level::info;
  spdlog::set_level(lvl);
}

void log_event(const nlohmann::json& event) {
  static std::mutex mu;
  std::string line = event.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  std::lock_guard<std::mutex> lock(mu);
  std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
}

}  // namespace uf::core
