#pragma once
// Subcommands register themselves at static-initialisation time; main() wires them into CLI11.

#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

namespace uf::cli {

// Adds the subcommand to `app`. The callback it installs returns the process exit code through
// `exit_code`; errors are thrown as uf::core::Error and reported by main().
using CommandSetup = void (*)(CLI::App& app, int& exit_code);

struct CommandEntry {
  std::string name;
  CommandSetup setup;
};

std::vector<CommandEntry>& command_registry();
int register_command(const char* name, CommandSetup setup);

#define UF_REGISTER_COMMAND(name, setup)                            \
  [[maybe_unused]] static const int uf_command_registered_##setup = \
      ::uf::cli::register_command(name, setup)

}  // namespace uf::cli
