#include "cli/command_registry.h"

namespace uf::cli {

std::vector<CommandEntry>& command_registry() {
  static std::vector<CommandEntry> entries;
  return entries;
}

int register_command(const char* name, CommandSetup setup) {
  command_registry().push_back({name, setup});
  return int(command_registry().size());
}

}  // namespace uf::cli
