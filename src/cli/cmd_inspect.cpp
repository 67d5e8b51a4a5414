// `ultrafast inspect <model-dir>`: config summary, layer roles, tensors by dtype and the tensor
// contract. Exits 1 if the checkpoint does not match its config; a load error (truncated shard,
// missing tensor, bad header) is reported by main() with the file and tensor it names.
#include <iostream>
#include <string>

#include "cli/command_registry.h"
#include "model/inspect.h"

namespace {

void setup_inspect(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("inspect",
                                 "Check a model folder and print its config, layer "
                                 "roles, tensor statistics and contract result");
  auto dir = std::make_shared<std::string>();
  cmd->add_option("model-dir", *dir,
                  "Checkpoint folder (config.json, inference/config.json, "
                  "safetensors shards and index)")
      ->required();
  cmd->callback([dir, &exit_code] { exit_code = uf::model::inspect_model(*dir, std::cout); });
}

UF_REGISTER_COMMAND("inspect", setup_inspect);

}  // namespace
