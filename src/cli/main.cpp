// ultrafast: DeepSeek-V4.1-Flash inference server. See README.md and docs/.
#include <algorithm>
#include <cstdio>
#include <exception>

#include "cli/command_registry.h"
#include "core/error.h"
#include "core/log.h"

int main(int argc, char** argv) {
  CLI::App app{"ultrafast: a DeepSeek-V4.1-Flash inference engine and OpenAI-compatible server"};
  app.require_subcommand(1);
  std::string log_level = "info";
  app.add_option("--log-level", log_level, "trace, debug, info, warn or error")
      ->capture_default_str();
  int exit_code = 0;
  auto& entries = uf::cli::command_registry();
  std::sort(entries.begin(), entries.end(),
            [](const auto& a, const auto& b) { return a.name < b.name; });
  for (const auto& e : entries) e.setup(app, exit_code);
  app.parse_complete_callback([&] { uf::core::init_logging(log_level); });
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const uf::core::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return exit_code;
}
