#pragma once
// Logging: human-readable spdlog lines on stderr; machine-read events are one JSON object per line.

#include <spdlog/spdlog.h>

#include <nlohmann/json.hpp>

namespace uf::core {

// Sets the global level from a name (trace, debug, info, warn, error); unknown names keep info.
void init_logging(const std::string& level = "info");

// Writes one JSON object as a single line on stderr (e.g. {"event":"request_end",...}).
void log_event(const nlohmann::json& event);

}  // namespace uf::core
